"""Specification of the smoothed preemption rate the router reads from ReplicaLoad."""

from __future__ import annotations

import math
import random

import pytest

from replica.server.preemption_rate import PreemptionRateEstimator

HALF_LIFE_S = 5.0


def test_rate_is_zero_when_never_preempted():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    assert estimator.rate(now=0.0) == 0.0
    for step in range(100):
        estimator.observe(preemptions_total=0, now=step * 0.05)
    assert estimator.rate(now=5.0) == 0.0
    assert estimator.rate_per_running(now=5.0, num_running=8) == 0.0


def test_constant_rate_converges_within_five_percent_after_five_half_lives():
    # 10 preemptions/s observed every 100 ms: one preemption per observation.
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    for step in range(251):  # 25 s = 5 half-lives
        estimator.observe(preemptions_total=step, now=step * 0.1)
    assert estimator.rate(now=25.0) == pytest.approx(10.0, rel=0.05)


def test_constant_rate_is_recovered_exactly_at_steady_state_with_irregular_intervals():
    # 1000 preemptions/s (one per millisecond, so the counter is exact at every reading);
    # the engine steps at irregular intervals between 1 ms and 2 s.
    rng = random.Random(0)
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    now_ms = 0
    estimator.observe(preemptions_total=0, now=0.0)
    while now_ms < 100_000:  # 20 half-lives: the start-up transient is below 1e-6
        now_ms += rng.randint(1, 2000)
        estimator.observe(preemptions_total=now_ms, now=now_ms / 1000)
    assert estimator.rate(now_ms / 1000) == pytest.approx(1000.0, rel=1e-5)


def test_integer_counter_read_at_irregular_intervals_tracks_the_true_rate():
    true_rate = 4.0
    rng = random.Random(1)
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    now = 0.0
    estimator.observe(preemptions_total=0, now=now)
    while now < 60.0:
        now += rng.uniform(0.01, 0.5)
        estimator.observe(preemptions_total=math.floor(true_rate * now), now=now)
    assert estimator.rate(now) == pytest.approx(true_rate, rel=0.05)


def test_burst_at_one_instant_is_bounded_by_count_times_ln2_over_half_life():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=10.0)
    estimator.observe(preemptions_total=100, now=10.0)  # zero elapsed time
    bound = 100 * math.log(2) / HALF_LIFE_S  # 13.86 per second, not infinity
    assert estimator.rate(now=10.0) == pytest.approx(bound)
    assert math.isfinite(estimator.rate(now=10.0))


def test_burst_over_a_tiny_interval_stays_near_the_same_bound():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=10.0)
    estimator.observe(preemptions_total=100, now=10.0 + 1e-9)
    assert estimator.rate(now=10.0 + 1e-9) == pytest.approx(100 * math.log(2) / HALF_LIFE_S, rel=1e-6)


def test_burst_rate_halves_every_half_life_once_preemptions_stop():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=0.0)
    estimator.observe(preemptions_total=100, now=0.0)
    peak = estimator.rate(now=0.0)
    assert estimator.rate(now=5.0) == pytest.approx(peak / 2)
    assert estimator.rate(now=10.0) == pytest.approx(peak / 4)


def test_rate_falls_below_five_percent_of_peak_five_half_lives_after_preemptions_stop():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    for step in range(301):  # 30 s at 10 preemptions/s
        estimator.observe(preemptions_total=step, now=step * 0.1)
    peak = estimator.rate(now=30.0)
    for step in range(1, 251):  # 25 more seconds of steps with no preemption
        estimator.observe(preemptions_total=300, now=30.0 + step * 0.1)
    assert estimator.rate(now=55.0) == pytest.approx(peak / 32)
    assert estimator.rate(now=55.0) < 0.05 * peak


def test_rate_between_observations_decays_without_new_observations():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=0.0)
    estimator.observe(preemptions_total=10, now=1.0)
    at_observation = estimator.rate(now=1.0)
    assert estimator.rate(now=1.0 + HALF_LIFE_S) == pytest.approx(at_observation / 2)


def test_first_observation_only_sets_the_baseline():
    # An estimator created after the engine already preempted 500 times does not count
    # those 500 as happening now.
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=500, now=100.0)
    assert estimator.rate(now=100.0) == 0.0
    estimator.observe(preemptions_total=501, now=100.0)
    assert estimator.rate(now=100.0) == pytest.approx(math.log(2) / HALF_LIFE_S)


def test_counter_going_backwards_raises():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=7, now=0.0)
    with pytest.raises(ValueError, match="went backwards from 7 to 3"):
        estimator.observe(preemptions_total=3, now=1.0)


def test_observation_time_going_backwards_raises():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=5.0)
    with pytest.raises(ValueError, match="time went backwards"):
        estimator.observe(preemptions_total=1, now=4.0)


def test_reading_at_a_time_just_before_the_last_observation_returns_its_rate():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=0.0)
    estimator.observe(preemptions_total=10, now=1.0)
    assert estimator.rate(now=0.999) == estimator.rate(now=1.0)


def test_rate_per_running_divides_by_the_running_count():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=0.0)
    estimator.observe(preemptions_total=10, now=0.0)
    rate = estimator.rate(now=0.0)
    assert estimator.rate_per_running(now=0.0, num_running=4) == pytest.approx(rate / 4)


def test_rate_per_running_with_nothing_running_reports_the_full_rate():
    estimator = PreemptionRateEstimator(half_life_s=HALF_LIFE_S)
    estimator.observe(preemptions_total=0, now=0.0)
    estimator.observe(preemptions_total=10, now=0.0)
    assert estimator.rate_per_running(now=0.0, num_running=0) == estimator.rate(now=0.0)


def test_rate_per_running_rejects_a_negative_count():
    with pytest.raises(ValueError, match="num_running"):
        PreemptionRateEstimator().rate_per_running(now=0.0, num_running=-1)


@pytest.mark.parametrize("half_life_s", [0.0, -1.0])
def test_half_life_must_be_positive(half_life_s: float):
    with pytest.raises(ValueError, match="half_life_s"):
        PreemptionRateEstimator(half_life_s=half_life_s)


def test_shorter_half_life_reacts_faster_to_the_same_onset():
    fast = PreemptionRateEstimator(half_life_s=1.0)
    slow = PreemptionRateEstimator(half_life_s=10.0)
    for step in range(11):  # 1 s at 10 preemptions/s, starting from quiet
        fast.observe(preemptions_total=step, now=step * 0.1)
        slow.observe(preemptions_total=step, now=step * 0.1)
    assert fast.rate(now=1.0) == pytest.approx(10.0 * 0.5)  # one half-life: half the rate
    assert slow.rate(now=1.0) < fast.rate(now=1.0)
