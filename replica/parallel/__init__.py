"""Tensor parallelism: one replica across N ranks (processes, one device each). The core's
process is rank 0 and keeps the scheduler; ranks 1..N-1 are worker processes that run the
same forward pass on their 1/N shard of the model and of the KV cache (Megatron-style), and
the SLO abort becomes an all-reduce vote at each layer boundary (vote.py)."""
