"""The engine core: what runs in the engine-core process. Requests and their queue, the
scheduler (token budget, chunked prefill, admission, preemption, SLO aborts), the paged KV
cache and its block pool with prefix caching, the LLMEngine that steps them through the
executor, and the process's busy loop (engine_core.py) and entry point (process.py)."""
