"""Serving one engine across two processes: the engine core (scheduler, model runner, KV cache,
a busy step loop) in its own process, and the front (tokenizer, detokenizer, per-request
streams, gRPC) that talks to it through typed, batched messages over a local socket."""
