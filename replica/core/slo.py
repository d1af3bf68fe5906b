"""TTFT-SLO scheduling: the online TTFT predictor, slack and urgency, and the gate that
decides whether an urgent waiter may abort the forward pass of a running prefill. The
thread that applies the gate lives in replica/core/slo_monitor.py."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from replica.config import EngineConfig
from replica.core.request import Request
from replica.errors import InvalidRequestError


def ttft_deadline(arrival_time: float, ttft_slo_ms: Optional[float]) -> Optional[float]:
    """Absolute TTFT deadline on the engine clock, or None for a request without an SLO."""
    if ttft_slo_ms is None:
        return None
    if not ttft_slo_ms > 0:
        raise InvalidRequestError("ttft_slo_ms", f"must be > 0, got {ttft_slo_ms}")
    return arrival_time + ttft_slo_ms / 1000.0


@dataclass(frozen=True)
class PredictorCoefficients:
    """predicted_ttft = per_token_s * prompt_tokens + base_s (seconds)."""

    per_token_s: float
    base_s: float

    def predict(self, num_tokens: int) -> float:
        return self.per_token_s * num_tokens + self.base_s


class TTFTPredictor:
    """Least-squares line through the engine's latest measured prefills: tokens prefilled
    since admission against the time from admission to the first token.

    `coefficients` is replaced whole on each fit, so the monitor thread always reads a
    consistent pair without a lock.
    """

    def __init__(self, per_token_s: float, base_s: float, window: int):
        self.coefficients = PredictorCoefficients(per_token_s, base_s)
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "TTFTPredictor":
        return cls(config.slo_predictor_per_token_ms / 1000.0, config.slo_predictor_base_ms / 1000.0,
                   config.slo_predictor_window)

    def predict(self, num_tokens: int) -> float:
        return self.coefficients.predict(num_tokens)

    def observe(self, num_tokens: int, prefill_s: float) -> None:
        self.record(num_tokens, prefill_s)
        self.refit()

    def record(self, num_tokens: int, prefill_s: float) -> None:
        """A sample, without a refit: a step that gives many requests their first token (a
        prefill-heavy step, ~16) records them all and refits once, not once each."""
        self._samples.append((num_tokens, prefill_s))

    def refit(self) -> None:
        if len(self._samples) >= 2:
            self.coefficients = self._fit()

    def _fit(self) -> PredictorCoefficients:
        xs = [x for x, _ in self._samples]
        ys = [y for _, y in self._samples]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mean_x) ** 2 for x in xs)
        if sxx == 0:  # one prompt length seen so far: keep the slope, fit the intercept
            per_token = self.coefficients.per_token_s
        else:
            per_token = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
        base = mean_y - per_token * mean_x
        # Noise can tilt the line below zero at either end; a prefill never takes negative
        # time, so clamp the offending coefficient and refit the other one alone.
        if per_token < 0:
            per_token, base = 0.0, mean_y
        elif base < 0:
            sum_xx = sum(x * x for x in xs)
            per_token = sum(x * y for x, y in zip(xs, ys)) / sum_xx if sum_xx else 0.0
            base = 0.0
        return PredictorCoefficients(per_token, base)


@dataclass(frozen=True)
class SLOView:
    """What the gate knows of one request, copied from it so another thread can read it."""

    request_id: str
    ttft_deadline: Optional[float]
    num_tokens_to_compute: int  # until its first token
    preemptible: bool = True  # running prefills only: not SLO-preempted before (stubbornness)

    @classmethod
    def of(cls, request: Request, num_computed_tokens: Optional[int] = None) -> "SLOView":
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        return cls(request.request_id, request.ttft_deadline, request.num_tokens - computed,
                   request.num_slo_preemptions == 0)

    def slack(self, now: float, coefficients: PredictorCoefficients) -> float:
        return slack(self.ttft_deadline, now, coefficients.predict(self.num_tokens_to_compute))

    def urgency(self, now: float, coefficients: PredictorCoefficients) -> float:
        return urgency(self.ttft_deadline, now, coefficients.predict(self.num_tokens_to_compute))


def slack(deadline: Optional[float], now: float, predicted_ttft: float) -> float:
    """Time to spare if started now: (deadline - now) - predicted_ttft; +inf without a deadline."""
    if deadline is None:
        return math.inf
    return (deadline - now) - predicted_ttft


def urgency(deadline: Optional[float], now: float, predicted_ttft: float) -> float:
    """sign(slack) / |deadline - now|; larger is more urgent.

    Rescuable requests (slack > 0) are positive and rank by earliest deadline; doomed ones
    (slack < 0) are negative, so they sink below everyone; requests without a deadline
    (slack +inf, |deadline - now| +inf) sit at 0, between the two.
    """
    if deadline is None:
        return 0.0
    time_left = deadline - now
    request_slack = time_left - predicted_ttft
    if request_slack == 0:
        return 0.0
    if time_left == 0:
        return math.copysign(math.inf, request_slack)
    return math.copysign(1.0, request_slack) / abs(time_left)


def gate_allows(waiter_slack: float, waiter_urgency: float, running_slack: float, running_urgency: float,
                margin: float) -> bool:
    """May a waiter abort a running prefill? The four sign cases of the two slacks."""
    if waiter_slack <= 0:
        return False  # waiter doomed (whatever the running one's slack): aborting cannot save it
    if running_slack <= 0:
        return True  # running doomed, waiter rescuable: always yield
    return waiter_urgency > margin * running_urgency  # both rescuable: the margin rule


def choose_victim(waiters: Sequence[SLOView], prefills: Sequence[SLOView], now: float,
                  coefficients: PredictorCoefficients, margin: float, aggressive: bool = False) -> Optional[str]:
    """The request id of the running prefill to preempt for the most urgent waiter, or None.

    The waiter is compared with the most urgent running prefill (the least urgent one when
    `aggressive`): aborting the pass delays every request in it, not just the victim. The
    victim is the least urgent prefill that has not been SLO-preempted before.
    """
    victims = [view for view in prefills if view.preemptible]
    if not waiters or not victims:
        return None
    waiter = max(waiters, key=lambda view: view.urgency(now, coefficients))
    pick = min if aggressive else max
    reference = pick(prefills, key=lambda view: view.urgency(now, coefficients))
    if not gate_allows(waiter.slack(now, coefficients), waiter.urgency(now, coefficients),
                       reference.slack(now, coefficients), reference.urgency(now, coefficients), margin):
        return None
    return min(victims, key=lambda view: view.urgency(now, coefficients)).request_id


@dataclass(frozen=True)
class StepSnapshot:
    """One step's forward pass as the monitor sees it, published before the pass runs."""

    step_id: int
    prefills: tuple[SLOView, ...]  # the step's requests still before their first token
    waiters: tuple[SLOView, ...]  # the most urgent waiting requests before their first token


@dataclass(frozen=True)
class AbortOrder:
    """The monitor's verdict: abort step `step_id` and preempt `victim_request_id`. It names
    the step, never a bare flag, so a verdict that arrives late cannot hit a later step."""

    step_id: int
    victim_request_id: str
