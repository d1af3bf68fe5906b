"""The SLO monitor: a thread that re-evaluates the preemption gate every few milliseconds
while a forward pass runs, and posts an AbortOrder naming the step it wants aborted.

It shares no lock with the step loop: the engine publishes immutable snapshots by
assigning one attribute, and the layer hook reads `abort_order` the same way.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from replica.config import EngineConfig
from replica.core.slo import AbortOrder, SLOView, StepSnapshot, TTFTPredictor, choose_victim


class SLOMonitor:
    def __init__(self, config: EngineConfig, predictor: TTFTPredictor, clock: Callable[[], float] = time.monotonic):
        self.predictor = predictor
        self.clock = clock
        self.margin = config.slo_preemption_margin
        self.aggressive = config.slo_aggressive
        self.interval_s = config.slo_monitor_interval_ms / 1000.0
        self.abort_order: Optional[AbortOrder] = None
        # Written by the step thread only: the forward pass in flight, None between passes.
        self._step: Optional[StepSnapshot] = None
        # Written by the thread that accepts requests only: requests accepted but not yet
        # in the scheduler (AsyncEngine applies adds between steps), so an urgent arrival
        # is seen while the pass that keeps it waiting still runs.
        self._arrivals: tuple[SLOView, ...] = ()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def step_in_flight(self) -> Optional[StepSnapshot]:
        return self._step

    def publish_step(self, snapshot: Optional[StepSnapshot]) -> None:
        self._step = snapshot

    def publish_arrivals(self, arrivals: tuple[SLOView, ...]) -> None:
        self._arrivals = arrivals

    def check(self) -> Optional[AbortOrder]:
        """Evaluate the gate once against the pass in flight; post and return a new order."""
        step = self._step  # read once: the snapshot cannot change under this evaluation
        if step is None:
            return None
        order = self.abort_order
        if order is not None and order.step_id == step.step_id:
            return None  # already decided for this pass
        victim = choose_victim(step.waiters + self._arrivals, step.prefills, self.clock(),
                               self.predictor.coefficients, self.margin, self.aggressive)
        if victim is None:
            return None
        self.abort_order = AbortOrder(step.step_id, victim)
        return self.abort_order

    # ---- the thread --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slo-monitor", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.check()
