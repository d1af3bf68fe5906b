"""The router's index of a replica's host KV tier: host-medium events fill a set of their own,
a prompt's host blocks continue its device hit, and they count at what the replica says a
host hit saves after its copy back."""

from __future__ import annotations

from protos import headroom_pb2 as pb
from router.cache_index import ReplicaCache, host_hit_worth

STORED, REMOVED, CLEARED = pb.KV_EVENT_BLOCK_STORED, pb.KV_EVENT_BLOCK_REMOVED, pb.KV_EVENT_ALL_BLOCKS_CLEARED
HOST = pb.KV_MEDIUM_HOST


def test_host_blocks_continue_the_device_hit_and_each_medium_has_its_own_entries():
    cache = ReplicaCache()
    cache.apply_events([(STORED, b"a"), (STORED, b"b", HOST), (STORED, b"c", HOST), (STORED, b"a", HOST)])
    prompt = [b"a", b"b", b"c", b"d"]
    assert cache.leading_blocks(prompt) == 1
    assert cache.leading_host_blocks(prompt, 1) == 2
    cache.apply_events([(REMOVED, b"a")])  # gone from the device only: the host copy still serves
    assert cache.leading_blocks(prompt) == 0 and cache.leading_host_blocks(prompt, 0) == 3
    cache.apply_events([(REMOVED, b"b", HOST)])
    assert cache.leading_host_blocks(prompt, 0) == 1
    cache.apply_events([(CLEARED, b"")])
    assert not cache.hashes and not cache.host_hashes


def test_a_batch_from_the_wire_carries_the_medium():
    cache = ReplicaCache()
    batch = pb.KVEventBatch(replica_id="r", seq=1, snapshot=True, block_size=16, events=[
        pb.KVEvent(kind=CLEARED), pb.KVEvent(kind=STORED, block_hash=b"a"),
        pb.KVEvent(kind=STORED, block_hash=b"b", medium=HOST)])
    assert cache.apply(batch)
    assert set(cache.hashes) == {b"a"} and set(cache.host_hashes) == {b"b"}


def test_a_host_hit_is_worth_a_device_hit_less_its_copy_back():
    assert host_hit_worth(pb.ReplicaLoad(host_kv_blocks_total=64, host_hit_cost_ratio=0.25)) == 0.75
    assert host_hit_worth(pb.ReplicaLoad(host_kv_blocks_total=64, host_hit_cost_ratio=3.0)) == 0.0
    assert host_hit_worth(pb.ReplicaLoad()) == 0.0  # no host tier reported
    assert host_hit_worth(None) == 0.0
