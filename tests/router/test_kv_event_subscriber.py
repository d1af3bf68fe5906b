"""The router's KV event subscription against a real ReplicaServer on loopback: the index
fills with the hashes of what the replica cached, a prompt sharing that prefix is seen as
cached there, the index is dropped while the replica is down and rebuilt from the snapshot of
its next stream, and the router's prefix metrics count hits and spills."""

from __future__ import annotations

import asyncio

from protos.block_hash import block_hashes
from replica.core.request import SamplingParams
from router.headroom_router import HeadroomRouter
from router.load_subscriber import Backoff
from router.policies import RoutingRequest
from test_load_subscriber import eventually, free_port, start_replica

PROMPT = list(range(30, 78))  # 48 tokens: 3 full blocks
FOLLOW_UP = tuple(PROMPT + [5, 6, 7, 8])  # shares all 3 blocks


def follow_up() -> RoutingRequest:
    return RoutingRequest(prompt_tokens=len(FOLLOW_UP), max_tokens=8, prompt_token_ids=FOLLOW_UP)


def cached_blocks_gauge(router: HeadroomRouter, replica_id: str = "r0"):
    """headroom_router_cached_blocks for the replica as a scrape reads it; None: no series."""
    return router.metrics.registry.get_sample_value("headroom_router_cached_blocks", {"replica": replica_id})


def test_the_index_learns_what_the_replica_cached_and_is_rebuilt_after_a_restart():
    async def scenario() -> None:
        port = free_port()
        server = await start_replica(port)
        router = HeadroomRouter("headroom", backoff=Backoff(initial_s=0.05, max_s=0.2))
        try:
            router.sync_replicas({"r0": f"127.0.0.1:{port}"})
            await eventually(lambda: router.cache_index.get("r0") is not None)  # the first snapshot
            async for _ in server.engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0)):
                pass
            hashes = block_hashes(PROMPT, 16)
            await eventually(lambda: router.cache_index.get("r0").leading_blocks(hashes) == 3)
            # The gauge follows the batches: nothing has been ranked yet.
            assert cached_blocks_gauge(router) == len(router.cache_index.get("r0").hashes) >= 3
            await eventually(lambda: router.loads.get("r0").load is not None)
            assert router.rank(follow_up(), {"r0": 0}, "k") == ["r0"]
            assert router._view(follow_up(), "r0", 0).cached_tokens == 48

            await server.stop(0.5)
            await eventually(lambda: router.cache_index.get("r0") is None)  # dropped with the stream
            assert cached_blocks_gauge(router) is None  # and its gauge with it: no stale count
            server = await start_replica(port)  # a new engine: its cache is empty
            await eventually(lambda: router.cache_index.get("r0") is not None)
            assert router.cache_index.get("r0").leading_blocks(hashes) == 0
            assert cached_blocks_gauge(router) == 0
            assert router.metrics.sample("headroom_router_kv_event_resyncs_total", replica="r0") == 1
            router.sync_replicas({})  # the replica left: no series left behind
            assert cached_blocks_gauge(router) is None
        finally:
            await router.close()
            await server.stop(0.5)

    asyncio.run(scenario())


def test_routed_requests_count_predicted_hits_and_spills_away_from_the_holder():
    async def scenario() -> None:
        port = free_port()
        server = await start_replica(port, "holder")
        router = HeadroomRouter("headroom")
        endpoint = f"127.0.0.1:{port}"
        try:
            router.sync_replicas({"holder": endpoint, "elsewhere": None})  # the other: no endpoint announced yet
            async for _ in server.engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0)):
                pass
            await eventually(lambda: router.cache_index.get("holder") is not None
                             and router.cache_index.get("holder").leading_blocks(block_hashes(PROMPT, 16)) == 3)
            router.routed(follow_up(), "a", "holder")
            router.routed(follow_up(), "b", "elsewhere")  # no cache there: a spill
            assert router.metrics.sample("headroom_router_prefix_hit_tokens_total", replica="holder") == 48
            assert router.metrics.sample("headroom_router_prefix_spills_total", replica="elsewhere") == 1
            assert router.metrics.sample("headroom_router_prefix_spills_total", replica="holder") == 0
        finally:
            await router.close()
            await server.stop(0.5)

    asyncio.run(scenario())


def test_a_batch_arriving_as_its_replica_is_unsubscribed_does_not_bring_its_index_entry_back():
    """A race a real stream cannot be made to hit on demand, so the transport is a stand-in
    (the subscription's own stream code reads it): the stream task is woken with a batch in
    the same loop iteration as the router drops the replica. It used to run first and apply the
    batch, recreating the index entry with no subscription left to drop it."""
    from protos import headroom_pb2 as pb
    from router.cache_index import PrefixCacheIndex
    from router.kv_event_subscriber import KVEventSubscriber

    snapshot = pb.KVEventBatch(replica_id="r", seq=1, snapshot=True, block_size=16, events=[
        pb.KVEvent(kind=pb.KV_EVENT_ALL_BLOCKS_CLEARED), pb.KVEvent(kind=pb.KV_EVENT_BLOCK_STORED, block_hash=b"a")])
    later = pb.KVEventBatch(replica_id="r", seq=2, block_size=16, events=[
        pb.KVEvent(kind=pb.KV_EVENT_BLOCK_STORED, block_hash=b"b", parent_hash=b"a")])

    class GatedChannel:
        """Answers every stream with the snapshot, then `later` once the gate opens."""

        def __init__(self, gate: asyncio.Event):
            self.gate = gate

        def unary_stream(self, *args, **kwargs):
            async def stream():
                yield snapshot
                await self.gate.wait()
                yield later
            return lambda request, metadata=(): stream()

        unary_unary = unary_stream

    async def scenario() -> None:
        index = PrefixCacheIndex()
        subscriber = KVEventSubscriber(index)
        subscription = subscriber._make("r", "unused:1")
        gate = asyncio.Event()
        subscription._task = asyncio.get_running_loop().create_task(subscription._stream_once(GatedChannel(gate)))
        subscriber._subscriptions["r"] = subscription
        await eventually(lambda: index.get("r") is not None)
        gate.set()  # the stream task is woken with `later`...
        subscriber.unsubscribe("r")  # ...as the router drops the replica
        for _ in range(5):
            await asyncio.sleep(0)
        assert index.get("r") is None and "r" not in index.replica_ids()
        await subscriber.close()

    asyncio.run(scenario())


def test_a_gap_in_the_batches_is_a_resync_logged_as_one_warning_line(monkeypatch, caplog):
    """A replica's stream skipping a batch number is expected (the router resyncs from the
    next stream's snapshot), not an error: one warning line, no traceback, and the resync
    counted. The transport is a stand-in: a live stream cannot be made to skip on demand."""
    import logging

    import grpc

    from protos import headroom_pb2 as pb
    from router.cache_index import PrefixCacheIndex
    from router.kv_event_subscriber import KVEventSubscriber
    from router.metrics import RouterMetrics

    snapshot = pb.KVEventBatch(replica_id="r", seq=1, snapshot=True, block_size=16, events=[
        pb.KVEvent(kind=pb.KV_EVENT_ALL_BLOCKS_CLEARED), pb.KVEvent(kind=pb.KV_EVENT_BLOCK_STORED, block_hash=b"a")])
    after_a_gap = pb.KVEventBatch(replica_id="r", seq=3, block_size=16, events=[
        pb.KVEvent(kind=pb.KV_EVENT_BLOCK_STORED, block_hash=b"c", parent_hash=b"b")])
    streams = []

    class Channel:
        """Each stream: the snapshot, then (the first stream only) a batch past a gap."""

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info):
            return False

        def unary_stream(self, *args, **kwargs):
            async def stream():
                streams.append(None)
                yield snapshot
                if len(streams) == 1:
                    yield after_a_gap
                await asyncio.Event().wait()
            return lambda request, metadata=(): stream()

        unary_unary = unary_stream

    monkeypatch.setattr(grpc.aio, "insecure_channel", lambda *args, **kwargs: Channel())
    caplog.set_level(logging.DEBUG, logger="router")

    async def scenario() -> None:
        index = PrefixCacheIndex()
        metrics = RouterMetrics("headroom")
        subscriber = KVEventSubscriber(index, backoff=Backoff(initial_s=0.01, max_s=0.02),
                                       on_resync=metrics.kv_event_resynced)
        subscriber.subscribe("r", "unused:1")
        await eventually(lambda: len(streams) == 2 and index.get("r") is not None, timeout_s=2.0)
        assert metrics.sample("headroom_router_kv_event_resyncs_total", replica="r") == 1
        await subscriber.close()

    asyncio.run(scenario())
    records = [record for record in caplog.records if record.levelno >= logging.INFO]
    assert len(records) == 1 and records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert "batch 3 came after 1" in records[0].getMessage() and "\n" not in records[0].getMessage()
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
