"""The front: the engine's side in the serving process. AsyncEngine queues requests its edge
validated and owns one stream per request, the core client launches the engine-core process
and talks to it over replica/ipc/, and the output processor detokenizes, applies stop strings
and merges each step's outputs into the streams; the KV-event log numbers cache events for the
routers that subscribe."""
