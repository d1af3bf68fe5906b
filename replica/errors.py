"""Every error a client of headroom can be told about, in one hierarchy, and how each is told.

Each class declares its answer once: the gRPC status code (by name, so this module needs no
grpc), the HTTP status and OpenAI's error `type` and `code`. The gRPC servicers map an error
with `replica.server.status.grpc_status`, the OpenAI API with `cluster.openai_api.openai_error`;
neither lists classes of its own. Light on purpose (no torch, no grpc): the ingress, the
router and the CLI import it.

Requests are validated once, where they enter, by `replica.core.request.validate_request`: the
cluster's ingress (against its replicas' ModelInfo), a replica's own gRPC servicer, or
`LLMEngine.add_request` in-process; the front and the core trust them, and the scheduler keeps
only the guards that protect memory (`Scheduler.check_request`).
"""

from __future__ import annotations

from typing import Optional


class HeadroomError(Exception):
    """Base of the errors a request can end with; unknown exceptions are internal errors."""

    grpc_code = "INTERNAL"
    http_status = 500
    openai_type = "server_error"
    openai_code: Optional[str] = "internal_error"

    @property
    def client_message(self) -> str:
        return str(self)


class InvalidRequestError(HeadroomError, ValueError):
    """A request the engine cannot serve. `field` names the offending input field."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"
    openai_code = None

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):
        # Crosses process boundaries intact (a Ray Serve replica raises it to the ingress);
        # the default would call __init__ with the one formatted string.
        return (type(self), (self.field, self.message))


class ContextLengthExceededError(InvalidRequestError):
    """A prompt, or a prompt and its max_tokens, past the model's context length: OpenAI's code
    for it, and its sentence as OpenAI's API and vLLM's server word it, which clients match on
    (LiteLLM's "maximum context length") to trim a conversation and retry."""

    openai_code = "context_length_exceeded"


class AuthenticationError(HeadroomError, PermissionError):
    """The call carried no credential a door accepts (an API key, the cluster token). Its
    message names the credential and how to send it, never a value presented or configured."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    # OpenAI's own answer to a missing or wrong key.
    openai_type = "invalid_request_error"
    openai_code = "invalid_api_key"


class QueueFullError(HeadroomError, RuntimeError):
    """The waiting queue is at its configured bound; the caller should retry later."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    openai_type = "rate_limit_error"
    openai_code = "queue_full"


class EngineDeadError(HeadroomError, RuntimeError):
    """The engine-core process is gone; nothing it held can finish."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_code = "replica_unavailable"


class EngineShutdownError(HeadroomError, RuntimeError):
    """The engine is shutting down and takes no new requests."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_code = "replica_unavailable"


class ReplicaLostError(HeadroomError, RuntimeError):
    """The replica serving a stream died after the stream had produced tokens (which cannot
    be taken back), or every try died before producing one."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_code = "replica_unavailable"


class EngineStepError(HeadroomError, RuntimeError):
    """The model failed while running this request's step (the engine aborted the request)."""


class FirstTokenDeadlineExceeded(HeadroomError, RuntimeError):
    """No first token within the request's hard TTFT deadline; its stream ends with this."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    openai_code = "ttft_deadline_exceeded"

    @property
    def client_message(self) -> str:
        return f"ttft_deadline_ms: {self}"


class StreamStalledError(HeadroomError, RuntimeError):
    """The stream's reader took none of its outputs for EngineConfig.stream_stall_timeout_s:
    the request was aborted (its KV blocks freed) and its unread outputs dropped. A reader that
    comes back gets this in their place."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 408
    openai_code = "stream_stalled"
