"""The messages between a replica's front and its engine core: one NamedTuple per kind.

On the wire a message is the plain tuple `(kind, *fields)`, and every nested value is a
tuple, list, str or number too: pickling those is ~8x faster than pickling NamedTuples or
dataclasses, which matters for the per-step output batch (bench/bench_channel.py).

Nothing that crosses to the front needs torch to unpickle: the front's process never imports
it (tests/test_light_imports.py runs a front with torch blocked). The model's config keeps its
dtype by name, and errors cross through `error_for_front`.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, NamedTuple, Optional

from replica.config import EngineConfig
from replica.model import ModelConfig
from replica.core.request import Request, SamplingDefaults, SamplingParams
from replica.core.load import LOAD_FIELDS, SchedulerLoad

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))

# How long another front may take to attach (its first word) after the core started, while
# front_stall_timeout_s is on: one that has not by then hung while starting, and would have a
# message queued for it every step for ever, its stall clock never started. A front process's
# start (Python, its imports, its gRPC server) takes 2-5 s: this is ten times that, for a
# loaded node, and twice again; what queues for it meanwhile is one message a step (the load and
# KV events), ~12k at 100 steps a second.
# Front 0 waits as long for each other front to say it serves (cluster/replica_command.py).
FRONT_ATTACH_TIMEOUT_S = 120.0


# ---- start-up (sent once, before the loop) ---------------------------------------------
class CoreSpec(NamedTuple):
    """What the core process builds: LLMEngine's constructor arguments, plus process settings."""

    config: EngineConfig
    model: str
    device: Optional[str] = None
    dtype: Optional[str] = None
    attention_backend: str = "auto"
    # torch intra-op threads in the core; None keeps torch's default (one per core).
    torch_threads: Optional[int] = None
    # "module:callable" taking LLMEngine's arguments; another engine class (or a test's
    # instrumented one) plugs in here.
    engine_factory: str = "replica.core.engine:LLMEngine"
    # The front's chat template instead of the checkpoint's (--chat-template's text); the core
    # renders no chat.
    chat_template: Optional[str] = None


class CoreReady(NamedTuple):
    """The core's answer once its engine is built: the facts the front validates and reports with."""

    config: EngineConfig  # as resolved by the core (the KV pool may be sized from free memory)
    model_config: ModelConfig
    eos_token_ids: tuple[int, ...]
    sampling_defaults: SamplingDefaults  # what requests leave unset takes (the model's generation_config.json)
    device: str
    load: tuple  # SchedulerLoad's fields


class CoreFailed(NamedTuple):
    """The engine could not be built; the front re-raises `error` (e.g. ConfigError)."""

    error: BaseException


# ---- front -> core -----------------------------------------------------------------------
class AddRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    sampling: tuple  # SamplingParams' fields in declaration order
    priority: int
    arrival_time: float  # on CLOCK_MONOTONIC, which both processes share
    ttft_deadline: Optional[float]
    cache_salt: Optional[str]

    @classmethod
    def of(cls, request: Request) -> "AddRequest":
        params = request.sampling_params
        return cls(request.request_id, request.prompt_token_ids, tuple(getattr(params, f) for f in _SAMPLING_FIELDS),
                   request.priority, request.arrival_time, request.ttft_deadline, request.cache_salt)

    def to_request(self, eos_token_ids: tuple[int, ...]) -> Request:
        params = SamplingParams(**dict(zip(_SAMPLING_FIELDS, self.sampling)))
        return Request(self.request_id, list(self.prompt_token_ids), params, eos_token_ids=eos_token_ids,
                       arrival_time=self.arrival_time, priority=self.priority, ttft_deadline=self.ttft_deadline,
                       cache_salt=self.cache_salt)


class AbortRequests(NamedTuple):
    """Free these requests' blocks before the next step; unknown (already finished) ids are ignored."""

    request_ids: list[str]


class UtilityCall(NamedTuple):
    """Run one of EngineCore.UTILITIES between steps and answer with a UtilityResult."""

    call_id: int
    method: str
    args: tuple


class Shutdown(NamedTuple):
    """Abort everything, stop the SLO monitor and exit."""


# ---- core -> front -----------------------------------------------------------------------
class CoreOutput(NamedTuple):
    """What one step added to one request. Sent as a plain tuple in this field order, which
    LLMEngine.step_rows builds directly (no RequestOutput in the core: it detokenizes nothing)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str]  # "stop" | "length" once finished
    num_cached_tokens: int
    logprobs: Optional[list[float]]
    # Per new token, (token ids, logprobs) of its most likely alternatives, when asked for:
    # plain tuples on the wire; the front rebuilds TopLogprobs.
    top_logprobs: Optional[list[tuple[list[int], list[float]]]]
    stop_reason: Optional[int]  # the stop token id that finished it (stop strings are the front's)
    first_admitted_time: Optional[float]  # with the first token only (queue-time metric)
    # With the first token, when asked for: PromptLogprobArrays' numpy arrays (the front unpacks
    # them into PromptLogprobs' lists).
    prompt_logprobs: Optional[tuple]


class StepOutputs(NamedTuple):
    """Everything one core iteration has to say, in one message."""

    outputs: list[tuple]  # CoreOutput rows
    load: tuple  # SchedulerLoad's fields, taken after the step
    step_time_s: float  # StepStats, smoothed
    generation_tokens_per_s: float
    kv_events: list[Any]  # opaque: whatever the engine's per-step KV-event drain returns
    # Adds the scheduler refused (e.g. QueueFullError), and requests the engine ended with an
    # error of theirs (LLMEngine.take_failed: their rows above finish them "abort").
    rejected: list[tuple[str, BaseException]]


class StepFailed(NamedTuple):
    """A forward pass raised: these requests were aborted, the core keeps serving."""

    request_ids: list[str]
    message: str


class UtilityResult(NamedTuple):
    call_id: int
    value: Any
    error: Optional[BaseException]


FRONT_TO_CORE = (AddRequest, AbortRequests, UtilityCall, Shutdown)
CORE_TO_FRONT = (StepOutputs, StepFailed, UtilityResult)
_KINDS = {kind: index for index, kind in enumerate(FRONT_TO_CORE + CORE_TO_FRONT)}
_TYPES = FRONT_TO_CORE + CORE_TO_FRONT


def to_wire(message: NamedTuple) -> tuple:
    return (_KINDS[type(message)], *message)


def from_wire(wire: tuple) -> NamedTuple:
    return _TYPES[wire[0]]._make(wire[1:])


# Where the classes of errors that cross to the front as themselves live: modules the front
# imports anyway, none of them torch's (ConfigError, ModelConfigError, ModelLoadError,
# TokenizerLoadError, the request errors, the built-in exceptions).
FRONT_ERROR_MODULES = frozenset({"builtins", "replica.errors", "replica.config", "replica.model.config",
                                 "replica.text.tokenizer"})


def error_for_front(error: BaseException) -> BaseException:
    """`error` as it may cross to the front: itself when its class lives in FRONT_ERROR_MODULES
    and it pickles, else a RuntimeError naming its class (unpickling torch's OutOfMemoryError,
    or an error of a module that imports torch, would import torch in the front)."""
    if type(error).__module__ in FRONT_ERROR_MODULES:
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:
            pass
    return RuntimeError(f"{type(error).__name__}: {error}")


def load_to_wire(load: SchedulerLoad) -> tuple:
    return tuple(getattr(load, name) for name in LOAD_FIELDS)


def load_from_wire(values: tuple) -> SchedulerLoad:
    return SchedulerLoad(*values)
