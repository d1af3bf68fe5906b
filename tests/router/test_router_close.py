"""A router's streams end with it, against a real ReplicaServer on loopback: its replica sees
every WatchLoad and WatchKVEvents stream end and no stream task is left, whether the router is
closed, drops the replica from its set, or is discarded without a word (Ray Serve 2.60 gives a
request router no shutdown hook)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from replica.server.grpc_service import LoadReporterServicer
from router.headroom_router import HeadroomRouter
from test_load_subscriber import eventually, start_replica


@pytest.fixture
def open_streams(monkeypatch) -> dict[str, int]:
    """The replica's WatchLoad and WatchKVEvents calls still running, by method."""
    running = {"WatchLoad": 0, "WatchKVEvents": 0}

    def counted(name: str):
        method = getattr(LoadReporterServicer, name)

        async def watch(self, request, context) -> None:
            running[name] += 1
            try:
                await method(self, request, context)
            finally:
                running[name] -= 1

        monkeypatch.setattr(LoadReporterServicer, name, watch)

    for name in list(running):
        counted(name)
    return running


def stream_tasks() -> list[asyncio.Task]:
    return [task for task in asyncio.all_tasks() if task.get_name().startswith(("watch-load-", "watch-kv-events-"))]


async def subscribed_router(port: int, open_streams: dict[str, int]) -> HeadroomRouter:
    router = HeadroomRouter("headroom")  # reads caches: a load and a KV event stream per replica
    router.sync_replicas({"r0": f"127.0.0.1:{port}"})
    await eventually(lambda: open_streams == {"WatchLoad": 1, "WatchKVEvents": 1})
    assert len(stream_tasks()) == 2
    return router


def test_a_replica_that_leaves_the_set_sees_its_streams_end(open_streams):
    async def scenario() -> None:
        server = await start_replica(0)
        try:
            router = await subscribed_router(server.port, open_streams)
            router.sync_replicas({})
            await eventually(lambda: open_streams == {"WatchLoad": 0, "WatchKVEvents": 0})
            await eventually(lambda: not stream_tasks())
            await router.close()
        finally:
            await server.stop(0.5)

    asyncio.run(scenario())


def test_a_discarded_router_ends_its_streams(open_streams):
    """Discarded without close(), a router's subscriptions kept their tasks, channels and the
    replica's streams for the life of the process (a proxy builds one per application handle)."""
    async def scenario() -> None:
        server = await start_replica(0)
        try:
            router = await subscribed_router(server.port, open_streams)
            discarded = weakref.ref(router)
            del router
            gc.collect()
            assert discarded() is None  # nothing of the router lives on in its streams
            await eventually(lambda: open_streams == {"WatchLoad": 0, "WatchKVEvents": 0})
            await eventually(lambda: not stream_tasks())
        finally:
            await server.stop(0.5)

    asyncio.run(scenario())
