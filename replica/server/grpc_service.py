"""The replica's gRPC servicers: Generation (streaming Generate, Tokenize, GetModelInfo) and
LoadReporter (GetLoad, WatchLoad, WatchKVEvents) over one AsyncEngine (the engine core's front). Requests are
validated here, once, at the edge (replica.core.request.validate_request; the front and the core trust them),
and every engine error maps to one gRPC status whose message names the proto field.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

from typing import TYPE_CHECKING

import grpc

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from protos.not_serving import ENGINE_CORE_DIED, SHUTTING_DOWN, not_serving_metadata
from replica.front.async_engine import AsyncEngine, RequestStream, ServedEngine
from replica.errors import HeadroomError, InvalidRequestError
from replica.text.chat_template import ChatTemplateError
from replica.core.outputs import PromptLogprobs, RequestOutput
from replica.core.kv_events import medium_of
from replica.front.kv_event_log import KVEventBatch
from replica.server.load_report import LoadReportBuilder, is_significant_change
from replica.server.shared_messages import SharedMessagesCache
from replica.core.request import (
    SamplingDefaults, SamplingParams, check_text, context_length_exceeded, validate_request,
)
from replica.server.request_limits import RequestLimits, encode_prompt
from replica.server.status import grpc_status
from replica.core.structured_output import GrammarCompiler, StructuredOutput
from replica.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from replica.core.engine import LLMEngine

FINISH_REASON_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
DEFAULT_WATCH_INTERVAL_MS = 100
# Conversations up to this many messages are checked and rendered on the event loop (well
# under a millisecond with the built-in fallback format); longer ones on a worker thread.
INLINE_RENDER_MAX_MESSAGES = 256
# An output constraint's text up to this long is read on the event loop (well under a
# millisecond); a longer one on a worker thread.
INLINE_CONSTRAINT_MAX_CHARS = 64 * 1024
# A snapshot of a large prefix cache goes out in parts of at most this many events (~40
# bytes each), far below gRPC's default 4 MiB message limit. Each part is applied on the
# router's event loop in one go, where its routing runs: a part of 16,384 took 13 ms there
# (2-core VM: reading the events out of the message, ~0.8 us each), 4,096 takes ~3 ms.
KV_EVENTS_PER_MESSAGE = 4096
# A first response carrying up to this many prompt positions' logprobs is built on the event loop
# (~3 ms at 20 alternatives each); a longer one on a worker thread: 8,192 positions of 20 alternatives
# took 23 ms of the loop, every stream's.
INLINE_PROMPT_LOGPROBS_MAX_POSITIONS = 1024
# A first response's prompt logprobs go out in parts of at most about this many bytes, each on
# a message of its own: gRPC clients refuse a message over 4 MiB by default, and the top 20 of
# a prompt of ~29k tokens is more (PromptLogprobs.start).
PROMPT_LOGPROBS_PART_BYTES = 1 << 20
# WatchLoad streams check for server shutdown at least this often, whatever interval the
# client asked for, so stop() ends them cleanly instead of cancelling them.
WATCH_STOP_CHECK_S = 0.1


# The proto -> engine mapping of a GenerateRequest, shared by this servicer and the cluster's
# ingress (which serves the same service through Ray Serve's gRPC proxy).
async def prompt_token_ids_from_proto(request: pb.GenerateRequest, tokenizer: Tokenizer,
                                      limits: RequestLimits, max_model_len: Optional[int] = None) -> list[int]:
    """The prompt's token ids; a request over `limits` fails before anything is tokenized, and
    token ids past `max_model_len` before they are copied out of the message. Its size is the
    caller's to check, where its bytes are known (check_request_limits)."""
    check_request_limits(request, limits)
    prompt_kind = request.WhichOneof("prompt")
    if prompt_kind is None:
        raise InvalidRequestError("prompt", "set exactly one of text, token_ids or chat")
    if prompt_kind == "token_ids":
        ids = request.token_ids.ids
        if max_model_len is not None and len(ids) >= max_model_len:  # validate_request's refusal, in O(1):
            # copying 4 million ids out of a 4 MiB message held the event loop, every stream's, ~0.2 s
            raise context_length_exceeded(max_model_len, len(ids))
        return list(ids)
    if prompt_kind == "chat":
        chat = request.chat.messages
        if len(chat) <= INLINE_RENDER_MAX_MESSAGES:
            messages = chat_messages(chat)
        else:  # gathering 400,000 of them took 0.2 s of the event loop
            messages = await asyncio.to_thread(chat_messages, chat)
        return await chat_prompt_token_ids(tokenizer, messages, field="chat.messages", limits=limits)
    if not request.text:  # checked before encoding, which may add a BOS to empty text
        raise InvalidRequestError("prompt", "must not be empty")
    return await encode_prompt(tokenizer, request.text, add_special_tokens=request.add_special_tokens,
                               limits=limits, field_name="text")


def check_request_limits(request: pb.GenerateRequest, limits: RequestLimits) -> None:
    """What a GenerateRequest may bring in beyond its prompt (RequestLimits), checked before any
    work is spent on it: its id, and the stop conditions and biases that cost every token of its
    stream. Not its size: a replica's server refuses a request over the byte limit from its raw
    bytes, before parsing them (MalformedRequestInterceptor), and the cluster's ingress, handed a
    parsed message, measures it; ByteSize costs a whole serialization (10 ms of the event loop for
    4 MiB of token ids)."""
    limits.check_request_id(request.request_id)
    sampling = request.sampling
    limits.check_stop(sampling.stop)
    limits.check_token_lists(len(sampling.stop_token_ids), len(sampling.logit_bias))


def chat_messages(chat) -> list[dict]:
    return [{"role": message.role, "content": message.content} for message in chat]


async def chat_prompt_token_ids(tokenizer: Tokenizer, messages: list[dict], *, field: str,
                                limits: RequestLimits, tools: Optional[list[dict]] = None,
                                off_loop: bool = False, **template_options: Any) -> list[int]:
    """A conversation's prompt ids through the model's chat template (gRPC `chat`, OpenAI
    `messages`, with OpenAI's `tools` as the template's variable); the contents are checked
    against `limits` before anything is rendered. A conversation of many messages is checked
    and rendered on a worker thread, as a long text is tokenized there: 400,000 empty messages
    (2 MB) held the event loop, every stream's, for 0.65 s before the rendered text was found
    over the character limit (SmolLM2's Jinja template renders 300,000 in 0.8 s). `off_loop`: on
    a worker thread whatever the count (a caller that knows the conversation is large).
    `template_options`: Tokenizer.apply_chat_template's (OpenAI's add_generation_prompt, ...)."""
    if not messages:
        raise InvalidRequestError(field, "must hold at least one message")
    if len(messages) <= INLINE_RENDER_MAX_MESSAGES and not off_loop:
        text = _render_chat(tokenizer, messages, field=field, limits=limits, tools=tools, **template_options)
    else:
        text = await asyncio.to_thread(functools.partial(_render_chat, tokenizer, messages, field=field, limits=limits,
                                                         tools=tools, **template_options))
    # The rendered template already holds its special tokens.
    return await encode_prompt(tokenizer, text, add_special_tokens=False, limits=limits, field_name=field)


def _render_chat(tokenizer: Tokenizer, messages: list[dict], *, field: str, limits: RequestLimits,
                tools: Optional[list[dict]], **template_options: Any) -> str:
    """The conversation's prompt text, its messages checked first (chat_prompt_token_ids)."""
    for index, message in enumerate(messages):
        if not message["role"]:
            raise InvalidRequestError(f"{field}[{index}].role", "must not be empty")
        check_text(f"{field}[{index}].content", message["content"])
    limits.check_prompt_text(field, "".join(message["content"] for message in messages))
    try:
        return tokenizer.apply_chat_template(messages, tools, **template_options)
    except ChatTemplateError as error:
        raise InvalidRequestError(field, str(error)) from error


async def output_constraint_from_proto(request: pb.GenerateRequest) -> Optional[tuple[StructuredOutput, str]]:
    """The request's structured-output constraint (its `output_constraint` oneof) and the name
    of the field that holds it; None when unset (or json_object is false)."""
    kind = request.WhichOneof("output_constraint")
    if kind is None or (kind == "json_object" and not request.json_object):
        return None
    value = request.choice.choices if kind == "choice" else getattr(request, kind)
    if isinstance(value, str) and len(value) > INLINE_CONSTRAINT_MAX_CHARS:
        # Parsing and checking a schema of megabytes (within the 4 MiB request bound) held
        # the event loop, every stream's, for 2.5 s.
        return await asyncio.to_thread(StructuredOutput.of, kind, value, kind), kind
    return StructuredOutput.of(kind, value, kind), kind


def named_for_request(error: BaseException, request: pb.GenerateRequest) -> BaseException:
    """`error` naming the request's own output-constraint field (`regex`, `json_schema`, ...)
    where the engine ended the request for its constraint (field "structured_output"), as the
    edge's refusals name it."""
    if isinstance(error, InvalidRequestError) and error.field == "structured_output":
        kind = request.WhichOneof("output_constraint")
        if kind is not None:
            return InvalidRequestError(kind, error.message)
    return error


def sampling_params_from_proto(
    sampling: pb.SamplingParams, *, max_model_len: int, num_prompt_tokens: int,
    defaults: SamplingDefaults = SamplingDefaults(),
) -> SamplingParams:
    """The request's sampling parameters; a field it leaves unset takes `defaults`' (the model's)."""
    def given(name: str) -> Any:
        return getattr(sampling, name) if sampling.HasField(name) else None

    return defaults.sampling_params(
        # Unset means "up to the context length" (at most the model's max_new_tokens), as the proto documents.
        max_tokens=defaults.max_tokens_or_default(given("max_tokens"), max_model_len - num_prompt_tokens),
        temperature=given("temperature"),
        top_p=given("top_p"),
        top_k=given("top_k"),
        min_p=given("min_p"),
        seed=given("seed"),
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        prompt_logprobs=given("prompt_logprobs"),
        stop=tuple(sampling.stop),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        skip_special_tokens=given("skip_special_tokens"),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=given("repetition_penalty"),
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
    )


def _positive_ms(request: pb.GenerateRequest, field_name: str) -> Optional[float]:
    if not request.HasField(field_name):
        return None
    value = getattr(request, field_name)
    if not (math.isfinite(value) and value > 0):
        raise InvalidRequestError(field_name, f"must be > 0, got {value}")
    return value


@dataclass(frozen=True)
class TTFTTargets:
    """A request's time-to-first-token targets, in ms from arrival."""

    slo_ms: Optional[float]  # what the scheduler aims for (the `slo` policy orders by it)
    deadline_ms: Optional[float]  # past it without a first token, the request is aborted

    @property
    def first_token_timeout_s(self) -> Optional[float]:
        return None if self.deadline_ms is None else self.deadline_ms / 1000.0


def ttft_targets_from_proto(request: pb.GenerateRequest) -> TTFTTargets:
    slo_ms = _positive_ms(request, "ttft_slo_ms")
    deadline_ms = _positive_ms(request, "ttft_deadline_ms")
    # A hard deadline is a target too: without an explicit SLO the scheduler aims for it.
    return TTFTTargets(slo_ms=slo_ms if slo_ms is not None else deadline_ms, deadline_ms=deadline_ms)


def generate_response(output: RequestOutput, replica_id: str) -> pb.GenerateResponse:
    """One engine output as a Generate response; the replica and the cluster ingress both send these.
    Built with the fields that are set only: it runs once per message of every stream (one per
    token for a stream that keeps up), and the keyword form with an empty top-logprobs list,
    a Usage built apart and a dict for the stop reason cost twice as much (a test checks that
    both forms give the same message)."""
    response = pb.GenerateResponse(request_id=output.request_id, token_ids=output.new_token_ids, text=output.text,
                                   finish_reason=FINISH_REASON_TO_PROTO[output.finish_reason], replica_id=replica_id)
    usage = response.usage  # set even when all three are 0, as clients read it on every message
    usage.SetInParent()
    usage.prompt_tokens = output.num_prompt_tokens
    usage.completion_tokens = output.num_output_tokens
    usage.cached_prompt_tokens = output.num_cached_tokens
    if output.logprobs:
        response.logprobs.extend(output.logprobs)
    if output.top_logprobs:
        response.top_logprobs.extend(pb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)
                                     for top in output.top_logprobs)
    stop_reason = output.stop_reason
    if isinstance(stop_reason, str):
        response.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        response.stop_token_id = stop_reason
    if output.prompt_logprobs is not None:
        _set_prompt_logprobs(response.prompt_logprobs, output.prompt_logprobs)
    return response


def generate_responses(output: RequestOutput, replica_id: str) -> list[pb.GenerateResponse]:
    """One engine output as the Generate responses that carry it: one, but for a first output
    whose prompt logprobs would pass PROMPT_LOGPROBS_PART_BYTES, which go in parts, each on a
    response of its own (no tokens; its usage and ids as the output's) but the last, which
    rides with the output's own response."""
    prompt_logprobs = output.prompt_logprobs
    per_part = _prompt_logprobs_per_part(prompt_logprobs)
    if prompt_logprobs is None or len(prompt_logprobs.logprobs) <= per_part:
        return [generate_response(output, replica_id)]
    starts = range(0, len(prompt_logprobs.logprobs), per_part)
    responses = []
    for start in starts[:-1]:
        response = pb.GenerateResponse(request_id=output.request_id, replica_id=replica_id)
        response.usage.prompt_tokens = output.num_prompt_tokens  # as on every message
        response.usage.completion_tokens = output.num_output_tokens - len(output.new_token_ids)
        response.usage.cached_prompt_tokens = output.num_cached_tokens
        _set_prompt_logprobs(response.prompt_logprobs, prompt_logprobs, start, start + per_part)
        responses.append(response)
    last = generate_response(replace(output, prompt_logprobs=None), replica_id)
    _set_prompt_logprobs(last.prompt_logprobs, prompt_logprobs, starts[-1], len(prompt_logprobs.logprobs))
    responses.append(last)
    return responses


def _prompt_logprobs_per_part(prompt_logprobs: Optional[PromptLogprobs]) -> int:
    """Positions per part: each at most its packed logprob and rank (5 bytes each) and a
    TopLogprobs entry of k ids (up to 5 bytes each), k floats and its tags (6 bytes)."""
    num_top = len(prompt_logprobs.top[0].token_ids) if prompt_logprobs is not None and prompt_logprobs.top else 0
    return max(1, PROMPT_LOGPROBS_PART_BYTES // (16 + 9 * num_top))


def _set_prompt_logprobs(message: pb.PromptLogprobs, prompt_logprobs: PromptLogprobs, start: int = 0,
                         stop: Optional[int] = None) -> None:
    message.SetInParent()  # present even for a one-token prompt, which has no entries
    message.logprobs.extend(prompt_logprobs.logprobs[start:stop])
    message.ranks.extend(prompt_logprobs.ranks[start:stop])
    if start:
        message.start = start
    add = message.top_logprobs.add  # in place: a third faster than extending with built messages
    for top in (prompt_logprobs.top or ())[start:stop]:
        add(token_ids=top.token_ids, logprobs=top.logprobs)


async def generate_responses_off_loop(output: RequestOutput, replica_id: str) -> list[pb.GenerateResponse]:
    """generate_responses, built on a worker thread for an output carrying more than
    INLINE_PROMPT_LOGPROBS_MAX_POSITIONS prompt logprobs (a first one), else here."""
    if output.prompt_logprobs is None or len(output.prompt_logprobs.logprobs) <= INLINE_PROMPT_LOGPROBS_MAX_POSITIONS:
        return generate_responses(output, replica_id)
    return await asyncio.to_thread(generate_responses, output, replica_id)


def engine_priority(proto_priority: int) -> int:
    # The proto runs higher priorities first (what clients expect); the engine, like vLLM,
    # serves lower values first.
    return -proto_priority


def model_info_proto(engine: LLMEngine | ServedEngine, model_id: str) -> pb.ModelInfo:
    eos_token_ids = engine.eos_token_ids
    return pb.ModelInfo(
        model_id=model_id,
        max_model_len=engine.config.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        block_size=engine.config.block_size,
        eos_token_id=eos_token_ids[0] if eos_token_ids else -1,
    )


async def _write(context: grpc.aio.ServicerContext, response: pb.GenerateResponse) -> bool:
    """Write one response; False when the call is already over (its client disconnected or
    reset the stream: grpc raises its ExecuteBatchError, a grpc.aio.InternalError, which, let
    through, logged a traceback at ERROR for every slow reader that hung up). Anything else (a
    response of ours that does not serialize) still fails the call."""
    try:
        await context.write(response)
    except (grpc.aio.InternalError, grpc.aio.UsageError) as error:
        logger.debug("Generate: the client is gone (%s)", type(error).__name__)
        return False
    return True


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine, replica_id: str, model_id: str, limits: RequestLimits = RequestLimits()):
        self.engine = engine
        self.replica_id = replica_id
        self.model_id = model_id
        self.limits = limits
        # Made now, before the server serves: llguidance's view of the tokenizer takes ~0.23 s
        # with the GIL held (SmolLM2's 49k ids), which made by the first constrained request
        # stalled every stream this event loop serves. A tokenizer llguidance cannot take is
        # left to the first constrained request to report.
        self._grammars: Optional[GrammarCompiler] = None
        try:
            self._grammars = self._make_grammars()
        except Exception as error:  # noqa: BLE001 - a constrained request reports it
            logger.warning("structured outputs: no grammar compiler for this tokenizer (%s)", error)

    def _make_grammars(self) -> GrammarCompiler:
        engine = self.engine.engine
        return GrammarCompiler.for_tokenizer(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                                             engine.config)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            stream = await self._add_request(request)
        except HeadroomError as error:  # refused on entry: invalid, queue full, shutting down, core dead
            await context.abort(*grpc_status(error))

        failure: Optional[BaseException] = None
        try:
            # grpc.aio also cancels this task when the client's deadline passes; the
            # timeout makes the status DEADLINE_EXCEEDED even if that races our writes.
            async with asyncio.timeout(context.time_remaining()):
                async for output in stream:
                    for response in await generate_responses_off_loop(output, self.replica_id):
                        if not await _write(context, response):
                            return  # the client is gone: the request is aborted below, nothing to report
        except (TimeoutError, HeadroomError) as error:
            # The call's deadline, a missed TTFT deadline, a failed step (the engine already
            # aborted the request), a dead core, or a queue that filled after validation.
            failure = error
        finally:
            # Runs on client cancellation too (grpc.aio cancels this task): the request
            # must not keep its KV blocks once nobody reads its stream.
            if not stream.finished:
                self.engine.abort_stream(stream)
        if failure is not None:
            await context.abort(*grpc_status(named_for_request(failure, request)))

    async def _add_request(self, request: pb.GenerateRequest) -> RequestStream:
        engine = self.engine.engine
        prompt_token_ids = await prompt_token_ids_from_proto(request, engine.tokenizer, self.limits,
                                                             engine.config.max_model_len)
        ttft = ttft_targets_from_proto(request)
        sampling = sampling_params_from_proto(request.sampling, max_model_len=engine.config.max_model_len,
                                              num_prompt_tokens=len(prompt_token_ids),
                                              defaults=engine.sampling_defaults)
        # This replica's edge: the one validation a request it serves gets, before anything
        # costly (its output constraint's compile) is done for it.
        validate_request(prompt_token_ids, sampling, max_model_len=engine.config.max_model_len,
                         vocab_size=engine.model_config.vocab_size)
        engine.config.check_request_priority(request.priority)
        sampling = await self._with_output_constraint(request, sampling)
        return self.engine.add_request(
            prompt_token_ids,
            sampling,
            request_id=request.request_id or None,
            priority=engine_priority(request.priority),
            ttft_slo_ms=ttft.slo_ms,
            first_token_timeout_s=ttft.first_token_timeout_s,
        )

    async def _with_output_constraint(self, request: pb.GenerateRequest, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with the request's output constraint, compiled here first (cached, within
        the time bound, off the event loop) so that a bad one is refused naming its field."""
        found = await output_constraint_from_proto(request)
        if found is None:
            return sampling
        constraint, field_name = found
        if self._grammars is None:  # raises what llguidance refused at start
            self._grammars = await asyncio.to_thread(self._make_grammars)
        await self._grammars.check_async(constraint, field_name)
        return replace(sampling, structured_output=constraint)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            token_ids = await encode_prompt(self.engine.engine.tokenizer, request.text,
                                            add_special_tokens=request.add_special_tokens, limits=self.limits,
                                            field_name="text")
        except InvalidRequestError as error:
            await context.abort(*grpc_status(error))
        return pb.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return model_info_proto(self.engine.engine, self.model_id)


def kv_event_batch_protos(batch: KVEventBatch, replica_id: str, block_size: int) -> Iterator[pb.KVEventBatch]:
    """One KVEventBatch as messages: one for a step's events, several parts for a big snapshot,
    each built as it is asked for (the caller writes each before the next is built: a snapshot
    of 262,144 blocks built whole took 0.5 s, and WatchKVEvents builds such parts on a worker
    thread, as they held the front's event loop, every stream on it, 30 ms each). Each event is
    added in place: a part built from a list of 16,384 KVEvent messages, all alive at once, set
    off full garbage collections of 40-50 ms with the GIL held, the event loop's too."""
    events = batch.events
    for start in range(0, max(len(events), 1), KV_EVENTS_PER_MESSAGE):
        message = pb.KVEventBatch(replica_id=replica_id, seq=batch.seq, snapshot=batch.snapshot, block_size=block_size)
        add = message.events.add
        for event in events[start : start + KV_EVENTS_PER_MESSAGE]:
            add(kind=int(event[0]), block_hash=event[1], parent_hash=event[2] or b"", medium=medium_of(event))
        yield message


class LoadReporterServicer(pb_grpc.LoadReporterServicer):
    def __init__(self, engine: AsyncEngine, load_reports: LoadReportBuilder, stopping: asyncio.Event):
        self.engine = engine
        self.load_reports = load_reports
        self.stopping = stopping
        # A big batch's messages (a snapshot's), built once for the WatchKVEvents streams
        # sending it at the same time (the log hands them the same snapshot).
        self._kv_batch_messages = SharedMessagesCache()

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.ReplicaLoad:
        await self._abort_if_not_serving(context)
        return self.load_reports.build_for(self.engine)

    async def _abort_if_not_serving(self, context: grpc.aio.ServicerContext) -> None:
        """A call begun when the replica can serve nothing more: its core died, or it is
        shutting down (a new watch would end at once; GetLoad's load would draw requests)."""
        await self._abort_if_core_dead(context)
        if self.stopping.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica is shutting down",
                                trailing_metadata=not_serving_metadata(SHUTTING_DOWN))

    async def _abort_if_core_dead(self, context: grpc.aio.ServicerContext) -> None:
        # A dead core's last load would look healthy forever: routers must see no load instead.
        if self.engine.dead is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(self.engine.dead),
                                trailing_metadata=not_serving_metadata(ENGINE_CORE_DIED))

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: grpc.aio.ServicerContext) -> None:
        max_interval_s = (request.max_interval_ms or DEFAULT_WATCH_INTERVAL_MS) / 1000.0
        await self._abort_if_not_serving(context)
        version = self.engine.load_version
        sent_load = self.engine.load()
        # Each message says when the core took its load and how old it is (a load sent again,
        # the core not having stepped, keeps ageing unless it is current): load_report.py.
        await context.write(self.load_reports.build_for(self.engine))
        sent_at = time.monotonic()
        while not self.stopping.is_set():
            await self._abort_if_core_dead(context)
            until_due_s = max_interval_s - (time.monotonic() - sent_at)
            if until_due_s > 0:
                version = await self.engine.wait_for_load(version, timeout=min(until_due_s, WATCH_STOP_CHECK_S))
            load = self.engine.load()
            due = time.monotonic() - sent_at >= max_interval_s
            if due or is_significant_change(sent_load, load):
                await context.write(self.load_reports.build_for(self.engine))
                sent_load, sent_at = load, time.monotonic()

    async def _write_shared_parts(self, batch: KVEventBatch, replica_id: str, block_size: int,
                                  context: grpc.aio.ServicerContext) -> None:
        parts = self._kv_batch_messages.get(batch, lambda: kv_event_batch_protos(batch, replica_id, block_size))
        reader = parts.join()
        try:
            index = 0
            while (message := await parts.get(reader, index)) is not None:
                await context.write(message)
                index += 1
        finally:
            parts.leave(reader)

    async def WatchKVEvents(self, request: pb.WatchKVEventsRequest, context: grpc.aio.ServicerContext) -> None:
        # A dead core's cache died with it: routers must drop their index.
        await self._abort_if_not_serving(context)
        log = self.engine.kv_events
        replica_id = self.load_reports.replica_id
        block_size = self.engine.engine.config.block_size
        seq = None  # what this subscriber has been sent up to; None: it needs a snapshot
        while not self.stopping.is_set():
            await self._abort_if_core_dead(context)
            for batch in await log.batches_after(seq):
                if len(batch.events) <= KV_EVENTS_PER_MESSAGE:
                    await context.write(next(kv_event_batch_protos(batch, replica_id, block_size)))
                else:  # a big batch's parts (a snapshot's) are ~7 ms of Python each: built on a worker thread, once
                    await self._write_shared_parts(batch, replica_id, block_size, context)
                seq = batch.seq
            await log.wait_for_batch(seq, timeout=WATCH_STOP_CHECK_S)
