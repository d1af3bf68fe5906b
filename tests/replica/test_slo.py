"""The SLO policy without a model: slack and urgency, the gate's four sign cases, the TTFT
predictor, the urgency-ordered waiting queue, the monitor, and `Scheduler.abort_step`
checked against a simulated KV cache that remembers which prefix each slot really holds."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st
from sched_harness import draw_prompt, fake_next_token, make_request, make_scheduler, reference_outputs

from replica.config import ConfigError, make_engine_config
from protos.headroom_pb2 import ReplicaLoad
from replica.server.metrics import ReplicaMetrics
from replica.core.request import RequestStatus
from replica.errors import InvalidRequestError
from replica.core.scheduler import Scheduler, SchedulerOutput
from replica.core.slo import (
    AbortOrder,
    PredictorCoefficients,
    SLOView,
    StepSnapshot,
    TTFTPredictor,
    choose_victim,
    gate_allows,
    slack,
    ttft_deadline,
    urgency,
)
from replica.core.slo_monitor import SLOMonitor

NO_PREDICTION = PredictorCoefficients(per_token_s=0.0, base_s=0.0)


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def slo_scheduler(clock: FakeClock, **overrides) -> Scheduler:
    config = dict(scheduling_policy="slo", slo_predictor_per_token_ms=0.0, slo_predictor_base_ms=0.0)
    config.update(overrides)
    return make_scheduler(clock, **config)


# ---- slack and urgency -------------------------------------------------------------------


def test_slack_is_time_left_minus_the_predicted_ttft():
    assert slack(deadline=10.3, now=10.0, predicted_ttft=0.1) == pytest.approx(0.2)
    assert slack(deadline=10.05, now=10.0, predicted_ttft=0.1) == pytest.approx(-0.05)
    assert slack(deadline=None, now=10.0, predicted_ttft=0.1) == math.inf


def test_urgency_is_sign_of_slack_over_time_left():
    assert urgency(deadline=10.3, now=10.0, predicted_ttft=0.1) == pytest.approx(1 / 0.3)
    assert urgency(deadline=15.0, now=10.0, predicted_ttft=1.0) == pytest.approx(1 / 5.0)
    assert urgency(deadline=10.05, now=10.0, predicted_ttft=0.1) == pytest.approx(-1 / 0.05)  # doomed
    assert urgency(deadline=9.0, now=10.0, predicted_ttft=0.1) == pytest.approx(-1.0)  # already missed
    assert urgency(deadline=None, now=10.0, predicted_ttft=0.1) == 0.0


def test_rescuable_rank_by_earliest_deadline_then_no_deadline_then_doomed():
    clock = FakeClock(10.0)
    scheduler = slo_scheduler(clock, max_num_seqs=1, slo_predictor_base_ms=100.0)
    deadlines = {"far": 15.0, "none": None, "near": 10.3, "missed": 9.0, "doomed": 10.05}
    for arrival, (request_id, deadline) in enumerate(deadlines.items()):
        scheduler.add_request(make_request(request_id, [1, 2, 3], arrival_time=float(arrival), ttft_deadline=deadline))
    scheduler.waiting.reorder()
    assert [r.request_id for r in scheduler.waiting] == ["near", "far", "none", "missed", "doomed"]


def test_slo_policy_admits_the_most_urgent_waiter_first_and_reranks_as_time_passes():
    clock = FakeClock(0.0)
    scheduler = slo_scheduler(clock, max_num_seqs=1, slo_predictor_base_ms=100.0)
    scheduler.add_request(make_request("relaxed", [1, 2], arrival_time=0.0, ttft_deadline=5.0))
    scheduler.add_request(make_request("urgent", [3, 4], arrival_time=0.0, ttft_deadline=0.3))
    clock.now = 0.25  # urgent's 0.05 s left cannot fit its 0.1 s prefill: doomed, it sinks
    assert [entry.request.request_id for entry in scheduler.schedule().scheduled] == ["relaxed"]


def test_a_waiters_urgency_counts_its_prompt_net_of_the_prefix_it_found_cached():
    # 1 ms per token: the cached tenant's 42-token prompt would take 42 ms, but 40 of its tokens
    # are cached (the running request holds them), so it prefills 2 (2 ms) and its 20 ms are enough.
    clock = FakeClock(0.0)
    scheduler = slo_scheduler(clock, max_num_seqs=1, block_size=4, slo_predictor_per_token_ms=1.0)
    prefix = list(range(1, 41))
    scheduler.add_request(make_request("holder", prefix, arrival_time=0.0))
    scheduler.schedule()  # runs alone (max_num_seqs 1): its prompt's blocks are cached and held
    scheduler.add_request(make_request("relaxed", [50, 51], arrival_time=0.0, ttft_deadline=5.0))
    scheduler.add_request(make_request("cached", prefix + [60, 61], arrival_time=0.0, ttft_deadline=0.02))
    scheduler.waiting.reorder()
    # Rescuable, earliest deadline first; on its whole prompt it would be doomed and sink last.
    assert [r.request_id for r in scheduler.waiting] == ["cached", "relaxed"]
    assert [view.num_tokens_to_compute for view in scheduler.slo_snapshot(SchedulerOutput(1, [], 0, [], [])).waiters] == [2, 2]


def test_a_doomed_waiter_overdue_by_the_bound_goes_first_for_its_share_of_admissions():
    # "old" (SLO 100 ms) is doomed at 0.15 s; rescuable arrivals keep coming. Unbounded, it waits
    # behind every one of them; with slo_doomed_max_wait_ms 200 it is overdue once it has waited
    # 0.2 s and goes first, the oldest overdue first, for at most half the admissions (share 0.5).
    # "patient" (SLO 1 s) has waited as long, but its deadline is ahead: it is not overdue.
    def fill(scheduler: Scheduler, clock: FakeClock) -> None:
        scheduler.add_request(make_request("old", [1, 2], arrival_time=0.0, ttft_deadline=0.1))
        scheduler.add_request(make_request("older", [1, 2], arrival_time=-0.01, ttft_deadline=0.09))
        scheduler.add_request(make_request("patient", [1, 2], arrival_time=-0.02, ttft_deadline=4.0))
        clock.now = 0.15
        for i, name in enumerate(("a", "b", "c")):
            scheduler.add_request(make_request(name, [3, 4], arrival_time=0.15, ttft_deadline=1.0 + i))

    def order(scheduler: Scheduler) -> list[str]:
        scheduler.waiting.reorder()
        return [r.request_id for r in scheduler.waiting]

    clock = FakeClock(0.0)
    unbounded = slo_scheduler(clock, slo_predictor_base_ms=50.0)
    fill(unbounded, clock)
    clock.now = 0.3
    assert unbounded.config.slo_doomed_max_wait_ms is None  # off unless the operator sets it
    assert order(unbounded) == ["a", "b", "c", "patient", "older", "old"]

    clock = FakeClock(0.0)
    bounded = slo_scheduler(clock, slo_predictor_base_ms=50.0, slo_doomed_max_wait_ms=200.0, slo_doomed_share=0.5)
    fill(bounded, clock)
    assert order(bounded) == ["a", "b", "c", "patient", "older", "old"]  # waited 0.15 s of the 0.2 s bound
    clock.now = 0.3
    assert order(bounded) == ["older", "a", "b", "c", "patient", "old"]
    admitted = [bounded.waiting.pop().request_id for _ in range(6)]
    # older (its credit), then a rescuable one earns half a credit each: old after a.
    assert admitted == ["older", "a", "old", "b", "c", "patient"]


def test_default_ttft_slo_sets_the_deadline_and_an_explicit_one_wins():
    scheduler = slo_scheduler(FakeClock(), default_ttft_slo_ms=300.0)
    plain = make_request("plain", [1, 2], arrival_time=5.0)
    explicit = make_request("explicit", [1, 2], arrival_time=5.0, ttft_deadline=9.0)
    scheduler.add_request(plain)
    scheduler.add_request(explicit)
    assert plain.ttft_deadline == pytest.approx(5.3)
    assert explicit.ttft_deadline == 9.0
    assert ttft_deadline(2.0, None) is None
    with pytest.raises(InvalidRequestError) as error:
        ttft_deadline(2.0, 0.0)
    assert error.value.field == "ttft_slo_ms"


@pytest.mark.parametrize("overrides, field", [
    (dict(slo_preemption_margin=0.9), "slo_preemption_margin"),
    (dict(slo_abort_max_layer_fraction=1.5), "slo_abort_max_layer_fraction"),
    (dict(default_ttft_slo_ms=0.0), "default_ttft_slo_ms"),
])
def test_impossible_slo_config_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        make_engine_config(**overrides)


# ---- the gate ----------------------------------------------------------------------------


def test_gate_both_rescuable_applies_the_margin():
    # Waiter: 0.3 s left, urgency 3.33; running: 2 s left, urgency 0.5 -> 3.33 > 1.2 * 0.5.
    assert gate_allows(waiter_slack=0.2, waiter_urgency=1 / 0.3, running_slack=1.5, running_urgency=0.5, margin=1.2)
    # 2.3 is not 1.2 times 2.0: within the margin, the running prefill keeps its pass.
    assert not gate_allows(waiter_slack=0.2, waiter_urgency=2.3, running_slack=0.3, running_urgency=2.0, margin=1.2)


def test_gate_never_aborts_for_a_doomed_waiter():
    assert not gate_allows(waiter_slack=-0.01, waiter_urgency=-50.0, running_slack=4.0, running_urgency=0.2,
                           margin=1.2)


def test_gate_always_yields_a_doomed_running_prefill_to_a_rescuable_waiter():
    assert gate_allows(waiter_slack=0.2, waiter_urgency=0.1, running_slack=-1.0, running_urgency=-2.0, margin=1.2)


def test_gate_never_aborts_when_both_are_doomed():
    assert not gate_allows(waiter_slack=-0.5, waiter_urgency=-1.0, running_slack=-1.0, running_urgency=-2.0,
                           margin=1.2)


def test_victim_is_the_least_urgent_preemptible_prefill_and_aggressive_mode_compares_with_it():
    now = 100.0
    waiter = SLOView("waiter", now + 0.45, 16)  # urgency 2.22
    near = SLOView("near", now + 0.5, 400)  # urgency 2.0: 2.22 is within its 1.2 margin
    far = SLOView("far", now + 10.0, 4000)  # urgency 0.1
    assert choose_victim([waiter], [near, far], now, NO_PREDICTION, margin=1.2) is None
    assert choose_victim([waiter], [near, far], now, NO_PREDICTION, margin=1.2, aggressive=True) == "far"
    assert choose_victim([waiter], [far], now, NO_PREDICTION, margin=1.2) == "far"


def test_a_prefill_preempted_once_is_immune():
    now = 0.0
    waiter = SLOView("waiter", 0.3, 16)
    immune = SLOView("immune", 10.0, 4000, preemptible=False)
    assert choose_victim([waiter], [immune], now, NO_PREDICTION, margin=1.2) is None
    assert choose_victim([waiter], [immune, SLOView("other", 20.0, 8)], now, NO_PREDICTION, margin=1.2) == "other"


def test_the_gate_uses_the_predicted_ttft():
    # 0.3 s left, but 2000 tokens at 0.2 ms each take 0.4 s: the waiter is doomed.
    coefficients = PredictorCoefficients(per_token_s=0.0002, base_s=0.0)
    assert choose_victim([SLOView("waiter", 0.3, 2000)], [SLOView("long", 60.0, 4000)], 0.0, coefficients, 1.2) is None
    assert choose_victim([SLOView("waiter", 0.3, 20)], [SLOView("long", 60.0, 4000)], 0.0, coefficients, 1.2) == "long"


# ---- the predictor -----------------------------------------------------------------------


def test_predictor_starts_from_the_configured_coefficients():
    predictor = TTFTPredictor.from_config(make_engine_config())  # 0.05 ms per token + 20 ms
    assert predictor.predict(1000) == pytest.approx(0.07)


def test_predictor_fits_the_measured_prefills_by_least_squares():
    predictor = TTFTPredictor(per_token_s=0.5, base_s=0.5, window=8)
    for num_tokens in (100, 200, 400, 800):
        predictor.observe(num_tokens, 0.001 * num_tokens + 0.01)
    assert predictor.coefficients.per_token_s == pytest.approx(0.001)
    assert predictor.coefficients.base_s == pytest.approx(0.01)


def test_predictor_forgets_samples_older_than_its_window():
    predictor = TTFTPredictor(per_token_s=0.0, base_s=0.0, window=2)
    predictor.observe(100, 5.0)
    predictor.observe(200, 9.0)
    predictor.observe(100, 0.2)
    predictor.observe(200, 0.3)
    assert predictor.predict(300) == pytest.approx(0.4)


def test_predictor_clamps_a_negative_slope_and_keeps_the_slope_for_a_single_length():
    falling = TTFTPredictor(per_token_s=0.001, base_s=0.0, window=8)
    falling.observe(100, 0.5)
    falling.observe(200, 0.3)
    assert falling.coefficients == PredictorCoefficients(0.0, pytest.approx(0.4))
    one_length = TTFTPredictor(per_token_s=0.001, base_s=0.0, window=8)
    one_length.observe(100, 0.3)
    one_length.observe(100, 0.5)
    assert one_length.coefficients == PredictorCoefficients(0.001, pytest.approx(0.3))


def test_scheduler_feeds_the_predictor_admission_to_first_token():
    clock = FakeClock(0.0)
    scheduler = slo_scheduler(clock, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64, max_model_len=128)
    for request_id, first_token, prompt_len, prefill_s in (("a", 1, 10, 0.02), ("b", 100, 50, 0.06)):
        scheduler.add_request(make_request(request_id, list(range(first_token, first_token + prompt_len)), 1))
        output = scheduler.schedule()
        clock.now += prefill_s
        scheduler.update(output, {request_id: 7})
    assert scheduler.ttft_predictor.coefficients.per_token_s == pytest.approx(0.001)
    assert scheduler.ttft_predictor.coefficients.base_s == pytest.approx(0.01)
    assert scheduler.load().ttft_predictor_per_token_s == pytest.approx(0.001)


def test_slo_totals_and_predictor_coefficients_are_exported_as_metrics():
    scheduler = slo_scheduler(FakeClock(), slo_predictor_per_token_ms=0.25, slo_predictor_base_ms=30.0)
    scheduler.counters.slo_preemptions, scheduler.counters.slo_discarded_layers = 3, 40
    metrics = ReplicaMetrics(replica_id="r0", model="m")
    metrics.update(scheduler.load(), ReplicaLoad())
    metrics.update(scheduler.load(), ReplicaLoad())  # counters follow totals: syncing twice adds nothing
    labels = {"replica": "r0", "model": "m"}
    sample = metrics.registry.get_sample_value
    assert sample("headroom_slo_preemptions_total", labels) == 3
    assert sample("headroom_slo_discarded_layers_total", labels) == 40
    assert sample("headroom_slo_ttft_predictor_per_token_seconds", labels) == pytest.approx(0.00025)
    assert sample("headroom_slo_ttft_predictor_base_seconds", labels) == pytest.approx(0.03)


# ---- the monitor -------------------------------------------------------------------------


def monitor(clock: FakeClock, **overrides) -> SLOMonitor:
    config = make_engine_config(scheduling_policy="slo", **overrides)
    return SLOMonitor(config, TTFTPredictor(0.0, 0.0, 8), clock)


def test_monitor_orders_the_step_in_flight_aborted_once():
    slo_monitor = monitor(FakeClock(0.0))
    assert slo_monitor.check() is None  # no pass in flight
    slo_monitor.publish_step(StepSnapshot(7, (SLOView("long", 60.0, 4000),), (SLOView("urgent", 0.3, 16),)))
    assert slo_monitor.check() == AbortOrder(7, "long")
    assert slo_monitor.check() is None  # already decided for step 7
    assert slo_monitor.abort_order == AbortOrder(7, "long")


def test_monitor_sees_arrivals_not_yet_in_the_scheduler():
    slo_monitor = monitor(FakeClock(0.0))
    slo_monitor.publish_step(StepSnapshot(3, (SLOView("long", 60.0, 4000),), ()))
    assert slo_monitor.check() is None
    slo_monitor.publish_arrivals((SLOView("urgent", 0.3, 16),))
    assert slo_monitor.check() == AbortOrder(3, "long")


def test_a_late_order_keeps_naming_the_step_it_was_decided_for():
    # Decided for step 7; step 7 ends and step 8 starts with no reason to abort: the order
    # still names 7, which the engine's layer hook compares with 8 (see test_slo_engine).
    slo_monitor = monitor(FakeClock(0.0))
    slo_monitor.publish_step(StepSnapshot(7, (SLOView("long", 60.0, 4000),), (SLOView("urgent", 0.3, 16),)))
    slo_monitor.check()
    slo_monitor.publish_step(StepSnapshot(8, (SLOView("long", 60.0, 3000, preemptible=False),), ()))
    assert slo_monitor.check() is None
    assert slo_monitor.abort_order.step_id == 7


def test_monitor_thread_posts_an_order_within_a_few_intervals():
    slo_monitor = monitor(FakeClock(0.0), slo_monitor_interval_ms=1.0)
    slo_monitor.publish_step(StepSnapshot(1, (SLOView("long", 60.0, 4000),), (SLOView("urgent", 0.3, 16),)))
    slo_monitor.start()
    try:
        for _ in range(2000):
            if slo_monitor.abort_order is not None:
                break
            time.sleep(0.001)
    finally:
        slo_monitor.stop()
    assert slo_monitor.abort_order == AbortOrder(1, "long")


# ---- abort_step, against a simulated KV cache --------------------------------------------

GARBAGE = "written by an aborted pass"


class SimulatedKV:
    """Stands in for the KV tensors: each slot remembers the token prefix whose KV it holds.
    A step writes its tokens' slots, then every scheduled request reads all its positions,
    which must hold exactly its own prefix; an aborted pass leaves garbage in its slots."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.slots: dict[tuple[int, int], object] = {}

    def _slot(self, request, position: int) -> tuple[int, int]:
        block_size = self.scheduler.config.block_size
        block = self.scheduler.kv_cache.req_to_blocks[request.request_id][position // block_size]
        return block.block_id, position % block_size

    def step(self, output: SchedulerOutput, abort_victim: str | None = None) -> None:
        for entry in output.scheduled:
            request = entry.request
            for position in range(entry.start_pos, entry.start_pos + entry.num_new_tokens):
                prefix = GARBAGE if abort_victim else tuple(request.all_token_ids[: position + 1])
                self.slots[self._slot(request, position)] = prefix
        if abort_victim is not None:
            self.scheduler.abort_step(output, abort_victim, num_discarded_layers=2)
            return
        sampled = {}
        for entry in output.scheduled:
            request = entry.request
            for position in range(entry.start_pos + entry.num_new_tokens):
                assert self.slots.get(self._slot(request, position)) == tuple(request.all_token_ids[: position + 1]), (
                    f"{request.request_id} reads wrong KV at position {position}"
                )
            if entry.samples:
                sampled[request.request_id] = fake_next_token(request.all_token_ids)
        self.scheduler.update(output, sampled)


def test_abort_step_restores_every_request_and_preempts_only_the_victim():
    scheduler = slo_scheduler(FakeClock(), block_size=4, num_kv_blocks=64, max_model_len=128,
                              max_num_batched_tokens=16)
    kv = SimulatedKV(scheduler)
    decode = make_request("decode", [1, 2, 3], 30)
    long = make_request("long", list(range(10, 70)), 4)
    scheduler.add_request(decode)
    kv.step(scheduler.schedule())
    scheduler.add_request(long)
    kv.step(scheduler.schedule())  # decode's token + long's first 15-token chunk
    free_before = scheduler.kv_cache.num_free_blocks
    decode_computed = decode.num_computed_tokens
    assert long.num_computed_tokens == 15

    output = scheduler.schedule()
    assert {entry.request.request_id for entry in output.scheduled} == {"decode", "long"}
    kv.step(output, abort_victim="long")

    assert decode.num_computed_tokens == decode_computed  # its token is simply run again
    assert decode.num_output_tokens == 2
    assert long.status == RequestStatus.PREEMPTED and long.num_computed_tokens == 0
    assert long.num_slo_preemptions == 1 and long.num_preemptions == 0
    assert scheduler.counters.slo_preemptions == 1 and scheduler.counters.slo_discarded_layers == 2
    assert scheduler.counters.preemptions == 0, "an SLO preemption is not a memory preemption"
    assert scheduler.kv_cache.num_free_blocks > free_before  # the victim's blocks came back
    scheduler.check_invariants()
    assert scheduler.schedule().preempted_req_ids == ["long"]  # so the runner drops its table


def test_aborted_pass_blocks_are_never_served_from_the_prefix_cache():
    scheduler = slo_scheduler(FakeClock(), block_size=4, num_kv_blocks=64, max_model_len=128,
                              max_num_batched_tokens=8)
    kv = SimulatedKV(scheduler)
    prompt = list(range(10, 34))  # 6 full blocks
    first = make_request("first", prompt, 2)
    scheduler.add_request(first)
    kv.step(scheduler.schedule())  # blocks 0-1 written and cached
    output = scheduler.schedule()  # blocks 2-3 registered before the pass
    kv.step(output, abort_victim="first")
    second = make_request("second", prompt + [99], 2)
    scheduler.add_request(second)
    assert scheduler.kv_cache.get_computed_blocks(second)[1] == 8, "only the two written blocks may hit"
    while scheduler.has_unfinished_requests():
        kv.step(scheduler.schedule())
    outputs = {r.request_id: r.output_token_ids for r in (first, second)}
    assert outputs == reference_outputs([make_request("first", prompt, 2), make_request("second", prompt + [99], 2)])
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_usable_blocks


def test_same_step_prefix_hit_on_an_aborted_block_waits_to_be_admitted_afresh():
    scheduler = slo_scheduler(FakeClock(), block_size=4, num_kv_blocks=64, max_model_len=128,
                              max_num_batched_tokens=64)
    kv = SimulatedKV(scheduler)
    prompt = list(range(10, 26))  # 4 full blocks
    leader = make_request("leader", prompt + [1], 3, ttft_deadline=60.0)
    follower = make_request("follower", prompt + [2], 3, ttft_deadline=60.0)
    scheduler.add_request(leader)
    scheduler.add_request(follower)
    output = scheduler.schedule()
    assert follower.num_cached_tokens == 16, "the follower hit the leader's blocks in the same step"
    kv.step(output, abort_victim="leader")
    # The blocks it hit were never written: it waits again, holding none, and computed nothing
    # to lose (no preemption of its own).
    assert follower.status == RequestStatus.PREEMPTED and follower in scheduler.waiting
    assert follower.request_id not in scheduler.kv_cache.req_to_blocks and follower.num_computed_tokens == 0
    assert scheduler.counters.preemptions == 0 and follower.num_preemptions == 0
    scheduler.check_invariants()
    output = scheduler.schedule()
    assert {"leader", "follower"} <= set(output.preempted_req_ids), "the runner drops both rows"
    kv.step(output)
    while scheduler.has_unfinished_requests():
        kv.step(scheduler.schedule())
        scheduler.check_invariants()
    assert [leader.output_token_ids, follower.output_token_ids] == list(
        reference_outputs([make_request("l", prompt + [1], 3), make_request("f", prompt + [2], 3)]).values()
    )
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_usable_blocks


def test_a_hit_on_a_block_whose_owner_stays_is_not_rewritten_by_the_hitter():
    """The hit block's owner is not the victim and keeps it: rewound to 0, the hitter used to
    recompute that block's tokens into the owner's block (which the owner had computed part of
    a step before), beside the host tier's write-through of it (found by fuzzing the scheduler,
    seed 2423). A slot a running request has computed is written by no one else."""
    scheduler = slo_scheduler(FakeClock(), block_size=4, num_kv_blocks=20, num_host_kv_blocks=8, max_model_len=32,
                              long_prefill_token_threshold=3)
    kv = SimulatedKV(scheduler)
    owner, hitter, victim = (make_request(request_id, prompt, 4, ttft_deadline=60.0) for request_id, prompt in
                             (("owner", [1, 2, 3, 4, 5, 6]), ("hitter", [1, 2, 3, 4, 9, 9]), ("victim", [50, 51])))
    scheduler.add_request(owner)
    scheduler.add_request(victim)
    kv.step(scheduler.schedule())  # the owner's first 3 tokens
    scheduler.add_request(hitter)
    output = scheduler.schedule()  # the owner fills its first block; the hitter hits it
    assert hitter.num_cached_tokens == 4
    kv.step(output, abort_victim="victim")
    assert hitter.status == RequestStatus.PREEMPTED and hitter.request_id not in scheduler.kv_cache.req_to_blocks
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        # What each request computed before this step (one admitted now holds only hits, which
        # the pass may fill beside it: a same-step hit, by design).
        computed = {entry.request.request_id: 0 if entry.is_new else entry.start_pos for entry in output.scheduled}
        for entry in output.scheduled:
            table = scheduler.kv_cache.req_to_blocks[entry.request.request_id]
            written = {table[position // 4].block_id for position in range(entry.start_pos, entry.start_pos + entry.num_new_tokens)}
            for other in scheduler.running:
                if other is not entry.request:
                    done = computed.get(other.request_id, other.num_computed_tokens) // 4
                    held = {block.block_id for block in scheduler.kv_cache.req_to_blocks[other.request_id][:done]}
                    assert not written & held, f"{entry.request.request_id} rewrites {written & held} of {other.request_id}"
        kv.step(output)
        scheduler.check_invariants()
    assert [request.output_token_ids for request in (owner, hitter, victim)] == list(reference_outputs(
        [make_request(request.request_id, request.prompt_token_ids, 4) for request in (owner, hitter, victim)]).values())
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_usable_blocks


# ---- property: random arrivals, repeated aborts -------------------------------------------

MAX_MODEL_LEN = 48


@st.composite
def abort_scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    min_blocks = -(-MAX_MODEL_LEN // block_size) + 1
    config = dict(
        block_size=block_size,
        num_kv_blocks=draw(st.integers(min_blocks, min_blocks * 3)),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=draw(st.integers(1, 8)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 10])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.05])),
        slo_predictor_per_token_ms=draw(st.sampled_from([0.0, 10.0])),
        slo_predictor_base_ms=0.0,
    )
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prompt, max_tokens = draw_prompt(draw, MAX_MODEL_LEN)
        arrival_step = draw(st.integers(0, 15))
        slo_steps = draw(st.one_of(st.none(), st.integers(1, 40)))
        cancel_step = draw(st.one_of(st.none(), st.integers(0, 60)))
        requests.append((f"r{i}", prompt, max_tokens, arrival_step, slo_steps, cancel_step))
    abort_steps = draw(st.sets(st.integers(0, 80), max_size=30))
    victim_picks = draw(st.lists(st.integers(0, 7), min_size=30, max_size=30))
    return config, requests, abort_steps, victim_picks


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(abort_scenarios())
def test_repeated_aborts_leak_no_block_strand_no_request_and_change_no_output(scenario):
    config, specs, abort_steps, victim_picks = scenario
    clock = FakeClock(0.0)
    scheduler = slo_scheduler(clock, **config)
    kv = SimulatedKV(scheduler)
    requests = {}
    for step in range(5000):
        clock.now = float(step)
        for request_id, prompt, max_tokens, arrival_step, slo_steps, cancel_step in specs:
            if arrival_step == step:
                deadline = None if slo_steps is None else float(step + slo_steps)
                request = make_request(request_id, prompt, max_tokens, arrival_time=float(step), ttft_deadline=deadline)
                scheduler.add_request(request)
                requests[request_id] = request
            if cancel_step == step and request_id in requests:
                scheduler.abort_request(request_id)
                scheduler.check_invariants()
        if len(requests) == len(specs) and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        # As the gate does: only a request never SLO-preempted may be the victim, which is
        # also what guarantees progress however often passes are aborted.
        candidates = [entry.request.request_id for entry in output.scheduled
                      if entry.request.num_slo_preemptions == 0]
        victim = None
        if step in abort_steps and candidates:
            victim = candidates[victim_picks[step % len(victim_picks)] % len(candidates)]
        kv.step(output, abort_victim=victim)  # checks every KV read of the step
        scheduler.check_invariants()
    else:
        raise AssertionError("a request is stuck")

    target(float(scheduler.counters.slo_preemptions), label="aborted steps")
    kv_cache = scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked KV blocks"
    for request in requests.values():
        assert request.is_finished
        if request.status != RequestStatus.FINISHED_ABORTED:
            expected = reference_outputs([make_request("x", request.prompt_token_ids, request.sampling_params.max_tokens)])
            assert request.output_token_ids == expected["x"]
