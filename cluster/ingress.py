"""The application's ingress: `headroom.v1.Generation` through Ray Serve's gRPC proxy and an
OpenAI-compatible HTTP API through its HTTP proxy, both streaming from LLMReplica through the
router. With API keys configured, every /v1 route needs one (401 in OpenAI's shape) and GET
/health stays open. Requests are bounded and validated here, at the edge (sizes before parsing, prompts
before tokenizing, long prompts tokenized off the event loop); a replica lost before a
request's first token is retried on another one; a stream nobody reads any more is cancelled
on its replica.
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations at
# runtime, from the copy of the class Serve's ingress pickles, where names may not resolve.
import asyncio
import importlib.metadata
import logging
import math
import random
import time
import tomllib
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.autoscaler_metrics import AutoscalerCollector
from cluster.autoscaling import decision_board
from cluster.config import ClusterConfig
from cluster.deployment import (
    METRICS_ENDPOINT_STAT, GenerationRequest, bind_address, generate_stream, routing_stats,
    running_replicas, serve_metrics_on_free_port,
)
from cluster.openai_api import (
    ChatCompletionRequest, Choice, CompletionRequest, DetokenizeRequest, OpenAIError, TokenizeRequest,
    choice_sampling_params, error_body, openai_error, parse_body,
)
from cluster.openai_responses import (
    SSE_DONE, ChoiceResult, CompletionBodies, TokenText, best_choices, response_json_in_pieces, sse,
    without_generation,
)
from cluster.openai_structured import OutputConstraint
from cluster.prometheus_targets import PrometheusTargets
from cluster.tool_parsers import PARSERS
from cluster.serve_logging import ClientRefusal, DisconnectWhenReceiveIsCancelled, log_client_errors_in_one_line
from protos import headroom_pb2 as pb
from replica.errors import (
    EngineDeadError, EngineShutdownError, HeadroomError, InvalidRequestError, QueueFullError, ReplicaLostError,
)
from replica.server.grpc_service import (
    chat_prompt_token_ids, engine_priority, generate_responses_off_loop,
    named_for_request, prompt_token_ids_from_proto, output_constraint_from_proto, sampling_params_from_proto,
    ttft_targets_from_proto,
)
from replica.model.checkpoint import read_model_config, sampling_defaults
from replica.model.registry import resolve_model_path
from replica.core.outputs import PromptLogprobs, RequestOutput
from replica.core.process import freeze_startup_heap
from replica.core.request import validate_request
from replica.server.auth import (
    Credentials, api_key_credentials, host_port, metadata_authorization, missing_credential,
)
from replica.server.request_limits import INLINE_TOKENIZE_MAX_CHARS, encode_prompt
from replica.server.status import grpc_status
from replica.core.structured_output import GrammarCompiler
from replica.text.tokenizer import Tokenizer
from router import metrics as router_metrics

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT_NAME = "Ingress"
# Where the packages sit in a source tree (run with PYTHONPATH or as a Ray working_dir): its pyproject.toml.
SOURCE_ROOT = Path(__file__).resolve().parent.parent
HEAD_NODE_RESOURCE = "node:__internal_head__"
# How Ray reports a replica that died (killed, crashed, its node lost) under a call.
REPLICA_LOST_ERRORS = (RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError)
# Tries per request while no token has been streamed: the router drops a dead replica
# from its candidates once a call to it fails, so the next try lands elsewhere.
MAX_ATTEMPTS = 3
# A replica whose engine core died stays a live actor until Serve's health check replaces
# it, so Serve keeps it as a candidate; our router drops it as soon as its load stream ends
# saying so (protos/not_serving.py), which races the failed call's error back to here. The
# pauses before the second and third tries let the router hear first. Other losses (a dead
# actor, a dead node) retry at once: Serve drops those replicas from its candidates itself.
RETRY_PAUSES_S = (0.2, 1.0)
# The ingress only relays streams; the engines bound the work they accept (and refuse
# beyond their queues), so Serve's default limit of 5 would be the cluster's bottleneck.
INGRESS_MAX_ONGOING_REQUESTS = 100_000
# How long a stopping ingress may finish its streams (Serve's default, stated): an in-place
# update starts the new one meanwhile, which may wait that long, and its __del__ more, for its
# router metrics port (ports.router_metrics_wait_s: the Helm chart, whose PodMonitor scrapes that
# port, sets their sum; tests/cluster/test_helm.py holds it to them).
INGRESS_DRAIN_S = 20.0
INGRESS_DEL_S = 5.0
# Serve's gRPC proxy picks the application from this metadata key.
APPLICATION_METADATA_KEY = "application"
# OpenAI's body field names for the engine's field names, where they differ.
COMPLETION_PARAM_FOR_FIELD = {"prompt_token_ids": "prompt", "top_logprobs": "logprobs"}
CHAT_PARAM_FOR_FIELD = {"prompt": "messages", "prompt_token_ids": "messages"}

# Bodies up to this size are parsed and validated on the event loop (well under a millisecond);
# larger ones on a worker thread, where the Python parts of the work yield to the loop: a 3 MB
# body of 700,000 one-token prompts took 1.7 s, every stream's and request's, on the loop.
INLINE_PARSE_MAX_BYTES = 64 * 1024
# The wait a 429 or 503 asks for, in milliseconds, drawn for each refusal from this range: a full
# queue frees a place as soon as any of its requests finishes, and a lost replica's requests go to
# the others at once, so a short wait is honest; the router spreads the retries over the replicas.
# The openai client waits exactly what the server says (retry-after-ms, else Retry-After), with
# no jitter of its own: one fixed value sent every client refused together back together.
RETRY_AFTER_MS = (500, 2000)
# How long /health answers from one lookup of Serve's controller.
HEALTH_CACHE_S = 1.0
# Token-id prompts echoed back are decoded on the event loop up to this many tokens in all
# (about a millisecond), on a worker thread beyond.
INLINE_DECODE_MAX_TOKENS = 4096
# A response, or a streamed chunk, showing prompt log-probabilities is built and rendered on the
# event loop up to this many of their entries (a prompt token with its alternatives: ~2 us each
# built and rendered, ~2 ms in all), on a worker thread beyond: a 128k-token prompt's with 20
# alternatives, echoed and in vLLM's field too, is 5.5M entries, seconds of every stream's loop.
INLINE_LOGPROBS_MAX_ENTRIES = 1024

# The routes that need the API key: the /v1 API, as vLLM's server, and vLLM's /tokenize and
# /detokenize, which it leaves open but which cost this server work per request; /health,
# /version and the API's own description stay open.
API_KEY_PATH_PREFIX = "/v1"
API_KEY_PATHS = frozenset({"/tokenize", "/detokenize"})
HTTP_AUTHORIZATION_HINT = "header 'Authorization"


class RequireAPIKey:
    """ASGI middleware: a request to a /v1 route without `Authorization: Bearer <API key>` is
    answered 401 in OpenAI's shape (`invalid_api_key`) before any route sees it. The keys
    are this process' (replica/server/auth.py); with none configured every request passes."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.credentials = api_key_credentials()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and self.credentials.required and _needs_api_key(scope)
                and not self.credentials.accepts_authorization(Headers(scope=scope).get("authorization"))):
            status, body = openai_error(missing_credential("API key", HTTP_AUTHORIZATION_HINT), {})
            # RFC 6750: a 401 names the scheme it wants.
            await JSONResponse(body, status_code=status, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def prompt_param(index: int, num_prompts: int) -> str:
    """The body parameter of a completion's prompt `index`: `prompt`, or `prompt[i]` in a batch."""
    return "prompt" if num_prompts == 1 else f"prompt[{index}]"


def _needs_api_key(scope: dict[str, Any]) -> bool:
    """Whether the request's path, below the application's route prefix, is a /v1 route or one of
    API_KEY_PATHS: the path as the routes match it (Starlette's get_route_path: the prefix is cut only at a
    segment boundary, so /v1/models under root /v is itself, and needs the key)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        path = path[len(root):]
    return path == API_KEY_PATH_PREFIX or path.startswith(API_KEY_PATH_PREFIX + "/") or path in API_KEY_PATHS


api = FastAPI(title="headroom", description="OpenAI-compatible API of one headroom model")
api.add_middleware(DisconnectWhenReceiveIsCancelled)
api.add_middleware(RequireAPIKey)  # the outermost: a refused request costs nothing more


@api.exception_handler(StarletteHTTPException)
async def _openai_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    # Unknown paths and methods answer in OpenAI's shape too, not FastAPI's {"detail": ...}.
    message = f"{request.method} {request.url.path}: {error.detail}"
    # The exception's headers too: a 405's Allow (RFC 9110), as Starlette's own handler sends it.
    return JSONResponse(error_body(message, None, "not_found" if error.status_code == 404 else None),
                        status_code=error.status_code, headers=getattr(error, "headers", None))


@api.exception_handler(Exception)
async def _openai_server_error(request: Request, error: Exception) -> JSONResponse:
    # An error no route turned into a response: a 500 in OpenAI's shape (openai_error logs it),
    # not Starlette's plain-text "Internal Server Error", which OpenAI clients cannot parse.
    status, body = openai_error(error, {})
    return JSONResponse(body, status_code=status)


@api.exception_handler(RequestValidationError)
async def _openai_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"] if part != "body") or None
    return JSONResponse(error_body(f"{param or 'body'}: {first['msg']}", param), status_code=400)


def error_response(error: BaseException, param_for_field: dict[str, str]) -> JSONResponse:
    """The response `error` ends a request with (openai_error's status and body); a 429 (a
    replica's queue is full) or 503 (no replica can serve it now) says in Retry-After when to
    try again, which the openai client waits rather than its own backoff."""
    status, body = openai_error(error, param_for_field)
    return JSONResponse(body, status_code=status, headers=retry_after(status))


def retry_after(status: int) -> Optional[dict[str, str]]:
    """The retry headers of a response of this status, if it takes them: a wait drawn from
    RETRY_AFTER_MS in `retry-after-ms` (which the openai client reads first), and in whole
    seconds, rounded up, in the standard Retry-After."""
    if status not in (429, 503):
        return None
    wait_ms = random.randint(*RETRY_AFTER_MS)
    return {"Retry-After": str(math.ceil(wait_ms / 1000)), "retry-after-ms": str(wait_ms)}


def headroom_version(source_root: Path = SOURCE_ROOT) -> str:
    """This server's version (GET /version): the installed package's, else, run from a source
    tree (PYTHONPATH, a Ray working_dir, where no package metadata exists), its pyproject.toml's,
    else 0+unknown."""
    try:
        return importlib.metadata.version("headroom")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open(source_root / "pyproject.toml", "rb") as file:
            return str(tomllib.load(file)["project"]["version"])
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return "0+unknown"


HEADROOM_VERSION = headroom_version()


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 before it is parsed (or even read) once past `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise OpenAIError(413, f"body: {declared} bytes exceeds the limit of {max_bytes} bytes", None,
                          "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise OpenAIError(413, f"body: more than the limit of {max_bytes} bytes", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _sse_stream(chunks: AsyncIterator[tuple[Choice, RequestOutput]], bodies: CompletionBodies,
                      choices: list[Choice], include_usage: bool,
                      param_for_field: dict[str, str], continuous_usage: bool = False) -> AsyncIterator[str]:
    """OpenAI's SSE framing: `data: {json}` per chunk, then `data: [DONE]`. An error after the
    response started can only be an event of its own (the status line is already sent).
    `include_usage`: a last chunk of the request's usage; `continuous_usage`: every chunk
    carries its choice's usage so far (its prompt, its tokens; a chat choice's role chunk
    none yet), as vLLM's continuous_usage_stats.

    The opening chunks (a chat choice's role, echoed text) go out with the first engine
    output, as vLLM's do, not when the response starts: a client times its first token by the
    first chunk (vLLM's `bench serve` does), which the role chunk sent at once made ~0 s."""
    opening = bodies.first_chunks([(choice.index, choice.prompt_index) for choice in choices])
    results = {choice.index: ChoiceResult(choice.index, choice.prompt_index) for choice in choices}
    prompt_tokens = {choice.index: len(choice.prompt_token_ids) for choice in choices}

    def with_usage(body: dict[str, Any], index: int, completion_tokens: int) -> dict[str, Any]:
        if not continuous_usage:
            return body
        prompt = prompt_tokens[index]
        return {**body, "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                                  "total_tokens": prompt + completion_tokens}}

    def event(choice: Choice, chunk: RequestOutput, in_pieces: bool = False) -> Optional[str]:
        body = bodies.chunk(choice.index, choice.prompt_index, chunk)
        return None if body is None else sse(with_usage(body, choice.index, chunk.num_output_tokens), in_pieces)

    try:
        async for choice, chunk in chunks:
            results[choice.index].add(chunk)
            for first in opening:
                yield sse(with_usage(first, first["choices"][0]["index"], 0))
            opening = []
            if (bodies.opens_with_prompt(choice.index)
                    and bodies.prompt_logprob_entries(choice.prompt_index) > INLINE_LOGPROBS_MAX_ENTRIES):
                text = await asyncio.to_thread(event, choice, chunk, True)
            else:
                text = event(choice, chunk)
            if text is not None:
                yield text
        if include_usage:
            yield sse(bodies.usage_chunk(list(results.values())))
    except Exception as error:
        yield sse(openai_error(error, param_for_field)[1])
    yield SSE_DONE


async def _aborted_as_errors(chunks: AsyncIterator[tuple[Choice, RequestOutput]]
                             ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """`chunks`, a choice the replica ended unfinished (`abort`: it shut down past its drain
    time) raising EngineShutdownError: OpenAI's API has no such finish reason, and a 200 with
    the text so far read as a whole answer (gRPC keeps FINISH_REASON_ABORT)."""
    try:
        async for choice, chunk in chunks:
            if chunk.finish_reason == "abort":
                raise EngineShutdownError("the replica stopped before this request finished; retry")
            yield choice, chunk
    finally:
        await chunks.aclose()  # its replica calls are cancelled however this one stops


async def _without_generation(chunks: AsyncIterator[tuple[Choice, RequestOutput]]
                              ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """`chunks` of an echo-only completion (max_tokens 0), its generated token dropped."""
    try:
        async for choice, chunk in chunks:
            yield choice, without_generation(chunk)
    finally:
        await chunks.aclose()


async def _prompt_logprobs_shared(chunks: AsyncIterator[tuple[Choice, RequestOutput]]
                                  ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """`chunks` of a request asking for prompt log-probabilities with several choices a prompt,
    where only each prompt's first choice computes them (choice_sampling_params): each other
    choice's first chunk gets that choice's, and waits for them (they come with its first token,
    which the others' prefill, a prefix-cache hit of its blocks, rarely beats)."""
    gathered: dict[int, PromptLogprobs] = {}  # by prompt index
    held: dict[int, list[tuple[Choice, RequestOutput]]] = {}  # other choices' chunks before them, by prompt
    given: set[int] = set()  # choices whose first chunk has them

    def shared(choice: Choice, chunk: RequestOutput) -> tuple[Choice, RequestOutput]:
        if choice.index in given:
            return choice, chunk
        given.add(choice.index)
        return choice, replace(chunk, prompt_logprobs=gathered[choice.prompt_index])

    try:
        async for choice, chunk in chunks:
            if choice.sampling.prompt_logprobs is not None:  # the prompt's first choice: computes them
                if chunk.prompt_logprobs is not None:
                    gathered[choice.prompt_index] = chunk.prompt_logprobs
                yield choice, chunk
                for other in held.pop(choice.prompt_index, ()):
                    yield shared(*other)
            elif choice.prompt_index in gathered:
                yield shared(choice, chunk)
            else:
                held.setdefault(choice.prompt_index, []).append((choice, chunk))
    finally:
        await chunks.aclose()


async def _first_awaited(chunks: AsyncIterator[tuple[Choice, RequestOutput]]
                         ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """`chunks` with its first item already awaited, so that a request refused before its
    first output (a full queue, a lost replica, its first-token deadline) raises here, while
    the response can still carry the error's own status (429, 503, 504) as OpenAI's does;
    after the status line of a stream it can only be an event, which clients' retries never
    see. Raises what `chunks` raises before its first item."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None

    async def rest() -> AsyncIterator[tuple[Choice, RequestOutput]]:
        try:
            if first is not None:
                yield first
                async for item in chunks:
                    yield item
        finally:
            await chunks.aclose()  # the replica calls are cancelled however the stream stops

    return rest()


def _other_model(model_id: str, named: str) -> JSONResponse:
    """A body's `model` naming another model than the one served: 404, as OpenAI's API answers."""
    return JSONResponse(error_body(f"model: this endpoint serves {model_id!r}, not {named!r}", "model",
                                   "model_not_found"), status_code=404)


def _retrieved(future: asyncio.Future) -> None:
    """Marks a background future's exception as seen (asyncio logs one nobody retrieved), and
    logs it: the grammar compiler that failed to build is made again by the next constrained
    request, which reports what it raises."""
    if not future.cancelled() and future.exception() is not None:
        logger.warning("structured outputs: no grammar compiler yet (%s)", future.exception())


def _abort(grpc_context: RayServegRPCContext, error: HeadroomError) -> None:
    """Ends the call with the status `error` declares (replica/server/status.py): Ray Serve
    reports the status set on the context when the method raises."""
    code, details = grpc_status(error)
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    raise error


def refuse_without_api_key(grpc_context: RayServegRPCContext, credentials: Credentials) -> None:
    if not credentials.accepts_authorization(metadata_authorization(grpc_context.invocation_metadata())):
        _abort(grpc_context, missing_credential("API key"))


# Serve's FastAPI ingress pickles the class when it is decorated: everything its methods call
# must be defined above it.
@serve.deployment(
    name=INGRESS_DEPLOYMENT_NAME,
    max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
    graceful_shutdown_timeout_s=INGRESS_DRAIN_S,
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
    async def __init__(self, llm: DeploymentHandle, config: ClusterConfig):
        log_client_errors_in_one_line()
        # Read here too (RequireAPIKey reads them for HTTP) so that an unusable key file fails
        # the deployment at start, not its first request.
        self.api_keys = api_key_credentials()
        self.llm = llm
        self.app_name = serve.get_replica_context().app_name
        self.model_id = config.served_model_id
        self.started_at = int(time.time())  # /v1/models' `created` (it was 0; vLLM's is a time too)
        self.max_num_seqs = config.engine.max_num_seqs
        self.limits = config.limits.request_limits()
        self.tool_call_parser = config.tool_call_parser
        self.engine_config = config.engine  # the grammar compiler's time bounds
        # Tokenizing here gives the router each prompt's exact size and lets bad input fail
        # at the edge, before it costs a replica anything.
        model_dir = resolve_model_path(config.model)
        self.tokenizer = Tokenizer.from_pretrained(model_dir, chat_template=config.chat_template)
        # The model's vocabulary, as each replica reads it: /detokenize answers with no replica up.
        self.vocab_size = read_model_config(model_dir).vocab_size
        # What requests leave unset takes, read as each replica's engine reads it (they log it).
        self.sampling_defaults = sampling_defaults(model_dir, config.engine.generation_config)
        if self.tokenizer.chat_template is None:
            logger.warning("model %s has no chat template: chat requests are refused (serve it with "
                           "--chat-template FILE, or chat_template: in the config)", config.model)
        # The grammar compiler, made at start once a replica has said the model's vocabulary:
        # llguidance's view of the tokenizer takes ~0.23 s with the GIL held (SmolLM2's 49k ids),
        # which made by the first constrained request stalled every stream this ingress serves.
        # Constrained requests await it; one that finds it failed (no replica answered yet, a
        # tokenizer llguidance cannot take) makes it again and reports what it raises.
        self._model_info: Optional[pb.ModelInfo] = None
        self._grammars: asyncio.Future = asyncio.ensure_future(self._make_grammars())
        self._grammars.add_done_callback(_retrieved)  # a failure here is a later request's to report
        self.token_text = TokenText(lambda token_ids: self.tokenizer.decode(token_ids, skip_special_tokens=False),
                                    self.tokenizer.token_bytes)
        host = bind_address(config)
        self.router_metrics_http = await serve_metrics_on_free_port(
            router_metrics.start_http_server, host, config.ports.router_metrics, "ports.router_metrics",
            base_port_wait_s=config.ports.router_metrics_wait_s,
        )
        # Serve's controller publishes each autoscaling decision on the board; its gauges are
        # served beside the router's (cluster/autoscaler_metrics.py).
        self.autoscaler_metrics: Optional[AutoscalerCollector] = None
        if config.replicas.autoscaling is not None:
            decision_board()
            self.autoscaler_metrics = AutoscalerCollector(self.app_name)
            router_metrics.PROCESS_ROUTER_REGISTRY.register(self.autoscaler_metrics)
        self._metrics_endpoints: dict[str, str] = {}  # replica id -> its /metrics host:port
        self.targets: Optional[PrometheusTargets] = None
        if config.monitoring.targets_dir is not None:
            self.targets = PrometheusTargets(Path(config.monitoring.targets_dir), self.app_name,
                                             host_port(host, self.router_metrics_http.server_port),
                                             self._replica_metrics_endpoints)
            self.targets.start()
        # As the replicas' fronts and engine cores: what is alive now (Ray, Serve, FastAPI, the
        # tokenizer) lives as long as this process, so full collections, which walked all of it
        # and stopped every stream this ingress serves for ~100 ms, scan only what serving made.
        freeze_startup_heap()

    async def __del__(self) -> None:
        self._grammars.cancel()
        if self.targets is not None:
            self.targets.stop()
        self.router_metrics_http.shutdown()
        self.router_metrics_http.server_close()  # the port, for the next ingress at once
        if self.autoscaler_metrics is not None:
            router_metrics.PROCESS_ROUTER_REGISTRY.unregister(self.autoscaler_metrics)
        parent_del = getattr(super(), "__del__", None)  # Serve's ASGI wrapper shuts the app down
        if parent_del is not None:
            await parent_del()

    async def _replica_metrics_endpoints(self) -> list[str]:
        def listed() -> list[str]:
            endpoints = {}
            for _, replica in running_replicas(self.app_name):
                replica_id = replica["replica_id"]
                if replica_id not in self._metrics_endpoints:
                    self._metrics_endpoints[replica_id] = routing_stats(replica)[METRICS_ENDPOINT_STAT]
                endpoints[replica_id] = self._metrics_endpoints[replica_id]
            self._metrics_endpoints = endpoints  # forget replicas Serve no longer runs
            return sorted(endpoints.values())

        return await asyncio.to_thread(listed)  # the controller and replica calls block

    # ---- streaming from the replicas ----------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncIterator[tuple[str, RequestOutput]]:
        """The request's (replica id, output) pairs from one replica; raises ReplicaLostError
        when the stream is cut by a dying replica after its first output (or on every try
        before it). However the caller stops reading (cancelled, closed, an error), the
        replica's call is cancelled, so its engine aborts the request and frees its KV blocks."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            streamed = core_died = False
            response = generate_stream(self.llm, request)
            finished = False
            try:
                async for served in response:
                    streamed = True
                    yield served
                finished = True
                return
            except RayTaskError as error:
                if not isinstance(error.cause, EngineDeadError):
                    # The replica raised it (a field it validates, a full queue): the cause is the answer.
                    raise error.cause from None
                lost, core_died = EngineDeadError.__name__, True  # its engine core died: the replica is as good as lost
            except REPLICA_LOST_ERRORS as error:
                # Ray's message spans lines of actor details; the class says what happened.
                lost = type(error).__name__
            finally:
                # Serve does not reliably carry a cancelled gRPC call (or a closed generator)
                # over to the call this one made: cancel it explicitly.
                if not finished:
                    response.cancel()
            if streamed:
                raise ReplicaLostError(f"the replica serving this request was lost mid-stream ({lost})") from None
            if attempt == MAX_ATTEMPTS:
                raise ReplicaLostError(f"replicas were lost on {attempt} tries ({lost})") from None
            logger.warning("replica lost before the first token (try %d, %s); retrying elsewhere", attempt, lost)
            if core_died:  # a dead actor Serve drops at once; a dead core it does not
                await asyncio.sleep(RETRY_PAUSES_S[attempt - 1])

    async def choice_chunks(self, choices: list[tuple[Choice, GenerationRequest]]
                            ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's chunks as they come, tagged with their choice; the first error
        ends them all, and so does the caller stopping (each choice's replica call is then
        cancelled)."""
        if len(choices) == 1:
            choice, request = choices[0]
            async for _, chunk in self.stream(request):
                yield choice, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(choice: Choice, request: GenerationRequest) -> None:
            try:
                async for _, chunk in self.stream(request):
                    queue.put_nowait((choice, chunk))
                queue.put_nowait(done)
            except Exception as error:
                queue.put_nowait(error)

        tasks = [asyncio.create_task(pump(choice, request)) for choice, request in choices]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # each stream's own cleanup cancels its replica call

    def _generation_request(self, prompt_token_ids: list[int], info: pb.ModelInfo, **fields: Any) -> GenerationRequest:
        request = GenerationRequest(prompt_token_ids=prompt_token_ids, **fields)
        # The cluster's edge: the one validation a request gets (the replicas trust it), so a
        # refused request costs no replica. The context length is the replicas' (each engine
        # resolves it from the model and its pool).
        validate_request(prompt_token_ids, request.sampling, max_model_len=info.max_model_len,
                         vocab_size=info.vocab_size)
        self.engine_config.check_request_priority(request.priority)
        return request

    # ---- gRPC: headroom.v1.Generation ---------------------------------------------------
    def _check_application(self, grpc_context: RayServegRPCContext) -> None:
        """The call's API key and application. headroom's proxy handlers (cluster/grpc_proxy.py)
        refuse a call without a key before it gets here; this refuses one that came through
        Serve's plain handlers (a config registering Generation without them). Serve's proxy
        hands a lone application every call, whatever application it names."""
        refuse_without_api_key(grpc_context, self.api_keys)
        named = dict(grpc_context.invocation_metadata()).get(APPLICATION_METADATA_KEY)
        if named is not None and named != self.app_name:
            _abort(grpc_context, ClientRefusal(
                f"application: {named!r} is not served here (this cluster serves {self.app_name!r})"))

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._check_application(grpc_context)
        try:
            # Measured here, on the message Serve re-parsed for this process (its raw size is not
            # handed over): headroom's proxy handlers bound the raw bytes by the largest application's
            # limit (cluster/grpc_proxy.py), Serve's plain ones by its message cap only.
            self.limits.check_request_bytes(request.ByteSize())
            # The context, where known already: refused token ids are then never copied out of the
            # message (validate_request, below, refuses them anyway).
            known = self._model_info.max_model_len if self._model_info is not None else None
            prompt_token_ids = await prompt_token_ids_from_proto(request, self.tokenizer, self.limits, known)
            info = await self.model_info()
            constraint = await output_constraint_from_proto(request)
            generation = self._generation_request(
                prompt_token_ids, info,
                sampling=replace(sampling_params_from_proto(
                    request.sampling, max_model_len=info.max_model_len, num_prompt_tokens=len(prompt_token_ids),
                    defaults=self.sampling_defaults,
                ), structured_output=constraint[0] if constraint else None),
                priority=engine_priority(request.priority),
                request_id=request.request_id or None,
                ttft=ttft_targets_from_proto(request),
            )
            if constraint is not None:  # compiled once the cheap checks above have passed
                await self.check_constraint(OutputConstraint(*constraint))
            async for replica_id, output in self.stream(generation):
                for response in await generate_responses_off_loop(output, replica_id):
                    yield response
        except HeadroomError as error:
            _abort(grpc_context, named_for_request(error, request))

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext) -> pb.TokenizeResponse:
        self._check_application(grpc_context)
        try:
            self.limits.check_request_bytes(request.ByteSize())
            token_ids = await encode_prompt(self.tokenizer, request.text, add_special_tokens=request.add_special_tokens,
                                            limits=self.limits, field_name="text")
        except InvalidRequestError as error:
            _abort(grpc_context, error)
        return pb.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request: pb.ModelInfoRequest, grpc_context: RayServegRPCContext) -> pb.ModelInfo:
        self._check_application(grpc_context)
        return await self.model_info()

    async def model_info(self) -> pb.ModelInfo:
        if self._model_info is None:  # the same on every replica; ask one, once
            self._model_info = await self.llm.model_info.remote()
        return self._model_info

    def _known_max_model_len(self) -> Optional[int]:
        """max_model_len as known here without asking a replica (/tokenize, /v1/models answer with none up):
        what one has said, else the configured value; None while it follows the model and the KV
        pool a replica sizes (a GPU's profiled pool may cut it) and no replica has said it yet."""
        if self._model_info is not None:
            return self._model_info.max_model_len
        return self.engine_config.max_model_len

    # ---- HTTP: OpenAI-compatible API ----------------------------------------------------
    @api.get("/health")
    async def health(self):
        """200 while Serve runs a replica of this application's engine, else 503: open to
        load balancers and probes whatever the API keys (as vLLM's /health)."""
        if await self._has_running_replica():
            return Response(status_code=200)
        return JSONResponse(error_body(f"application {self.app_name!r} has no running replica", None,
                                       "replica_unavailable", "server_error"),
                            status_code=503, headers=retry_after(503))

    # (when the last lookup started, the lookup): shared by every /health call for HEALTH_CACHE_S.
    _health: Optional[tuple[float, asyncio.Future]] = None

    async def _has_running_replica(self) -> bool:
        """Whether Serve runs a replica of the engine, as Serve's controller said at most
        HEALTH_CACHE_S ago. Each /health call asked the controller for the whole Serve's details,
        on a thread of the pool that tokenizes long prompts: /health is open to anyone, and a
        flood of it loaded the controller (which drives every application's replicas) and
        slowed tokenization beside it more than any other route's flood."""
        now, last = time.monotonic(), self._health
        if last is None or (last[1].done() and (last[1].cancelled() or last[1].exception() is not None
                                                or now - last[0] > HEALTH_CACHE_S)):
            # Blocks on Serve's controller: on a thread, and one lookup at a time.
            last = self._health = (now, asyncio.ensure_future(asyncio.to_thread(running_replicas, self.app_name)))
        return bool(await asyncio.shield(last[1]))

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_object()]}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str):
        """One model, as OpenAI's API answers `client.models.retrieve(id)`; another id is 404."""
        if model != self.model_id:
            return _other_model(self.model_id, model)
        return self._model_object()

    def _model_object(self) -> dict[str, Any]:
        # No replica asked (with none up the call hung): the context length as /tokenize gives it.
        return {"id": self.model_id, "object": "model", "created": self.started_at, "owned_by": "headroom",
                "max_model_len": self._known_max_model_len()}

    @api.get("/version")
    async def version(self) -> dict[str, str]:
        """vLLM's GET /version: this server's package version."""
        return {"version": HEADROOM_VERSION}

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's POST /tokenize: a prompt's token ids, or a conversation's as chat completions
        renders it (`messages`, with its tools and template fields), with the context length (null
        while no replica has said it and none is configured). Nothing here waits for a replica."""
        try:
            raw, body = await self._parsed_body(request, TokenizeRequest)
            if body.model not in (None, self.model_id):
                return _other_model(self.model_id, body.model)
            body.check_supported()
            if body.messages is not None:
                token_ids = await self._chat_prompt(body, len(raw))
            else:
                add_special_tokens = body.add_special_tokens is not False
                token_ids = await encode_prompt(self.tokenizer, body.prompt, add_special_tokens=add_special_tokens,
                                                limits=self.limits, field_name="prompt")
        except OpenAIError as error:
            return JSONResponse(error.body, status_code=error.status)
        except InvalidRequestError as error:
            return error_response(error, {})
        return {"count": len(token_ids), "max_model_len": self._known_max_model_len(), "tokens": token_ids,
                "token_strs": self.tokenizer.token_strings(token_ids) if body.return_token_strs else None}

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's POST /detokenize: token ids' text (special tokens skipped, as vLLM's); no replica asked."""
        try:
            _, body = await self._parsed_body(request, DetokenizeRequest)
            if body.model not in (None, self.model_id):
                return _other_model(self.model_id, body.model)

            def decode() -> str:
                for token_id in body.tokens:  # one outside the vocabulary (or a C long) made the decoder raise
                    if not 0 <= token_id < self.vocab_size:
                        raise InvalidRequestError("tokens", f"token id {token_id} is outside the vocabulary "
                                                            f"[0, {self.vocab_size})")
                return self.tokenizer.decode(body.tokens)

            text = await asyncio.to_thread(decode) if len(body.tokens) > INLINE_DECODE_MAX_TOKENS else decode()
        except OpenAIError as error:
            return JSONResponse(error.body, status_code=error.status)
        except InvalidRequestError as error:
            return error_response(error, {})
        return {"prompt": text}

    async def _parsed_body(self, http_request: Request, body_type: type) -> tuple[bytes, Any]:
        """The raw body and it parsed as `body_type` (parse_body; a large one on a worker
        thread); raises OpenAIError."""
        raw = await read_body(http_request, self.limits.max_request_bytes)
        if len(raw) <= INLINE_PARSE_MAX_BYTES:
            return raw, parse_body(raw, body_type, self.limits)
        return raw, await asyncio.to_thread(parse_body, raw, body_type, self.limits)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, CompletionRequest)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, ChatCompletionRequest)

    async def _prompts(self, body: Union[CompletionRequest, ChatCompletionRequest], body_bytes: int = 0
                       ) -> list[list[int]]:
        """Each prompt's token ids; `body_bytes` the size of the body they came in."""
        if isinstance(body, ChatCompletionRequest):
            return [await self._chat_prompt(body, body_bytes)]
        prompts = body.prompts
        if sum(len(prompt) for prompt in prompts if isinstance(prompt, str)) > INLINE_TOKENIZE_MAX_CHARS:
            # One long prompt, or many short ones (256 prompts of 4,096 characters, a 1 MB body,
            # held the event loop 0.34 s): one worker thread tokenizes them all.
            return await asyncio.to_thread(self._encode_prompts, prompts, body.add_special_tokens)
        return self._encode_prompts(prompts, body.add_special_tokens)

    async def _chat_prompt(self, body: Union[ChatCompletionRequest, TokenizeRequest], body_bytes: int) -> list[int]:
        """The token ids of a body's conversation, rendered with its tools and template fields."""
        # A large conversation is gathered and rendered on a worker thread, however few its
        # messages: an earlier tool call's arguments (parsed for the template) or the tools
        # (rendered as JSON) can be megabytes; 2.5 MB of arguments held the loop 0.4 s.
        large = body_bytes > INLINE_PARSE_MAX_BYTES
        gather = lambda: ([message.template_message() for message in body.messages],  # noqa: E731
                          body.template_tools())
        messages, tools = await asyncio.to_thread(gather) if large else gather()
        return await chat_prompt_token_ids(self.tokenizer, messages, field="messages", limits=self.limits,
                                           tools=tools, off_loop=large, **body.template_options())

    def _encode_prompts(self, prompts: list[Union[str, list[int]]], add_special_tokens: bool) -> list[list[int]]:
        """Each prompt's token ids, each text checked against the limits first (as encode_prompt does)."""
        token_ids = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self.limits.check_prompt_text(prompt_param(index, len(prompts)), prompt)
                token_ids.append(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
            else:
                token_ids.append(list(prompt))
        return token_ids

    async def _echo_texts(self, body: Union[CompletionRequest, ChatCompletionRequest]) -> list[str]:
        """The text each prompt's choices open with (echo). Token-id prompts are decoded only
        once validated: an id outside the vocabulary (or a C long) made the decoder raise."""
        if isinstance(body, ChatCompletionRequest):
            return [body.echo_text]
        if not body.echo:
            return [""] * len(body.prompts)
        decoded = [prompt for prompt in body.prompts if not isinstance(prompt, str)]
        decode = lambda: [self.tokenizer.decode(prompt) for prompt in decoded]  # noqa: E731
        texts = iter(await asyncio.to_thread(decode) if sum(map(len, decoded)) > INLINE_DECODE_MAX_TOKENS else decode())
        return [prompt if isinstance(prompt, str) else next(texts) for prompt in body.prompts]

    async def _make_grammars(self) -> GrammarCompiler:
        info = await self.model_info()
        eos_token_ids = [info.eos_token_id] if info.eos_token_id >= 0 else []
        return await asyncio.to_thread(GrammarCompiler.for_tokenizer, self.tokenizer, info.vocab_size, eos_token_ids,
                                       self.engine_config)

    async def check_constraint(self, constraint: OutputConstraint) -> None:
        """Compile an output constraint here (cached, within the time bound, off the event loop),
        so that a bad one is refused naming its parameter before any replica queues it."""
        made = self._grammars
        if made.done() and (made.cancelled() or made.exception() is not None):
            self._grammars = made = asyncio.ensure_future(self._make_grammars())  # the last try failed
            made.add_done_callback(_retrieved)
        # Shielded: a request cancelled while it waits (its client went away) must not cancel
        # the compiler every later request waits for.
        grammars = await asyncio.shield(made)
        await grammars.check_async(constraint.constraint, constraint.param)

    def _max_tokens(self, body: Union[CompletionRequest, ChatCompletionRequest], num_prompt_tokens: int,
                    max_model_len: int) -> int:
        # Unset (chat) or null: up to the context length (and the model's max_new_tokens), as in vLLM's API.
        return self.sampling_defaults.max_tokens_or_default(body.requested_max_tokens, max_model_len - num_prompt_tokens)

    async def _complete(self, http_request: Request, body_type: type):
        chat = body_type is ChatCompletionRequest
        try:
            raw, body = await self._parsed_body(http_request, body_type)
        except OpenAIError as error:
            return JSONResponse(error.body, status_code=error.status)
        if body.model not in (None, self.model_id):
            return _other_model(self.model_id, body.model)
        param_for_field = dict(CHAT_PARAM_FOR_FIELD if chat else COMPLETION_PARAM_FOR_FIELD)
        if chat:
            param_for_field["max_tokens"] = body.max_tokens_param
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            body.check_supported(self.max_num_seqs)
            # Building the constraints reads and checks every schema (2 s of the loop for a 4 MB
            # one, 0.6 s for 60 KB of date-time properties): off the loop whenever there is one.
            # Compiling them waits for the cheap checks below.
            build = lambda: (body.output_constraint(), body.tool_parameter_schemas() if chat else [])  # noqa: E731
            constraint, tool_schemas = (await asyncio.to_thread(build) if body.asks_for_schemas() or (chat and body.tools)
                                         else build())
            if constraint is not None:
                # A constraint the engine ends mid-output (too costly to follow) names it too.
                param_for_field["structured_output"] = constraint.param
            tool_calling = body.tool_calling(self.tool_call_parser) if chat else None
            # The text a tool parser reads keeps the parser's tags where the checkpoint makes them
            # special tokens: skipped, a call came back as content (vLLM's #25281).
            kept_special_token_ids = (self.tokenizer.special_token_ids(PARSERS[tool_calling.parser].TAGS)
                                      if tool_calling is not None and tool_calling.parser is not None else ())
            prompts = await self._prompts(body, len(raw))
            info = await self.model_info()
            choices = []
            for prompt_index, token_ids in enumerate(prompts):
                base = replace(body.base_sampling_params(
                    self._max_tokens(body, len(token_ids), info.max_model_len), body.num_logprobs,
                    constraint.constraint if constraint else None, self.sampling_defaults,
                ), kept_special_token_ids=kept_special_token_ids)
                for candidate in range(body.num_candidates):
                    choice = Choice(prompt_index * body.num_candidates + candidate, prompt_index, token_ids,
                                    choice_sampling_params(base, candidate))
                    try:
                        generation = self._generation_request(token_ids, info, sampling=choice.sampling,
                                                              priority=body.priority,
                                                              request_id=f"{request_id}-{choice.index}")
                    except InvalidRequestError as error:
                        if len(prompts) > 1 and param_for_field.get(error.field, error.field) == "prompt":
                            # A batch names the prompt at fault, as its text prompts' checks do (the
                            # error's class kept: its OpenAI code).
                            raise type(error)(prompt_param(prompt_index, len(prompts)), error.message) from None
                        raise
                    choices.append((choice, generation))
            for tool_schema in tool_schemas:
                await self.check_constraint(tool_schema)
            if constraint is not None:
                await self.check_constraint(constraint)
            echo_texts = await self._echo_texts(body)
        except (InvalidRequestError, QueueFullError) as error:  # QueueFullError: the compiles are backed up
            return error_response(error, param_for_field)
        bodies = CompletionBodies("chat" if chat else "completion", request_id, self.model_id, self.token_text,
                                  body.num_logprobs, echo_texts, tool_calling, prompt_token_ids=prompts,
                                  echo_logprobs=not chat and body.echo_logprobs,
                                  prompt_logprobs_field=body.prompt_logprobs)
        chunks = _aborted_as_errors(self.choice_chunks(choices))
        if body.num_prompt_logprobs is not None and body.num_candidates > 1:
            chunks = _prompt_logprobs_shared(chunks)
        if not chat and body.echo_only:
            chunks = _without_generation(chunks)
        if body.stream:
            try:
                chunks = await _first_awaited(chunks)
            except Exception as error:
                return error_response(error, param_for_field)
            return StreamingResponse(
                _sse_stream(chunks, bodies, [choice for choice, _ in choices], body.include_usage, param_for_field,
                            body.continuous_usage),
                media_type="text/event-stream",
            )
        results = {choice.index: ChoiceResult(choice.index, choice.prompt_index) for choice, _ in choices}
        try:
            async for choice, chunk in chunks:
                results[choice.index].add(chunk)
        except Exception as error:
            return error_response(error, param_for_field)
        generated = [results[index] for index in sorted(results)]
        chosen = best_choices(generated, body.num_candidates, body.n)
        if sum(bodies.prompt_logprob_entries(result.prompt_index) for result in chosen) > INLINE_LOGPROBS_MAX_ENTRIES:
            # Rendered there too: FastAPI would turn the dict into JSON on the loop.
            return await asyncio.to_thread(lambda: Response(
                response_json_in_pieces(bodies.response(generated, chosen)), media_type="application/json"))
        return bodies.response(generated, chosen)
