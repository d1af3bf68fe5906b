"""Admission by predicted growth: per live request, the KV blocks it will hold when it ends
(prompt plus max_tokens, or plus its expected output length), summed over live and over
running requests.

The committed KV a replica reports is the live sum minus the blocks they hold now, and minus
the cached prefix blocks waiting requests will share with running ones (found when they
joined the queue: those are never allocated again). Under
the reserve modes a waiting request is admitted only if its own final blocks fit beside the
growth the running requests are still owed, so the replica stops taking work it cannot
finish without preempting; the optimistic mode (vLLM's) admits whatever fits today.
"""

from __future__ import annotations

from typing import Literal

from replica.output_length import OutputLengthEstimator
from replica.request import Request

AdmissionMode = Literal["optimistic", "reserve_max_tokens", "reserve_expected"]


class GrowthLedger:
    """Final-size estimates of live requests. Each estimate is at least the request's current
    length, so final minus held blocks (the growth still owed) is never negative."""

    def __init__(self, mode: AdmissionMode, block_size: int):
        self.mode = mode
        self.block_size = block_size
        self.reserves_growth = mode != "optimistic"
        # Only this mode's estimates move while a request runs (its output passes them).
        self.tracks_output = mode == "reserve_expected"
        self.output_lengths = OutputLengthEstimator()
        self._final_tokens: dict[str, int] = {}
        self.live_final_blocks = 0
        self.running_final_blocks = 0
        self._waiting_shared: dict[str, int] = {}  # per waiting request, cached blocks in use by others
        self.waiting_shared_blocks = 0

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _estimate(self, request: Request) -> int:
        max_tokens = request.sampling_params.max_tokens
        if self.tracks_output:
            return request.num_prompt_tokens + self.output_lengths.expected_final(request.num_output_tokens, max_tokens)
        # The optimistic mode reserves nothing, but reports (as committed KV) the growth to max_tokens.
        return request.num_prompt_tokens + max_tokens

    def final_tokens(self, request: Request) -> int:
        return self._final_tokens[request.request_id]

    # ---- a request's life ----------------------------------------------------------------
    def add(self, request: Request, shared_blocks: int) -> None:
        """A new waiting request; `shared_blocks`: cached blocks of its prefix other requests hold."""
        num_tokens = self._final_tokens[request.request_id] = self._estimate(request)
        self.live_final_blocks += self._blocks(num_tokens)
        self._wait(request, shared_blocks)

    def _wait(self, request: Request, shared_blocks: int) -> None:
        self._waiting_shared[request.request_id] = shared_blocks
        self.waiting_shared_blocks += shared_blocks

    def _stop_waiting(self, request: Request) -> None:
        self.waiting_shared_blocks -= self._waiting_shared.pop(request.request_id)

    def admitted(self, request: Request) -> None:
        self._stop_waiting(request)
        self.running_final_blocks += self._blocks(self._final_tokens[request.request_id])

    def left_running(self, request: Request, shared_blocks: int) -> None:
        """Preempted (or its pass aborted): it holds nothing and is owed nothing until re-admitted."""
        self.running_final_blocks -= self._blocks(self._final_tokens[request.request_id])
        self._wait(request, shared_blocks)

    def output_grew(self, request: Request) -> None:
        """Called with each new output token of a running request (reserve_expected only): one
        that outlives its estimate gets a new one, conditioned on the length it has reached."""
        old = self._final_tokens[request.request_id]
        if request.num_tokens <= old:
            return
        new = self._final_tokens[request.request_id] = self._estimate(request)
        delta = self._blocks(new) - self._blocks(old)
        self.live_final_blocks += delta
        self.running_final_blocks += delta

    def remove(self, request: Request, was_running: bool) -> None:
        blocks = self._blocks(self._final_tokens.pop(request.request_id))
        self.live_final_blocks -= blocks
        if was_running:
            self.running_final_blocks -= blocks
        else:
            self._stop_waiting(request)

    def expected_new_output(self, max_model_len: int) -> int:
        """The output length a new request is expected to reach (reserve_expected; else 0):
        the estimate for max_tokens as large as the context allows."""
        return self.output_lengths.expected_final(0, max_model_len) if self.tracks_output else 0

    def observe_finished(self, num_output_tokens: int, hit_max_tokens: bool) -> None:
        self.output_lengths.observe(num_output_tokens, hit_max_tokens)

    # ---- what it adds up to --------------------------------------------------------------
    def growth_blocks(self, held_blocks: int, running_only: bool = False) -> int:
        """Blocks the live (or only the running) requests will still claim beyond the
        `held_blocks` they hold (only running requests hold blocks) and, for waiting ones,
        beyond the cached blocks they will share."""
        if running_only:
            return self.running_final_blocks - held_blocks
        return self.live_final_blocks - held_blocks - self.waiting_shared_blocks
