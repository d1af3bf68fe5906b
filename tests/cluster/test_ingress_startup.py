"""The ingress's own construction (its __init__, as Serve runs it, on the built-in model; no Ray)."""

from __future__ import annotations

import asyncio
import gc
import types

from ray import serve


def test_the_ingress_freezes_its_startup_heap(monkeypatch):
    """As the replicas' fronts and engine cores do: full collections over the whole ingress
    heap (Ray, Serve, the tokenizer) stopped its event loop, every stream it serves, ~100 ms."""
    from cluster.config import ClusterConfig
    from cluster.ingress import Ingress

    class NoReplica:  # the engine's handle: the grammar compiler's lookup waits, as with none up
        class model_info:
            @staticmethod
            async def remote():
                await asyncio.Event().wait()

    monkeypatch.setattr(serve, "get_replica_context", lambda: types.SimpleNamespace(app_name="default"))
    user_class = Ingress.func_or_class.__mro__[1]  # the class as written, under Serve's ASGI wrapper

    class Built(user_class):
        def __del__(self):  # user_class's own, a coroutine, is awaited below
            pass

    config = ClusterConfig(model="builtin", ports={"bind_address": "127.0.0.1", "router_metrics": 29200})
    threshold = gc.get_threshold()
    gc.unfreeze()

    async def construct():
        ingress = object.__new__(Built)
        await user_class.__init__(ingress, NoReplica(), config)
        frozen = gc.get_freeze_count()
        await user_class.__del__(ingress)
        return frozen

    try:
        assert asyncio.run(construct()) > 10_000  # imported code and the tokenizer, at least
    finally:
        gc.unfreeze()  # the test process's heap back within the collector's reach
        gc.set_threshold(*threshold)
