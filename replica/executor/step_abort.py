"""The one question the model runner asks at a layer boundary: abort this step now?

The engine gives the runner a StepAbort (the SLO policy's lives in replica/core/slo_monitor.py;
a tensor-parallel replica wraps it in an all-reduce vote, replica/parallel/vote.py). The runner
asks `begin` once per step whether the step may be aborted at all (a step that may not runs
without layer checks, so a decode step can replay a CUDA graph), `abort_now` before each
decoder layer of a step that may, and `end` when the step's forward pass is over or abandoned.
A yes unwinds the pass with StepAborted; the engine then rolls the step back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

if TYPE_CHECKING:
    from replica.core.scheduler import SchedulerOutput


class StepAborted(Exception):
    """A forward pass abandoned between decoder layers, before layer `num_layers_done` ran."""

    def __init__(self, victim_request_id: Optional[str], num_layers_done: int):
        super().__init__(victim_request_id, num_layers_done)
        # None on a tensor-parallel worker rank: only rank 0, beside the scheduler, knows the victim.
        self.victim_request_id = victim_request_id
        self.num_layers_done = num_layers_done


class StepAbort(Protocol):
    def begin(self, scheduler_output: "SchedulerOutput") -> bool:
        """A step's forward pass starts: may it be aborted?"""

    def abort_now(self, step_id: int, layer_index: int) -> Optional[str]:
        """Before decoder layer `layer_index` of step `step_id`: the request to preempt if the
        pass must stop here, else None."""

    def end(self) -> None:
        """The pass that `begin` announced is over (run through or abandoned)."""
