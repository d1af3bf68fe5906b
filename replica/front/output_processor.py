"""The front's half of every step: turns the core's batched token ids into per-request
RequestOutputs (detokenized here, not in the core, with usage counts), matches stop strings
on that text, and puts each output on its request's stream, where the request observer (the
request metrics) sees it. It is also where a request ends early on the front's side (abort,
a stop string) and where a dead core or a failed step fails the streams it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from replica.core.outputs import RequestOutput
from replica.core.outputs import TopLogprobs
from replica.core.request import Request
from replica.text.stop_strings import StopStringMatcher
from replica.text.tokenizer import IncrementalDetokenizer, Tokenizer


class Stream:
    """What the processor needs of a request's stream (RequestStream in async_engine)."""

    request: Request

    def put(self, item: RequestOutput | BaseException) -> None: ...


class RequestObserver(Protocol):
    """Sees every output (and every error that ends a stream instead of a last output) as it
    reaches its request's stream: replica.server.request_metrics.RequestMetrics."""

    def on_output(self, request: Request, output: RequestOutput) -> None: ...

    def on_failed(self, request: Request) -> None: ...


@dataclass
class _Live:
    stream: Stream
    detokenizer: IncrementalDetokenizer
    stop_matcher: Optional[StopStringMatcher]  # only for requests with stop strings


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, abort_in_core: Callable[[str], None],
                 observer: Optional[RequestObserver] = None):
        """abort_in_core(request_id): tell the core to drop a request the front ended early."""
        self.tokenizer = tokenizer
        self.abort_in_core = abort_in_core
        self.observer = observer
        self._live: dict[str, _Live] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def request_ids(self) -> list[str]:
        return list(self._live)

    def track(self, stream: Stream) -> None:
        params = stream.request.sampling_params
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._live[stream.request.request_id] = _Live(stream, IncrementalDetokenizer(self.tokenizer), matcher)

    def process(self, rows: list[tuple]) -> None:
        """One StepOutputs' CoreOutput rows. Rows of requests the front already ended are dropped."""
        live = self._live
        for (request_id, new_token_ids, finish_reason, num_cached_tokens, logprobs, top_logprobs, stop_token_id,
             first_admitted_time) in rows:
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
            if state.stop_matcher is None:  # the common case, once per request and step: inline
                text = state.detokenizer.add_tokens(new_token_ids)
                if core_finished:
                    text += state.detokenizer.flush()
                stop_string = None
            else:
                text, stop_string = self._text_delta(state, new_token_ids, finished=core_finished)
                if stop_string is not None:
                    request.stop_reason = stop_string
                    finish_reason = "stop"
            tops = [TopLogprobs._make(top) for top in top_logprobs] if top_logprobs else None
            # RequestOutput.of, built directly (lengths, not properties): this runs for every
            # request every step, and at batch 256 the front's event loop has ~2 ms per step.
            output = RequestOutput(request_id, new_token_ids, text, finish_reason, len(request.prompt_token_ids),
                                   len(request.output_token_ids), num_cached_tokens, logprobs, tops,
                                   request.stop_reason if finish_reason is not None else None)
            if stop_string is not None and not core_finished:
                self.finish(request_id, "stop", last=output)  # the core would generate on
                continue
            if core_finished:
                del live[request_id]
            self._put(state.stream, output)

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
        """End a live request on the front's side now and have the core drop it before its
        next step: an abort, or a stop string matched here (`last` is then the output that
        carries the text before it)."""
        state = self._live.pop(request_id, None)
        if state is None:
            return  # already ended
        self._put(state.stream, last if last is not None else
                  RequestOutput.of(state.stream.request, [], "", finish_reason))
        self.abort_in_core(request_id)

    def fail(self, request_id: str, error: BaseException) -> None:
        state = self._live.pop(request_id, None)
        if state is not None:
            self._put(state.stream, error)

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        live, self._live = self._live, {}
        for state in live.values():
            self._put(state.stream, make_error())

    def stream_of(self, request_id: str) -> Optional[Stream]:
        state = self._live.get(request_id)
        return state.stream if state is not None else None

    def _put(self, stream: Stream, item: RequestOutput | BaseException) -> None:
        """The one place an output or error reaches a stream, so the observer misses none."""
        observer = self.observer
        if observer is not None:
            if isinstance(item, BaseException):
                observer.on_failed(stream.request)
            else:
                observer.on_output(stream.request, item)
        stream.put(item)
