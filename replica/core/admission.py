"""Admission by predicted growth: per live request, the KV blocks it will hold when it ends
(prompt plus max_tokens, or plus its expected output length), summed over live and over
running requests.

The committed KV a replica reports is the live sum minus the blocks they hold now, and minus
the cached prefix blocks waiting requests will share with running ones (found when they
joined the queue: those are never allocated again). Under the reserve modes a waiting
request is admitted only if it can run to its end beside the running requests, so the
replica stops taking work it cannot finish without preempting; the optimistic mode
(vLLM's) admits whatever fits today.

reserve_max_tokens (mini-SGLang's) reserves the sum of every running request's growth to
max_tokens. reserve_expected reserves the peak of the expected future instead: requests
grow one token per step until their expected length, and each frees the blocks it computed
itself when it ends, so a batch whose requests end at different times never needs all of
its growth at once (`peak_growth_tokens`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Literal, Optional

from replica.core.output_length import OutputLengthEstimator
from replica.core.request import Request

if TYPE_CHECKING:
    from replica.core.kv_cache_manager import KVCacheManager

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

    def final_blocks(self, request: Request) -> int:
        return self._blocks(self._final_tokens[request.request_id])

    # ---- a request's life ----------------------------------------------------------------
    def add(self, request: Request, shared_blocks: int) -> None:
        """A new waiting request; `shared_blocks`: cached blocks of its prefix other requests hold."""
        num_tokens = self._final_tokens[request.request_id] = self._estimate(request)
        self.live_final_blocks += self._blocks(num_tokens)
        self._wait(request, shared_blocks)

    def _wait(self, request: Request, shared_blocks: int) -> None:
        self._waiting_shared[request.request_id] = shared_blocks
        self.waiting_shared_blocks += shared_blocks

    def update_shared(self, request: Request, shared_blocks: int) -> None:
        """A waiting request's cached blocks held by running ones, as they stand now."""
        self.waiting_shared_blocks += shared_blocks - self._waiting_shared[request.request_id]
        self._waiting_shared[request.request_id] = shared_blocks

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
    def peak_reserve_blocks(self, running: Iterable[Request], waiting: Iterable[Request], kv_cache: "KVCacheManager",
                            candidate: Optional[Request] = None) -> int:
        """reserve_expected: blocks the running requests and the `waiting` ones (once
        admitted) will claim beyond what they hold now at the peak of their expected future:
        the rest of their prompts at once (less the cached blocks a waiting one shares),
        outputs as they grow (to the end of each one's last block), minus what the ones that
        end free (the blocks only they hold). A `candidate` counts like a waiting request
        except for its prompt, which the caller fits itself."""
        block_size = self.block_size
        pending_prefill, future = 0, []
        for request in running:
            held = kv_cache.num_held_blocks(request)
            pending_prefill += max(0, request.num_tokens - held * block_size)
            future.append((self._remaining(request), (kv_cache.num_private_blocks(request) - held) * block_size
                           + request.num_tokens))
        kept_tokens = 0  # blocks running requests hold that waiting ones will share: not freed when they end
        for request in waiting:
            shared_tokens = self._waiting_shared[request.request_id] * block_size
            kept_tokens += shared_tokens
            pending_prefill += max(0, request.num_tokens - shared_tokens)
            future.append((self._remaining(request), request.num_tokens - shared_tokens))
        if candidate is not None:
            shared_tokens = self._waiting_shared[candidate.request_id] * block_size
            kept_tokens += shared_tokens
            future.append((self._remaining(candidate), candidate.num_tokens - shared_tokens))
        peak = peak_growth_tokens(future, kept_tokens, partial_tokens=block_size - 1)
        return -(-(pending_prefill + peak) // block_size)

    def _remaining(self, request: Request) -> int:
        """Tokens it may still grow beyond the blocks its tokens fill now: to its expected
        length, to the end of that length's last block."""
        return (self._blocks(self._final_tokens[request.request_id]) - self._blocks(request.num_tokens)) * self.block_size

    def growth_blocks(self, held_blocks: int) -> int:
        """Blocks the live requests will still claim beyond the `held_blocks` they hold and,
        for waiting ones, beyond the cached blocks they will share."""
        return self.live_final_blocks - held_blocks - self.waiting_shared_blocks


def peak_growth_tokens(requests: Iterable[tuple[int, int]], kept_tokens: int = 0, partial_tokens: int = 0) -> int:
    """Given (remaining output tokens, tokens it frees when it ends) per request, the most
    their memory rises above today's if each grows one token per step and ends on time:
    max over t of t x (requests still running at t) - (freed by those ended before t).
    The maximum sits just before some request ends, so only those instants are checked.
    `kept_tokens` of what they would free stay held (shared by requests not counted here);
    each request still running may hold `partial_tokens` more (a block it has just opened)."""
    ordered = sorted(requests, reverse=True)  # longest remaining first
    freed_total = sum(freed for _, freed in ordered)
    peak = running = freed_by_running = 0
    for remaining, freed in ordered:
        running += 1
        freed_by_running += freed
        freed_before = max(0, freed_total - freed_by_running - kept_tokens)
        peak = max(peak, (remaining + partial_tokens) * running - partial_tokens - freed_before)
    return peak
