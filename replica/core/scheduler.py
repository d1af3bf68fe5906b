"""The continuous-batching scheduler: one token budget per step, shared by running
requests first and waiting ones next.

There is no prefill phase and no decode phase. Each request's `num_computed_tokens` chases
its `num_tokens`; a step gives each request a slice of the budget, so long prompts are
prefilled in chunks that ride along with decodes. When blocks run out, a victim is
preempted: its KV is either dropped and later recomputed (its output tokens are kept) or,
with a host KV tier, swapped to host memory and copied back when it resumes, whichever the
preemption mode picks for it (replica/core/preemption_mode.py). Under the "slo"
policy a step's forward pass may also be aborted (`abort_step`) to let an urgent request in.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from replica.core.admission import GrowthLedger
from replica.config import EngineConfig
from replica.core.kv_cache_manager import KVCacheManager, cdiv
from replica.core.host_pool import BlockCopies
from replica.core.load import SchedulerLoad
from replica.core.preemption_mode import SWAP, PreemptionPlanner
from replica.core.victim_policy import VICTIM_POLICIES
from replica.core.request import Request, RequestStatus, validate_request
from replica.errors import InvalidRequestError, QueueFullError
from replica.core.request_queue import make_waiting_queue
from replica.core.slo import SLOView, StepSnapshot, TTFTPredictor, ttft_deadline, urgency

# Waiters an SLO snapshot carries, most urgent first: the gate needs only the most urgent
# rescuable one, and a few more cover those that turn doomed while the pass runs.
SLO_SNAPSHOT_WAITERS = 8


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start_pos: int  # num_computed_tokens before this step
    # Blocks the request gained this step; on admission (`is_new`), its whole block table.
    new_block_ids: list[int]
    is_new: bool
    samples: bool = False  # its computed tokens catch up with its length this step

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start_pos : self.start_pos + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_req_ids: list[str]
    # Requests that finished or were aborted since the previous step: runners drop their state.
    finished_req_ids: list[str]
    # Copies between the device and host KV tiers to run before this step's forward pass.
    block_copies: Optional[BlockCopies] = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class TokenUpdate:
    """One sampled token appended to a request, and the status it ended in if it finished."""

    request: Request
    token_id: int
    finished: Optional[RequestStatus]


@dataclass
class SchedulerCounters:
    preemptions: int = 0  # of either mode
    swap_preemptions: int = 0  # of those, the victims swapped to the host tier
    recomputed_tokens: int = 0  # computed tokens thrown away by preemption and computed again
    # Computed tokens a preemption kept by swapping, which recompute would have computed again.
    recompute_tokens_avoided: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    scheduled_tokens: int = 0
    slo_preemptions: int = 0  # forward passes aborted to let an urgent request in, one victim each
    slo_discarded_layers: int = 0  # decoder layers those aborted passes had already run
    # Requests the admission mode's growth reserve held back while memory for their prompt
    # was free (each counted once per wait at the head of the queue).
    admissions_held: int = 0
    # Of those, admitted with part of the reserve waived because they had waited (admission_max_hold_ms).
    admissions_relaxed: int = 0


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if config.max_model_len is None:
            raise ValueError("Scheduler: config.max_model_len is unset; resolve it for the model first "
                             "(replica.config.resolve_max_model_len)")
        self.config = config
        self.clock = clock
        if config.host_kv_bytes is not None and not config.num_host_kv_blocks:
            raise ValueError("Scheduler: config.host_kv_bytes is not in blocks yet; the engine turns it into "
                             "num_host_kv_blocks for the model")
        self.kv_cache = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                       num_host_blocks=config.num_host_kv_blocks,
                                       protected_share=config.prefix_cache_protected_share)
        # Per victim: recompute or swap (the engine sets the costs it measured at start).
        self.preemption = PreemptionPlanner(config.preemption_mode, self.kv_cache)
        self.kv_block_bytes = 0  # of one block across layers, for the swap byte counts (the engine knows it)
        # A swapped-out request at the head of the queue whose blocks fit is prefetched: its
        # copy-in runs beside this step's forward pass and it resumes the next step. Where the
        # copies cannot overlap a forward pass (the CPU) the engine turns this off.
        self.prefetch_swap_ins = True
        self.ttft_predictor = TTFTPredictor.from_config(config)
        self.waiting = make_waiting_queue(config.scheduling_policy, self._urgency, clock,
                                          config.slo_doomed_max_wait_ms, config.slo_doomed_share)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live request
        self.select_victim = VICTIM_POLICIES[config.resolved_victim_policy]
        self.counters = SchedulerCounters()
        # Tokens the waiting requests must compute: their length less the prefix-cache hit
        # each had when it joined the queue (`_waiting_hit_tokens`).
        self.waiting_prefill_tokens = 0
        self._waiting_hit_tokens: dict[str, int] = {}
        # The blocks each live request will hold when it ends; minus the blocks they hold
        # now, the committed KV growth load() reports and the reserve modes admit against.
        self.growth = GrowthLedger(config.admission_mode, config.block_size)
        self._held_request_id: Optional[str] = None  # the head of the queue the reserve holds back
        self._finished_req_ids: list[str] = []
        # A hold runs from the later of these and the request's arrival (see _reserve_share).
        self._last_preemption_time = -math.inf
        self._last_reserve_met_time = -math.inf
        # The time between admission checks while requests run (a smoothed step time): a
        # request's last chance to start by its latest start is the check before it.
        self._last_admission_check_time: Optional[float] = None
        # The latest admission pass stopped at a head that did not fit: (its id, free blocks,
        # running requests) then; None when it did not (may_schedule_prefill).
        self._admission_blocked: Optional[tuple[str, int, int]] = None
        self._admission_interval_s = 0.0
        self._slo_preempted_req_ids: list[str] = []  # victims of an aborted step, for the next output
        self._step_id = 0
        self._num_constrained = 0  # live requests with a structured-output grammar (their masks are budgeted)

    # ---- requests in and out -------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """What the scheduler must hold true of every request it takes, whoever validated it (the
        edge did: replica.core.request.validate_request): an id no live request has (the queues
        and the KV cache are keyed by it) and a length the block tables can hold (a prompt of at
        least one token, plus max_tokens, within max_model_len). A cheap guard, not the field
        checks; where it fails (an edge judged by another replica's max_model_len) it raises the
        error the edge would have. Nothing in the engine changes."""
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        num_prompt_tokens, max_model_len = len(request.prompt_token_ids), self.config.max_model_len
        if (not 0 < num_prompt_tokens < max_model_len
                or num_prompt_tokens + request.sampling_params.max_tokens > max_model_len):
            # Raises: its first checks are these, naming the prompt or max_tokens.
            validate_request(request.prompt_token_ids, request.sampling_params, max_model_len=max_model_len)

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        request.status = RequestStatus.WAITING
        if request.ttft_deadline is None:
            request.ttft_deadline = ttft_deadline(request.arrival_time, self.config.default_ttft_slo_ms)
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self._num_constrained += 1
        request.waiting_since = request.arrival_time
        self.waiting.add(request)
        self.growth.add(request, self._count_waiting(request))
        self.counters.prompt_tokens += request.num_prompt_tokens

    def abort_request(self, request_id: str) -> Optional[Request]:
        """Finish a live request as aborted and free its blocks at once. Unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
            self._uncount_waiting(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.growth.remove(request, was_running=request.status == RequestStatus.RUNNING)
        if status != RequestStatus.FINISHED_ABORTED:  # an abort says nothing about length
            self.growth.observe_finished(request.num_output_tokens, status == RequestStatus.FINISHED_LENGTH)
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        if request.grammar is not None:
            self._num_constrained -= 1
        self._finished_req_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _count_waiting(self, request: Request) -> int:
        """Add a request joining the waiting queue to the prefill backlog, net of the prefix
        it finds cached now; returns how many of those cached blocks other requests hold
        (memory it will share rather than claim)."""
        hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
        num_hit_tokens += len(self.kv_cache.get_host_hits(request, len(hit_blocks))) * self.kv_cache.block_size
        num_hit_tokens = max(num_hit_tokens, self.kv_cache.num_swapped_tokens(request))
        self._waiting_hit_tokens[request.request_id] = num_hit_tokens
        self.waiting_prefill_tokens += request.num_tokens - num_hit_tokens
        return sum(1 for block in hit_blocks if block.ref_cnt > 0)

    def _uncount_waiting(self, request: Request) -> None:
        self.waiting_prefill_tokens -= request.num_tokens - self._waiting_hit_tokens.pop(request.request_id)

    def _admission_reserve_blocks(self) -> int:
        # The watermark is a reserve only admissions must leave free, and only while
        # something runs: running requests can then grow into it before anyone has to be
        # preempted, while an idle engine can still admit a request that needs it all.
        return self.config.watermark_blocks if self.running else 0

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        config = self.config
        kv_cache = self.kv_cache
        running = self.running
        token_budget = config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        # A request with at most this many tokens left runs them all if the budget allows
        # (no _step_tokens call: the loop below runs once per running request every step,
        # so it reads the token lists' lengths rather than the properties, too).
        threshold = config.long_prefill_token_threshold
        whole_limit = threshold if threshold > 0 else math.inf
        # Structured outputs: the running constrained requests whose masks this step builds
        # (None: all of them), and the mask time left for admissions.
        masked, mask_room = self._mask_turns(whole_limit) if self._num_constrained else (None, math.inf)

        # 1. Running requests, in admission order.
        index = 0
        waits_for_finishing = False
        while index < len(running) and token_budget > 0:
            request = running[index]
            num_pending = request.num_pending_tokens
            if num_pending and (len(request.output_token_ids) + num_pending >= request.sampling_params.max_tokens):
                index += 1  # the token still being sampled is its last: nothing left to run
                continue
            num_remaining = len(request.all_token_ids) + num_pending - request.num_computed_tokens
            if num_remaining <= token_budget and num_remaining <= whole_limit:
                num_new_tokens = num_remaining
            else:
                num_new_tokens = self._step_tokens(num_remaining, token_budget)
                if num_new_tokens is None:
                    index += 1  # it runs whole or not at all; a later, smaller one may fit
                    continue
            if (masked is not None and num_new_tokens == num_remaining and request.grammar is not None
                    and id(request) not in masked):
                index += 1  # it would sample: its mask waits for a step with room for it
                continue

            # Preempt until the allocation succeeds. Two exits: blocks were found, or the
            # request itself was the victim (nothing left to take from), which ends the
            # running pass for this step.
            while True:
                new_blocks = kv_cache.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                if kv_cache.cancel_prefetches(most=1):  # a running request's memory before a prefetch's (the latest's)
                    continue
                # Not a request whose token in flight is its last (async scheduling): its
                # blocks come back at the next update, and preempting it un-finished it, its
                # whole prompt to recompute for one token already sampled.
                eligible = [i for i, other in enumerate(running) if not _last_token_in_flight(other)]
                victim_index = eligible[self.select_victim([running[i] for i in eligible], self.preemption.cost)]
                victim = running[victim_index]
                if victim is request and len(eligible) < len(running):
                    waits_for_finishing = True  # theirs first: nothing preempted, nothing admitted
                    break
                undone = next((entry for entry in scheduled if entry.request is victim), None)
                if undone is not None:  # the victim already had its slice of this step
                    scheduled.remove(undone)
                    token_budget += undone.num_new_tokens
                    # Its slice registered full blocks in the prefix cache that will never be written.
                    kv_cache.forget_unwritten_blocks([victim])
                self._preempt(victim_index)
                preempted.append(victim)
                if victim is request:
                    break
                if victim_index < index:
                    index -= 1
            if new_blocks is None:
                break

            scheduled.append(ScheduledRequest(
                request, num_new_tokens, request.num_computed_tokens,
                [b.block_id for b in new_blocks] if new_blocks else [], False,
            ))
            token_budget -= num_new_tokens
            index += 1

        # 2. Waiting requests, unless this step had to preempt (admitting now would only take
        # back the memory the preemption just freed) or waits for finishing requests' memory.
        self._admission_blocked = None
        if not preempted and not waits_for_finishing:
            self.waiting.reorder()
            token_budget = self._admit_waiting(token_budget, scheduled, mask_room)
        # A prefetch lives one step: one whose request did not resume now gives its device blocks back.
        if kv_cache.prefetched:
            kv_cache.cancel_prefetches(made_before_step=self._step_id + 1)

        step_id = self._step_id + 1
        for entry in scheduled:
            request = entry.request
            num_computed = request.num_computed_tokens = request.num_computed_tokens + entry.num_new_tokens
            if num_computed >= len(request.all_token_ids) + request.num_pending_tokens:
                entry.samples = True
                request.num_pending_tokens += 1  # until update() appends it
                if request.grammar is not None:
                    request.grammar.masked_at_step = step_id  # _mask_turns: when its mask was last built

        self._step_id += 1
        num_scheduled_tokens = config.max_num_batched_tokens - token_budget
        self.counters.scheduled_tokens += num_scheduled_tokens
        finished_ids, self._finished_req_ids = self._finished_req_ids, []
        slo_preempted_ids, self._slo_preempted_req_ids = self._slo_preempted_req_ids, []
        return SchedulerOutput(
            step_id=self._step_id,
            scheduled=scheduled,
            num_scheduled_tokens=num_scheduled_tokens,
            preempted_req_ids=slo_preempted_ids + [r.request_id for r in preempted],
            finished_req_ids=finished_ids,
            block_copies=kv_cache.take_block_copies(),
        )

    def _mask_turns(self, whole_limit: float) -> tuple[Optional[set[int]], float]:
        """The running constrained requests that may sample this step (their `id`s), so that
        their masks' predicted time (each request's grammar's `mask_s`, its latest) stays within
        structured_output_step_mask_ms: the requests whose masks were built longest ago first,
        at least one, then any that still fit. None when they all fit. A step builds its
        constrained rows' masks before it samples, so the sum of many masks each within
        structured_output_max_mask_ms held every request of the batch back (63 parallel samples
        at ~9 ms a mask: 1.2 s steps). A request that waits keeps its tokens and its KV, as one
        past the token budget does. Also the mask time left for admissions."""
        budget = self.config.structured_output_step_mask_ms / 1e3
        # Those that would sample if scheduled (a chunk of a long prompt builds no mask).
        limit = min(whole_limit, self.config.max_num_batched_tokens)
        candidates = [request for request in self.running if request.grammar is not None
                      and len(request.all_token_ids) + request.num_pending_tokens - request.num_computed_tokens <= limit
                      and not _last_token_in_flight(request)]
        predicted = sum(request.grammar.mask_s for request in candidates)
        if predicted <= budget:
            return None, budget - predicted
        candidates.sort(key=lambda request: request.grammar.masked_at_step)  # stable: then in admission order
        masked, spent = set(), 0.0
        for request in candidates:
            if not masked or spent + request.grammar.mask_s <= budget:
                masked.add(id(request))
                spent += request.grammar.mask_s
        return masked, budget - spent

    def _step_tokens(self, num_remaining: int, token_budget: int) -> Optional[int]:
        """Tokens a request with `num_remaining` uncomputed tokens runs this step: at most the
        long-prefill threshold and the budget left. None when it does not fit the budget and
        chunked prefill is off (a prompt then runs whole or not at all)."""
        threshold = self.config.long_prefill_token_threshold
        num_tokens = threshold if 0 < threshold < num_remaining else num_remaining
        if num_tokens <= token_budget:
            return num_tokens
        return token_budget if self.config.enable_chunked_prefill else None

    def _admit_waiting(self, token_budget: int, scheduled: list[ScheduledRequest], mask_room: float) -> int:
        """Admit waiting requests into this step within `token_budget`; returns what is left.
        mask_room: the predicted mask time this step may still take (_mask_turns)."""
        config = self.config
        mask_budget = config.structured_output_step_mask_ms / 1e3
        kv_cache = self.kv_cache
        growth = self.growth
        now = self.clock()
        if self.running and self._last_admission_check_time is not None:  # stepping: not an idle gap
            interval = now - self._last_admission_check_time
            self._admission_interval_s = (interval if not self._admission_interval_s
                                          else 0.8 * self._admission_interval_s + 0.2 * interval)
        self._last_admission_check_time = now
        # Requests prefetched this step: off the queue while the swapped requests behind them are
        # prefetched too, then back at its front, in order, to resume first next step.
        prefetching: list[Request] = []
        while self.waiting and token_budget > 0 and len(self.running) + len(prefetching) < config.max_num_seqs:
            request = self.waiting.peek()
            # A swapped-out request starts where it stopped: its host blocks are copied back
            # (or were, beside the step before: prefetched into the device blocks it holds).
            num_restored = kv_cache.num_swapped_tokens(request)
            prefetched = kv_cache.prefetched.get(request.request_id)
            if prefetched is not None:
                hit_blocks, num_hit_tokens, host_hits, num_start = [], prefetched.num_hit_tokens, [], prefetched.num_start
            else:
                hit_blocks, num_hit_tokens = kv_cache.get_computed_blocks(request)
                # Past its device hit, the prefix blocks spilled to the host tier are copied back too.
                host_hits = kv_cache.get_host_hits(request, len(hit_blocks)) if not num_restored else []
                num_start = max(num_hit_tokens + len(host_hits) * kv_cache.block_size, num_restored)
            num_new_tokens = self._step_tokens(request.num_tokens - num_start, token_budget)
            if num_new_tokens is None:
                break  # it waits whole, and nothing behind it skips ahead
            if request.grammar is not None and num_new_tokens == request.num_tokens - num_start:
                if request.grammar.mask_s > mask_room and mask_room < mask_budget and num_new_tokens > 1:
                    # No room for its first mask beside the others': its prompt's last token (and
                    # that mask) next step, as a running request's turn; nothing behind it waits.
                    num_new_tokens -= 1
                else:
                    mask_room -= request.grammar.mask_s
            watermark_blocks = self._admission_reserve_blocks()
            optimistic_fit = request.num_tokens if config.reserve_full_sequence else None
            growth_blocks = own_growth = 0
            if growth.tracks_output:
                # Its prompt must fit now, and the peak of everyone's expected growth beside it
                # (with the blocks it is about to share counted as held by their owners too).
                growth.update_shared(request, sum(1 for block in hit_blocks if block.ref_cnt > 0))
                # Its own prompt is fitted by allocate_slots below, net of its prefix-cache hit.
                growth_blocks = growth.peak_reserve_blocks(self._holders(request), (), kv_cache, candidate=request)
            elif growth.reserves_growth:
                # Its whole final size must fit beside all that the requests holding blocks are still owed.
                growth_blocks = self._owed_growth_blocks(request)
                own_growth = growth.final_tokens(request) - request.num_tokens

            def room(share: float) -> dict[str, Any]:
                """What must stay free beside it: this share of the growth reserve (none: the
                optimistic check)."""
                return dict(reserved_blocks=watermark_blocks + int(growth_blocks * share),
                            num_tokens_to_fit=request.num_tokens + int(own_growth * share)
                            if growth.reserves_growth and share > 0 else optimistic_fit)

            def allocate(share: float) -> Optional[list]:
                return kv_cache.allocate_slots(request, num_new_tokens, hit_blocks, num_start, **room(share))

            if (num_restored and prefetched is None and scheduled and self.prefetch_swap_ins
                    and kv_cache.num_swap_in_copies(request, len(hit_blocks))
                    and kv_cache.can_allocate(request, num_new_tokens, hit_blocks, num_start, **room(1.0))):
                # It fits now and this step has a forward pass to overlap: its copy-in runs
                # beside it and it resumes next step, first in line (nothing overtakes it).
                kv_cache.allocate_slots(request, 0, hit_blocks, num_start)
                kv_cache.prefetch_swap_in(request, len(hit_blocks), num_start, num_hit_tokens, self._step_id + 1)
                self.waiting.remove(request)  # not pop(): no admission (the SLO queue's credit counts them)
                prefetching.append(request)
                continue  # the swapped requests behind it may be prefetched too
            if prefetching:
                # After a prefetch, nothing but prefetches: an admission now could hit a block a
                # prefetch writes beside this step (its prefix hash is registered) and read it
                # unwritten, and its reserve would not count the prefetched requests' growth.
                break
            if host_hits:  # no spill of this very allocation may reuse them
                kv_cache.hold_host_hits(host_hits)
            new_blocks = allocate(1.0)
            if growth.reserves_growth and new_blocks is not None:
                self._last_reserve_met_time = now
            elif growth.reserves_growth:
                share = self._reserve_share(request, now)
                if share < 1.0:
                    # Held a while: it needs only part of the growth reserve (none once the hold is over).
                    new_blocks = allocate(share)
                    if new_blocks is not None:
                        self.counters.admissions_relaxed += 1
            if new_blocks is None:
                if host_hits:
                    kv_cache.release_host_hits(host_hits)
                if growth.reserves_growth:
                    self._count_held_admission(request, num_new_tokens, hit_blocks, num_start)
                self._admission_blocked = (request.request_id, kv_cache.num_free_blocks, len(self.running))
                break  # head-of-line: later requests do not overtake

            self.waiting.pop()
            self._uncount_waiting(request)
            if host_hits:
                kv_cache.copy_in_host_hits(request, len(hit_blocks), host_hits)
                num_hit_tokens += len(host_hits) * kv_cache.block_size
            kv_cache.record_prefix_cache_lookup(request.num_tokens, num_hit_tokens)
            if num_restored:
                if prefetched is not None:
                    kv_cache.admit_prefetched(request)
                else:
                    kv_cache.swap_in(request, len(hit_blocks))
                self.counters.recompute_tokens_avoided += max(0, num_restored - num_hit_tokens)
            if request.num_computed_tokens_lost:
                self.counters.recomputed_tokens += max(0, request.num_computed_tokens_lost - num_start)
                request.num_computed_tokens_lost = 0
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_start
            request.num_start_tokens = num_start
            request.admitted_time = now
            if request.first_admitted_time is None:
                request.first_admitted_time = now
                # Usage's cached tokens: a readmission's hit is mostly its own KV.
                request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)
            self.running.append(request)
            growth.admitted(request)
            scheduled.append(
                ScheduledRequest(
                    request, num_new_tokens, num_start, kv_cache.get_block_ids(request.request_id), True
                )
            )
            token_budget -= num_new_tokens
        for request in reversed(prefetching):
            self.waiting.add_front(request)
        return token_budget

    def _reserve_share(self, request: Request, now: float) -> float:
        """The share of the growth reserve a request still needs to be admitted: all of it at
        first, shrinking linearly to none over admission_max_hold_ms from the latest of its
        arrival (or requeue), this replica's last admission on the whole reserve and its last
        preemption. So the hold times how long the reserve has blocked the queue, not how long
        the request has queued: under a sustained overload, where requests finish often and
        the queue drains on whole reserves, it rarely expires however long the queue; a burst
        of long generations, which frees nothing for seconds, costs its held requests at most
        that long to their first token; and after a preemption (a waived reserve that did not
        pay) the whole reserve is needed again (SGLang's new_token_ratio decays the same way
        over steps and is reset by a retraction). A request whose TTFT is still at stake (no
        output yet, and the TTFT predictor says it can still make its deadline if started now)
        is held at most until its latest start, the deadline less its predicted TTFT and less
        one admission interval (the smoothed time between this replica's admission checks), so
        the last check that can still start it in time needs none of the reserve: held longer
        it misses the deadline whatever follows. A request whose TTFT is no longer at
        stake (a preempted stream, or one past its latest start) gains nothing on its TTFT
        from being let in early and, let in on a waived reserve, is what the replica preempts
        next (a resumed stream is the most recently admitted): it keeps the whole hold, and one
        past its latest start the longer admission_max_hold_late_ms (at least the hold: in the
        router simulation 1 s instead of 0.5 s took preemptions at the best baseline's capacity
        to 0.24-0.41x of it on every workload; a stream held as long stalls and cost goodput
        past capacity: docs/benchmarks.md, issue 27's tenth run)."""
        config = self.config
        max_hold_ms = config.admission_max_hold_ms
        if max_hold_ms is None:
            return 1.0
        start = max(request.waiting_since, self._last_reserve_met_time, self._last_preemption_time)
        if request.ttft_deadline is not None and request.num_output_tokens == 0:
            latest_start = request.ttft_deadline - self.ttft_predictor.predict(self._num_tokens_to_first_token(request))
            if now < latest_start:
                # The ramp ends an admission interval early: at the last check before the latest start.
                max_hold_ms = min(max_hold_ms, (latest_start - self._admission_interval_s - start) * 1000)
                if max_hold_ms <= 0:
                    return 0.0
            elif config.admission_max_hold_late_ms is None:
                return 1.0
            else:
                max_hold_ms = max(max_hold_ms, config.admission_max_hold_late_ms)
        held_s = now - start
        return min(1.0, max(0.0, 1.0 - held_s * 1000 / max_hold_ms))

    def _count_held_admission(self, request: Request, num_new_tokens: int, hit_blocks, num_hit_tokens: int) -> None:
        """Count the head request once if only the growth reserve keeps it waiting: the
        optimistic check (watermark, full prompt) would have admitted it."""
        if request.request_id == self._held_request_id:
            return
        fits_today = self.kv_cache.can_allocate(
            request, num_new_tokens, hit_blocks, num_hit_tokens, reserved_blocks=self._admission_reserve_blocks(),
            num_tokens_to_fit=request.num_tokens if self.config.reserve_full_sequence else None,
        )
        if fits_today:
            self._held_request_id = request.request_id
            self.counters.admissions_held += 1

    def _preempt(self, running_index: int) -> None:
        request = self.running.pop(running_index)
        self._last_preemption_time = self.clock()
        request.num_preemptions += 1
        self.counters.preemptions += 1
        mode, _ = self.preemption.choose(request)
        if mode == SWAP:
            self.counters.swap_preemptions += 1
        self._requeue(request, swap=mode == SWAP)

    def _requeue(self, request: Request, swap: bool = False) -> None:
        """Free a request taken off `running` and put it back at the front of the waiting
        queue, to be recomputed (its output tokens are kept) or, when `swap`, with its KV
        copied to host blocks it keeps until it resumes."""
        if swap:
            self.kv_cache.swap_out(request)
        else:
            self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens_lost = request.num_computed_tokens
        request.num_computed_tokens = 0
        request.waiting_since = self.clock()
        self.waiting.add_front(request)
        self.growth.left_running(request, self._count_waiting(request))

    # ---- SLO preemption ----------------------------------------------------------------
    def _num_tokens_to_first_token(self, request: Request) -> int:
        """Tokens a request computes before its first token: a waiting one's prompt net of the
        prefix it found cached when it joined the queue, as the predictor is fitted (tokens
        prefilled since admission). Its whole prompt would doom a cached tenant's request on
        arrival wherever the bare prompt's prefill exceeds the SLO."""
        num_hit_tokens = self._waiting_hit_tokens.get(request.request_id, 0)
        return request.num_tokens - max(request.num_computed_tokens, num_hit_tokens)

    def _urgency(self, request: Request, now: float) -> float:
        return urgency(request.ttft_deadline, now, self.ttft_predictor.predict(self._num_tokens_to_first_token(request)))

    def may_schedule_prefill(self) -> bool:
        """Whether the next schedule() may hold a prefill as slo_snapshot counts one (prompt
        tokens of a request with no output yet): a running request still in its prompt, or a
        waiter before its first token that may be admitted. Not while every sequence slot is
        taken, nor while the head the latest admission pass stopped at still heads the queue
        with no more free blocks and no fewer running requests than then: a loaded replica's
        blocked queue must not cost its decode steps their overlap (LLMEngine._step). It may
        still be wrong both ways: yes for a head that will not fit after all, and no for one
        a relaxed growth reserve (a hold past its time) or a reordered queue lets in."""
        waiting, running = self.waiting, self.running
        if waiting and len(running) < self.config.max_num_seqs:
            blocked = self._admission_blocked
            if (blocked is None or waiting.peek().request_id != blocked[0]
                    or self.kv_cache.num_free_blocks > blocked[1] or len(running) < blocked[2]):
                if any(request.num_output_tokens == 0 for request in waiting):
                    return True
        return any(request.num_output_tokens == 0 and request.num_computed_tokens < request.num_prompt_tokens
                   for request in running)

    def slo_snapshot(self, output: SchedulerOutput) -> StepSnapshot:
        """What the SLO monitor needs of the step about to run: its requests still before
        their first token, and the most urgent waiters still before theirs."""
        # Steps that compute prompt tokens of a request with no output yet (a first token
        # still being sampled by the step before, under overlapped scheduling, is output).
        prefills = tuple(SLOView.of(entry.request, entry.start_pos) for entry in output.scheduled
                         if entry.request.num_output_tokens == 0 and entry.start_pos < entry.request.num_prompt_tokens)
        waiters = (SLOView.of(r, r.num_tokens - self._num_tokens_to_first_token(r))
                   for r in self.waiting if r.num_output_tokens == 0)
        return StepSnapshot(output.step_id, prefills, tuple(itertools.islice(waiters, SLO_SNAPSHOT_WAITERS)))

    def abort_step(self, output: SchedulerOutput, victim_request_id: str, num_discarded_layers: int) -> None:
        """Undo a step whose forward pass was abandoned between layers, and preempt the victim.

        Every scheduled request goes back to the computed tokens it started the step with
        (nothing was sampled, so decodes lose only time); prefix-cache entries registered
        for the pass's unwritten KV are forgotten; blocks the step gave non-victims stay
        theirs (they are needed again next step). The victim's blocks are returned and it
        waits to be recomputed; the next SchedulerOutput lists it as preempted.
        """
        for entry in output.scheduled:
            entry.request.num_computed_tokens = entry.start_pos
            if entry.samples:
                entry.request.num_pending_tokens -= 1
        hit_unwritten = self.kv_cache.forget_unwritten_blocks([entry.request for entry in output.scheduled])
        self.counters.slo_preemptions += 1
        self.counters.slo_discarded_layers += num_discarded_layers
        victim = self.requests.get(victim_request_id)
        # A victim that left while the pass ran needs nothing more: the rollback alone keeps
        # the step consistent.
        if victim is not None and victim.status == RequestStatus.RUNNING:
            self.running.remove(victim)
            victim.num_slo_preemptions += 1
            self._requeue(victim)
            self._slo_preempted_req_ids.append(victim_request_id)
        # Admitted this step on a prefix hit that the pass never wrote: back to wait, no
        # preemption of theirs (they computed nothing), and the runner drops their rows.
        for request in hit_unwritten:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._requeue(request)
                request.num_computed_tokens_lost = 0
                self._slo_preempted_req_ids.append(request.request_id)

    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]) -> list[TokenUpdate]:
        """Append the sampled tokens of the requests that caught up this step and finish the
        ones that hit EOS, a stop token or max_tokens (their blocks are freed at once)."""
        updates = []
        finished_requests = []
        first_tokens = False
        now = None
        growth = self.growth
        tracks_output = growth.tracks_output
        running_status = RequestStatus.RUNNING  # a class attribute of an Enum is slow to read
        for entry in output.scheduled:
            if not entry.samples:
                continue  # mid-prefill chunk
            request = entry.request
            request.num_pending_tokens -= 1
            if request.status != running_status:
                continue  # finished, aborted or preempted while the step ran: its token is dropped
            token_id = sampled_token_ids[request.request_id]
            request.output_token_ids.append(token_id)  # request.append_output_token, inlined
            request.all_token_ids.append(token_id)
            if now is None:
                now = self.clock()
            if request.first_token_time is None:
                request.first_token_time = now
                # Latest admission to first token, over the prompt tokens it computed since (not
                # those it found cached, restored from the host tier, or kept).
                self.ttft_predictor.record(request.num_prompt_tokens - min(request.num_start_tokens,
                                                                           request.num_prompt_tokens),
                                           now - request.admitted_time)
                first_tokens = True
            request.last_token_time = now
            finished = request.check_stop(token_id)
            if finished is not None:
                self._finish(request, finished)
                finished_requests.append(request)
            elif tracks_output:
                growth.output_grew(request)
            updates.append(TokenUpdate(request, token_id, finished))
        self.counters.generation_tokens += len(updates)
        if first_tokens:
            self.ttft_predictor.refit()
        if finished_requests:
            ended = set(map(id, finished_requests))
            self.running = [r for r in self.running if id(r) not in ended]
        return updates

    # ---- observation -----------------------------------------------------------------
    def load(self) -> SchedulerLoad:
        kv_cache = self.kv_cache
        return SchedulerLoad(
            kv_blocks_total=kv_cache.num_usable_blocks,
            kv_blocks_free=kv_cache.num_free_blocks,
            block_size=self.config.block_size,
            kv_usage=kv_cache.usage(),
            # What an admission may still take now, so the router's fit filter and the
            # replica's own admission check agree.
            headroom_tokens=kv_cache.headroom_tokens(self._admission_reserve_blocks()),
            kv_committed_tokens=self._committed_blocks() * kv_cache.block_size,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            waiting_prefill_tokens=self.waiting_prefill_tokens,
            preemptions_total=self.counters.preemptions,
            recomputed_tokens_total=self.counters.recomputed_tokens,
            prefix_cache_queries=kv_cache.prefix_cache_queries,
            prefix_cache_hits=kv_cache.prefix_cache_hits,
            prompt_tokens_total=self.counters.prompt_tokens,
            generation_tokens_total=self.counters.generation_tokens,
            max_num_seqs=self.config.max_num_seqs,
            slo_preemptions_total=self.counters.slo_preemptions,
            slo_discarded_layers_total=self.counters.slo_discarded_layers,
            admissions_held_total=self.counters.admissions_held,
            admissions_relaxed_total=self.counters.admissions_relaxed,
            expected_output_tokens=self.growth.expected_new_output(self.config.max_model_len),
            ttft_predictor_per_token_s=self.ttft_predictor.coefficients.per_token_s,
            ttft_predictor_base_s=self.ttft_predictor.coefficients.base_s,
            host_kv_blocks_total=kv_cache.num_host_blocks,
            host_kv_blocks_free=kv_cache.num_free_host_blocks,
            host_kv_usage=1.0 - kv_cache.num_free_host_blocks / kv_cache.num_host_blocks if kv_cache.num_host_blocks else 0.0,
            swap_preemptions_total=self.counters.swap_preemptions,
            recompute_tokens_avoided_total=self.counters.recompute_tokens_avoided,
            swapped_out_blocks_total=kv_cache.swapped_out_blocks,
            swapped_in_blocks_total=kv_cache.swapped_in_blocks,
            swapped_out_bytes_total=kv_cache.swapped_out_blocks * self.kv_block_bytes,
            swapped_in_bytes_total=kv_cache.swapped_in_blocks * self.kv_block_bytes,
            host_hit_cost_ratio=self.preemption.host_hit_cost_ratio(kv_cache.block_size) if kv_cache.num_host_blocks else 0.0,
            spilled_blocks_total=kv_cache.spilled_blocks,
            host_prefix_hit_blocks_total=kv_cache.host_hit_blocks,
            prefetched_blocks_total=kv_cache.prefetched_blocks,
            prefetches_cancelled_total=kv_cache.prefetches_cancelled,
            copy_wait_steps_total=kv_cache.copy_wait_steps,
            copy_wait_blocks_total=kv_cache.copy_wait_blocks,
        )

    def _holders(self, candidate: Optional[Request] = None) -> list[Request]:
        """The requests that hold device blocks, but `candidate`: the running ones and the
        swapped-out ones prefetched back (waiting to resume, holding the blocks their KV is
        copied into)."""
        prefetched = [entry.request for entry in self.kv_cache.prefetched.values() if entry.request is not candidate]
        return self.running + prefetched if prefetched else self.running

    def _owed_growth_blocks(self, candidate: Optional[Request] = None) -> int:
        """reserve_max_tokens: blocks the requests holding device blocks but `candidate` will
        still claim to reach max_tokens, beyond those they hold. A prefetched request holds
        blocks and is owed its growth as a running one is: left out, the reserve came out
        negative (running requests' growth less the prefetched ones' blocks) and admitted
        requests the pool could not hold."""
        kv_cache, growth = self.kv_cache, self.growth
        owed = growth.running_final_blocks - kv_cache.num_request_blocks
        for request_id, entry in kv_cache.prefetched.items():
            if entry.request is candidate:
                owed += kv_cache.num_held_blocks(candidate)
            else:
                owed += growth.final_blocks(entry.request)
        return owed

    def _committed_blocks(self) -> int:
        """KV blocks live requests will still claim: their summed growth, or under
        reserve_expected the peak of their expected future (what admission reserves)."""
        growth, kv_cache = self.growth, self.kv_cache
        if growth.tracks_output:
            return growth.peak_reserve_blocks(self.running, self.waiting, kv_cache)
        return growth.growth_blocks(kv_cache.num_request_blocks)

    def _check_host_tier(self, waiting_ids: set[str]) -> None:
        """Host blocks are held by swapped-out waiting requests (and, within a step, by the
        swap-ins reading them) and by nothing else: none leaks, none is free and held."""
        kv_cache, host_pool = self.kv_cache, self.kv_cache.host_pool
        assert set(kv_cache.swapped) <= waiting_ids, "a request that is not waiting holds host blocks"
        if host_pool is None:
            assert not kv_cache.swapped
            return
        for host_blocks, num_tokens in kv_cache.swapped.values():
            assert len(host_blocks) == cdiv(num_tokens, kv_cache.block_size)
        _check_pool(host_pool, itertools.chain(itertools.chain.from_iterable(
                                                   swapped.host_blocks for swapped in kv_cache.swapped.values()),
                                               kv_cache._host_blocks_read), "host ")

    def check_invariants(self) -> None:
        """Assert the engine's structural invariants (for tests; O(blocks + requests))."""
        waiting = list(self.waiting)
        waiting_ids = {r.request_id for r in waiting}
        running_ids = {r.request_id for r in self.running}
        assert len(waiting_ids) == len(waiting) and len(running_ids) == len(self.running), "duplicate in a queue"
        assert not waiting_ids & running_ids, "a request is both waiting and running"
        assert waiting_ids | running_ids == set(self.requests), "a live request is in no queue"
        assert len(self.running) <= self.config.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
        assert self.waiting_prefill_tokens == sum(r.num_tokens - self._waiting_hit_tokens[r.request_id] for r in waiting)
        kv_cache = self.kv_cache
        assert set(kv_cache.prefetched) <= waiting_ids & set(kv_cache.swapped), "a prefetched request is not swapped out"
        assert set(kv_cache.req_to_blocks) <= running_ids | set(kv_cache.prefetched), (
            "a request outside running holds blocks")
        _check_pool(kv_cache.pool, itertools.chain.from_iterable(kv_cache.req_to_blocks.values()))
        self._check_host_tier(waiting_ids)
        # The committed-KV figure load() reports, recomputed from scratch.
        held = {request_id: len(blocks) for request_id, blocks in kv_cache.req_to_blocks.items()}
        final = {r.request_id: cdiv(self.growth.final_tokens(r), kv_cache.block_size) for r in self.requests.values()}
        assert all(final[r] >= held.get(r, 0) for r in final), "a request holds more blocks than its final estimate"
        assert all(self.growth.final_tokens(r) >= r.num_tokens for r in self.requests.values())
        assert kv_cache.num_request_blocks == sum(held.values())
        assert (self.growth.live_final_blocks, self.growth.running_final_blocks) == (
            sum(final.values()), sum(final[r.request_id] for r in self.running))
        assert self._owed_growth_blocks() == sum(final[r.request_id] - held.get(r.request_id, 0)
                                                 for r in self._holders())


def _check_pool(pool, held_blocks, label: str = "") -> None:
    """Every block of `pool` has as many references as holders in `held_blocks`, and is in the
    free queue exactly when it has none (check_invariants, for both KV tiers)."""
    holders: dict[int, int] = {}
    for block in held_blocks:
        holders[block.block_id] = holders.get(block.block_id, 0) + 1
    free_ids = {block.block_id for block in pool.free_queue}
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), f"{label}{block} has {holders.get(block.block_id, 0)} holders"
        assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"{label}{block} free-queue membership is wrong"
    assert len(free_ids) == pool.num_free_blocks


def _last_token_in_flight(request: Request) -> bool:
    """The token still being sampled for `request` (async scheduling) is its last (max_tokens)."""
    num_pending = request.num_pending_tokens
    return bool(num_pending) and len(request.output_token_ids) + num_pending >= request.sampling_params.max_tokens
