"""The front's half of every step: turns the core's batched token ids into per-request
RequestOutputs (detokenized here, not in the core, with usage counts), matches stop strings
on that text, and puts each output on its request's stream, where the request observer (the
request metrics) sees it. It is also where a request ends early on the front's side (abort,
a stop string, a reader that stopped reading) and where a dead core or a failed step fails
the streams it holds.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from replica.core.outputs import PromptLogprobs, RequestOutput, TopLogprobs
from replica.core.request import Request
from replica.text.stop_strings import StopStringMatcher
from replica.text.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


class Stream:
    """What the processor needs of a request's stream (RequestStream in async_engine)."""

    request: Request

    def put(self, item: RequestOutput | BaseException) -> bool:
        """True: its reader has stalled (left outputs unread past its bound); the processor then
        ends the request with what `abandon` returns."""

    def abandon(self) -> BaseException: ...


class RequestObserver(Protocol):
    """Sees every output (and every error that ends a stream instead of a last output) as it
    reaches its request's stream: replica.server.request_metrics.RequestMetrics."""

    def on_output(self, request: Request, output: RequestOutput) -> None: ...

    def on_failed(self, request: Request) -> None: ...


# A request the front ends early (an abort, a stop string matched here) may still have rows on
# their way from the core: steps it ran before the abort reached it. Its id, added again soon
# after (a client's retry), gets an id of its own in the core, so those rows, still carrying
# the old request's id, are dropped instead of reaching the new stream. The ids ended early
# are remembered this many at a time: rows are in flight for a step or two.
RECENTLY_ENDED_IDS = 4096


@dataclass
class _Live:
    stream: Stream
    detokenizer: IncrementalDetokenizer
    stop_matcher: Optional[StopStringMatcher]  # only for requests with stop strings
    request_id: str  # the client's; the core's (stream.request.request_id) differs after a reuse


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, abort_in_core: Callable[[str], None],
                 observer: Optional[RequestObserver] = None, core_id_suffix: str = ""):
        """abort_in_core(request_id): tell the core to drop a request the front ended early.
        core_id_suffix: appended to every core id, where other fronts share the core (their
        clients may use the same ids)."""
        self.tokenizer = tokenizer
        self.core_id_suffix = core_id_suffix
        self.abort_in_core = abort_in_core
        self.observer = observer
        self._live: dict[str, _Live] = {}  # by the core's id
        self._core_ids: dict[str, str] = {}  # a live request's core id, where it is not the client's
        # Client and core ids of requests ended early, the latest RECENTLY_ENDED_IDS: neither is
        # given to a new request while rows of the old one may be on their way.
        self._ended_early: OrderedDict[str, None] = OrderedDict()
        self._reuses = itertools.count(1)

    def __contains__(self, request_id: str) -> bool:
        """Whether a live request has this (client's) id."""
        if request_id in self._core_ids:
            return True
        state = self._live.get(request_id)
        return state is not None and state.request_id == request_id

    def __len__(self) -> int:
        return len(self._live)

    def core_id_for(self, request_id: str) -> str:
        """The id the core is to know a new request of this (client's) id by: the same (with
        the front's suffix), unless a request of that id ended early here moments ago or
        another client's request has it."""
        suffix = self.core_id_suffix
        core_id = request_id + suffix
        ended = self._ended_early
        if request_id not in ended and core_id not in self._live and core_id not in ended:
            return core_id
        while True:
            core_id = f"{request_id}#{next(self._reuses)}{suffix}"
            if core_id not in self._live and core_id not in self._ended_early:
                return core_id

    def track(self, stream: Stream, request_id: Optional[str] = None) -> None:
        """Follow `stream`, whose request the core knows by its own id; `request_id`, the
        client's, where core_id_for gave it another."""
        params = stream.request.sampling_params
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        core_id = stream.request.request_id
        request_id = request_id or core_id
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                             kept_special_token_ids=params.kept_special_token_ids)
        self._live[core_id] = _Live(stream, detokenizer, matcher, request_id)
        if core_id != request_id:
            self._core_ids[request_id] = core_id

    def _drop(self, core_id: str) -> Optional[_Live]:
        state = self._live.pop(core_id, None)
        if state is not None and state.request_id != core_id:
            del self._core_ids[state.request_id]
        return state

    def process(self, rows: list[tuple]) -> None:
        """One StepOutputs' CoreOutput rows. Rows of requests the front already ended are dropped."""
        live = self._live
        for (request_id, new_token_ids, finish_reason, num_cached_tokens, logprobs, top_logprobs, stop_token_id,
             first_admitted_time, prompt_logprobs) in rows:
            state = live.get(request_id)
            if state is None:
                continue  # ended here while the core was still stepping it
            request = state.stream.request
            for token_id in new_token_ids:
                request.append_output_token(token_id)
            request.num_cached_tokens = num_cached_tokens
            if first_admitted_time is not None:
                request.first_admitted_time = first_admitted_time
            if stop_token_id is not None:
                request.stop_reason = stop_token_id
            core_finished = finish_reason is not None
            text_token_ids = new_token_ids
            if finish_reason == "stop" and not request.sampling_params.include_stop_str_in_output:
                # The core stops on a token (EOS, or one of stop_token_ids): its text is left
                # out, as vLLM leaves it out (the id stays in the token ids).
                text_token_ids = new_token_ids[:-1]
            if state.stop_matcher is None:  # the common case, once per request and step: inline
                text = state.detokenizer.add_tokens(text_token_ids)
                if core_finished:
                    text += state.detokenizer.flush()
                stop_string = None
            else:
                text, stop_string = self._text_delta(state, text_token_ids, finished=core_finished)
                if stop_string is not None:
                    request.stop_reason = stop_string
                    finish_reason = "stop"
            tops = [TopLogprobs._make(top) for top in top_logprobs] if top_logprobs else None
            # RequestOutput.of, built directly (lengths, not properties): this runs for every
            # request every step, and at batch 256 the front's event loop has ~2 ms per step.
            output = RequestOutput(state.request_id, new_token_ids, text, finish_reason, len(request.prompt_token_ids),
                                   len(request.output_token_ids), num_cached_tokens, logprobs, tops,
                                   request.stop_reason if finish_reason is not None else None,
                                   PromptLogprobs.from_wire(prompt_logprobs) if prompt_logprobs is not None else None)
            if stop_string is not None and not core_finished:
                # By the core's id, which the row carries: finish() would read it as a client's,
                # and another client's request may be known by that id (helper-40's fuzzing).
                self._finish(request_id, "stop", last=output)  # the core would generate on
                continue
            if core_finished:
                self._drop(request_id)
                self._put(state.stream, output)
            elif self._put(state.stream, output):
                # Its reader stopped reading (RequestStream's stall timeout): the request would
                # hold its KV blocks, and its stream a growing backlog, for nobody.
                error = state.stream.abandon()
                logger.warning("%s", error)
                self._finish(request_id, "abort", last=error)

    @staticmethod
    def _text_delta(state: _Live, new_token_ids: list[int], finished: bool) -> tuple[str, Optional[str]]:
        """The text these tokens release and the stop string they completed, if any. Text that
        could begin a stop string is held back until later tokens tell whether it does."""
        text = state.detokenizer.add_tokens(new_token_ids)
        if finished:  # the last token: nothing more will complete a character
            text += state.detokenizer.flush()
        matcher = state.stop_matcher
        if matcher is None:
            return text, None
        match = matcher.feed(text)
        if match.stop is None and finished:
            return match.text + matcher.flush(), None
        return match.text, match.stop

    def finish(self, request_id: str, finish_reason: str, last: Optional[RequestOutput] = None) -> None:
        """End a live request (by the client's id or the core's) on the front's side now and have
        the core drop it before its next step: an abort, or a stop string matched here (`last`
        is then the output that carries the text before it)."""
        self._finish(self._core_ids.get(request_id, request_id), finish_reason, last)

    def finish_stream(self, core_id: str, finish_reason: str) -> None:
        """End the request whose core id this is (a stream knows its core id; a client's id may
        equal another request's core id, so `finish` could end the wrong one)."""
        self._finish(core_id, finish_reason)

    def finish_all(self, finish_reason: str) -> None:
        """End every live request as `finish` does (by its core id: a client's id may equal
        another request's core id)."""
        for core_id in list(self._live):
            self._finish(core_id, finish_reason)

    def _finish(self, core_id: str, finish_reason: str, last: Optional[RequestOutput | BaseException] = None) -> None:
        """`last`: the output (or error) that ends the stream, else an empty one with `finish_reason`."""
        state = self._drop(core_id)
        if state is None:
            return  # already ended
        ended = self._ended_early
        for ended_id in {state.request_id, core_id}:
            ended[ended_id] = None
            ended.move_to_end(ended_id)
        while len(ended) > RECENTLY_ENDED_IDS:
            ended.popitem(last=False)
        if last is None:
            last = RequestOutput.of(state.stream.request, [], "", finish_reason)
            last.request_id = state.request_id
        self._put(state.stream, last)
        self.abort_in_core(core_id)

    def fail(self, request_id: str, error: BaseException) -> None:
        """End a request the core failed or refused (by the core's id) with `error`."""
        state = self._drop(request_id)
        if state is not None:
            self._put(state.stream, error)

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        live, self._live = self._live, {}
        self._core_ids.clear()
        for state in live.values():
            self._put(state.stream, make_error())

    def stream_of(self, request_id: str) -> Optional[Stream]:
        state = self._live.get(self._core_ids.get(request_id, request_id))
        return state.stream if state is not None else None

    def _put(self, stream: Stream, item: RequestOutput | BaseException) -> bool:
        """The one place an output or error reaches a stream, so the observer misses none; what
        the stream's `put` says."""
        observer = self.observer
        if observer is not None:
            if isinstance(item, BaseException):
                observer.on_failed(stream.request)
            else:
                observer.on_output(stream.request, item)
        return stream.put(item)
