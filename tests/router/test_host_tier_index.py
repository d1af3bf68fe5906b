"""The router's index of a replica's host KV tier: host-medium events fill a set of their own,
a prompt's host blocks continue its device hit, and they count at what the replica says a
host hit saves after its copy back."""

from __future__ import annotations

from protos import headroom_pb2 as pb
from router.cache_index import ReplicaCache, host_hit_worth
from router.policies import RoutingRequest
from router_harness import router_over

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


def test_a_host_tier_hit_saves_prefill_but_not_the_device_memory_the_fit_needs():
    # The holder keeps the whole 3,200-token prompt on its host tier (a copy back costs
    # nothing, host_hit_cost_ratio 0) but has 1,600 tokens free: the request (3,456 tokens
    # with its output) needs 216 new device blocks there, as anywhere. Counted as shared
    # device memory, the host hit made the holder "fit" and ranked it first.
    request = RoutingRequest(prompt_tokens=3200, max_tokens=256, prompt_token_ids=tuple(range(1, 3201)))
    loads = {replica_id: pb.ReplicaLoad(kv_blocks_total=1000, kv_blocks_free=free, block_size=16,
                                        kv_usage=1 - free / 1000, headroom_tokens=free * 16, step_time_ms=20.0,
                                        host_kv_blocks_total=4000, host_hit_cost_ratio=0.0)
             for replica_id, free in (("holder", 100), ("empty", 1000))}
    router = router_over(loads)
    router.cache_index.apply("holder", pb.KVEventBatch(seq=1, snapshot=True, block_size=16, events=[
        pb.KVEvent(kind=CLEARED), *(pb.KVEvent(kind=STORED, block_hash=h, medium=HOST) for h in request.prefix_hashes(16))]))
    view = router._view(request, "holder", 0)
    assert (view.cached_tokens, view.shared_tokens) == (3184, 0)  # the prefill saved; no memory shared
    assert not router.policy.score(request, view).fits
    assert router.rank(request, {"holder": 0, "empty": 0}, "k") == ["empty", "holder"]
    # And what a send there commits: every block of the sequence, less none.
    send = router._send_of(request, "holder")
    assert send.blocks == 216 and send.prefill_tokens == 3200 - 3184
