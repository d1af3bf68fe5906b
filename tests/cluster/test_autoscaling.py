"""The headroom autoscaling policy's arithmetic (cluster/autoscaling.py): KV demand against a
target utilisation, the waiting-work floor, the preemption step, hysteresis, delays and bounds;
and the Serve-facing callables on a real AutoscalingContext. No Ray needed."""

from __future__ import annotations

import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.autoscaling import (
    HOST_CAPACITY_STAT, HOST_PARKED_STAT, KV_CAPACITY_STAT, KV_DEMAND_STAT, PREEMPTION_RATE_STAT,
    UNREPORTED_GRACE_S, WAITING_PREFILL_STAT, HeadroomAutoscalingPolicy, HeadroomPolicyParams, PolicyState, ReplicaSignal,
    Decision, DecisionBoard, DecisionPublisher, RequestsAutoscalingPolicy, autoscaling_stats, decide,
)
from cluster.config import ClusterConfig
from cluster.deployment import ReplicaCounts
from cluster.status_command import scale_lines
from tests.replica.sched_harness import make_request, make_scheduler, run_step

CAPACITY = 10_000  # tokens per replica
PARAMS = HeadroomPolicyParams(min_replicas=1, max_replicas=8, target_utilization=0.8, scale_down_utilization=0.6,
                              preemption_rate_threshold=0.5, waiting_prefill_tokens_per_replica=4096,
                              upscale_delay_s=5.0, downscale_delay_s=30.0)


def replicas(*demands: float, waiting: float = 0.0, preemption_rate: float = 0.0) -> list[ReplicaSignal]:
    return [ReplicaSignal(CAPACITY, demand, waiting, preemption_rate) for demand in demands]


def no_delay_running(state: PolicyState) -> bool:
    return state.wants_up_since is None and state.wants_down_since is None


def test_stats_count_held_blocks_plus_committed_growth_against_the_pool():
    load = SimpleNamespace(kv_blocks_total=100, kv_blocks_free=40, block_size=16, kv_committed_tokens=320,
                           waiting_prefill_tokens=700, preemption_rate=0.25, host_kv_blocks_total=400,
                           host_kv_blocks_free=390)
    assert autoscaling_stats(load) == {KV_CAPACITY_STAT: 1600.0, KV_DEMAND_STAT: 60 * 16 + 320.0,
                                       WAITING_PREFILL_STAT: 700.0, PREEMPTION_RATE_STAT: 0.25,
                                       HOST_CAPACITY_STAT: 6400.0, HOST_PARKED_STAT: 160.0}


def test_a_swapped_out_request_stays_in_the_demand_and_its_host_blocks_are_the_parked_kv():
    # A real scheduler: 16 device blocks of 4 tokens for six requests of 3 + 30 tokens (9 blocks
    # each), a host tier of 64 blocks, preemption by swap. Run until victims are parked.
    scheduler = make_scheduler(block_size=4, max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=17,
                               num_host_kv_blocks=64, preemption_mode="swap")
    for index in range(6):
        scheduler.add_request(make_request(f"r{index}", [index + 1, 2 * index + 3, 5], max_tokens=30))
    while not scheduler.kv_cache.swapped:
        run_step(scheduler)
    stats = autoscaling_stats(SimpleNamespace(**vars(scheduler.load()), preemption_rate=0.0))
    parked_blocks = sum(len(swapped.host_blocks) for swapped in scheduler.kv_cache.swapped.values())
    assert stats[HOST_PARKED_STAT] == parked_blocks * 4 > 0 and stats[HOST_CAPACITY_STAT] == 64 * 4
    # The demand is every live request's whole final size (optimistic admission counts growth to
    # max_tokens), the parked ones' included though they hold no device block.
    assert stats[KV_DEMAND_STAT] == 6 * 9 * 4 and stats[KV_CAPACITY_STAT] == 16 * 4


def test_replicas_hold_the_cluster_kv_demand_at_the_target_utilisation():
    # 2 replicas committed to 9,000 + 9,000 tokens: 18,000 / (0.8 * 10,000) = 2.25 -> 3.
    decision, _ = decide(replicas(9000, 9000), running=2, target=2, params=PARAMS, now=100.0,
                         state=PolicyState(wants_up_since=90.0))
    assert (decision.desired_replicas, decision.reason, decision.kv_replicas) == (3, "kv_demand", 3)
    assert decision.kv_demand_tokens == 18000 and decision.kv_capacity_tokens == CAPACITY


def test_kv_scale_up_waits_for_the_upscale_delay():
    first, state = decide(replicas(9000, 9000), running=2, target=2, params=PARAMS, now=100.0)
    assert (first.desired_replicas, first.reason, state.wants_up_since) == (2, "pending", 100.0)
    early, state = decide(replicas(9000, 9000), running=2, target=2, params=PARAMS, now=104.0, state=state)
    assert early.desired_replicas == 2 and state.wants_up_since == 100.0
    due, state = decide(replicas(9000, 9000), running=2, target=2, params=PARAMS, now=105.0, state=state)
    assert due.desired_replicas == 3 and no_delay_running(state)


def test_preemptions_above_the_threshold_add_one_replica_at_once():
    # The KV arithmetic says 2 suffice (12,000 / 8,000), but the replicas preempt 0.8/s each.
    decision, state = decide(replicas(6000, 6000, preemption_rate=0.8), running=2, target=2, params=PARAMS, now=0.0)
    assert (decision.desired_replicas, decision.reason) == (3, "preemptions") and no_delay_running(state)


@pytest.mark.parametrize("pressure", ["preemptions", "host_tier"])
def test_preempting_adds_one_at_once_even_when_the_kv_demand_asks_for_more(pressure):
    def signals(demand: float) -> list[ReplicaSignal]:
        if pressure == "preemptions":
            return replicas(demand, demand, preemption_rate=0.8)
        return [ReplicaSignal(CAPACITY, demand, 0.0, 0.0, 20_000, 17_000)] * 2  # host tiers 85% full

    # The KV demand asks for exactly one more (18,000 / 8,000 -> 3): at once, not after the delay.
    decision, state = decide(signals(9000), running=2, target=2, params=PARAMS, now=0.0)
    assert (decision.desired_replicas, decision.reason) == (3, pressure) and no_delay_running(state)
    # It asks for two more (28,000 -> 4): one at once, the other once the delay is over.
    decision, state = decide(signals(14_000), running=2, target=2, params=PARAMS, now=0.0)
    assert (decision.desired_replicas, decision.reason, state.wants_up_since) == (3, pressure, 0.0)
    decision, state = decide(signals(14_000), running=2, target=3, params=PARAMS, now=5.0, state=state)
    assert (decision.desired_replicas, decision.reason) == (4, "kv_demand") and no_delay_running(state)


def test_preemption_step_counts_a_replica_already_starting():
    # Serve's target is 3 while the third starts: preempting still asks for running + 1 = 3, not 4.
    decision, _ = decide(replicas(6000, 6000, preemption_rate=0.8), running=2, target=3, params=PARAMS, now=0.0)
    assert decision.desired_replicas == 3 and decision.reason == "steady"


def rising(start: float, per_s: float, until: float) -> tuple[tuple[float, float], ...]:
    """A demand history, one point a second from 0 to `until` (excluded)."""
    return tuple((float(t), start + per_s * t) for t in range(int(until)))


def test_a_rising_demand_is_scaled_for_where_it_will_be_when_a_new_replica_serves():
    # 2 replicas hold 16,000 tokens at 0.8; the demand, 12,000 now, rose 200 tokens/s over the
    # last 30 s: in replica_startup_s (30 s) it reaches 18,000, which needs 3.
    state = PolicyState(wants_up_since=0.0, demand_history=rising(6_000, 200, 30))
    decision, state = decide(replicas(6000, 6000), running=2, target=2, params=PARAMS, now=30.0, state=state)
    assert (decision.desired_replicas, decision.reason, decision.kv_replicas) == (3, "kv_trend", 3)
    assert decision.kv_demand_growth_tokens == pytest.approx(200 * 30)
    assert state.demand_history[-1] == (30.0, 12_000) and no_delay_running(state)
    # Measured over 10 s only (the history restarted), the rise is continued 10 s: 14,000 fit 2.
    decision, _ = decide(replicas(6000, 6000), running=2, target=2, params=PARAMS, now=10.0,
                         state=PolicyState(wants_up_since=0.0, demand_history=rising(10_000, 200, 10)))
    assert decision.kv_demand_growth_tokens == pytest.approx(200 * 10) and decision.desired_replicas == 2


def test_a_falling_demand_adds_nothing_and_a_rising_one_holds_off_a_scale_down():
    falling, _ = decide(replicas(1000, 1000), running=2, target=2, params=PARAMS, now=10.0,
                        state=PolicyState(demand_history=rising(12_000, -1000, 10)))
    assert falling.kv_demand_growth_tokens == 0.0 and falling.reason == "pending"
    # 4,000 tokens now fit one replica at 0.6 (6,000), but rising 100 tokens/s they reach 7,000 in 30 s.
    held, _ = decide(replicas(2000, 2000), running=2, target=2, params=PARAMS, now=30.0,
                     state=PolicyState(wants_down_since=-100.0, demand_history=rising(1000, 100, 30)))
    assert (held.desired_replicas, held.reason) == (2, "steady")


def test_the_demand_history_keeps_a_point_a_second_for_replica_startup_s():
    state = PolicyState()
    for tick in range(400):  # Serve's control loop: every 0.1 s for 40 s
        _, state = decide(replicas(1000), running=1, target=1, params=PARAMS, now=tick / 10, state=state)
    times = [t for t, _ in state.demand_history]
    assert times[0] >= 39.9 - PARAMS.replica_startup_s and len(times) == 30
    assert all(later - earlier >= 1.0 for earlier, later in zip(times, times[1:]))
    off = HeadroomPolicyParams(replica_startup_s=0.0)
    decision, state = decide(replicas(9000), running=2, target=2, params=off, now=10.0,
                             state=PolicyState(demand_history=rising(0, 1000, 10)))
    assert decision.kv_demand_growth_tokens == 0.0 and state.demand_history == ()


def test_waiting_prefill_sets_a_floor():
    # Little KV held, but 3 x 5,000 waiting prefill tokens at 4,096 per replica asks for 4.
    decision, _ = decide(replicas(1000, 1000, 1000, waiting=5000), running=3, target=3, params=PARAMS, now=10.0,
                         state=PolicyState(wants_up_since=0.0))
    assert (decision.desired_replicas, decision.reason, decision.waiting_replicas) == (4, "waiting_work", 4)


def simulate(load, seconds: float, start: int = 1, startup_s: float = 30.0) -> list[tuple[float, int, int, str]]:
    """The policy deciding once a second against `load(running, t)` -> (demand, waiting prefill,
    preemption rate) per replica, replicas serving startup_s after they are asked for and
    gone at once when removed; the count changes as (t, from, to, reason)."""
    params = HeadroomPolicyParams(min_replicas=1, max_replicas=4)
    state, target, running, starting, changes = PolicyState(), start, start, [], []
    for t in range(int(seconds)):
        running += sum(1 for ready in starting if ready <= t)
        starting = [ready for ready in starting if ready > t]
        demand, waiting, preemption_rate = load(running, t)
        signals = [ReplicaSignal(32_768.0, demand, waiting, preemption_rate)] * running
        decision, state = decide(signals, running, target, params, float(t), state)
        desired = decision.desired_replicas
        if desired > target:
            starting += [t + startup_s] * (desired - target)
        elif desired < target:
            removed_starting = min(target - desired, len(starting))
            starting = starting[:len(starting) - removed_starting]
            running -= target - desired - removed_starting
        if desired != target:
            changes.append((t, target, desired, decision.reason))
        target = desired
    return changes


@pytest.mark.parametrize("waiting_in_demand", [False, True])
def test_a_backlog_that_builds_at_one_replica_fewer_rebounds_once_and_stays(waiting_in_demand):
    """A waiting prefill that builds at one replica and drains at two: the floor it asked for
    was gone at two, so the policy scaled 1 -> 2 -> 1 every ~95 s (13 changes in 600 s), the
    backlog's latency back at every return to one replica. The first scale-down's rebound sets a
    floor that stands until the load eases."""
    def load(running: int, t: float) -> tuple[float, float, float]:
        eased = t >= 900  # the load falls to a third: one replica keeps up
        waiting = 20_000.0 if running == 1 and not eased else 0.0
        demand = (2000.0 if eased else 6000.0) + (waiting if waiting_in_demand else 0.0)
        return demand / running, waiting / running, 0.0

    changes = simulate(load, 1200)
    assert [change[1:] for change in changes] == [(1, 2, "waiting_work"), (2, 1, "low_demand"),
                                                  (1, 2, "waiting_work"), (2, 1, "low_demand")], changes
    assert changes[3][0] >= 900


def test_a_one_off_burst_leaves_no_floor():
    """A backlog that one replica met once (a burst), under a steady load one replica carries:
    the count goes back to one, though the steady load never eases by the band."""
    def load(running: int, t: float) -> tuple[float, float, float]:
        waiting = 20_000.0 if 10 <= t < 40 else 0.0
        return 6000.0 / running, waiting / running, 0.0

    assert [change[1:] for change in simulate(load, 600)] == [(1, 2, "waiting_work"), (2, 1, "low_demand")]


def test_preemptions_that_stop_at_one_replica_more_rebound_once_and_stay():
    def load(running: int, t: float) -> tuple[float, float, float]:
        return 0.3 * 32_768 / running, 0.0, 1.2 if running == 1 else 0.0

    assert [change[1:] for change in simulate(load, 1200)] == [(1, 2, "preemptions"), (2, 1, "low_demand"),
                                                               (1, 2, "preemptions")]


def test_each_decision_shows_the_pressure_floor_its_delay_then_the_demand_it_is_lifted_at():
    """The floor held the count invisibly: a decision (so the metric and `headroom status`)
    carries it, and what holds it."""
    assert decide(replicas(3000, waiting=5000), running=1, target=1, params=PARAMS, now=120.0)[0].pressure_floor == 0
    # 2 -> 1 at t=100; at t=120 the waiting prefill asks for 2 again: a rebound.
    decision, state = decide(replicas(3000, waiting=5000), running=1, target=1, params=PARAMS, now=120.0,
                             state=PolicyState(scaled_down_from=2, scaled_down_from_at=100.0))
    assert (decision.pressure_floor, decision.pressure_floor_until, decision.pressure_floor_release_tokens) == \
        (2, 150.0, 0.0)  # held for downscale_delay_s (30 s) after it was last asked for
    decision, state = decide(replicas(3000, 3000), running=2, target=2, params=PARAMS, now=160.0, state=state)
    # Then until the demand (6,000 now) falls by the band: to 0.6 / 0.8 of it.
    assert (decision.pressure_floor, decision.pressure_floor_until, decision.pressure_floor_release_tokens) == \
        (2, None, pytest.approx(4500.0))
    decision, state = decide(replicas(2000, 2000), running=2, target=2, params=PARAMS, now=170.0, state=state)
    assert (decision.pressure_floor, state.pressure_floor) == (0, 0)


def test_an_idle_cluster_still_scales_in():
    assert [change[1:] for change in simulate(lambda running, t: (0.0, 0.0, 0.0), 900, start=4)] == \
        [(4, 2, "low_demand"), (2, 1, "low_demand")]


def test_scale_down_needs_the_demand_to_fit_fewer_at_the_lower_utilisation_for_the_delay():
    # 3 replicas, 7,000 tokens of demand in all: it fits 1 replica at 0.8 (8,000) but 2 at 0.6.
    decision, state = decide(replicas(3000, 2000, 2000), running=3, target=3, params=PARAMS, now=0.0)
    assert (decision.desired_replicas, decision.reason) == (3, "pending")
    decision, state = decide(replicas(3000, 2000, 2000), running=3, target=3, params=PARAMS, now=29.0, state=state)
    assert decision.desired_replicas == 3
    decision, state = decide(replicas(3000, 2000, 2000), running=3, target=3, params=PARAMS, now=30.0, state=state)
    assert (decision.desired_replicas, decision.reason) == (2, "low_demand") and no_delay_running(state)


def test_a_scale_down_removes_half_the_surplus_then_measures_again():
    # 8 replicas, 6,000 tokens of demand: 1 replica holds it at 0.6, but the step goes to
    # 8 - ceil(7 / 2) = 4 and the delay starts over before the next one (to 2, then 1).
    decision, state = decide(replicas(*[750] * 8), running=8, target=8, params=PARAMS, now=30.0,
                             state=PolicyState(wants_down_since=0.0))
    assert (decision.desired_replicas, decision.reason) == (4, "low_demand") and no_delay_running(state)
    decision, state = decide(replicas(*[1500] * 4), running=4, target=4, params=PARAMS, now=31.0, state=state)
    assert (decision.desired_replicas, decision.reason, state.wants_down_since) == (4, "pending", 31.0)
    decision, _ = decide(replicas(*[1500] * 4), running=4, target=4, params=PARAMS, now=61.0, state=state)
    assert (decision.desired_replicas, decision.reason) == (2, "low_demand")


def test_the_drained_replicas_demand_moving_to_the_others_is_no_trend_to_scale_up_for():
    # A constant 5,700 tokens over 2 replicas fits one at 0.6. The one removed stops reporting
    # while it drains, and its share climbs back on the survivor over ~30 s (95 tokens/s): as a
    # trend that would project 5,700 + 2,850 > 8,000 and start a replica again, for ever.
    state, now, counts = PolicyState(), 0.0, []
    while True:
        decision, state = decide(replicas(2850, 2850), running=2, target=2, params=PARAMS, now=now, state=state)
        if decision.reason == "low_demand":
            break
        now += 1.0
    assert decision.desired_replicas == 1 and state.demand_before_scale_down == 5700
    for second in range(1, 121):
        demand = min(5700.0, 2850.0 + 95.0 * second)
        decision, state = decide(replicas(demand), running=1, target=1, params=PARAMS, now=now + second, state=state)
        counts.append(decision.desired_replicas)
    assert counts == [1] * 120
    assert state.demand_before_scale_down is None  # back at its level: a real trend counts again
    # and it does: a rise of 200 tokens/s from there is scaled for before the demand needs it.
    now += 120
    for second in range(1, 20):
        decision, state = decide(replicas(5700.0 + 200.0 * second), running=1, target=1, params=PARAMS,
                                 now=now + second, state=state)
        if decision.reason in ("kv_trend", "pending"):
            break
    assert 5700.0 + 200.0 * second < 0.8 * CAPACITY and decision.kv_demand_growth_tokens > 0


def test_the_demand_a_draining_replica_holds_stands_until_it_is_back_or_the_drain_has_ended():
    # 23,000 tokens fit 4 replicas at 0.6. Scaled down to 4 while a removed replica drains,
    # only 8,000 are measured: sized by that, the next step would go to 3 (and on, to 2) at
    # 77% of KV and more once the drained requests' successors arrive.
    params = HeadroomPolicyParams(**{**asdict(PARAMS), "drain_timeout_s": 300.0})
    state = PolicyState(demand_before_scale_down=23_000.0, scaled_down_at=0.0, wants_down_since=None)
    for now in (1.0, 31.0, 61.0, 299.0):
        decision, state = decide(replicas(*[2000] * 4), running=4, target=4, params=params, now=now, state=state)
        assert (decision.desired_replicas, decision.reason) == (4, "steady"), now
    # The drain is over by drain_timeout_s: what is measured now is the demand, and it fits 2.
    decision, state = decide(replicas(*[2000] * 4), running=4, target=4, params=params, now=300.0, state=state)
    assert decision.reason == "pending" and state.demand_before_scale_down is None
    decision, state = decide(replicas(*[2000] * 4), running=4, target=4, params=params, now=330.0, state=state)
    assert (decision.desired_replicas, decision.reason, state.scaled_down_at) == (3, "low_demand", 330.0)


def test_a_running_replica_that_has_not_reported_yet_adds_no_step_at_once_and_allows_no_scale_down():
    # Two replicas preempting 0.6/s asked for a third; it serves but has not pushed its stats
    # yet: their mean still reads 0.6, and asking for running + 1 again started a fourth.
    decision, state = decide(replicas(1000, 1000, preemption_rate=0.6), running=3, target=3, params=PARAMS, now=0.0)
    assert (decision.desired_replicas, decision.reason, state.partial_since) == (3, "awaiting_stats", 0.0)
    # Nor does the demand the two report (2,000: it fits 1) take replicas away meanwhile.
    decision, _ = decide(replicas(1000, 1000), running=3, target=3, params=PARAMS, now=40.0,
                         state=PolicyState(wants_down_since=0.0, partial_since=38.0))
    assert (decision.desired_replicas, decision.reason) == (3, "awaiting_stats")
    decision, state = decide(replicas(1000, 1000, 0), running=3, target=3, params=PARAMS, now=40.0,
                             state=PolicyState(wants_down_since=0.0, partial_since=38.0))
    assert (decision.desired_replicas, decision.reason, state.partial_since) == (2, "low_demand", None)  # all have
    # One whose stats never parse stops nothing for long: past the grace the others decide.
    decision, _ = decide(replicas(1000, 1000, preemption_rate=0.6), running=3, target=3, params=PARAMS,
                         now=10.0 + UNREPORTED_GRACE_S, state=PolicyState(partial_since=10.0))
    assert (decision.desired_replicas, decision.reason) == (4, "preemptions")


def test_at_min_replicas_a_demand_that_fits_fewer_is_steady_not_a_scale_down():
    params = HeadroomPolicyParams(**{**asdict(PARAMS), "min_replicas": 2})
    decision, state = decide(replicas(100, 100), running=2, target=2, params=params, now=100.0,
                             state=PolicyState(wants_down_since=0.0))
    assert (decision.desired_replicas, decision.reason) == (2, "steady")
    assert state.demand_before_scale_down is None and state.wants_down_since is None


def test_a_wall_clock_stepped_back_restarts_the_history_and_the_delays():
    # A trend rising to t = 1,029 and a scale-up wanted since 1,000; the clock steps back an hour
    # and the demand is low: the stale trend and timers go, and the scale-down runs its own delay.
    state = PolicyState(wants_up_since=1000.0, demand_history=tuple((1000.0 + t, 10_000 + 200.0 * t) for t in range(30)))
    decision, state = decide(replicas(500, 500), running=2, target=2, params=PARAMS, now=-2570.0, state=state)
    assert decision.kv_demand_growth_tokens == 0.0 and state.demand_history == ((-2570.0, 1000.0),)
    assert (decision.reason, state.wants_up_since, state.wants_down_since) == ("pending", None, -2570.0)
    decision, state = decide(replicas(500, 500), running=2, target=2, params=PARAMS, now=-2540.0, state=state)
    assert (decision.desired_replicas, decision.reason) == (1, "low_demand")


def test_demand_inside_the_hysteresis_band_keeps_the_count():
    # 2 replicas holding 14,000: 2 needed at 0.8 (16,000), and 3 would be needed at 0.6 to drop to... 2:
    # neither up nor down, for as long as it stays there.
    for now in (0.0, 100.0, 1000.0):
        decision, state = decide(replicas(7000, 7000), running=2, target=2, params=PARAMS, now=now)
        assert (decision.desired_replicas, decision.reason) == (2, "steady") and no_delay_running(state)


def test_a_rise_during_the_scale_down_delay_restarts_it():
    _, state = decide(replicas(1000, 1000), running=2, target=2, params=PARAMS, now=0.0)
    assert state.wants_down_since == 0.0
    _, state = decide(replicas(7000, 7000), running=2, target=2, params=PARAMS, now=20.0, state=state)
    assert no_delay_running(state)
    decision, state = decide(replicas(1000, 1000), running=2, target=2, params=PARAMS, now=40.0, state=state)
    assert decision.desired_replicas == 2 and state.wants_down_since == 40.0


def test_kv_parked_in_the_host_tiers_beyond_the_target_utilisation_adds_one_replica_at_once():
    # 12,000 of 2 x 10,000 device tokens fit 2 replicas at 0.8, no preemption this instant, but
    # the host tiers (2 x 20,000 tokens) hold 34,000 tokens of swapped-out requests: 0.85 of them.
    signals = [ReplicaSignal(CAPACITY, 6000, 0.0, 0.0, 20_000, 17_000) for _ in range(2)]
    decision, state = decide(signals, running=2, target=2, params=PARAMS, now=0.0)
    assert (decision.desired_replicas, decision.reason) == (3, "host_tier") and no_delay_running(state)
    assert decision.host_kv_parked_tokens == 34_000 and decision.host_kv_usage == pytest.approx(0.85)
    # At 0.75 of the tiers the next victims still swap: the count stays.
    signals = [ReplicaSignal(CAPACITY, 6000, 0.0, 0.0, 20_000, 15_000) for _ in range(2)]
    decision, _ = decide(signals, running=2, target=2, params=PARAMS, now=0.0)
    assert (decision.desired_replicas, decision.reason) == (2, "steady")


def test_no_scale_down_while_kv_is_parked_in_a_host_tier():
    # 2,000 tokens of demand fit one replica at 0.6, but 400 of them are parked on a host tier:
    # their requests wait for a device, and removing one would make them wait longer.
    signals = [ReplicaSignal(CAPACITY, 1000, 0.0, 0.0, 20_000, 400), ReplicaSignal(CAPACITY, 1000)]
    decision, state = decide(signals, running=2, target=2, params=PARAMS, now=100.0,
                             state=PolicyState(wants_down_since=0.0))
    assert (decision.desired_replicas, decision.reason) == (2, "steady") and no_delay_running(state)


def test_no_scale_down_while_preempting_above_the_threshold():
    decision, state = decide(replicas(1000, 1000, preemption_rate=0.9), running=2, target=3, params=PARAMS, now=0.0)
    assert decision.desired_replicas == 3 and state.wants_down_since is None
    # At or below the threshold (the smoothed rate of an occasional preemption) the scale-down
    # delay runs, as the README states the rule.
    decision, state = decide(replicas(1000, 1000, preemption_rate=0.5), running=2, target=3, params=PARAMS, now=0.0)
    assert decision.desired_replicas == 3 and state.wants_down_since == 0.0


def test_the_policys_own_defaults_are_the_configs():
    # A Serve config may name the policy function without policy_kwargs: the dataclass's
    # defaults then apply, and they must be the documented ones (cluster/config.py).
    from cluster.config import AutoscalingConfig as HeadroomAutoscalingConfig
    from cluster.config import ReplicasConfig

    defaults = HeadroomAutoscalingConfig(policy="headroom")
    expected = {name: getattr(defaults, name) for name in asdict(HeadroomPolicyParams()) if name != "drain_timeout_s"}
    expected["drain_timeout_s"] = ReplicasConfig.model_fields["drain_timeout_s"].default  # the replicas' setting
    assert asdict(HeadroomPolicyParams()) == expected
    kwargs = ClusterConfig(replicas={"autoscaling": {"policy": "headroom"}, "drain_timeout_s": 45}).replicas
    assert kwargs.autoscaling.serve_autoscaling_config(kwargs.drain_timeout_s)["policy"]["policy_kwargs"] == {
        **expected, "drain_timeout_s": 45}


def test_bounds_clamp_and_say_so():
    high, _ = decide(replicas(*[10000] * 8), running=8, target=8, params=PARAMS, now=0.0,
                     state=PolicyState(wants_up_since=-10.0))
    assert (high.desired_replicas, high.reason) == (8, "max_replicas")
    low, _ = decide(replicas(0), running=1, target=1, params=HeadroomPolicyParams(min_replicas=2), now=0.0)
    assert (low.desired_replicas, low.reason) == (2, "min_replicas")


def test_without_stats_the_target_stays():
    decision, state = decide([], running=2, target=3, params=PARAMS, now=0.0, state=PolicyState(wants_up_since=1.0))
    assert (decision.desired_replicas, decision.reason) == (3, "no_stats") and state == PolicyState()


def test_a_replica_without_capacity_yet_is_not_a_signal():
    assert ReplicaSignal.from_stats({KV_DEMAND_STAT: 5.0}) is None
    assert ReplicaSignal.from_stats({KV_CAPACITY_STAT: 100.0}) == ReplicaSignal(100.0, 0.0)
    for broken in ({KV_CAPACITY_STAT: float("nan")}, {KV_CAPACITY_STAT: 100.0, KV_DEMAND_STAT: float("inf")}):
        assert ReplicaSignal.from_stats(broken) is None


# ---- the callables Serve's controller runs ----------------------------------------------------
def context(aggregated: dict, running: int, target: int, policy_state: dict | None = None,
            now: float = 1000.0, raw: dict | None = None, **config) -> AutoscalingContext:
    deployment = DeploymentID(name="LLMReplica", app_name="app")
    replica_ids = [ReplicaID(unique_id=f"r{i}", deployment_id=deployment) for i in range(running)]
    return AutoscalingContext(
        deployment_id=deployment, deployment_name="LLMReplica", app_name="app", current_num_replicas=running,
        target_num_replicas=target, running_replicas=replica_ids, total_num_requests=config.pop("requests", 0.0),
        total_queued_requests=0.0,
        aggregated_metrics={stat: {replica_ids[i]: value for i, value in enumerate(values)}
                            for stat, values in aggregated.items()},
        raw_metrics={stat: {replica_ids[i]: [TimeStampedValue(t, value) for t, value in points]
                            for i, points in enumerate(series)} for stat, series in (raw or {}).items()},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
        policy_state=policy_state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=AutoscalingConfig(min_replicas=1, max_replicas=4, **config),
    )


def serve_kwargs(**autoscaling) -> dict:
    options = ClusterConfig(replicas={"autoscaling": autoscaling}).replicas.autoscaling.serve_autoscaling_config()
    return options["policy"].get("policy_kwargs", {})


def test_headroom_policy_reads_serves_aggregated_stats_and_keeps_its_delay_in_policy_state():
    policy = HeadroomAutoscalingPolicy(**serve_kwargs(upscale_delay_s=5.0))
    stats = {KV_CAPACITY_STAT: [10000, 10000], KV_DEMAND_STAT: [9000, 9000], WAITING_PREFILL_STAT: [0, 0],
             PREEMPTION_RATE_STAT: [0.0, 0.0], "serve_internal": [1, 1]}
    desired, state = policy(context(stats, running=2, target=2, policy_state={"serve": 1}, now=1000.0))
    assert desired == 2 and state["headroom.wants_up_since"] == 1000.0 and state["serve"] == 1
    desired, state = policy(context(stats, running=2, target=2, policy_state=state, now=1005.0))
    assert desired == 3 and state["headroom.wants_up_since"] is None


def test_headroom_policy_reads_each_replicas_newest_point_rather_than_the_windows_mean():
    # A demand rising from 1,000 to 9,000 tokens on one replica of 10,000: the window's mean
    # (5,000) fits at 0.8, the newest point does not.
    policy = HeadroomAutoscalingPolicy(**serve_kwargs(upscale_delay_s=0.0))
    rising = {KV_CAPACITY_STAT: [[(990.0, 10000), (995.0, 10000)]], KV_DEMAND_STAT: [[(995.0, 9000), (990.0, 1000)]]}
    means = {KV_CAPACITY_STAT: [10000], KV_DEMAND_STAT: [5000]}
    desired, _ = policy(context(means, running=1, target=1, raw=rising))
    assert desired == 2
    desired, _ = policy(context(means, running=1, target=1))  # no raw series: the means
    assert desired == 1


def test_headroom_policy_bounds_are_serves_capacity_adjusted_ones():
    policy = HeadroomAutoscalingPolicy(**serve_kwargs(max_replicas=8))
    stats = {KV_CAPACITY_STAT: [1000], KV_DEMAND_STAT: [9000], PREEMPTION_RATE_STAT: [0.0]}
    desired, _ = policy(context(stats, running=1, target=1, policy_state={"headroom.wants_up_since": 0.0}))
    assert desired == 4  # the context's capacity-adjusted max, not 8 or the 12 the KV asks for


def test_requests_policy_is_serves_own_arithmetic():
    # 96 requests in flight at 32 per replica: 3 replicas.
    desired, _ = RequestsAutoscalingPolicy()(context({}, running=2, target=2, requests=96.0, target_ongoing_requests=32))
    assert desired == pytest.approx(3.0)


def test_status_prints_running_against_desired_with_the_reason_and_the_draining():
    counts = {"fixed": ReplicaCounts(target=2, running=2, draining=0, autoscaling=False),
              "scaled": ReplicaCounts(target=3, running=2, draining=1, autoscaling=True),
              "starting": ReplicaCounts(target=1, running=1, draining=0, autoscaling=True)}
    decision = {"desired_replicas": 3, "policy": "headroom", "reason": "kv_demand", "timestamp": 0.0}
    lines = scale_lines(counts, {"scaled": decision, "starting": None}, {"scaled": [decision]})
    assert lines[0] == "fixed: 2 replicas running of 2 (fixed)"
    assert lines[1].startswith("scaled: 2 replicas running, desired 3 (headroom policy: kv_demand), Serve's target 3; "
                               "last change to 3 (kv_demand)")
    assert lines[1].endswith(", 1 draining")
    assert lines[2] == "starting: 1 replica running, Serve's target 1 (autoscaling: no decision published yet)"


def test_status_prints_the_pressure_floor_and_what_holds_it():
    counts = {"app": ReplicaCounts(target=2, running=2, draining=0, autoscaling=True)}
    decision = {**asdict(Decision(2, "steady", kv_demand_tokens=6000.0, pressure_floor=2,
                                  pressure_floor_until=time.time() + 20.5)),
                "policy": "headroom", "timestamp": 0.0}
    assert scale_lines(counts, {"app": decision}, {}) == [
        "app: 2 replicas running, desired 2 (headroom policy: steady), Serve's target 2; pressure floor 2 (a "
        "scale-down rebounded): held 20 s more, then until the KV demand eases by the scale-down band"]
    decision.update(pressure_floor_until=None, pressure_floor_release_tokens=4500.0)
    assert scale_lines(counts, {"app": decision}, {})[0].endswith(
        "Serve's target 2; pressure floor 2 (a scale-down rebounded): held until the KV demand falls to 4500 tokens "
        "(now 6000)")
    decision.update(pressure_floor=0)
    assert scale_lines(counts, {"app": decision}, {})[0].endswith("Serve's target 2")


class _BoardByHand:
    """The real DecisionBoard behind the actor-handle shape the publisher calls (board.record.remote)."""

    def __init__(self):
        self.board = DecisionBoard()
        self.record = SimpleNamespace(remote=self.board.record)


def test_decisions_made_before_the_board_is_found_reach_it_in_order_once_it_is():
    publisher = DecisionPublisher()
    found = [None]
    publisher._lookup = lambda: found[0]
    # Serve runs the policy before the ingress has created the board: a scale-up then.
    publisher.publish("app", Decision(1, "low_demand"), 1, 1, "headroom")
    publisher.publish("app", Decision(2, "kv_demand"), 1, 1, "headroom")
    publisher.publish("app", Decision(2, "kv_demand"), 1, 2, "headroom")
    found[0] = _BoardByHand()
    publisher.publish("app", Decision(1, "low_demand"), 2, 2, "headroom")
    board = found[0].board
    assert [(change["desired_replicas"], change["target_replicas"]) for change in board.get_changes("app")] == \
        [(2, 1), (1, 2)]
    assert board.get("app")["desired_replicas"] == 1 and board.get("app")["target_replicas"] == 2
    publisher.publish("app", Decision(1, "low_demand"), 1, 1, "headroom")  # nothing left over to replay
    assert len(board.get_changes("app")) == 2 and board.get("app")["target_replicas"] == 1


def test_a_wish_decided_again_every_control_loop_through_serves_upscale_delay_is_one_change():
    """Serve applies the requests policy's delays after it, asking it every 0.1 s: each loop of
    the delay published the same wish, the 32 changes kept were all that one, and `headroom
    status` dated its "last change" to the latest loop."""
    by_hand = _BoardByHand()
    policy = RequestsAutoscalingPolicy()
    policy.board._lookup = lambda: by_hand
    ticks = [context({}, running=2, target=2, requests=96.0, target_ongoing_requests=32)] * 50
    ticks += [context({}, running=2, target=3, requests=96.0, target_ongoing_requests=32)]  # Serve follows
    ticks += [context({}, running=3, target=3, requests=20.0, target_ongoing_requests=32)] * 50  # fewer...
    ticks += [context({}, running=3, target=3, requests=96.0, target_ongoing_requests=32)]  # ...then 3 again
    ticks += [context({}, running=3, target=3, requests=150.0, target_ongoing_requests=32)] * 3
    for tick in ticks:
        policy(tick)
    changes = by_hand.board.get_changes("app")
    assert [(change["desired_replicas"], change["target_replicas"]) for change in changes] == [(3, 2), (1, 3), (4, 3)]
    assert by_hand.board.get("app")["desired_replicas"] == 4
    # The publisher keeps what it decided before the board was found the same way.
    publisher = DecisionPublisher()
    publisher._lookup = lambda: None
    for _ in range(40):
        publisher.publish("app", Decision(3, "requests"), 2, 2, "requests")
    assert len(publisher._unsent_changes) == 1
