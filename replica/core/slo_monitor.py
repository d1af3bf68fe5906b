"""The SLO monitor: a thread that re-evaluates the preemption gate every few milliseconds
while a forward pass runs, and posts an AbortOrder naming the step it wants aborted; and
SLOAbort, the StepAbort (replica/executor/step_abort.py) through which the model runner
asks, at each layer boundary, whether that order names the step in flight.

It shares no lock with the step loop: SLOAbort publishes immutable snapshots by assigning
one attribute, and reads `abort_order` the same way.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from replica.config import EngineConfig
from replica.core.slo import AbortOrder, SLOView, StepSnapshot, TTFTPredictor, choose_victim

if TYPE_CHECKING:
    from replica.core.scheduler import Scheduler, SchedulerOutput


class SLOMonitor:
    def __init__(self, config: EngineConfig, predictor: TTFTPredictor, clock: Callable[[], float] = time.monotonic):
        self.predictor = predictor
        self.clock = clock
        self.margin = config.slo_preemption_margin
        self.aggressive = config.slo_aggressive
        self.interval_s = config.slo_monitor_interval_ms / 1000.0
        self._abort_order: Optional[AbortOrder] = None
        # Where other processes read the ordered step id (tensor-parallel worker ranks vote
        # on it): anything with a `value` attribute, e.g. a shared multiprocessing RawValue.
        self.order_board = None
        # Written by the step thread only: the forward pass in flight, None between passes.
        self._step: Optional[StepSnapshot] = None
        # Written by the thread that accepts requests only: requests accepted but not yet
        # in the scheduler (AsyncEngine applies adds between steps), so an urgent arrival
        # is seen while the pass that keeps it waiting still runs.
        self._arrivals: tuple[SLOView, ...] = ()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def abort_order(self) -> Optional[AbortOrder]:
        return self._abort_order

    @abort_order.setter
    def abort_order(self, order: Optional[AbortOrder]) -> None:
        self._abort_order = order
        if self.order_board is not None:
            self.order_board.value = -1 if order is None else order.step_id

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


class SLOAbort:
    """The SLO policy's answer to "abort now?": yes when the monitor's order names the step in
    flight and the pass has not run past its stubbornness limit (max_abort_layer layers).
    Only steps with prefills can be targets; the monitor sees each such step while it runs."""

    def __init__(self, monitor: SLOMonitor, scheduler: "Scheduler", max_abort_layer: int):
        self.monitor = monitor
        self.scheduler = scheduler
        self.max_abort_layer = max_abort_layer

    def begin(self, scheduler_output: "SchedulerOutput") -> bool:
        snapshot = self.scheduler.slo_snapshot(scheduler_output)
        self.monitor.publish_step(snapshot)
        return bool(snapshot.prefills)

    def abort_now(self, step_id: int, layer_index: int) -> Optional[str]:
        victim_request_id = self.ordered_victim(step_id)
        return None if victim_request_id is None or self.stubborn(layer_index) else victim_request_id

    def ordered_victim(self, step_id: int) -> Optional[str]:
        """The victim the monitor's order names if it names this step, else None."""
        order = self.monitor.abort_order  # one read of an immutable order; no lock
        return order.victim_request_id if order is not None and order.step_id == step_id else None

    def stubborn(self, layer_index: int) -> bool:
        """Past the stubbornness limit: the pass has run too many layers to give up now."""
        return layer_index > self.max_abort_layer

    def end(self) -> None:
        self.monitor.publish_step(None)
