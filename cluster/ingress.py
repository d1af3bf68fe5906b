"""The application's ingress: `headroom.v1.Generation` through Ray Serve's gRPC proxy and an
OpenAI-compatible HTTP API through its HTTP proxy, both streaming from LLMReplica through the
router. A replica lost before a request's first token is retried on another one.
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations at
# runtime, from the copy of the class Serve's ingress pickles, where names may not resolve.
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from cluster.config import ClusterConfig
from cluster.deployment import GenerationChunk, GenerationRequest, generate_stream, node_ip, serve_metrics_on_free_port
from cluster.openai_api import (
    SSE_DONE, ChatCompletionRequest, CompletionBodies, CompletionRequest, error_body, invalid_request_body, sse,
)
from protos import headroom_pb2 as pb
from replica.async_engine import EngineDeadError, FirstTokenDeadlineExceeded
from replica.grpc_service import (
    chat_prompt_token_ids, engine_priority, generate_response, invalid_argument_message, prompt_token_ids_from_proto,
    sampling_params_from_proto, ttft_targets_from_proto,
)
from replica.model.registry import resolve_model_path
from replica.request import InvalidRequestError, validate_prompt
from replica.scheduler import QueueFullError
from replica.tokenizer import Tokenizer
from router import metrics as router_metrics

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT_NAME = "Ingress"
HEAD_NODE_RESOURCE = "node:__internal_head__"
# How Ray reports a replica that died (killed, crashed, its node lost) under a call.
REPLICA_LOST_ERRORS = (RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError)
# Tries per request while no token has been streamed: the router drops a dead replica
# from its candidates once a call to it fails, so the next try lands elsewhere.
MAX_ATTEMPTS = 3
# The ingress only relays streams; the engines bound the work they accept (and refuse
# beyond their queues), so Serve's default limit of 5 would be the cluster's bottleneck.
INGRESS_MAX_ONGOING_REQUESTS = 100_000
# OpenAI's body field names for the engine's field names, where they differ.
COMPLETION_PARAM_FOR_FIELD = {"prompt_token_ids": "prompt"}
CHAT_PARAM_FOR_FIELD = {"prompt": "messages", "prompt_token_ids": "messages"}

api = FastAPI(title="headroom", description="OpenAI-compatible API of one headroom model")


class ReplicaLostError(RuntimeError):
    """The replica serving a stream died after the stream had produced tokens (which cannot
    be taken back), or every try died before producing one."""


@api.exception_handler(RequestValidationError)
async def _openai_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    location = [str(part) for part in first["loc"] if part != "body"]
    param = ".".join(location) or None
    return JSONResponse(error_body(f"{param or 'body'}: {first['msg']}", param), status_code=400)


async def _sse_stream(chunks: AsyncIterator[GenerationChunk], bodies: CompletionBodies, include_usage: bool,
                      param_for_field: dict[str, str]) -> AsyncIterator[str]:
    """OpenAI's SSE framing: `data: {json}` per chunk, then `data: [DONE]`. An error after the
    response started can only be an event of its own (the status line is already sent)."""
    first = bodies.first_chunk()
    if first is not None:
        yield sse(first)
    last: Optional[GenerationChunk] = None
    try:
        async for chunk in chunks:
            last = chunk
            yield sse(bodies.chunk(chunk))
        if include_usage and last is not None:
            yield sse(bodies.usage_chunk(last))
    except Exception as error:
        yield sse(_http_error(error, param_for_field)[1])
    yield SSE_DONE


def _http_error(error: Exception, param_for_field: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error body for a failure while streaming from a replica."""
    if isinstance(error, InvalidRequestError):
        return 400, invalid_request_body(error, param_for_field)
    if isinstance(error, QueueFullError):
        return 429, error_body(str(error), None, "queue_full", "rate_limit_error")
    if isinstance(error, ReplicaLostError):
        return 503, error_body(str(error), None, "replica_unavailable", "server_error")
    if isinstance(error, FirstTokenDeadlineExceeded):
        return 504, error_body(str(error), None, "ttft_deadline_exceeded", "server_error")
    logger.exception("request failed")
    return 500, error_body(f"internal error: {error}", None, "internal_error", "server_error")


def _abort(grpc_context: RayServegRPCContext, code: grpc.StatusCode, details: str, error: Exception) -> None:
    """Ends the call with `code`: Ray Serve reports the status set on the context when the
    method raises."""
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    raise error


# Serve's FastAPI ingress pickles the class when it is decorated: everything its methods call
# must be defined above it.
@serve.deployment(
    name=INGRESS_DEPLOYMENT_NAME,
    max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
    ray_actor_options={
        # It relays bytes; a whole CPU reserved for it could keep an engine replica from starting.
        "num_cpus": 0,
        # On the head node (Ray's built-in head resource), beside Serve's controller: one
        # known place to scrape its router's metrics (ports.router_metrics) from.
        "resources": {HEAD_NODE_RESOURCE: 0.001},
    },
)
@serve.ingress(api)
class Ingress:
    def __init__(self, llm: DeploymentHandle, config: ClusterConfig):
        self.llm = llm
        self.model_id = config.served_model_id
        self.max_model_len = config.engine.max_model_len
        # Tokenizing here gives the router each prompt's exact size and lets bad input fail
        # at the edge, before it costs a replica anything.
        self.tokenizer = Tokenizer.from_pretrained(resolve_model_path(config.model))
        self._model_info: Optional[pb.ModelInfo] = None
        self.router_metrics_http = serve_metrics_on_free_port(
            router_metrics.start_http_server, node_ip(), config.ports.router_metrics, "ports.router_metrics"
        )

    # ---- streaming from the replicas ----------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The request's chunks from one replica; raises ReplicaLostError when the stream is
        cut by a dying replica after its first chunk (or on every try before it)."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            streamed = False
            try:
                async for chunk in generate_stream(self.llm, request):
                    streamed = True
                    yield chunk
                return
            except RayTaskError as error:
                if not isinstance(error.cause, EngineDeadError):
                    # The replica raised it (a field it validates, a full queue): the cause is the answer.
                    raise error.cause from None
                lost = EngineDeadError.__name__  # its engine core died: the replica is as good as lost
            except REPLICA_LOST_ERRORS as error:
                # Ray's message spans lines of actor details; the class says what happened.
                lost = type(error).__name__
            if streamed:
                raise ReplicaLostError(f"the replica serving this request was lost mid-stream ({lost})") from None
            if attempt == MAX_ATTEMPTS:
                raise ReplicaLostError(f"replicas were lost on {attempt} tries ({lost})") from None
            logger.warning("replica lost before the first token (try %d, %s); retrying elsewhere", attempt, lost)

    def _generation_request(self, prompt_token_ids: list[int], **fields: Any) -> GenerationRequest:
        request = GenerationRequest(prompt_token_ids=prompt_token_ids, **fields)
        validate_prompt(prompt_token_ids, max_model_len=self.max_model_len)
        request.sampling.validate(prompt_len=len(prompt_token_ids), max_model_len=self.max_model_len)
        return request

    # ---- gRPC: headroom.v1.Generation ---------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            prompt_token_ids = prompt_token_ids_from_proto(request, self.tokenizer)
            generation = self._generation_request(
                prompt_token_ids,
                sampling=sampling_params_from_proto(
                    request.sampling, max_model_len=self.max_model_len, num_prompt_tokens=len(prompt_token_ids)
                ),
                priority=engine_priority(request.priority),
                request_id=request.request_id or None,
                ttft=ttft_targets_from_proto(request),
            )
            async for chunk in self.stream(generation):
                yield generate_response(chunk, chunk.replica_id)
        except InvalidRequestError as error:
            _abort(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, invalid_argument_message(error), error)
        except QueueFullError as error:
            _abort(grpc_context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), error)
        except ReplicaLostError as error:
            _abort(grpc_context, grpc.StatusCode.UNAVAILABLE, str(error), error)
        except FirstTokenDeadlineExceeded as error:
            _abort(grpc_context, grpc.StatusCode.DEADLINE_EXCEEDED, f"ttft_deadline_ms: {error}", error)

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(
            token_ids=self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        )

    async def GetModelInfo(self, request: pb.ModelInfoRequest, grpc_context: RayServegRPCContext) -> pb.ModelInfo:
        return await self.model_info()

    async def model_info(self) -> pb.ModelInfo:
        if self._model_info is None:  # the same on every replica; ask one, once
            self._model_info = await self.llm.model_info.remote()
        return self._model_info

    # ---- HTTP: OpenAI-compatible API ----------------------------------------------------
    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        info = await self.model_info()
        model = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "headroom",
                 "max_model_len": info.max_model_len}
        return {"object": "list", "data": [model]}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        def prompt_token_ids() -> list[int]:
            if isinstance(body.prompt, str):
                return self.tokenizer.encode(body.prompt)
            return list(body.prompt)

        return await self._complete(body, "completion", prompt_token_ids, lambda _: body.max_tokens,
                                    COMPLETION_PARAM_FOR_FIELD)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        def prompt_token_ids() -> list[int]:
            messages = [message.model_dump() for message in body.messages]
            return chat_prompt_token_ids(self.tokenizer, messages, field="messages")

        def max_tokens(num_prompt_tokens: int) -> int:
            requested = body.requested_max_tokens
            return requested if requested is not None else self.max_model_len - num_prompt_tokens

        return await self._complete(body, "chat", prompt_token_ids, max_tokens, CHAT_PARAM_FOR_FIELD)

    async def _complete(self, body: Union[CompletionRequest, ChatCompletionRequest], kind: str,
                        prompt_token_ids: Callable[[], list[int]], max_tokens: Callable[[int], int],
                        param_for_field: dict[str, str]):
        if body.model != self.model_id:
            return JSONResponse(
                error_body(f"model: this endpoint serves {self.model_id!r}, not {body.model!r}", "model",
                           "model_not_found"),
                status_code=404,
            )
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            body.check_supported()
            token_ids = prompt_token_ids()
            generation = self._generation_request(
                token_ids, sampling=body.sampling_params(max_tokens(len(token_ids))),
                priority=body.priority, request_id=request_id,
            )
        except InvalidRequestError as error:
            return JSONResponse(invalid_request_body(error, param_for_field), status_code=400)
        bodies = CompletionBodies(kind, request_id, self.model_id)
        chunks = self.stream(generation)
        if body.stream:
            return StreamingResponse(
                _sse_stream(chunks, bodies, body.include_usage, param_for_field), media_type="text/event-stream"
            )
        texts: list[str] = []
        last: Optional[GenerationChunk] = None
        try:
            async for chunk in chunks:
                texts.append(chunk.text)
                last = chunk
        except Exception as error:
            status, error_json = _http_error(error, param_for_field)
            return JSONResponse(error_json, status_code=status)
        return bodies.response("".join(texts), last)
