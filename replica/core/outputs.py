"""What an engine hands its callers, and how a request is made: light types (no torch) that
the engine core, the front and the cluster share. `make_request` is the one constructor of a
Request for an engine's config, used by the LLMEngine and by the front before a request
crosses to the engine core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from replica.config import EngineConfig
from replica.core.request import Request, SamplingParams, StopReason
from replica.core.slo import ttft_deadline as _ttft_deadline


class TopLogprobs(NamedTuple):
    """The most likely tokens at one position, most likely first, with their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]


class PromptLogprobs(NamedTuple):
    """Log-probabilities of a prompt's tokens (SamplingParams.prompt_logprobs), each under the
    model given the tokens before it, of the raw logits as the sampled tokens' are. Entry i is
    prompt token i + 1's: the first token has no context, so no entry (the APIs show a null)."""

    logprobs: list[float]
    ranks: list[int]  # each token's rank in the vocabulary there, 1 the most likely
    top: Optional[list[TopLogprobs]]  # the prompt_logprobs most likely at each position; None when 0

    @classmethod
    def from_wire(cls, wire: tuple) -> "PromptLogprobs":
        """Unpacked from the engine core's arrays into lists, by the front (its own process)."""
        logprobs, ranks, top_ids, top_logprobs = wire
        top = None
        if top_ids is not None:
            top = list(map(TopLogprobs, top_ids.tolist(), top_logprobs.tolist()))
        return cls(logprobs.tolist(), ranks.tolist(), top)


class PromptLogprobArrays(NamedTuple):
    """Prompt log-probabilities as the engine core holds and sends them: numpy arrays, which
    pickle as their bytes (an 8k-token prompt's top 20 as lists took ~12 ms of the core's GIL
    to pickle). Positions as PromptLogprobs'; ranks and ids int32, logprobs float32."""

    logprobs: np.ndarray  # [positions]
    ranks: np.ndarray  # [positions]
    top_token_ids: Optional[np.ndarray]  # [positions, prompt_logprobs], None when it is 0
    top_logprobs: Optional[np.ndarray]

    def to_wire(self) -> tuple:
        return tuple(self)


class GatheredPromptLogprobs:
    """The engine core's prompt log-probabilities of one request so far, prefill chunk by
    prefill chunk (PromptLogprobArrays each), joined once when they go out with the first token."""

    __slots__ = ("num_top", "num_positions", "_chunks")

    def __init__(self, num_top: int):
        self.num_top = num_top
        self.num_positions = 0
        self._chunks: list[PromptLogprobArrays] = []

    def extend(self, first_position: int, more: PromptLogprobArrays) -> None:
        """Append `more`, entries from `first_position` on, past those this holds already: a
        prefill recomputed after a preemption may repeat positions a step still in flight
        computed too (equal values; the first kept)."""
        skip = self.num_positions - first_position
        if skip < 0:
            raise RuntimeError(f"prompt logprobs from position {first_position} follow only {self.num_positions}")
        if skip >= len(more.logprobs):
            return
        if skip:
            more = PromptLogprobArrays(*(None if values is None else values[skip:] for values in more))
        self._chunks.append(more)
        self.num_positions += len(more.logprobs)

    def arrays(self) -> PromptLogprobArrays:
        """Every position's, as one set of arrays."""
        if len(self._chunks) == 1:
            return self._chunks[0]
        if not self._chunks:
            top = np.zeros((0, self.num_top), dtype=np.int32) if self.num_top else None
            return PromptLogprobArrays(np.zeros(0, np.float32), np.zeros(0, np.int32), top,
                                       None if top is None else top.astype(np.float32))
        return PromptLogprobArrays(*(None if parts[0] is None else np.concatenate(parts)
                                     for parts in zip(*self._chunks)))

    def to_wire(self) -> tuple:
        return self.arrays().to_wire()

    def unpack(self) -> PromptLogprobs:
        return PromptLogprobs.from_wire(self.to_wire())


@dataclass
class RequestOutput:
    """What one step added to one request's output."""

    request_id: str
    new_token_ids: list[int]
    # Detokenized delta; concatenated deltas equal the decode of all output tokens, except
    # that a matched stop string (and anything after it) is left out, and so is the token the
    # core stopped on (EOS or a stop token id), unless include_stop_str_in_output (vLLM's rule).
    text: str
    finish_reason: Optional[str]  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[TopLogprobs]] = None  # per new token, when asked for
    # On the last output: the stop string or stop token id that ended it (None for EOS).
    stop_reason: Optional[StopReason] = None
    # With the first token, when asked for (SamplingParams.prompt_logprobs).
    prompt_logprobs: Optional[PromptLogprobs] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, request: Request, new_token_ids: list[int], text: str, finish_reason: Optional[str],
           logprobs: Optional[list[float]] = None,
           top_logprobs: Optional[list[TopLogprobs]] = None) -> "RequestOutput":
        """A delta of `request`, with its usage counts as they stand now."""
        return cls(request.request_id, new_token_ids, text, finish_reason, request.num_prompt_tokens,
                   request.num_output_tokens, request.num_cached_tokens, logprobs, top_logprobs,
                   request.stop_reason if finish_reason is not None else None)


@dataclass
class StepStats:
    """Smoothed engine speed, for load reports."""

    step_time_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    steps: int = 0

    def observe(self, elapsed_s: float, num_generated: int, smoothing: float = 0.2) -> None:
        tokens_per_s = num_generated / elapsed_s if elapsed_s > 0 else 0.0
        if self.steps == 0:
            self.step_time_s, self.generation_tokens_per_s = elapsed_s, tokens_per_s
        else:
            self.step_time_s += smoothing * (elapsed_s - self.step_time_s)
            self.generation_tokens_per_s += smoothing * (tokens_per_s - self.generation_tokens_per_s)
        self.steps += 1


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    sampling_params: SamplingParams,
    *,
    config: EngineConfig,
    eos_token_ids: tuple[int, ...],
    clock: Callable[[], float],
    priority: int = 0,
    ttft_deadline: Optional[float] = None,
    arrival_time: Optional[float] = None,
    cache_salt: Optional[str] = None,
    ttft_slo_ms: Optional[float] = None,
) -> Request:
    """A new request for an engine of `config`, arriving now on `clock` unless arrival_time says.
    ttft_slo_ms sets the TTFT deadline relative to arrival (an explicit ttft_deadline, absolute
    on the engine clock, wins); without either, config.default_ttft_slo_ms applies. The
    replica's front builds requests with this too, before they cross to the engine core."""
    arrival_time = clock() if arrival_time is None else arrival_time
    if ttft_deadline is None:
        slo_ms = ttft_slo_ms if ttft_slo_ms is not None else config.default_ttft_slo_ms
        ttft_deadline = _ttft_deadline(arrival_time, slo_ms)
    return Request(
        request_id, list(prompt_token_ids), sampling_params, eos_token_ids=eos_token_ids,
        arrival_time=arrival_time, priority=priority, ttft_deadline=ttft_deadline, cache_salt=cache_salt,
    )
