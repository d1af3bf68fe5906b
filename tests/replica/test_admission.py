"""Admission by predicted growth: the optimistic mode admits what fits today and preempts
later; the reserve modes hold a request back until it can run to its end (max_tokens, or
the output length finished requests suggest), count the hold once, and report committed KV
in the same terms."""

from __future__ import annotations

import pytest
from sched_harness import FAKE_VOCAB, make_request, make_scheduler, run_step, run_to_completion

from replica.core.admission import peak_growth_tokens
from replica.core.output_length import OutputLengthEstimator

# 12 usable blocks of 4 tokens. Each request: 8-token prompt (2 blocks), 28 output tokens
# (7 more blocks): two fit today, but not both to the end.
# Holds are unbounded here (admission_max_hold_ms None) so they do not depend on the wall
# clock; the test of the bound sets it, on a clock of its own.
POOL = dict(block_size=4, num_kv_blocks=13, max_model_len=40, max_num_batched_tokens=64, admission_max_hold_ms=None)


def two_growing_requests():
    return [make_request("a", list(range(8)), 28), make_request("b", list(range(100, 108)), 28)]


def test_estimator_without_data_reserves_max_tokens():
    assert OutputLengthEstimator().expected_final(0, 500) == 500


def test_estimator_averages_the_lengths_of_requests_still_long_enough():
    # Beside the samples, two pseudo-requests run to the cap (PRIOR_AT_CAP).
    estimator = OutputLengthEstimator()
    for length in (10, 20, 30, 40):
        estimator.observe(length, hit_max_tokens=False)
    assert estimator.expected_final(0, 100) == (100 + 200) // 6
    assert estimator.expected_final(25, 100) == 68  # only 30 and 40 outlive 25 tokens: (70 + 200) / 4
    assert estimator.expected_final(25, 32) == 32  # capped: (30 + 32 + 64) / 4
    assert estimator.expected_final(45, 100) == 100  # nobody ran that long: assume the cap


def test_estimator_counts_requests_cut_off_at_max_tokens_as_running_to_the_cap():
    estimator = OutputLengthEstimator()
    estimator.observe(10, hit_max_tokens=False)
    estimator.observe(50, hit_max_tokens=True)  # would have gone on
    assert estimator.expected_final(0, 200) == -(-(10 + 3 * 200) // 4)


def test_optimistic_admission_takes_both_and_later_preempts():
    scheduler = make_scheduler(**POOL)
    run_to_completion(scheduler, two_growing_requests())
    assert scheduler.counters.preemptions > 0
    assert scheduler.load().admissions_held_total == 0


def test_reserving_max_tokens_holds_the_second_back_once_and_never_preempts():
    scheduler = make_scheduler(**POOL, admission_mode="reserve_max_tokens")
    first, second = two_growing_requests()
    running_together = []
    run_to_completion(scheduler, [first, second], on_step=lambda *_: running_together.append(len(scheduler.running)))
    assert scheduler.counters.preemptions == 0
    assert max(running_together) == 1
    # Held at the head of the queue for ~28 steps, counted once.
    assert scheduler.load().admissions_held_total == 1
    assert first.output_token_ids and second.output_token_ids


def held_pair_on_a_clock(now: list[float], mode: str, **overrides):
    """A scheduler reading time from now[0], with the two growing requests arrived at now[0]."""
    scheduler = make_scheduler(lambda: now[0], **{**POOL, "admission_mode": mode, **overrides})
    first, second = two_growing_requests()
    for request in (first, second):
        request.arrival_time = now[0]
        scheduler.add_request(request)
    return scheduler, first, second


@pytest.mark.parametrize("mode", ["reserve_max_tokens", "reserve_expected"])
def test_a_hold_waives_the_reserve_over_admission_max_hold_ms(mode):
    now = [100.0]
    scheduler, first, second = held_pair_on_a_clock(now, mode, admission_max_hold_ms=200.0)
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a"] and scheduler.load().admissions_held_total == 1
    now[0] = 100.05
    run_step(scheduler)
    assert len(scheduler.running) == 1  # 50 ms: it still needs three quarters of the reserve
    now[0] = 100.2
    run_step(scheduler)
    assert len(scheduler.running) == 2  # 200 ms: it needs none
    load = scheduler.load()
    assert load.admissions_held_total == 1 and load.admissions_relaxed_total == 1
    # What the reserve would have prevented: both cannot grow to their ends together.
    run_to_completion(scheduler, [])
    assert scheduler.counters.preemptions > 0
    assert first.num_output_tokens == second.num_output_tokens == 28


def test_a_request_is_held_at_most_until_its_latest_start():
    """Held past its latest start (its TTFT deadline less its predicted TTFT) a request misses
    the deadline whatever follows: with an SLO of 80 ms and an 8-token prompt (predicted 20.4
    ms) the 500 ms hold ends at 59.6 ms. Past that it is held over the longer
    admission_max_hold_late_ms: letting it in early saves no TTFT, and on a waived reserve it is
    the next victim. A request without an SLO, and a preempted stream, keep the 500 ms."""
    now = [100.0]
    scheduler, first, second = held_pair_on_a_clock(now, "reserve_max_tokens", admission_max_hold_ms=500.0,
                                                    admission_max_hold_late_ms=1000.0, default_ttft_slo_ms=80.0)
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a"]
    latest_start = 100.08 - scheduler.ttft_predictor.predict(8)
    assert latest_start == pytest.approx(100.0596)
    assert scheduler._reserve_share(second, 100.0298) == pytest.approx(0.5)
    assert scheduler._reserve_share(second, 100.07) == pytest.approx(1 - 70 / 1000)  # late: the longer hold
    second.ttft_deadline = None
    assert scheduler._reserve_share(second, 100.07) == pytest.approx(1 - 70 / 500)  # no SLO: the hold
    # Never shorter than the hold itself, and None leaves it unbounded.
    second.ttft_deadline = 100.08
    late = scheduler.config
    scheduler.config = late.model_copy(update={"admission_max_hold_late_ms": 100.0})
    assert scheduler._reserve_share(second, 100.07) == pytest.approx(1 - 70 / 500)
    scheduler.config = late.model_copy(update={"admission_max_hold_late_ms": None})
    assert scheduler._reserve_share(second, 100.07) == 1.0
    scheduler.config = late
    now[0] = 100.0595
    run_step(scheduler)
    assert len(scheduler.running) == 2 and scheduler.load().admissions_relaxed_total == 1
    # A stream (its first token out) keeps the whole hold however far its deadline: its TTFT is
    # behind it, and let in early on a waived reserve it is what the replica preempts next.
    assert second.num_output_tokens > 0
    second.ttft_deadline = 200.0
    assert scheduler._reserve_share(second, 100.18) == pytest.approx(1 - 180 / 500)
    second.ttft_deadline = None
    assert scheduler._reserve_share(second, 100.18) == pytest.approx(1 - 180 / 500)


@pytest.mark.parametrize("step_s", [0.001, 0.015, 0.020])
def test_the_last_admission_check_before_the_latest_start_needs_none_of_the_reserve(step_s):
    """With steps of 15 ms the ramp to the latest start (43 ms) left 9% of the reserve at the last
    check before it (30 ms), which did not fit; past it the request was doomed and waited out the
    whole 500 ms hold (admitted at 480 ms; the SLO cap before admitted it at 75 ms, late). The ramp
    ends one admission interval early: it is admitted by its latest start at every step time."""
    now = [100.0]
    scheduler = make_scheduler(lambda: now[0], block_size=4, num_kv_blocks=101, max_model_len=400,
                               max_num_batched_tokens=512, admission_mode="reserve_max_tokens",
                               admission_max_hold_ms=500.0, default_ttft_slo_ms=80.0)
    # b fits beside a's growth only at a reserve share of about 0.03.
    a, b = make_request("a", list(range(8)), 390), make_request("b", list(range(1000, 1340)), 10)
    for request in (a, b):
        request.arrival_time = now[0]
        scheduler.add_request(request)
    latest_start = b.ttft_deadline - scheduler.ttft_predictor.predict(340)
    assert latest_start == pytest.approx(100.043)
    while b.admitted_time is None and now[0] < 101:
        run_step(scheduler)
        now[0] += step_s
    assert b.admitted_time <= latest_start
    assert scheduler.load().admissions_relaxed_total == 1


def test_a_hold_runs_from_the_last_admission_on_the_whole_reserve_not_from_arrival():
    """A request that queued long behind others is not waved through: the hold times how long
    the reserve has blocked the queue (under a sustained overload, the queue drains on whole
    reserves and nothing is waived however long it is)."""
    now = [0.0]
    scheduler, first, second = held_pair_on_a_clock(now, "reserve_max_tokens", admission_max_hold_ms=200.0)
    now[0] = 100.0  # both have queued 100 s
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a"]  # on the whole reserve: the hold starts now
    assert scheduler._reserve_share(second, 100.05) == pytest.approx(0.75)
    now[0] = 100.05
    run_step(scheduler)
    assert len(scheduler.running) == 1
    now[0] = 100.2
    run_step(scheduler)
    assert len(scheduler.running) == 2 and scheduler.load().admissions_relaxed_total == 1


def test_a_preemption_restores_the_whole_reserve_for_every_waiting_request():
    now = [0.0]
    scheduler, first, second = held_pair_on_a_clock(now, "reserve_max_tokens", admission_max_hold_ms=200.0)
    run_step(scheduler)
    now[0] = 0.1
    assert scheduler._reserve_share(second, now[0]) == pytest.approx(0.5)
    scheduler._preempt(0)  # the replica over-committed: waived reserves must be earned again
    assert scheduler._reserve_share(second, now[0]) == 1.0
    assert scheduler._reserve_share(second, 0.15) == pytest.approx(0.75)
    assert scheduler._reserve_share(first, 0.15) == pytest.approx(0.75)  # requeued at 0.1


def test_an_expired_hold_still_needs_memory_for_the_prompt_today():
    now = [0.0]
    # 9 usable blocks: the first request grows to all 9 (8 + 28 tokens); the second's
    # 2-block prompt fits beside it only until it passes 7 blocks.
    scheduler, first, second = held_pair_on_a_clock(now, "reserve_max_tokens", admission_max_hold_ms=1.0,
                                                    num_kv_blocks=10, max_model_len=36)
    for _ in range(22):  # held, on a clock that stands still
        run_step(scheduler)
    assert first.num_tokens > 7 * 4 and len(scheduler.running) == 1
    now[0] = 10.0  # the hold is long over, but the prompt no longer fits
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a"]
    assert scheduler.load().admissions_relaxed_total == 0
    run_to_completion(scheduler, [])
    assert second.num_output_tokens == 28 and scheduler.counters.preemptions == 0


def test_reserve_modes_report_committed_kv_in_their_own_terms():
    optimistic = make_scheduler(**POOL)
    expected = make_scheduler(**POOL, admission_mode="reserve_expected")
    for scheduler in (optimistic, expected):
        # Teach the learned mode that requests stop after one token: every id is EOS.
        run_to_completion(scheduler, [make_request(f"short{i}", [i + 1] * 8, 28, ignore_eos=False,
                                                   eos_token_ids=tuple(range(FAKE_VOCAB))) for i in range(40)])
        scheduler.add_request(make_request("next", list(range(8)), 28, ignore_eos=False))
    # Committed growth of a waiting 8 + 28 token request: 9 blocks to max_tokens, 3 when it
    # is expected to stop after one token (8 + 1 tokens).
    assert optimistic.load().kv_committed_tokens == 9 * 4
    assert expected.load().kv_committed_tokens == 3 * 4


def test_expected_length_admits_more_than_max_tokens_would_when_requests_end_early():
    def peak_running(mode: str) -> int:
        scheduler = make_scheduler(**POOL, admission_mode=mode)
        early_stop = dict(ignore_eos=False, eos_token_ids=tuple(range(FAKE_VOCAB)))
        run_to_completion(scheduler, [make_request(f"w{i}", [i + 1] * 8, 28, **early_stop) for i in range(40)])
        scheduled = []  # requests per step (each prefills and stops within its step)
        run_to_completion(scheduler, [make_request(f"r{i}", [i + 50] * 8, 28, **early_stop) for i in range(4)],
                          on_step=lambda _, output: scheduled.append(len(output.scheduled)))
        return max(scheduled)

    assert peak_running("reserve_max_tokens") == 1
    # 4 x 3 blocks at their ends would fill the 12; the reserve keeps a partial block's
    # slack per running request, so three run together.
    assert peak_running("reserve_expected") == 3


def test_a_request_outliving_its_estimate_is_re_estimated_and_still_fits():
    scheduler = make_scheduler(**POOL, admission_mode="reserve_expected")
    run_to_completion(scheduler, [make_request(f"w{i}", [i + 1] * 8, 28, ignore_eos=False,
                                               eos_token_ids=tuple(range(FAKE_VOCAB))) for i in range(40)])
    long_one = make_request("long", list(range(8)), 28)  # ignore_eos: runs to max_tokens
    scheduler.add_request(long_one)
    estimates = []
    while scheduler.has_unfinished_requests():
        run_step(scheduler)  # check_invariants: every estimate covers the request's length
        if not long_one.is_finished:
            estimates.append(scheduler.growth.final_tokens(long_one))
    assert estimates[0] == 8 + 3 and estimates[-1] == 8 + 28  # 40 one-token samples, 2 at the cap
    assert long_one.num_output_tokens == 28


@pytest.mark.parametrize("mode", ["optimistic", "reserve_max_tokens", "reserve_expected"])
def test_admission_mode_changes_timing_never_output(mode):
    requests = [make_request(f"r{i}", [(7 * i + t) % FAKE_VOCAB for t in range(6 + i)], 20 + i) for i in range(6)]
    reference = run_to_completion(make_scheduler(block_size=4, num_kv_blocks=200, max_model_len=40,
                                                 max_num_batched_tokens=64), [r for r in _copies(requests)])
    outputs = run_to_completion(make_scheduler(**POOL, admission_mode=mode), requests)
    assert outputs == reference


def _copies(requests):
    return [make_request(r.request_id, r.prompt_token_ids, r.sampling_params.max_tokens) for r in requests]


def test_staggered_endings_need_only_the_peak_of_the_growth_not_its_sum():
    # One request grows 100 more tokens, one 10 and then frees its 500: together they never
    # need more than 20 tokens beyond today's (both growing for 10 steps), not 110.
    assert peak_growth_tokens([(100, 500), (10, 500)]) == 20
    # If what the short one frees stays held by a request that shares it, the long one's
    # growth is the peak: 100.
    assert peak_growth_tokens([(100, 500), (10, 500)], kept_tokens=500) == 100
    assert peak_growth_tokens([(100, 500), (10, 500)], partial_tokens=15) == (10 + 15) * 2 - 15


def test_a_shared_prefix_is_not_what_its_first_holder_frees():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=33, max_model_len=64, max_num_batched_tokens=64)
    first = make_request("first", list(range(16)) + [1, 2], 20)  # 4 full prompt blocks + a partial one
    scheduler.add_request(first)
    run_step(scheduler)
    assert scheduler.kv_cache.num_private_blocks(first) == 5
    scheduler.add_request(make_request("second", list(range(16)) + [3, 4], 20))  # shares 4 blocks
    run_step(scheduler)
    assert scheduler.kv_cache.num_private_blocks(first) == 1
