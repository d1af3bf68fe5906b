"""The router's cache index as its KV event stream builds it: snapshots replace, live batches
apply in order, a gap is refused (the caller resyncs), memory stays bounded, and a prompt's
leading cached blocks are counted with the hashes the replica uses."""

from __future__ import annotations

from protos import headroom_pb2 as pb
from protos.block_hash import block_hashes
from router.cache_index import PrefixCacheIndex, ReplicaCache

PROMPT = list(range(200, 264))  # 4 blocks of 16
HASHES = block_hashes(PROMPT, 16)


def stored(block_hash: bytes) -> pb.KVEvent:
    return pb.KVEvent(kind=pb.KV_EVENT_BLOCK_STORED, block_hash=block_hash)


def removed(block_hash: bytes) -> pb.KVEvent:
    return pb.KVEvent(kind=pb.KV_EVENT_BLOCK_REMOVED, block_hash=block_hash)


def snapshot(seq: int, hashes) -> pb.KVEventBatch:
    events = [pb.KVEvent(kind=pb.KV_EVENT_ALL_BLOCKS_CLEARED)] + [stored(h) for h in hashes]
    return pb.KVEventBatch(seq=seq, snapshot=True, block_size=16, events=events)


def batch(seq: int, *events: pb.KVEvent) -> pb.KVEventBatch:
    return pb.KVEventBatch(seq=seq, block_size=16, events=events)


def test_live_batches_after_a_snapshot_build_the_set_and_count_leading_blocks():
    cache = ReplicaCache()
    assert cache.apply(snapshot(7, HASHES[:1]))
    assert cache.apply(batch(8, stored(HASHES[1]), stored(HASHES[3])))
    assert cache.leading_blocks(HASHES) == 2  # block 2 is missing: block 3 cannot be used
    assert cache.apply(batch(9, removed(HASHES[0])))
    assert cache.leading_blocks(HASHES) == 0


def test_a_gap_in_the_numbering_is_refused_and_changes_nothing():
    cache = ReplicaCache()
    assert not cache.apply(batch(1, stored(HASHES[0])))  # no snapshot yet
    assert cache.apply(snapshot(3, HASHES[:2]))
    assert not cache.apply(batch(5, removed(HASHES[0])))  # 4 is missing
    assert cache.leading_blocks(HASHES) == 2 and cache.seq == 3


def test_a_steps_events_in_several_parts_apply_as_one_batch():
    """The replica sends a step of more than KV_EVENTS_PER_MESSAGE events in parts sharing its seq, as it
    sends a snapshot; the second part was refused as a gap, and the router dropped the replica's
    index and resynced from a snapshot. A live seq repeated right after a snapshot stays a gap."""
    from replica.core.kv_events import stored as engine_stored
    from replica.server.grpc_service import KV_EVENTS_PER_MESSAGE, kv_event_batch_protos
    from replica.front.kv_event_log import KVEventBatch

    cache = ReplicaCache()
    assert cache.apply(snapshot(3, HASHES[:1]))
    many = [bytes([index % 256, index // 256]) * 8 for index in range(KV_EVENTS_PER_MESSAGE + 1)]
    parts = list(kv_event_batch_protos(KVEventBatch(4, [engine_stored(h, None) for h in many]), "r", 16))
    assert [part.seq for part in parts] == [4, 4] and not any(part.snapshot for part in parts)
    assert all(cache.apply(part) for part in parts)
    assert len(cache.hashes) == 1 + len(many) and cache.seq == 4
    assert cache.apply(batch(5, removed(HASHES[0])))
    cache = ReplicaCache()
    assert cache.apply(snapshot(3, HASHES[:1]))
    assert not cache.apply(batch(3, removed(HASHES[0])))  # the snapshot holds batch 3 already


def test_a_new_snapshot_replaces_whatever_was_there():
    cache = ReplicaCache()
    cache.apply(snapshot(3, HASHES))
    cache.apply(snapshot(10, HASHES[2:]))
    assert cache.leading_blocks(HASHES) == 0 and len(cache.hashes) == 2


def test_the_set_is_bounded_and_drops_its_oldest_hashes_first():
    cache = ReplicaCache(max_blocks=3)
    cache.apply(snapshot(1, HASHES))
    assert list(cache.hashes) == HASHES[1:]


def test_a_dropped_replica_holds_nothing_until_its_next_snapshot():
    index = PrefixCacheIndex()
    index.apply("r", snapshot(1, HASHES))
    assert index.get("r").leading_blocks(HASHES) == 4
    index.drop("r")
    assert index.get("r") is None and index.num_blocks("r") == 0
