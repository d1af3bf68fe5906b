"""The network edge of one replica: the gRPC servicers (generation, load and KV-event
streams, health, reflection), the server that hosts them beside the front (replica_server.py),
request limits checked on entry, load reports and their preemption rate, and the Prometheus
metrics."""
