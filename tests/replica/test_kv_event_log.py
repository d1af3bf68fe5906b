"""The replica's KV event stream: batches numbered in order, a snapshot for a new or lagging
subscriber that rebuilds the index, and WatchKVEvents over real gRPC carrying the hashes a
router computes from the prompt."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from protos.block_hash import block_hashes
from replica.server.grpc_service import kv_event_batch_protos
from replica.front.kv_event_log import KVEventLog
from replica.core.kv_events import KVEventKind, removed, stored
from router.cache_index import ReplicaCache
from replica_harness import REPLICA_ID, RunningReplica, collect_stream, sampling

H = [bytes([i]) * 16 for i in range(8)]


def after(log: KVEventLog, seq):
    return asyncio.run(log.batches_after(seq))


def test_batches_are_numbered_in_order_and_empty_steps_publish_nothing():
    log = KVEventLog()
    log.publish([stored(H[0], None)])
    log.publish([])
    log.publish([stored(H[1], H[0]), removed(H[0])])
    assert log.seq == 2
    assert [batch.seq for batch in after(log, 0)] == [1, 2]
    assert after(log, 2) == []


def test_a_new_subscriber_gets_a_snapshot_that_clears_then_stores_what_is_cached():
    log = KVEventLog()
    log.publish([stored(H[0], None), stored(H[1], H[0]), stored(H[2], None)])
    log.publish([removed(H[2])])
    (snapshot,) = after(log, None)
    assert snapshot.snapshot and snapshot.seq == 2
    assert snapshot.events[0][0] == KVEventKind.ALL_BLOCKS_CLEARED
    assert {(block_hash, parent) for _, block_hash, parent in snapshot.events[1:]} == {(H[0], None), (H[1], H[0])}


def test_a_subscriber_behind_the_window_resyncs_from_a_snapshot():
    log = KVEventLog(recent_batches=3)
    for i in range(6):
        log.publish([stored(H[i], None)])
    (snapshot,) = after(log, 1)  # batches 2 and 3 are gone from the window
    assert snapshot.snapshot and snapshot.seq == 6 and len(snapshot.events) == 7
    assert [batch.seq for batch in after(log, 3)] == [4, 5, 6]  # still in the window


def test_a_big_snapshot_is_split_into_parts_that_share_its_seq():
    log = KVEventLog()
    log.publish([stored(i.to_bytes(16, "little"), None) for i in range(40_000)])
    (snapshot,) = after(log, None)
    parts = list(kv_event_batch_protos(snapshot, "r", 16))
    assert len(parts) == 3 and {part.seq for part in parts} == {1} and all(part.snapshot for part in parts)
    assert sum(len(part.events) for part in parts) == 40_001


def test_waiting_returns_when_a_batch_is_published():
    async def scenario() -> float:
        log = KVEventLog()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, log.publish, [stored(H[0], None)])
        started = loop.time()
        await log.wait_for_batch(0, timeout=5.0)
        return loop.time() - started

    assert asyncio.run(scenario()) < 1.0


@pytest.fixture(scope="module")
def replica():
    running = RunningReplica(max_model_len=256, block_size=16, num_kv_blocks=64)
    yield running
    running.close()


def test_watch_kv_events_streams_a_snapshot_then_the_prompts_block_hashes(replica):
    prompt = list(range(40, 80))  # 40 tokens: 2 full blocks; output fills part of a third

    async def run() -> list[pb.KVEventBatch]:
        async with grpc.aio.insecure_channel(replica.address) as channel:
            watch = pb_grpc.LoadReporterStub(channel).WatchKVEvents(pb.WatchKVEventsRequest())
            batches = [await watch.read()]
            await collect_stream(pb_grpc.GenerationStub(channel), pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=sampling(max_tokens=4, temperature=0.0)))
            stored_hashes = set()
            while not set(block_hashes(prompt, 16)) <= stored_hashes:
                batches.append(await asyncio.wait_for(watch.read(), 10.0))
                stored_hashes |= {e.block_hash for e in batches[-1].events if e.kind == pb.KV_EVENT_BLOCK_STORED}
            watch.cancel()
            return batches

    batches = asyncio.run(run())
    first = batches[0]
    assert first.snapshot and first.replica_id == REPLICA_ID and first.block_size == 16
    assert first.events[0].kind == pb.KV_EVENT_ALL_BLOCKS_CLEARED
    live = batches[1:]
    assert all(not batch.snapshot for batch in live)
    assert [batch.seq for batch in live] == list(range(first.seq + 1, first.seq + 1 + len(live)))
    first_block, second_block = block_hashes(prompt, 16)
    events = [e for batch in live for e in batch.events]
    assert any(e.block_hash == second_block and e.parent_hash == first_block for e in events)


def test_a_big_snapshot_is_served_off_the_event_loop_and_the_batches_after_it_follow_it_once():
    """A new subscriber's snapshot of a prefix cache of 300,000 blocks was built on the front's
    event loop (and each of its parts after it): every stream and admission on that loop stalled
    for as long as the build. Now the loop's largest stall while it is served is a fraction of
    the build (both measured here), and batches published while it is built reach the
    subscriber after it, each once: its index ends equal to the replica's."""
    replica = RunningReplica(max_model_len=256, block_size=16, num_kv_blocks=64)
    try:
        log = replica.async_engine.kv_events
        cached = [i.to_bytes(16, "little") for i in range(300_000)]
        replica.on_loop(lambda: log.publish([stored(block_hash, None) for block_hash in cached]))
        started = time.perf_counter()
        log.snapshot()  # what the loop did for each new subscriber (the mirror is idle now)
        build_s = time.perf_counter() - started
        stop = threading.Event()

        async def probe_the_loop_and_publish() -> float:
            """On the server's loop: its largest gap between 2 ms ticks, while a step's batch
            is published every other tick."""
            largest_s, last, tick = 0.0, time.perf_counter(), 0
            while not stop.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                largest_s, last, tick = max(largest_s, now - last), now, tick + 1
                if tick % 2 == 0:
                    log.publish([stored((10**6 + tick).to_bytes(16, "little"), None), removed(cached[tick])])
            return largest_s

        async def subscribe() -> list[pb.KVEventBatch]:
            """Every message up to the first batch after the snapshot, then (the publishing
            stopped) up to the log's last batch."""
            async with grpc.aio.insecure_channel(replica.address) as channel:
                watch = pb_grpc.LoadReporterStub(channel).WatchKVEvents(pb.WatchKVEventsRequest())
                messages = [await asyncio.wait_for(watch.read(), 30.0)]
                while messages[-1].snapshot:
                    messages.append(await asyncio.wait_for(watch.read(), 30.0))
                stop.set()
                largest_gap_s = await asyncio.wrap_future(probe)
                last_seq = replica.on_loop(lambda: log.seq)
                while messages[-1].seq < last_seq:
                    messages.append(await asyncio.wait_for(watch.read(), 30.0))
                watch.cancel()
                return messages, largest_gap_s

        probe = asyncio.run_coroutine_threadsafe(probe_the_loop_and_publish(), replica.loop)
        messages, largest_gap_s = asyncio.run(subscribe())
        assert largest_gap_s < build_s / 3, (largest_gap_s, build_s)
        index = ReplicaCache()
        assert all(index.apply(message) for message in messages)  # no batch missing or repeated
        assert messages[0].snapshot and sum(message.snapshot for message in messages) > 1  # in parts
        published_meanwhile = [message for message in messages if not message.snapshot]
        assert len(published_meanwhile) > 1
        source = replica.on_loop(lambda: {event[1] for event in log.snapshot().events[1:]})
        assert set(index.hashes) == source and len(source) > len(cached) // 2
    finally:
        replica.close()
