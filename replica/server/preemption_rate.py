"""Smoothed preemptions-per-second from the engine's monotonically increasing counter.

The router reads this rate (through ReplicaLoad) to steer traffic away from replicas that
are thrashing; it must rise with sustained preemption, stay bounded on a burst, and fade
to zero once preemptions stop.
"""

from __future__ import annotations

import math


class PreemptionRateEstimator:
    """Exponentially decaying average of the preemption rate, in preemptions per second.

    Each observation adds the preemptions since the previous one, spread evenly over the
    elapsed interval and weighted by exp(-ln2 * age / half_life_s). That weighting is
    exact for any spacing of observations, so a constant rate is recovered exactly at
    steady state however irregularly the engine steps, and a burst of n preemptions
    observed at a single instant raises the rate by at most n * ln2 / half_life_s.
    O(1) time and memory; not thread-safe (one engine loop writes it).
    """

    def __init__(self, half_life_s: float = 5.0):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self._decay_per_s = math.log(2) / half_life_s
        self._rate_at_last_observation = 0.0
        self._last_total: int | None = None
        self._last_time = 0.0

    def observe(self, preemptions_total: int, now: float) -> None:
        """Records the engine's preemption counter as read at time `now` (seconds).

        The first observation only sets the baseline: preemptions counted before it
        happened over an unknown interval and do not enter the rate. Use a monotonic
        clock; `now` must not go backwards and the counter must not decrease (an engine
        restart gets a new estimator).
        """
        if self._last_total is None:
            self._last_total = preemptions_total
            self._last_time = now
            return
        if preemptions_total < self._last_total:
            raise ValueError(
                f"preemptions_total went backwards from {self._last_total} to {preemptions_total}; "
                "the counter must be monotonic (create a new estimator after an engine restart)"
            )
        elapsed_s = now - self._last_time
        if elapsed_s < 0:
            raise ValueError(f"observation time went backwards from {self._last_time} to {now}")
        new_preemptions = preemptions_total - self._last_total
        decay = math.exp(-self._decay_per_s * elapsed_s)
        self._rate_at_last_observation = (
            self._rate_at_last_observation * decay + new_preemptions * self._weight_per_event(elapsed_s)
        )
        self._last_total = preemptions_total
        self._last_time = now

    def rate(self, now: float) -> float:
        """Smoothed preemptions per second at `now`, decayed since the last observation.

        A `now` slightly before the last observation (a reader that took its timestamp
        before the engine's latest observe) reads the rate at that observation.
        """
        elapsed_s = max(0.0, now - self._last_time)
        return self._rate_at_last_observation * math.exp(-self._decay_per_s * elapsed_s)

    def rate_per_running(self, now: float, num_running: int) -> float:
        """Preemptions per second per running request: each one's risk of being preempted.

        Divides by at least 1, so a replica that preempted everything it ran still reports
        its full rate rather than looking idle.
        """
        if num_running < 0:
            raise ValueError(f"num_running must be >= 0, got {num_running}")
        return self.rate(now) / max(num_running, 1)

    def _weight_per_event(self, elapsed_s: float) -> float:
        # Events spread evenly over the last elapsed_s seconds, integrated against the
        # exponential kernel: (1 - exp(-k * dt)) / dt. Its limit as dt -> 0 is k, which is
        # what bounds an instantaneous burst; expm1 keeps it accurate for tiny dt.
        if elapsed_s == 0:
            return self._decay_per_s
        return -math.expm1(-self._decay_per_s * elapsed_s) / elapsed_s
