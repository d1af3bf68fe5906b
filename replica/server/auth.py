"""Bearer credentials for headroom's doors: a set of secrets (API keys on the public doors, the
cluster token on replica-internal endpoints) checked in constant time, and a grpc.aio server
interceptor that refuses every call without one (UNAUTHENTICATED) except the methods left open
(health checking and reflection, as vLLM leaves /health open).

A secret is never logged, never put in an error message and never compared with `==`:
`Credentials.accepts` runs hmac.compare_digest against every configured secret, so neither the
presented value's length nor which secret it resembles changes what the comparison does.

The public doors' API keys come from one place (`api_key_credentials`): `--api-key` (repeatable)
or else HEADROOM_API_KEY (comma-separated), plus `--api-key-file` or else HEADROOM_API_KEY_FILE
(one key per line). `headroom serve` exports its flags into that environment before Ray starts,
so its proxies and ingresses, which read it, agree with it; on Kubernetes the chart sets it.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
from typing import Awaitable, Callable, Iterable, Mapping, MutableMapping, Optional, Sequence

import grpc

from replica.errors import AuthenticationError
from replica.server.status import grpc_status

# gRPC metadata keys are lower case; HTTP's header is matched case-insensitively by the server.
AUTHORIZATION_METADATA_KEY = "authorization"
BEARER_PREFIX = "Bearer "  # as clients send it; read with the scheme in any case (RFC 7235)
# Services any client may call without a credential: load balancers' and Kubernetes' health
# probes, and reflection (which lists services, not data).
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Where every process of a cluster (and `headroom replica`) reads the public API keys.
API_KEY_ENV = "HEADROOM_API_KEY"
API_KEY_FILE_ENV = "HEADROOM_API_KEY_FILE"
API_KEY_SEPARATOR = ","
# Set to 1 where a key is meant to be configured (the Helm chart, whenever it wires a Secret):
# no key found then fails the start instead of opening the doors. An empty HEADROOM_API_KEY
# alone means "no key", as a shell's `HEADROOM_API_KEY= headroom serve` does; an empty Secret
# (`--from-literal=api-key="$(openssl rand -hex 32)"` without openssl) must not.
API_KEY_REQUIRED_ENV = "HEADROOM_API_KEY_REQUIRED"


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
        """`Authorization: Bearer <secret>` (the scheme in any case, as bearer_token reads it)."""
        return self.accepts(bearer_token(header))


def missing_credential(what: str, header: str = "metadata 'authorization") -> AuthenticationError:
    """The refusal of a call that carried no accepted `what` ("API key", "cluster token"),
    saying how to send one (gRPC metadata by default; HTTP passes its header)."""
    return AuthenticationError(f"missing or invalid {what} (send {header}: Bearer <{what.lower()}>')")


def bearer_token(header: Optional[str]) -> Optional[str]:
    """The token of an `Authorization: Bearer <token>` value, else None (another scheme, none).
    RFC 7235 makes the scheme case-insensitive and lets spaces part it from the token: clients
    that send `bearer <token>` (some HTTP libraries lower-case it) or pad it are served; a
    secret never has surrounding whitespace (Credentials refuses one), so none is lost."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != BEARER_PREFIX.strip().lower():
        return None
    return token.strip()


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
        return unauthenticated_handler(handler, grpc_status(missing_credential(self._what))[1])


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


# ---- the API keys: flags, environment, key file -----------------------------------------------
class CredentialsError(ValueError):
    """A source of API keys that cannot be used; names the source (flag, variable, file and
    line), never a key."""


def configured_api_keys(keys: Optional[Sequence[str]] = None, key_file: Optional[str] = None,
                        environ: Mapping[str, str] = os.environ) -> list[str]:
    """The API keys: `keys` (--api-key, one key each) or else HEADROOM_API_KEY's comma-separated
    ones, and the lines of `key_file` (--api-key-file) or else HEADROOM_API_KEY_FILE's (blank
    lines and # comments skipped). Raises CredentialsError naming a bad source."""
    found: list[str] = []
    if keys is not None:
        for key in keys:
            if not key or key != key.strip():
                raise CredentialsError("--api-key: an API key must be non-empty, without surrounding whitespace")
            if API_KEY_SEPARATOR in key:
                raise CredentialsError(f"--api-key: an API key cannot contain {API_KEY_SEPARATOR!r} "
                                       f"({API_KEY_ENV} separates keys with it); repeat --api-key for several")
            _check_sendable(key, "--api-key")
            found.append(key)
    elif environ.get(API_KEY_ENV, "").strip():
        listed = [key.strip() for key in environ[API_KEY_ENV].split(API_KEY_SEPARATOR)]
        if not all(listed):  # "k1,,k2", "k1,": a slip that must not leave the door open
            raise CredentialsError(f"{API_KEY_ENV}: an empty key between commas")
        for key in listed:
            _check_sendable(key, API_KEY_ENV)
        found.extend(listed)
    if key_file is not None:
        found.extend(_read_key_file(key_file, "--api-key-file"))
    elif environ.get(API_KEY_FILE_ENV):
        found.extend(_read_key_file(environ[API_KEY_FILE_ENV], API_KEY_FILE_ENV))
    if not found and environ.get(API_KEY_REQUIRED_ENV, "").strip() not in ("", "0"):
        raise CredentialsError(f"{API_KEY_REQUIRED_ENV}: a key is required, but {API_KEY_ENV} and "
                               f"{API_KEY_FILE_ENV} hold none (an empty Secret?): not serving without one")
    return found


def _read_key_file(path: str, source: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as key_file:
            lines = key_file.read().splitlines()
    except OSError as error:
        raise CredentialsError(f"{source}: cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise CredentialsError(f"{source}: {path} is not UTF-8 text") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise CredentialsError(f"{source}: {path} holds no API key (one key per line; blank and # lines are skipped)")
    for key in keys:
        _check_sendable(key, f"{source}: {path}")
    return keys


def _check_sendable(key: str, source: str) -> None:
    """A key no client could present is refused where it is configured: HTTP clients send a
    header's non-ASCII characters in an encoding of their own (curl UTF-8, requests Latin-1,
    httpx and the openai client none: they raise), which the server reads as Latin-1, and gRPC
    metadata carries printable ASCII only. Such a key matched nobody, or only some clients."""
    if not _is_sendable(key):
        raise CredentialsError(f"{source}: {UNSENDABLE_KEY}")


UNSENDABLE_KEY = "an API key must be printable ASCII (HTTP headers and gRPC metadata carry no other characters)"


def _is_sendable(key: str) -> bool:
    return key.isascii() and key.isprintable()


def _client_key(value: str) -> str:
    """--api-key of a client command: a key it could not send (gRPC refuses the metadata with an
    INTERNAL error naming nothing) is refused as the flag's value."""
    if not _is_sendable(value):
        raise argparse.ArgumentTypeError(UNSENDABLE_KEY)
    return value


def api_key_credentials(keys: Optional[Sequence[str]] = None, key_file: Optional[str] = None,
                        environ: Mapping[str, str] = os.environ) -> Credentials:
    """The public doors' Credentials, from the flags or else the environment (configured_api_keys)."""
    return Credentials(configured_api_keys(keys, key_file, environ))


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    """The server flags (`headroom serve`, `headroom replica`)."""
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require this key from every client (HTTP 'Authorization: Bearer KEY' where the "
                             f"command serves HTTP, gRPC metadata 'authorization: Bearer KEY'); repeat for several "
                             f"(default: ${API_KEY_ENV}, comma-separated; none: no key needed; a flag's value shows "
                             "in ps, the variable and --api-key-file do not)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help=f"accept the keys in FILE too, one per line (default: ${API_KEY_FILE_ENV})")


def api_key_credentials_from_args(args: argparse.Namespace) -> Credentials:
    return api_key_credentials(args.api_key, args.api_key_file)


def export_api_key_flags(args: argparse.Namespace, environ: MutableMapping[str, str] = os.environ) -> None:
    """Makes the flags the environment's sources, for every process started from here on (Ray
    workers inherit it): --api-key replaces HEADROOM_API_KEY, --api-key-file
    HEADROOM_API_KEY_FILE (as an absolute path: workers run elsewhere)."""
    if args.api_key is not None:
        environ[API_KEY_ENV] = API_KEY_SEPARATOR.join(args.api_key)
    if args.api_key_file is not None:
        environ[API_KEY_FILE_ENV] = os.path.abspath(args.api_key_file)


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC binds and dials it and Prometheus scrapes it: an IPv6 literal in
    brackets (`[fd00::1]:9300`; an announced `fd00::1:9300` did not resolve, and every router
    fell back to Serve's choice, logged at DEBUG)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback_host(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_door_warning(host: str, credentials: Credentials) -> Optional[str]:
    """One warning line when a server binds beyond loopback and takes no API key, else None."""
    if credentials.required or is_loopback_host(host):
        return None
    return (f"warning: serving on {host} without an API key: anyone who can reach it can generate "
            f"(set --api-key, --api-key-file, {API_KEY_ENV} or {API_KEY_FILE_ENV})")


# ---- the client side -----------------------------------------------------------------------
def add_client_api_key_argument(parser: argparse.ArgumentParser,
                                purpose: str = "the cluster's API key, sent as 'authorization: Bearer KEY'") -> None:
    parser.add_argument("--api-key", default=None, metavar="KEY", type=_client_key,
                        help=f"{purpose} (default: ${API_KEY_ENV}, its first key)")


def client_api_key(flag: Optional[str], environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The key a client sends: the flag's, else the first configured in the environment."""
    if flag is not None:
        return flag
    keys = configured_api_keys(environ=environ)
    return keys[0] if keys else None


def authorization_metadata(api_key: Optional[str]) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `api_key` (none without one); the routers send the cluster
    token the same way."""
    return ((AUTHORIZATION_METADATA_KEY, BEARER_PREFIX + api_key),) if api_key else ()
