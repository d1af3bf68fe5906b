"""The front's half of every step: turns the core's batched token ids into per-request
RequestOutputs (detokenized here, not in the core, with usage counts) and puts them on each
request's stream. It is also where a request ends early on the front's side (abort, a
stop string) and where a dead core or a failed step fails the streams it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from replica.engine import RequestOutput
from replica.request import Request
from replica.tokenizer import IncrementalDetokenizer, Tokenizer


class Stream:
    """What the processor needs of a request's stream (RequestStream in async_engine)."""

    request: Request

    def put(self, item: RequestOutput | BaseException) -> None: ...


@dataclass
class _Live:
    stream: Stream
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, abort_in_core: Callable[[str], None]):
        """abort_in_core(request_id): tell the core to drop a request the front ended early."""
        self.tokenizer = tokenizer
        self.abort_in_core = abort_in_core
        self._live: dict[str, _Live] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def request_ids(self) -> list[str]:
        return list(self._live)

    def track(self, stream: Stream) -> None:
        self._live[stream.request.request_id] = _Live(stream, IncrementalDetokenizer(self.tokenizer))

    def process(self, rows: list[tuple]) -> None:
        """One StepOutputs' CoreOutput rows. Rows of requests the front already ended are dropped."""
        live = self._live
        for request_id, new_token_ids, finish_reason, num_cached_tokens, logprobs, first_admitted_time in rows:
            state = live.get(request_id)
            if state is None:
                continue  # aborted here while the core was still stepping it
            request = state.stream.request
            for token_id in new_token_ids:
                request.append_output_token(token_id)
            request.num_cached_tokens = num_cached_tokens
            if first_admitted_time is not None:
                request.first_admitted_time = first_admitted_time
            text = state.detokenizer.add_tokens(new_token_ids)
            if finish_reason is not None:
                text += state.detokenizer.flush()
                del live[request_id]
            state.stream.put(RequestOutput.of(request, new_token_ids, text, finish_reason, logprobs))

    def finish(self, request_id: str, finish_reason: str) -> None:
        """End a live request on the front's side now (an abort; a stop string matched here
        would end it as "stop" the same way) and have the core drop it before its next step."""
        state = self._live.pop(request_id, None)
        if state is None:
            return  # already ended
        state.stream.put(RequestOutput.of(state.stream.request, [], "", finish_reason))
        self.abort_in_core(request_id)

    def fail(self, request_id: str, error: BaseException) -> None:
        state = self._live.pop(request_id, None)
        if state is not None:
            state.stream.put(error)

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        live, self._live = self._live, {}
        for state in live.values():
            state.stream.put(make_error())

    def stream_of(self, request_id: str) -> Optional[Stream]:
        state = self._live.get(request_id)
        return state.stream if state is not None else None
