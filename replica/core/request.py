"""A request's life inside one replica: its tokens, sampling parameters and scheduling state.

`num_computed_tokens` chases `num_tokens` (prompt + output). The scheduler moves it; the
KV cache manager holds the blocks behind it; preemption resets it to 0 (output is kept).
"""

from __future__ import annotations

import enum
import math
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union
from replica.errors import ContextLengthExceededError, InvalidRequestError

if TYPE_CHECKING:
    from replica.core.outputs import GatheredPromptLogprobs
    from replica.core.structured_output import StructuredOutput


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        """OpenAI-style finish reason, or None while the request is live."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


# Most alternatives a request may ask for per generated token (vLLM's default max_logprobs,
# and OpenAI's top_logprobs bound): top-k over the vocabulary runs on the device every step.
MAX_TOP_LOGPROBS = 20
# OpenAI's bounds for the additive penalties and for one logit bias.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# A temperature below this samples greedily, as in vLLM (its _SAMPLING_EPS): dividing logits by
# 1e-40 overflowed them to +-inf, every +inf tied, and the lowest such id won whatever top_k said.
GREEDY_TEMPERATURE_EPS = 1e-5
# The sampler holds these parameters as 32-bit floats: a temperature of 1e308 became inf there,
# and a constrained row's masked logits / inf were NaN.
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 (or below GREEDY_TEMPERATURE_EPS)
    means greedy.

    The penalties and logit_bias follow vLLM (and OpenAI): logit_bias is added to the raw
    logits; presence and frequency penalties subtract per generated occurrence;
    repetition_penalty divides positive (multiplies negative) logits of every token seen in
    the prompt or the output. Logprobs are of the raw logits, before any of them.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # the sampled token's log-probability
    top_logprobs: int = 0  # this many most likely alternatives per token, with theirs
    # Each prompt token's log-probability given the tokens before it (vLLM's prompt_logprobs),
    # with this many most likely alternatives at each position; None: not computed. They come
    # with the first token (RequestOutput.prompt_logprobs); asked for, the prompt takes no
    # prefix-cache hits, since a cached token has no logits.
    prompt_logprobs: Optional[int] = None
    # Strings that end generation, matched on the detokenized text across token boundaries;
    # the matched string is left out of the output unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # Special tokens the text keeps though it skips the others: a tool parser's tags, where the
    # checkpoint makes them special (vLLM keeps every special token of a tool-calling request,
    # EOS and control tokens showing in its content; here only these show).
    kept_special_token_ids: tuple[int, ...] = ()
    # False: the text keeps every special token (vLLM's skip_special_tokens).
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # The output must match this constraint (replica/core/structured_output.py); the edge
    # has compiled it once already, so a bad one never gets this far.
    structured_output: Optional["StructuredOutput"] = None

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < GREEDY_TEMPERATURE_EPS:
            object.__setattr__(self, "temperature", 0.0)
        # An integer of another type (numpy's, from an offline script) as the int it is: the
        # sampler's arrays take Python ints (np.int64 seeds overflowed there, failing the step).
        for name in ("max_tokens", "top_k", "top_logprobs", "prompt_logprobs", "seed"):
            if _other_integer(value := getattr(self, name)):
                object.__setattr__(self, name, operator.index(value))
        if any(map(_other_integer, self.stop_token_ids)):
            object.__setattr__(self, "stop_token_ids", tuple(map(_as_int, self.stop_token_ids)))
        if any(_other_integer(token_id) for token_id, _ in self.logit_bias):
            object.__setattr__(self, "logit_bias", tuple((_as_int(token_id), bias) for token_id, bias in self.logit_bias))

    def validate(self, *, prompt_len: int, max_model_len: int, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field (validate_request's second half)."""
        # In-process callers (LLMEngine.add_request) hand these in unchecked by any schema: a
        # float seed passed here and failed the whole step, every other request's with it.
        optional_ints = tuple(name for name in ("seed", "prompt_logprobs") if getattr(self, name) is not None)
        for name in ("max_tokens", "top_k", "top_logprobs") + optional_ints:
            if not _is_int(getattr(self, name)):
                raise InvalidRequestError(name, f"must be an integer, got {getattr(self, name)!r}")
        for name, token_ids in (("stop_token_ids", self.stop_token_ids),
                                ("logit_bias", [token_id for token_id, _ in self.logit_bias]),
                                ("kept_special_token_ids", self.kept_special_token_ids)):
            for token_id in token_ids:
                if not _is_int(token_id):
                    raise InvalidRequestError(name, f"token ids must be integers, got {token_id!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequestError("skip_special_tokens", f"must be true or false, got {self.skip_special_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if prompt_len + self.max_tokens > max_model_len:
            raise context_length_exceeded(max_model_len, prompt_len, self.max_tokens)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            # NaN passes every comparison below, and infinities turn logits into NaN.
            if not math.isfinite(value):
                raise InvalidRequestError(name, f"must be a finite number, got {value}")
            if abs(value) > FLOAT32_MAX:
                raise InvalidRequestError(name, f"must be at most {FLOAT32_MAX:.4g} in magnitude (a 32-bit float), "
                                                f"got {value:g}")
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 (off) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs",
                                      f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            low, high = PENALTY_RANGE
            if not low <= getattr(self, name) <= high:
                raise InvalidRequestError(name, f"must be in [{low:g}, {high:g}], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for stop in self.stop:
            if not stop:
                raise InvalidRequestError("stop", "an empty stop string would end every request before its first token")
            check_text("stop", stop)
        self._validate_token_ids(vocab_size)

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        low, high = LOGIT_BIAS_RANGE
        for token_id, bias in self.logit_bias:
            if not (math.isfinite(bias) and low <= bias <= high):
                raise InvalidRequestError("logit_bias", f"bias of token {token_id} must be in [{low:g}, {high:g}], got {bias}")
        if vocab_size is None:
            return
        for field_name, token_ids in (("stop_token_ids", self.stop_token_ids),
                                      ("logit_bias", [token_id for token_id, _ in self.logit_bias]),
                                      ("kept_special_token_ids", self.kept_special_token_ids)):
            for token_id in token_ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidRequestError(field_name, f"token id {token_id} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def num_logprobs(self) -> Optional[int]:
        """Alternatives per token when the sampled token's logprob is asked for, else None."""
        return self.top_logprobs if self.logprobs or self.top_logprobs else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _other_integer(value: object) -> bool:
    """An integer that is not a Python int (numpy's, torch's 0-d): one operator.index converts."""
    if isinstance(value, (int, float, str)) or value is None:
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _as_int(value: object) -> object:
    return operator.index(value) if _other_integer(value) else value


def check_text(field_name: str, text: str) -> None:
    """Raise InvalidRequestError when `text` cannot be UTF-8 encoded (a lone surrogate, which
    JSON's \\ud800 escapes can carry): tokenizers and every client downstream would choke on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            field_name, f"not valid Unicode: lone surrogate {text[error.start]!r} at index {error.start}"
        ) from None


# The fields a model's generation_config.json may set defaults for, under the names both use
# (vLLM's list; its max_new_tokens is SamplingDefaults.max_tokens).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request's unset sampling parameters take: the model's recommendations (its
    generation_config.json, under EngineConfig.generation_config "auto", as vLLM's
    --generation-config auto) where it gives them, else SamplingParams' own defaults. Every door
    (OpenAI HTTP, gRPC, the CLI through gRPC) builds its SamplingParams with `sampling_params`."""

    params: SamplingParams = SamplingParams()  # SamplingParams' defaults, the model's in place
    max_tokens: Optional[int] = None  # the model's max_new_tokens: the most an unset max_tokens means

    @property
    def model_values(self) -> dict[str, Any]:
        """The defaults the model changes, by field: what the engine logs at start."""
        built_in = SamplingParams()
        changed = {name: getattr(self.params, name) for name in MODEL_DEFAULT_FIELDS
                   if getattr(self.params, name) != getattr(built_in, name)}
        return changed if self.max_tokens is None else {**changed, "max_tokens": self.max_tokens}

    def sampling_params(self, **given: Any) -> SamplingParams:
        """SamplingParams of a request's fields; each one given as None (unset) takes its default."""
        return SamplingParams(**{name: getattr(self.params, name) if value is None else value
                                 for name, value in given.items()})

    def max_tokens_or_default(self, requested: Optional[int], room: int) -> int:
        """A request's max_tokens; unset, up to the context (`room`: max_model_len less the prompt),
        as OpenAI's and vLLM's APIs mean it, and at most the model's max_new_tokens."""
        if requested is not None:
            return requested
        return room if self.max_tokens is None else min(room, self.max_tokens)


StopReason = Union[str, int]  # the stop string or stop token id that ended a request


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids (some have several)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value is served first (vLLM's convention)
    ttft_deadline: Optional[float] = None  # absolute, on the engine's clock
    cache_salt: Optional[str] = None  # isolates this request's prefix-cache entries

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens scheduled steps will sample but that are not appended yet: with overlapped
    # scheduling the next step is planned while the device still samples this one's token.
    num_pending_tokens: int = 0
    num_preemptions: int = 0  # for memory
    num_slo_preemptions: int = 0  # forward passes aborted to let a more urgent request in
    # The prompt's prefix-cache hit (device and host tiers) at its first admission: what usage
    # reports as cached. A readmission's hit covers its own output too, and a swap-in restores
    # rather than hits: neither says what the cache saved the prompt.
    num_cached_tokens: int = 0
    num_start_tokens: int = 0  # tokens it did not compute at its latest admission: hits, restored, kept
    # Computed tokens thrown away by the latest preemption; settled on re-admission,
    # when the prefix-cache hit tells how many of them really must be recomputed.
    num_computed_tokens_lost: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    admitted_time: Optional[float] = None  # latest admission to running
    waiting_since: Optional[float] = None  # arrival, or its latest requeue: when its current wait began
    first_admitted_time: Optional[float] = None
    stop_reason: Optional[StopReason] = None  # the stop token id or string that finished it
    # The engine core's matcher of sampling_params.structured_output (a RequestGrammar), set
    # once compiled; it has consumed exactly output_token_ids.
    grammar: Optional[Any] = None
    # The engine core's prompt log-probabilities gathered so far (sampling_params.prompt_logprobs),
    # prefill chunk by prefill chunk: entry i is prompt token i + 1's. Complete when the first
    # token is sampled, which carries them out.
    prompt_logprobs: Optional["GatheredPromptLogprobs"] = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # Hashes of the full blocks of all_token_ids, extended lazily by the KV cache manager.
        self.block_hashes: list = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def gathers_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not yet out (they go with the first
        token): every prompt position must be computed, none taken from the prefix cache."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int) -> Optional[RequestStatus]:
        """The finished status the just-appended token puts this request in, if any."""
        params = self.sampling_params
        if (len(self.output_token_ids) < params.max_tokens and token_id not in params.stop_token_ids
                and (params.ignore_eos or token_id not in self.eos_token_ids)):
            return None  # the common case, once per request and step: nothing below applies
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def context_length_exceeded(max_model_len: int, num_prompt_tokens: int,
                            max_tokens: Optional[int] = None) -> ContextLengthExceededError:
    """The refusal of a prompt that leaves no room to generate within the context (`prompt`), or
    of a prompt and max_tokens past it (`max_tokens`), in the sentence OpenAI's API and vLLM's
    server send (clients match "maximum context length"), the same over gRPC and HTTP."""
    head = f"This model's maximum context length is {max_model_len} tokens."
    if max_tokens is None:
        return ContextLengthExceededError(
            "prompt", f"{head} However, your request has {num_prompt_tokens} input tokens, which leaves no room for "
                      "the completion. Please reduce the length of the input messages.")
    return ContextLengthExceededError(
        "max_tokens", f"{head} However, you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                      f"the messages, {max_tokens} in the completion). Please reduce the length of the messages or "
                      "completion.")


def validate_request(prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *, max_model_len: int,
                     vocab_size: int | None = None) -> None:
    """Raise InvalidRequestError naming the first bad field of the prompt or the sampling params.

    The one validation of a request, run once where it enters: the cluster's ingress (against its
    replicas' ModelInfo), a replica's own gRPC servicer, and LLMEngine.add_request for in-process
    callers. Inside, a request is trusted: the front and the engine core check only what their own
    state decides (a request id in use, a full queue) and what protects memory
    (Scheduler.check_request)."""
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    if len(prompt_token_ids) >= max_model_len:
        raise context_length_exceeded(max_model_len, len(prompt_token_ids))
    if vocab_size is not None:
        for token_id in prompt_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError("prompt_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
    sampling_params.validate(prompt_len=len(prompt_token_ids), max_model_len=max_model_len, vocab_size=vocab_size)
