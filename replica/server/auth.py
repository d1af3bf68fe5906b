"""Bearer credentials for headroom's doors: a set of secrets (API keys on the public doors, the
cluster token on replica-internal endpoints) checked in constant time, and a grpc.aio server
interceptor that refuses every call without one (UNAUTHENTICATED) except the methods left open
(health checking and reflection, as vLLM leaves /health open).

A secret is never logged, never put in an error message and never compared with `==`:
`Credentials.accepts` runs hmac.compare_digest against every configured secret, so neither the
presented value's length nor which secret it resembles changes what the comparison does.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable, Iterable, Optional

import grpc

# gRPC metadata keys are lower case; HTTP's header is matched case-insensitively by the server.
AUTHORIZATION_METADATA_KEY = "authorization"
BEARER_PREFIX = "Bearer "
# Services any client may call without a credential: load balancers' and Kubernetes' health
# probes, and reflection (which lists services, not data).
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class Credentials:
    """The secrets a door accepts. Empty means the door is open (no credential configured)."""

    def __init__(self, secrets: Iterable[str] = ()):
        self._secrets = tuple(secret.encode() for secret in secrets)
        if any(not secret or secret != secret.strip() for secret in self._secrets):
            raise ValueError("an API key or token must be non-empty and carry no surrounding whitespace")

    @property
    def required(self) -> bool:
        return bool(self._secrets)

    def __len__(self) -> int:
        return len(self._secrets)

    def __repr__(self) -> str:  # never the secrets themselves
        return f"Credentials({len(self._secrets)} configured)"

    def accepts(self, presented: Optional[str]) -> bool:
        """True when no secret is configured, or `presented` equals one of them. Every secret
        is compared, whatever matched, each with hmac.compare_digest."""
        if not self._secrets:
            return True
        if presented is None:
            presented = ""
        candidate = presented.encode()
        matched = False
        for secret in self._secrets:
            matched |= hmac.compare_digest(candidate, secret)
        return matched

    def accepts_authorization(self, header: Optional[str]) -> bool:
        """`Authorization: Bearer <secret>` (the scheme exactly as OpenAI clients send it)."""
        return self.accepts(bearer_token(header))


def bearer_token(header: Optional[str]) -> Optional[str]:
    """The token of an `Authorization: Bearer <token>` value, else None (another scheme, none)."""
    if header is None or not header.startswith(BEARER_PREFIX):
        return None
    return header[len(BEARER_PREFIX):]


def metadata_authorization(metadata: Optional[Iterable[tuple[str, object]]]) -> Optional[str]:
    """The `authorization` value of gRPC invocation metadata, if one was sent."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def is_open_method(method: str) -> bool:
    return method.startswith(OPEN_SERVICE_PREFIXES)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <accepted secret>`,
    except the open methods; `what` names the credential in the refusal ("API key",
    "cluster token"), never its value."""

    def __init__(self, credentials: Credentials, what: str = "API key"):
        self._credentials = credentials
        self._what = what

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if is_open_method(handler_call_details.method) or self._credentials.accepts_authorization(
                metadata_authorization(handler_call_details.invocation_metadata)):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return unauthenticated_handler(handler, f"missing or invalid {self._what} "
                                                f"(send metadata 'authorization: Bearer <{self._what.lower()}>')")


def unauthenticated_handler(handler: Optional[grpc.RpcMethodHandler], message: str) -> Optional[grpc.RpcMethodHandler]:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED (an
    unknown method stays unknown: UNIMPLEMENTED is grpc's own answer for it)."""
    if handler is None:
        return None

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover (abort raises): makes this an async generator

    serializers = dict(request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **serializers)
