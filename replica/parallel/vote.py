"""The SLO abort as a collective: at each layer boundary of a step that may be aborted, every
rank casts a local vote, (does the monitor's order name this step?, is this rank past its
stubbornness limit?), and one all_reduce(MAX) of the pair gives every rank the same answer:
abort when some rank saw the order and no rank is past its limit (a stubborn rank vetoes for
all). So all ranks unwind at the same layer or none does. No rank may skip the vote: a rank that raised
before the all-reduce would leave the others waiting in it. Steps that cannot be abort
targets (no prefill: StepAbort.begin says no) run without votes.

The vote runs on the host, over the group's gloo control group (TensorParallel.all_reduce_on_host),
even where the model's collectives are NCCL: a vote on the device had to read its answer
back, which waited for every layer launched so far, at every layer. A dead or hung peer fails
the vote (TensorParallelDead) within the collective timeout.

Rank 0 reads the order from the SLO monitor thread beside it (through SLOAbort); the worker ranks
read the ordered step id from a board in shared memory the monitor writes (SLOMonitor.order_board).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from replica.core.slo_monitor import SLOAbort
from replica.parallel.group import TensorParallel

# What a worker rank's vote answers for a step that aborts: only rank 0 knows the victim.
UNKNOWN_VICTIM = ""


class _Ballot:
    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self.box = torch.zeros(2, dtype=torch.int32)  # [ordered, stubborn], on the host
        self.num_votes = 0  # collectives cast, for benchmarks and tests

    def cast(self, ordered: bool, stubborn: bool) -> bool:
        """Every rank's answer: some rank saw the order and none is stubborn."""
        box = self.box
        box[0], box[1] = int(ordered), int(stubborn)
        self.tp.all_reduce_on_host(box, op=dist.ReduceOp.MAX)
        self.num_votes += 1
        any_ordered, any_stubborn = box.tolist()
        return bool(any_ordered and not any_stubborn)


class TensorParallelVote:
    """Rank 0's StepAbort: the engine's own (`inner`) decides the local vote and names the victim."""

    def __init__(self, inner: SLOAbort, tp: TensorParallel):
        self.inner = inner
        self.ballot = _Ballot(tp)

    @property
    def max_abort_layer(self) -> int:
        """The stubbornness limit (the runner paces no layer past it): every rank's is the same."""
        return self.inner.max_abort_layer

    def begin(self, scheduler_output) -> bool:
        return self.inner.begin(scheduler_output)

    def abort_now(self, step_id: int, layer_index: int) -> Optional[str]:
        victim_request_id = self.inner.ordered_victim(step_id)
        if not self.ballot.cast(victim_request_id is not None, self.inner.stubborn(layer_index)):
            return None
        if victim_request_id is None:  # another rank read the order first: it names this step, re-read it
            victim_request_id = self.inner.ordered_victim(step_id)
        return UNKNOWN_VICTIM if victim_request_id is None else victim_request_id

    def end(self) -> None:
        self.inner.end()


class WorkerVote:
    """A worker rank's StepAbort: its local vote reads the board rank 0's monitor writes."""

    def __init__(self, tp: TensorParallel, board, max_abort_layer: int):
        self.ballot = _Ballot(tp)
        self.board = board  # .value: the step id the latest order names, -1 for none
        self.max_abort_layer = max_abort_layer
        self.aborts: list[tuple[int, int]] = []  # (step id, layer) of each step this rank unwound

    def begin(self, scheduler_output) -> bool:  # workers run _forward directly; never asked
        raise NotImplementedError

    def abort_now(self, step_id: int, layer_index: int) -> Optional[str]:
        if not self.ballot.cast(self.board.value == step_id, layer_index > self.max_abort_layer):
            return None
        self.aborts.append((step_id, layer_index))
        return UNKNOWN_VICTIM

    def end(self) -> None:
        pass
