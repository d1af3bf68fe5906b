"""What headroom registers on Ray Serve's gRPC proxy, through its one extension point (the
`grpc_servicer_functions` entries, called with the proxy's server before it starts):

- `add_generation_to_server`: headroom.v1.Generation, routed to the applications by Serve's
  own handlers, behind the API key (`authorization` metadata, checked here so an
  unauthenticated call is never shipped to an application) and a size bound checked on the raw bytes (so an oversized message is
  never parsed, pickled and shipped to an application, stalling every call that shares the
  proxy and the ingress), with the streaming Generate made cancel-safe. grpc.aio cancels a streaming
  handler wherever it is; when that is while a response is being written, Serve 2.60's
  handler is later closed at a `yield` and swallows the close, so the call it made to the
  application is never cancelled and keeps generating to max_tokens. Here Serve's handler is
  driven from a task of its own that is only ever suspended inside Serve's awaits, where a
  cancellation takes Serve's own path: it cancels the application's call.
- `add_health_and_reflection_to_server`: standard health checking (`grpc.health.v1`) and
  reflection v1 beside Serve's own v1alpha, both answered by the proxy itself.

Serve's private pieces used here (the server's handler factory and its local-service marks,
`gRPCStreamingType`) are Ray Serve 2.60's; tests/cluster/test_outside_clients.py exercises them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import urllib.parse
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.serve_logging import log_client_errors_in_one_line
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.server.grpc_reflection import V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME, add_v1_reflection
from replica.errors import InvalidRequestError
from replica.server.auth import Credentials, api_key_credentials, metadata_authorization, missing_credential
from replica.server.request_limits import DEFAULT_MAX_REQUEST_BYTES, RequestLimits
from replica.server.status import grpc_status

GENERATION_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# The services a reflection client sees on the cluster port, the proxy's own included.
ADVERTISED_SERVICE_NAMES = (GENERATION_SERVICE_NAME, health.SERVICE_NAME, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
_STREAM_END = object()
# Serve's proxy takes no options of ours; `headroom serve` hands them over through the
# environment the proxy's process inherits. The proxy serves every application: its size
# bound is the largest application's limits.max_request_bytes (each application's ingress
# enforces its own exact limit behind it); the default elsewhere.
PROXY_MAX_REQUEST_BYTES_ENV = "HEADROOM_PROXY_MAX_REQUEST_BYTES"
# Serve binds its gRPC proxy to every interface; on a loopback-only cluster the proxy
# serves loopback clients only.
PROXY_LOOPBACK_ONLY_ENV = "HEADROOM_PROXY_LOOPBACK_ONLY"
# Serve's gRPC server takes messages up to this (its default: 2 GiB) and buffers each whole
# before any handler runs, so before the API key, the loopback rule or the size bound above is
# checked: one 600 MB message from anyone took the proxy, which serves HTTP too, to 2.3 GB.
# `headroom serve` sets it (Serve reads it as the proxy starts) to the largest application's
# RequestLimits.message_cap().
SERVE_GRPC_MAX_MESSAGE_SIZE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def proxy_request_limits() -> RequestLimits:
    return RequestLimits(max_request_bytes=int(os.environ.get(PROXY_MAX_REQUEST_BYTES_ENV, DEFAULT_MAX_REQUEST_BYTES)))


def is_loopback_peer(peer: str) -> bool:
    """grpc's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") names a local client."""
    kind, _, address = urllib.parse.unquote(peer).partition(":")
    if kind == "unix":
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def parsed(raw: bytes, message_type: type, limits: RequestLimits, credentials: Credentials, context: Any) -> Any:
    """The request from its raw bytes, refused from a remote client when the proxy serves
    loopback only (PERMISSION_DENIED), without an accepted API key (UNAUTHENTICATED), or past
    the bound or malformed (INVALID_ARGUMENT)."""
    if os.environ.get(PROXY_LOOPBACK_ONLY_ENV) == "1" and not is_loopback_peer(context.peer()):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            "this cluster serves local clients only (headroom serve --host 0.0.0.0 serves the network)")
    if not credentials.accepts_authorization(metadata_authorization(context.invocation_metadata())):
        await context.abort(*grpc_status(missing_credential("API key")))
    try:
        limits.check_request_bytes(len(raw))
        try:
            return message_type.FromString(raw)
        except DecodeError as error:
            raise InvalidRequestError("request", f"not a valid {message_type.__name__}: {error}") from None
    except InvalidRequestError as error:  # names `request`, the same in the proto as in the engine
        await context.abort(*grpc_status(error))


class ContextUntilEnd:
    """The RPC's servicer context for a handler that may outlive the RPC. While the RPC is
    live every call goes through; once it has ended (`end()`), touching grpc's context
    crashes the process (it is freed), so what Serve reads is answered from a copy taken at
    the start (peer, metadata) or as "unset", and what it writes is dropped."""

    _AFTER_END = {"trailing_metadata": (), "code": None, "details": None}

    def __init__(self, context: Any):
        self._context = context
        self._peer = context.peer()
        self._invocation_metadata = tuple(context.invocation_metadata())
        self._ended = False

    def end(self) -> None:
        self._ended = True

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return self._invocation_metadata

    def __getattr__(self, name: str) -> Any:
        if not self._ended:
            return getattr(self._context, name)
        value = self._AFTER_END.get(name)
        return lambda *args, **kwargs: value


def bounded_unary(serve_handler: Callable[[Any, Any], Awaitable[bytes]], message_type: type,
                  limits: RequestLimits, credentials: Credentials) -> Callable[[bytes, Any], Awaitable[bytes]]:
    async def handler(raw: bytes, context: Any) -> bytes:
        return await serve_handler(await parsed(raw, message_type, limits, credentials, context), context)

    return handler


def quiet_cancelled_requests(loop: asyncio.AbstractEventLoop) -> None:
    """Drops asyncio's "Task exception was never retrieved" report for a task that ended with
    Serve's RequestCancelledError, in this loop (once; other reports go where they went).

    A cancelled Generate (a client that cancels or hits its deadline) cancels the pump below
    inside Serve's ProxyResponseGenerator._get_next_streaming_result, which leaves the task it
    made for the response's next item to end with RequestCancelledError unread: Serve swallows
    that only on its HTTP disconnect path. Each cancel printed a 1.4 KB traceback to the
    proxy's log (1,963 in a 47-minute soak), burying real errors."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_cancelled_requests", False):
        return
    from ray.serve.exceptions import RequestCancelledError

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if isinstance(context.get("exception"), RequestCancelledError) and "never retrieved" in context.get("message", ""):
            return  # the request was cancelled, as its caller asked: nothing to report
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiets_cancelled_requests = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


def bounded_cancel_safe_stream(serve_handler: Callable[[Any, Any], AsyncIterator[bytes]], message_type: type,
                               limits: RequestLimits, credentials: Credentials
                               ) -> Callable[[bytes, Any], AsyncIterator[bytes]]:
    """A unary-stream handler yielding what `serve_handler` yields, which it runs in a task
    that is cancelled (inside Serve's awaits) however this handler ends."""

    async def handler(raw: bytes, context: Any) -> AsyncIterator[bytes]:
        request = await parsed(raw, message_type, limits, credentials, context)
        quiet_cancelled_requests(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        serve_context = ContextUntilEnd(context)

        async def pump() -> None:
            try:
                async for message in serve_handler(request, serve_context):
                    queue.put_nowait(message)  # never suspends: cancellation lands in Serve's awaits
            except BaseException as error:  # noqa: BLE001 (handed over and re-raised below)
                queue.put_nowait(error)
                raise
            finally:
                queue.put_nowait(_STREAM_END)

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while (item := await queue.get()) is not _STREAM_END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            serve_context.end()
            task.cancel()

    return handler


def add_generation_to_server(servicer: object, server: grpc.aio.Server) -> None:
    """A `grpc_servicer_functions` entry registering headroom.v1.Generation on Serve's proxy
    (on any other server, e.g. where Serve only validates the entry, it registers plainly)."""
    factory = getattr(server, "service_handler_factory", None)
    mark_local = getattr(server, "add_passthrough_service", None)
    if factory is None or mark_local is None:
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        return
    log_client_errors_in_one_line()  # this is the proxy's process
    from cluster.serve_private import gRPCStreamingType

    def routed(method: str, streaming_type: gRPCStreamingType) -> Callable:
        return factory(service_method=f"/{GENERATION_SERVICE_NAME}/{method}", streaming_type=streaming_type)

    # Registered as the proxy's own service so Serve does not replace these handlers with its
    # plain ones; they still route through Serve (its handlers, metrics and access log).
    mark_local(GENERATION_SERVICE_NAME)
    limits = proxy_request_limits()
    # The keys this node's environment configures (`headroom serve` exports its flags there
    # before Ray starts; on Kubernetes the chart sets them): none leaves Generation open.
    credentials = api_key_credentials()
    unary = gRPCStreamingType.UNARY_UNARY
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(bounded_cancel_safe_stream(
            routed("Generate", gRPCStreamingType.UNARY_STREAM), pb.GenerateRequest, limits, credentials)),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            bounded_unary(routed("Tokenize", unary), pb.TokenizeRequest, limits, credentials)),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            bounded_unary(routed("GetModelInfo", unary), pb.ModelInfoRequest, limits, credentials)),
    }
    # No (de)serializers: requests arrive as raw bytes (bounded, then parsed above), and
    # Serve's handlers answer with the bytes the application serialized.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATION_SERVICE_NAME, handlers),))


class ProxyHealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for the proxy: SERVING for the whole server ("") and for
    headroom.v1.Generation while the proxy runs (as Serve's own Healthz reports it);
    NOT_FOUND for any other service."""

    SERVING = health_pb2.HealthCheckResponse.SERVING
    SERVICES = ("", GENERATION_SERVICE_NAME)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        if request.service not in self.SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self.SERVING)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        known = request.service in self.SERVICES
        yield health_pb2.HealthCheckResponse(
            status=self.SERVING if known else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        await asyncio.Event().wait()  # nothing changes while the proxy serves; the client ends the watch

    async def List(self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext):
        return health_pb2.HealthListResponse(
            statuses={service: health_pb2.HealthCheckResponse(status=self.SERVING) for service in self.SERVICES})


def add_health_and_reflection_to_server(servicer: object, server: grpc.aio.Server) -> None:
    """A `grpc_servicer_functions` entry: Serve calls it with a placeholder servicer and its
    proxy's server, before the server starts."""
    # Serve routes every registered method to an application unless its service is marked
    # as answered in the proxy (how Serve serves its own reflection).
    mark_local = getattr(server, "add_passthrough_service", None)
    if mark_local is not None:
        mark_local(health.SERVICE_NAME)
        mark_local(V1_SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(ProxyHealthServicer(), server)
    add_v1_reflection(ADVERTISED_SERVICE_NAMES, server)
