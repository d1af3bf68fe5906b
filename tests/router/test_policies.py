"""Routing policies as specifications: the headroom policy's fit filter, preemption penalty,
herd avoidance and stale-stat fallback, and the baselines doing what their sources do."""

from __future__ import annotations

import collections
import random

import pytest

from protos.headroom_pb2 import ReplicaLoad
from router.inflight import InflightCounts, InflightTracker
from router.policies import (
    HeadroomPolicy,
    LeastLoadedPolicy,
    PowerOfTwoPolicy,
    ReplicaView,
    RoundRobinPolicy,
    RoutingRequest,
    make_policy,
)

BLOCK_SIZE = 16
POOL_BLOCKS = 1000  # 16,000 tokens


def make_load(replica_id: str, free_blocks: int = POOL_BLOCKS, seq: int = 1, **fields) -> ReplicaLoad:
    fields.setdefault("step_time_ms", 20.0)
    return ReplicaLoad(
        replica_id=replica_id, seq=seq, kv_blocks_total=POOL_BLOCKS, kv_blocks_free=free_blocks,
        block_size=BLOCK_SIZE, kv_usage=1 - free_blocks / POOL_BLOCKS, headroom_tokens=free_blocks * BLOCK_SIZE,
        **fields,
    )


def view(replica_id: str, load: ReplicaLoad | None = None, age_s: float = 0.05, queue_len: int = 0,
         inflight: InflightCounts = InflightCounts(), cached_blocks: int = 0) -> ReplicaView:
    return ReplicaView(replica_id, load, age_s, queue_len, inflight, cached_blocks, BLOCK_SIZE)


def headroom_policy(seed: int = 0) -> HeadroomPolicy:
    return HeadroomPolicy(rng=random.Random(seed))


def test_replica_where_the_full_sequence_does_not_fit_ranks_after_one_where_it_does():
    # 4,000 prompt + 1,000 output tokens need 313 blocks; "roomy" has 400 free, "tight" 300.
    # On headroom alone "tight" would not lose by much, but it cannot hold the sequence.
    request = RoutingRequest(prompt_tokens=4000, max_tokens=1000)
    replicas = [view("tight", make_load("tight", free_blocks=300)), view("roomy", make_load("roomy", free_blocks=400))]
    for seed in range(20):
        assert headroom_policy(seed).rank(request, replicas) == ["roomy", "tight"]


def test_fit_counts_max_tokens_not_just_the_prompt():
    # The prompt alone (200 blocks) fits both; prompt + max_tokens (325 blocks) only "b".
    request = RoutingRequest(prompt_tokens=3200, max_tokens=2000)
    policy = headroom_policy()
    a = policy.score(request, view("a", make_load("a", free_blocks=300)))
    b = policy.score(request, view("b", make_load("b", free_blocks=330)))
    assert not a.fits and b.fits


def test_fit_subtracts_committed_growth_and_blocks_sent_since_the_snapshot():
    request = RoutingRequest(prompt_tokens=1600, max_tokens=16)  # 101 blocks
    policy = headroom_policy()
    free = make_load("r", free_blocks=200)
    assert policy.score(request, view("r", free)).fits
    committed = make_load("r", free_blocks=200, kv_committed_tokens=100 * BLOCK_SIZE)
    assert not policy.score(request, view("r", committed)).fits
    assert not policy.score(request, view("r", free, inflight=InflightCounts(requests=1, blocks=100))).fits


def test_free_blocks_already_promised_to_running_requests_do_not_count_as_room():
    # "promised" has 800 free blocks, but its live requests will still grow by 600 of them
    # (say, long outputs just admitted); "settled" has 500 free and owes nothing. On free
    # blocks alone "promised" wins; it would preempt someone once its requests grow.
    request = RoutingRequest(prompt_tokens=1000, max_tokens=1000)  # 125 blocks: fits both on free blocks
    replicas = [
        view("promised", make_load("promised", free_blocks=800, num_running=20, kv_committed_tokens=600 * BLOCK_SIZE)),
        view("settled", make_load("settled", free_blocks=500, num_running=20)),
    ]
    for seed in range(20):
        assert headroom_policy(seed).rank(request, replicas) == ["settled", "promised"]


def test_when_nothing_fits_the_least_bad_replica_still_gets_the_request():
    request = RoutingRequest(prompt_tokens=15000, max_tokens=900)  # 994 blocks
    replicas = [view("fuller", make_load("fuller", free_blocks=100)), view("emptier", make_load("emptier", free_blocks=600))]
    assert headroom_policy().rank(request, replicas) == ["emptier", "fuller"]


def test_higher_preemption_rate_ranks_lower_at_equal_headroom():
    request = RoutingRequest(prompt_tokens=500, max_tokens=500)
    replicas = [
        view("thrashing", make_load("thrashing", free_blocks=500, num_running=10, preemption_rate=5.0,
                                    preemption_rate_per_running=0.5)),
        view("calm", make_load("calm", free_blocks=500, num_running=10, preemption_rate=0.0)),
        view("mild", make_load("mild", free_blocks=500, num_running=10, preemption_rate=0.5,
                               preemption_rate_per_running=0.05)),
    ]
    for seed in range(20):
        assert headroom_policy(seed).rank(request, replicas) == ["calm", "mild", "thrashing"]


def test_preemption_penalty_outweighs_a_modest_headroom_advantage():
    # 20% more headroom does not make up for a replica that preempts every running request
    # about once every two seconds: this 500-token decode (10 s at 20 ms/step) would
    # almost surely be preempted there.
    request = RoutingRequest(prompt_tokens=500, max_tokens=500)
    thrashing = make_load("thrashing", free_blocks=700, num_running=10, preemption_rate=5.0,
                          preemption_rate_per_running=0.5)
    calm = make_load("calm", free_blocks=500, num_running=10)
    assert headroom_policy().rank(request, [view("thrashing", thrashing), view("calm", calm)])[0] == "calm"


def test_waiting_prefill_backlog_ranks_lower_at_equal_headroom():
    request = RoutingRequest(prompt_tokens=100, max_tokens=100)
    replicas = [
        view("queued", make_load("queued", free_blocks=800, waiting_prefill_tokens=3000)),
        view("idle", make_load("idle", free_blocks=800)),
    ]
    assert headroom_policy().rank(request, replicas) == ["idle", "queued"]


@pytest.mark.parametrize("num_replicas", [2, 4, 8])
def test_burst_of_2r_requests_without_a_new_snapshot_spreads_evenly(num_replicas):
    # Identical snapshots, no update during the burst: only the router's own bookkeeping
    # tells the replicas apart. Each must get 1/R of the burst, within 10% of the burst.
    ids = [f"replica-{i}" for i in range(num_replicas)]
    loads = {replica_id: make_load(replica_id, free_blocks=900) for replica_id in ids}
    burst = 2 * num_replicas
    for seed in range(10):
        policy = headroom_policy(seed)
        tracker = InflightTracker()
        for replica_id in ids:
            tracker.observe_snapshot(replica_id, seq=1, taken_at=0.0)
        request = RoutingRequest(prompt_tokens=50, max_tokens=20)  # tiny: its blocks alone barely move the score
        chosen = collections.Counter()
        for i in range(burst):
            views = [view(r, loads[r], inflight=tracker.counts(r)) for r in ids]
            target = policy.rank(request, views)[0]
            tracker.record_sent(target, request.num_blocks(BLOCK_SIZE), now=0.01 + i * 1e-3)
            chosen[target] += 1
        for replica_id in ids:
            assert abs(chosen[replica_id] / burst - 1 / num_replicas) <= 0.10, chosen


def test_a_newer_snapshot_forgets_the_sends_it_covers_and_keeps_later_ones():
    tracker = InflightTracker()
    tracker.record_sent("r", blocks=10, now=1.0)
    tracker.record_sent("r", blocks=20, now=2.0)
    assert tracker.counts("r") == InflightCounts(requests=2, blocks=30)
    assert tracker.observe_snapshot("r", seq=5, taken_at=1.5)  # taken after the first send only
    assert tracker.counts("r") == InflightCounts(requests=1, blocks=20)
    assert not tracker.observe_snapshot("r", seq=4, taken_at=3.0)  # reordered: older seq, ignored
    assert tracker.counts("r") == InflightCounts(requests=1, blocks=20)
    assert tracker.observe_snapshot("r", seq=6, taken_at=3.0)
    assert tracker.counts("r") == InflightCounts()


def test_an_end_the_snapshot_cannot_show_yet_credits_its_blocks_until_a_later_snapshot():
    """A request that ended after the replica's latest snapshot freed KV the snapshot still
    shows as held: with reports 500 ms late the router's room was 0.115 of a pool too low on
    mixed_long, nearly all of it requests ended since (bench_router_sim staleness)."""
    tracker = InflightTracker()
    tracker.record_sent("r", blocks=10, now=1.0, request_key="before")
    tracker.observe_snapshot("r", seq=1, taken_at=1.5)  # holds `before`'s KV
    tracker.record_sent("r", blocks=20, now=2.0, request_key="after")
    assert tracker.counts("r") == InflightCounts(requests=1, blocks=20)
    tracker.record_ended("before", now=2.5)  # sent before the snapshot: its blocks are freed
    assert tracker.counts("r") == InflightCounts(requests=1, blocks=10)
    tracker.record_ended("after", now=3.0)  # sent and ended since: nothing of it counts
    assert tracker.counts("r") == InflightCounts(requests=0, blocks=-10)  # room the snapshot does not show
    tracker.observe_snapshot("r", seq=2, taken_at=2.7)  # shows `before` gone and `after` still held
    assert tracker.counts("r") == InflightCounts(requests=0, blocks=-20)
    tracker.observe_snapshot("r", seq=3, taken_at=3.5)
    assert tracker.counts("r") == InflightCounts()


def test_the_router_credits_a_requests_end_to_its_replica_until_a_snapshot_shows_it():
    from router_harness import router_over

    router = router_over({"r0": make_load("r0")})
    request = RoutingRequest(prompt_tokens=100, max_tokens=50)
    router.routed(request, "a", "r0")
    sent = router.inflight.counts("r0")
    assert sent.requests == 1 and sent.blocks > 0
    router.abandoned("a", "r0")  # ended before any snapshot after its send
    assert router.inflight.counts("r0") == InflightCounts(requests=0, blocks=0)
    router.routed(request, "b", "r0")
    router.inflight.observe_snapshot("r0", seq=10**6, taken_at=router.wall_clock())  # now holds b's KV
    assert router.inflight.counts("r0") == InflightCounts()
    router.abandoned("b", "r0")
    assert router.inflight.counts("r0") == InflightCounts(requests=0, blocks=-sent.blocks)
    # An end that arrived before its routing call: the send is credited back at once.
    router.abandoned("c", "r0")
    router.routed(request, "c", "r0")
    assert router.inflight.counts("r0") == InflightCounts(requests=0, blocks=-sent.blocks)


def test_removed_replica_starts_afresh():
    tracker = InflightTracker()
    tracker.observe_snapshot("r", seq=9, taken_at=0.0)
    tracker.record_sent("r", blocks=10, now=1.0)
    tracker.remove_replica("r")
    assert tracker.counts("r") == InflightCounts()
    assert tracker.observe_snapshot("r", seq=1, taken_at=2.0)  # a restarted replica counts from 1 again


@pytest.mark.parametrize("policy_name", ["headroom", "least_loaded"])
def test_stale_and_missing_stats_fall_back_to_queue_length(policy_name):
    request = RoutingRequest(prompt_tokens=100, max_tokens=100)
    # The stale snapshots claim the opposite of the queues: they must be ignored.
    replicas = [
        view("busy", make_load("busy", free_blocks=1000), age_s=5.0, queue_len=9),
        view("missing", None, age_s=float("inf"), queue_len=1),
        view("middle", make_load("middle", free_blocks=10), age_s=1.5, queue_len=4),
    ]
    for seed in range(10):
        assert make_policy(policy_name, random.Random(seed)).rank(request, replicas) == ["missing", "middle", "busy"]


def test_stale_replica_goes_ahead_of_fresh_ones_only_with_a_shorter_queue():
    request = RoutingRequest(prompt_tokens=100, max_tokens=100)
    replicas = [
        view("fresh-best", make_load("fresh-best", free_blocks=900), queue_len=3),
        view("fresh-worse", make_load("fresh-worse", free_blocks=300), queue_len=2),
        view("stale-short", None, age_s=float("inf"), queue_len=1),
        view("stale-long", make_load("stale-long"), age_s=2.0, queue_len=8),
    ]
    assert headroom_policy().rank(request, replicas) == ["stale-short", "fresh-best", "fresh-worse", "stale-long"]


def test_round_robin_cycles_through_replicas_in_id_order_whatever_the_load():
    policy = RoundRobinPolicy()
    replicas = [view("b", queue_len=100), view("a", queue_len=0), view("c", queue_len=5)]
    request = RoutingRequest(prompt_tokens=10, max_tokens=10)
    firsts = [policy.rank(request, replicas)[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert policy.rank(request, replicas) == ["a", "b", "c"]


def test_pow2_takes_the_shorter_queue_of_two_sampled_replicas():
    request = RoutingRequest(prompt_tokens=10, max_tokens=10)
    replicas = [view("longest", queue_len=9), view("middle", queue_len=5), view("shortest", queue_len=1)]
    policy = PowerOfTwoPolicy(rng=random.Random(0))
    firsts = collections.Counter(policy.rank(request, replicas)[0] for _ in range(3000))
    # The longest queue never wins a pair; the shortest wins both pairs it is in (2 of 3),
    # the middle one the pair without the shortest (1 of 3).
    assert firsts["longest"] == 0
    assert firsts["shortest"] / 3000 == pytest.approx(2 / 3, abs=0.03)
    assert firsts["middle"] / 3000 == pytest.approx(1 / 3, abs=0.03)


def test_pow2_ignores_load_reports():
    request = RoutingRequest(prompt_tokens=10, max_tokens=10)
    replicas = [view("a", make_load("a", free_blocks=1), queue_len=0), view("b", make_load("b"), queue_len=3)]
    assert all(PowerOfTwoPolicy(random.Random(s)).rank(request, replicas)[0] == "a" for s in range(10))


def test_least_loaded_sums_normalised_queue_and_kv_scores_with_weight_2_each():
    request = RoutingRequest(prompt_tokens=10, max_tokens=10)
    # queue scores (max - waiting)/(max - min): a 1.0, b 0.5, c 0.0; kv scores 1 - usage:
    # a 0.2, b 0.9, c 1.0. Totals x2: a 2.4, b 2.8, c 2.0.
    replicas = [
        view("a", make_load("a", free_blocks=200, num_waiting=0)),
        view("b", make_load("b", free_blocks=900, num_waiting=4)),
        view("c", make_load("c", free_blocks=1000, num_waiting=8)),
    ]
    assert LeastLoadedPolicy(rng=random.Random(0)).rank(request, replicas) == ["b", "a", "c"]


def test_least_loaded_with_equal_queues_ranks_on_kv_usage_alone():
    request = RoutingRequest(prompt_tokens=10, max_tokens=10)
    replicas = [
        view("full", make_load("full", free_blocks=100, num_waiting=3)),
        view("empty", make_load("empty", free_blocks=1000, num_waiting=3)),
    ]
    assert LeastLoadedPolicy(rng=random.Random(0)).rank(request, replicas) == ["empty", "full"]


def test_unknown_policy_name_is_a_clear_error():
    with pytest.raises(ValueError, match="policy: unknown 'fastest'"):
        make_policy("fastest")


def shared_prefix_request(prefix_blocks: int = 200, query_tokens: int = 800) -> RoutingRequest:
    tokens = tuple(range(prefix_blocks * BLOCK_SIZE)) + (7,) * query_tokens
    return RoutingRequest(prompt_tokens=len(tokens), max_tokens=200, prompt_token_ids=tokens)


def test_at_equal_load_the_replica_caching_the_prefix_ranks_first():
    request = shared_prefix_request()  # 3,200 of 4,000 prompt tokens cached on "holder"
    replicas = [view("cold", make_load("cold", free_blocks=800)),
                view("holder", make_load("holder", free_blocks=800), cached_blocks=200)]
    for seed in range(10):
        ranked = headroom_policy(seed).rank(request, replicas)
        assert ranked == ["holder", "cold"]
    score = headroom_policy().score(request, replicas[1])
    assert score.cached_tokens == 3200


def test_a_hot_prefix_spills_once_its_holders_queue_outweighs_the_prefill_it_saves():
    # The cache saves 3,200 prefill tokens there, weighted 4x (prefill_weight): that prefill
    # would delay this request and everything queued behind it on the other replica.
    request = shared_prefix_request()
    idle = view("idle", make_load("idle", free_blocks=800))
    light = view("holder", make_load("holder", free_blocks=800, waiting_prefill_tokens=10_000), cached_blocks=200)
    assert headroom_policy().rank(request, [idle, light])[0] == "holder"
    heavy = view("holder", make_load("holder", free_blocks=800, waiting_prefill_tokens=16_000), cached_blocks=200)
    assert headroom_policy().rank(request, [idle, heavy])[0] == "idle"


def test_a_cached_prefix_never_sends_a_request_where_it_does_not_fit():
    # 4,000 + 200 tokens: 263 blocks, 63 of them beyond the 200 cached on the holder.
    request = shared_prefix_request()
    assert headroom_policy().score(request, view("h", make_load("h", free_blocks=63), cached_blocks=200)).fits
    tight_holder = view("holder", make_load("holder", free_blocks=62), cached_blocks=200)
    roomy = view("roomy", make_load("roomy", free_blocks=600))
    assert headroom_policy().rank(request, [tight_holder, roomy]) == ["roomy", "holder"]


def test_a_holder_that_admits_by_expected_growth_may_be_short_by_the_prefix_it_saves():
    # 4,000 + 200 tokens, 3,200 of them cached on the holder: 1,008 tokens of its own there,
    # 4,208 on any other replica. With no free block the holder is 1,008 short.
    request = shared_prefix_request()
    roomy = view("roomy", make_load("roomy", free_blocks=600, expected_output_tokens=200))
    short = view("holder", make_load("holder", free_blocks=0, expected_output_tokens=200), cached_blocks=200)
    assert headroom_policy().score(request, short).headroom_after < 0
    assert headroom_policy().rank(request, [roomy, short]) == ["holder", "roomy"]  # it waits there
    # Short by more than the prefix: the copy elsewhere is the smaller cost.
    shorter = view("holder", make_load("holder", free_blocks=0, expected_output_tokens=200,
                                       kv_committed_tokens=2_300), cached_blocks=200)
    assert headroom_policy().rank(request, [roomy, shorter]) == ["roomy", "holder"]
    # A replica that admits optimistically would preempt for it: no lending.
    optimistic = view("holder", make_load("holder", free_blocks=0), cached_blocks=200)
    assert headroom_policy().rank(request, [roomy, optimistic]) == ["roomy", "holder"]


def test_a_prefix_sent_to_a_replica_without_a_kv_index_yet_counts_in_its_loads_block_size():
    """Before a replica's first KV snapshot (or after its index was dropped) its view has no
    cache block size: the live blocks this router sent were credited as blocks of 0 tokens, and
    the tenant's burst spread (2 to 5 of 20 seeds kept together)."""
    first, second = shared_prefix_request(), shared_prefix_request(query_tokens=900)
    replicas = [ReplicaView(f"r{i}", make_load(f"r{i}", free_blocks=800), 0.05, 0) for i in range(4)]
    assert all(view.cache_block_size == 0 for view in replicas)
    for seed in range(20):
        policy = headroom_policy(seed)
        target = policy.rank(first, replicas)[0]
        policy.on_routed(first, target, "first", cached_blocks=0)
        assert policy.rank(second, replicas)[0] == target, seed


@pytest.mark.parametrize("fields", [
    {"step_time_ms": float("nan")}, {"step_time_ms": float("inf")},
    {"preemption_rate_per_running": -1.0, "step_time_ms": 1e300}, {"block_size": 0},
], ids=["nan_step", "inf_step", "negative_rate", "no_block_size"])
def test_a_degenerate_load_is_ranked_never_dropped_and_never_raises(fields):
    """A NaN score fell out of every group of the ranking (the healthy replica beside it too,
    once the tenant was placed), a negative rate overflowed expm1, a block size of 0 divided:
    loads no replica of ours sends, but a router must still rank every replica."""
    request = RoutingRequest(prompt_tokens=100, max_tokens=256, prompt_token_ids=tuple(range(100)))
    for others in (0, 3):
        policy = headroom_policy()
        for tenant in range(others):  # other tenants in the window: this one is pinned and placed
            other = RoutingRequest(100, 16, prompt_token_ids=tuple(range(1000 * (tenant + 1), 1000 * (tenant + 1) + 100)))
            policy.rank(other, [view("odd", make_load("odd")), view("fine", make_load("fine"))])
            policy.on_routed(other, "fine", f"t{tenant}", 0)
        odd = make_load("odd", **{name: value for name, value in fields.items() if name != "block_size"})
        if "block_size" in fields:
            odd.block_size = fields["block_size"]
        for replicas in ([view("odd", odd)], [view("odd", odd), view("fine", make_load("fine"))]):
            assert sorted(policy.rank(request, replicas)) == sorted(v.replica_id for v in replicas)


def test_an_unsized_request_is_pinned_nowhere():
    """With no share gate (pin_share_window 0) a prompt of 0 tokens 'held enough' of itself on a
    full replica, which then fit it whatever its room."""
    from router.headroom_router import UNSIZED_REQUEST

    policy = HeadroomPolicy(rng=random.Random(0), pin_share_window=0)
    full = view("full", make_load("full", free_blocks=0, kv_committed_tokens=50_000, expected_output_tokens=300))
    roomy = view("roomy", make_load("roomy", waiting_prefill_tokens=40_000))  # a busy queue, but room
    assert not policy.holds_enough(UNSIZED_REQUEST, full)
    assert policy.rank(UNSIZED_REQUEST, [full, roomy]) == ["roomy", "full"]


def test_a_replica_that_learned_short_outputs_needs_room_for_them_only():
    request = RoutingRequest(prompt_tokens=1600, max_tokens=3200)  # 300 blocks to max_tokens
    learned = make_load("learned", free_blocks=150, expected_output_tokens=400)  # 125 blocks expected
    assert headroom_policy().score(request, view("learned", learned)).fits
    assert not headroom_policy().score(request, view("unknown", make_load("unknown", free_blocks=150))).fits


def test_a_prefix_sent_before_any_kv_event_shows_it_counts_as_cached_until_its_request_finishes():
    # Two requests of one tenant in a burst: the first's prefix is not cached anywhere yet
    # (no KV event can say so before its prefill), but the replica it went to will hold it.
    policy = headroom_policy()
    first, second = shared_prefix_request(), shared_prefix_request(query_tokens=900)
    replicas = [view(f"r{i}", make_load(f"r{i}", free_blocks=800)) for i in range(4)]
    target = policy.rank(first, replicas)[0]
    policy.on_routed(first, target, "first", cached_blocks=0)
    for seed in range(10):
        policy.rng = random.Random(seed)
        assert policy.rank(second, replicas)[0] == target
    assert policy.live_blocks(second, next(v for v in replicas if v.replica_id == target)) >= 200  # the prefix at least
    policy.on_finished("first")  # its blocks may now be evicted: only KV events can say they stay
    assert policy.live_blocks(second, next(v for v in replicas if v.replica_id == target)) == 0
    policy.on_routed(first, target, "again", cached_blocks=0)
    policy.forget_replica(target)
    assert policy.live_blocks(second, next(v for v in replicas if v.replica_id == target)) == 0


def test_when_most_of_the_cluster_is_full_a_transient_room_does_not_pull_a_request_off_its_prefix():
    # Three of four replicas have no room for the request (their queues are promised the
    # pool); the fourth has room only until its next admissions. With half or more fitting,
    # the fit filter decides, as before; under this pressure the score does, and the prefix
    # holder (short, like everyone, but saving 3,200 prefill tokens) keeps its tenant.
    request = shared_prefix_request()
    full = dict(free_blocks=100, kv_committed_tokens=40_000)
    holder = view("holder", make_load("holder", **full), cached_blocks=200)
    others = [view(f"full{i}", make_load(f"full{i}", **full)) for i in range(2)]
    roomy = view("roomy", make_load("roomy", free_blocks=600))
    assert not headroom_policy().score(request, holder).fits
    for seed in range(10):
        assert headroom_policy(seed).rank(request, [holder, roomy] + others)[0] == "holder"
    # Two of four fitting is not pressure: the filter still sends it where it fits.
    second_roomy = view("roomy2", make_load("roomy2", free_blocks=600))
    for seed in range(10):
        assert headroom_policy(seed).rank(request, [holder, roomy, second_roomy, others[0]])[0] in ("roomy", "roomy2")


def test_a_pinned_prefix_holder_keeps_its_tenant_however_short_of_room_it_is():
    # pin_prefix_fraction 0.5, every tenant pinned (pin_share_window 0): the holder caches
    # 3,200 of the 4,000 prompt tokens (0.8), so it counts as fitting though it is short by
    # more than the prefix (unpinned, the request goes where it fits, as
    # test_a_holder_that_admits_by_expected_growth_may_be_short_by_the_prefix_it_saves says).
    request = shared_prefix_request()
    roomy = view("roomy", make_load("roomy", free_blocks=600, expected_output_tokens=200))
    shorter = view("holder", make_load("holder", free_blocks=0, expected_output_tokens=200,
                                       kv_committed_tokens=2_300), cached_blocks=200)
    pinned = HeadroomPolicy(rng=random.Random(0), pin_prefix_fraction=0.5, pin_share_window=0)
    assert HeadroomPolicy(pin_prefix_fraction=0).rank(request, [roomy, shorter]) == ["roomy", "holder"]
    assert pinned.rank(request, [roomy, shorter]) == ["holder", "roomy"]
    # Less than the fraction cached, or a replica that would preempt for it: not pinned.
    assert HeadroomPolicy(pin_prefix_fraction=0.9, pin_share_window=0).rank(request, [roomy, shorter]) == ["roomy", "holder"]
    optimistic = view("holder", make_load("holder", free_blocks=0), cached_blocks=200)
    assert pinned.rank(request, [roomy, optimistic]) == ["roomy", "holder"]


def tenant_request(tenant: int, prefix_blocks: int = 200, query_tokens: int = 800) -> RoutingRequest:
    """A prompt of `tenant`'s own 3,200-token prefix (its first tokens name the tenant) and a query."""
    tokens = tuple(tenant * 100_000 + i for i in range(prefix_blocks * BLOCK_SIZE)) + (7,) * query_tokens
    return RoutingRequest(prompt_tokens=len(tokens), max_tokens=200, prompt_token_ids=tokens)


def test_pinning_keeps_a_tenant_within_a_replicas_share_of_traffic_and_spreads_a_hot_one():
    # Four replicas: the prefix holder is short of room (its queue is promised the pool), three
    # are roomy. Of the last 256 requests routed, tenant 0 sent half (hot: more than one
    # replica's share, 1/4) and tenants 1-8 one sixteenth each. By default (pin_prefix_fraction
    # 0.3, share gated over 256 requests) a small tenant stays on its holder whatever its room;
    # the hot tenant goes where it fits, spreading its prefix.
    def cluster() -> list[ReplicaView]:
        holder = view("holder", make_load("holder", free_blocks=0, expected_output_tokens=200,
                                          kv_committed_tokens=2_300), cached_blocks=200)
        return [holder] + [view(f"roomy{i}", make_load(f"roomy{i}", free_blocks=600, expected_output_tokens=200))
                           for i in range(3)]

    policy = headroom_policy()
    assert policy.pin_prefix_fraction == 0.3 and policy.pin_share_window == 256  # the defaults: on
    for i in range(256):
        tenant = 0 if i % 2 == 0 else 1 + (i // 2) % 8
        policy.on_routed(tenant_request(tenant), f"roomy{i % 3}", f"old{i}", cached_blocks=0)
    policy.on_routed(tenant_request(1), "roomy0", "old1", cached_blocks=0)  # a retry: counted once
    assert policy.tenant_share(tenant_request(0)) == pytest.approx(129 / 257)
    assert policy.tenant_share(tenant_request(3)) == pytest.approx(17 / 257)
    for seed in range(10):
        policy.rng = random.Random(seed)
        assert policy.rank(tenant_request(3), cluster())[0] == "holder"
        assert policy.rank(tenant_request(0), cluster())[0] != "holder"
        # Without pinning the small tenant leaves its holder too.
        assert HeadroomPolicy(rng=random.Random(seed), pin_prefix_fraction=0).rank(tenant_request(3), cluster())[0] != "holder"
    # The window slides: 256 requests of tenants 9-16 later, tenant 0 is a small tenant again.
    for i in range(256):
        policy.on_routed(tenant_request(9 + i % 8), "roomy0", f"new{i}", cached_blocks=0)
    assert policy.tenant_share(tenant_request(0)) == pytest.approx(1 / 257)
    assert policy.rank(tenant_request(0), cluster())[0] == "holder"


def test_a_hot_prefix_is_replicated_its_requests_going_where_the_fewest_queue():
    # Tenant 0 sent half of the last 256 requests: its system prompt is worth a copy on every
    # replica, so its requests go to the shortest queue, not to the two replicas that cache it
    # (ranked by the score, they stayed there while those replicas queued). A small tenant (one
    # sixteenth) is ranked by the score, as without replication.
    def cluster() -> list[ReplicaView]:
        def roomy(name: str, waiting: int, cached: int = 0) -> ReplicaView:
            return view(name, make_load(name, free_blocks=600, expected_output_tokens=200, num_waiting=waiting),
                        cached_blocks=cached)
        # "e" queues nothing because it has no room (it admits everything and preempts): last.
        full = view("e", make_load("e", free_blocks=0, expected_output_tokens=200, kv_committed_tokens=2_000))
        return [roomy("a", 5, 200), roomy("b", 3, 200), roomy("c", 0), roomy("d", 1), full]

    def routed(policy: HeadroomPolicy) -> HeadroomPolicy:
        policy.rank(tenant_request(0), cluster())  # learns the replicas' block size, as serving does
        for i in range(256):  # tenant 0 to its holders, the others elsewhere
            tenant = 0 if i % 2 == 0 else 1 + (i // 2) % 8
            policy.on_routed(tenant_request(tenant), "ab"[i // 2 % 2] if tenant == 0 else "cd"[i // 2 % 2], f"old{i}",
                             cached_blocks=0)
        return policy

    policy = routed(headroom_policy())
    off = routed(HeadroomPolicy(rng=random.Random(0), replicate_hot=False))
    for seed in range(10):
        policy.rng = off.rng = random.Random(seed)
        ranked = policy.rank(tenant_request(0), cluster())
        assert ranked[0] == "c" and ranked[-1] == "e"
        assert off.rank(tenant_request(0), cluster())[0] in ("a", "b")
        # A small tenant is not hot: ranked as without replication.
        policy.rng, off.rng = random.Random(seed), random.Random(seed)
        assert policy.rank(tenant_request(3), cluster()) == off.rank(tenant_request(3), cluster())
    # Early in a run (fewer than hot_min_window requests routed) nothing is hot yet.
    fresh = headroom_policy()
    fresh.rank(tenant_request(0), cluster())
    for i in range(8):
        fresh.on_routed(tenant_request(0), "a", f"early{i}", cached_blocks=0)
    assert fresh.rank(tenant_request(0), cluster())[0] in ("a", "b")


def test_routers_reading_the_same_snapshots_spread_a_hot_prefix_over_near_equal_replicas():
    # Two replicas queue nothing and differ by one block of room: a near-tie, so eight routers
    # (independent random streams) do not all pick the roomier one.
    def cluster() -> list[ReplicaView]:
        return [view(name, make_load(name, free_blocks=free, expected_output_tokens=200, num_waiting=waiting),
                     cached_blocks=cached)
                for name, free, waiting, cached in (("a", 600, 4, 200), ("b", 600, 4, 200), ("c", 600, 0, 0),
                                                    ("d", 599, 0, 0))]

    picks = set()
    for seed in range(8):
        policy = HeadroomPolicy(rng=random.Random(seed))
        policy.rank(tenant_request(0), cluster())
        for i in range(64):
            policy.on_routed(tenant_request(0 if i % 2 == 0 else 1 + i % 7), "a", f"r{i}", cached_blocks=0)
        picks.add(policy.rank(tenant_request(0), cluster())[0])
    assert picks == {"c", "d"}


def test_hot_min_window_past_the_pin_share_window_is_a_clear_error():
    with pytest.raises(ValueError, match="hot_min_window: 32 is more than pin_share_window"):
        HeadroomPolicy(pin_share_window=16)
    HeadroomPolicy(pin_share_window=16, replicate_hot=False)
    HeadroomPolicy(pin_share_window=16, hot_min_window=16)


def test_a_new_tenant_lands_where_the_fewest_prompt_blocks_were_routed_and_an_evicted_one_goes_home():
    # Four replicas with room, r3 with less of it (the lowest score). The router sent tenants
    # 1-12 to r0-r2 (four each), so a tenant no replica holds is placed on r3, where the fewest
    # prompt blocks went, as approx_prefix places a new prefix on its smallest tree; pinning
    # keeps it there. Without pinning the score alone ranks, and r3 comes last.
    def cluster() -> list[ReplicaView]:
        return [view(f"r{i}", make_load(f"r{i}", free_blocks=800 if i < 3 else 600, expected_output_tokens=200))
                for i in range(4)]

    def routed(policy: HeadroomPolicy) -> HeadroomPolicy:
        policy.rank(tenant_request(0), cluster())  # learns the replicas' block size
        for tenant in range(1, 13):
            policy.on_routed(tenant_request(tenant), f"r{tenant % 3}", f"t{tenant}", cached_blocks=0)
        return policy

    for seed in range(10):
        assert routed(headroom_policy(seed)).rank(tenant_request(20), cluster())[0] == "r3"
        assert routed(HeadroomPolicy(rng=random.Random(seed), pin_prefix_fraction=0)).rank(
            tenant_request(20), cluster())[-1] == "r3"
    # Unless r3 scores worse by more than `placement_margin` (0.1 of a pool): a queue of 4,000
    # prefill tokens (0.25 of its pool) ahead of it there.
    queued = cluster()[:3] + [view("r3", make_load("r3", free_blocks=600, expected_output_tokens=200,
                                                   waiting_prefill_tokens=4_000))]
    for seed in range(10):
        assert routed(headroom_policy(seed)).rank(tenant_request(20), queued)[-1] == "r3"
    # Tenant 5 went to r2; its request ended and r2 evicted its prefix, so no replica holds it:
    # it goes back to r2, not to r3 where fewer blocks went (a second copy of its tenants' spread).
    policy = routed(headroom_policy())
    policy.on_finished("t5")
    assert policy.rank(tenant_request(5), cluster())[0] == "r2"
    # Where r3 has no room for it, the placement is among the replicas that fit.
    full = cluster()[:3] + [view("r3", make_load("r3", free_blocks=0, expected_output_tokens=200))]
    assert policy.rank(tenant_request(20), full)[0] in ("r0", "r1", "r2")
    # A replica gone takes its routes with it: r2's tenants are new again, placed on r3.
    policy.forget_replica("r2")
    assert policy.tenant_share(tenant_request(5)) == pytest.approx(1 / 9)
    assert policy.rank(tenant_request(5), [v for v in cluster() if v.replica_id != "r2"])[0] == "r3"


@pytest.mark.parametrize("fraction", [1.5, -0.2])
def test_pin_prefix_fraction_outside_0_1_is_a_clear_error(fraction):
    with pytest.raises(ValueError, match="pin_prefix_fraction"):
        HeadroomPolicy(pin_prefix_fraction=fraction)


def test_placement_margin_below_0_is_a_clear_error():
    with pytest.raises(ValueError, match="placement_margin"):
        HeadroomPolicy(placement_margin=-0.1)


@pytest.mark.parametrize("window", [-1, 2.5])
def test_pin_share_window_must_be_a_whole_number_of_requests(window):
    with pytest.raises(ValueError, match="pin_share_window"):
        HeadroomPolicy(pin_share_window=window)


@pytest.mark.parametrize("policy", ["headroom", "pow2", "least_loaded", "round_robin"])
def test_a_load_without_a_block_size_is_ranked_and_routed_to_without_dividing_by_it(policy):
    # Ranked first by its shorter queue, the odd replica's send was sized by dividing by 0.
    from router_harness import router_over

    loads = {"odd": make_load("odd", free_blocks=800), "fine": make_load("fine", free_blocks=800)}
    loads["odd"].block_size = 0
    router = router_over(loads, policy)
    request = RoutingRequest(prompt_tokens=100, max_tokens=50)
    ranked = router.rank(request, {"odd": 0, "fine": 5}, "k")
    assert sorted(ranked) == ["fine", "odd"]
    for replica_id in ranked:
        router.routed(request, "k", replica_id)


def test_a_request_that_ends_before_its_routing_is_reported_leaves_nothing_live_and_a_rejection_elsewhere_no_hole():
    """Serve 2.60 puts on_request_completed and on_request_routed on the router's loop apart: a
    request refused at once (or a very short one) could end first, and its prompt blocks then
    stayed 'live' on the replica for good, pinning its tenant there after the prefix was gone."""
    from router_harness import router_over

    loads = {"r0": make_load("r0"), "r1": make_load("r1")}
    prompt = tuple(range(3, 3 + 64))
    request = RoutingRequest(prompt_tokens=len(prompt), max_tokens=8, prompt_token_ids=prompt)
    router = router_over(loads)
    router.rank(request, {"r0": 0, "r1": 0}, "k")  # the policy learns the replicas' block sizes
    router.abandoned("k", "r0")  # its end, first
    router.routed(request, "k", "r0")
    assert not router.policy._live.of("r0") and not router._live
    # An end reported for another replica (r1) than the one it is live on (r0) leaves r0's live.
    router.rank(request, {"r0": 0, "r1": 0}, "k2")
    router.routed(request, "k2", "r0")
    router.abandoned("k2", "r1")
    assert sum(router.policy._live.of("r0").values()) == 3 and router._live == {"k2": "r0"}
    router.abandoned("k2", "r0")  # its own end
    assert not router.policy._live.of("r0") and not router._live


def test_a_replica_that_left_leaves_no_bookkeeping_and_a_late_routing_to_it_recreates_none():
    from router_harness import router_over

    router = router_over({"r0": make_load("r0")})
    request = RoutingRequest(prompt_tokens=100, max_tokens=50)
    router.sync_replicas({"r0": None, "early": None})  # "early" has announced no endpoint yet
    router.routed(request, "a", "early")  # routed by queue length meanwhile
    assert router.inflight.counts("early").requests == 1
    router.sync_replicas({"r0": None})  # it left
    assert router.inflight.counts("early").requests == 0 and "early" not in router._replica_ids
    router.routed(request, "b", "early")  # Serve's accept, after the removal
    assert router.inflight.counts("early").requests == 0 and not router._live
