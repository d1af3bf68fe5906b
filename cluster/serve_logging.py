"""One log line, not a traceback, for a request refused for the client's own fault. Ray Serve
logs every exception a deployment method raises with its traceback at ERROR; for an invalid
field or a full queue that is ~40 lines of noise per bad request, on every replica it crossed.
And none at all for a client that closed its stream, which is no error.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from ray.exceptions import TaskCancelledError

from replica.errors import AuthenticationError, HeadroomError, InvalidRequestError, QueueFullError

# Ray Serve's logger (ray.serve._private.constants.SERVE_LOGGER_NAME), where it logs
# "Request failed." with the exception of a failed call.
SERVE_LOGGER_NAME = "ray.serve"


class ClientRefusal(HeadroomError):
    """A request refused for the client's own fault that is not an engine field error (an
    unknown application); logged like one."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "invalid_request_error"
    openai_code = "not_found"


CLIENT_ERRORS = (InvalidRequestError, QueueFullError, ClientRefusal, AuthenticationError)


# How Serve's gRPC proxy words a call that ended with the status the application set: the
# message carries the whole remote traceback, ending in the one line that says what happened.
STATUS_SET_BY_APPLICATION = "gRPCStatusError"


def client_error(error: BaseException | None) -> BaseException | None:
    """The client error behind `error` (Serve wraps a gRPC one in gRPCStatusError, Ray a
    remote one in RayTaskError), or None."""
    for _ in range(4):
        if error is None or isinstance(error, CLIENT_ERRORS):
            return error
        error = getattr(error, "original_exception", None) or getattr(error, "cause", None) or error.__cause__
    return None


class ClientErrorLogFilter(logging.Filter):
    """Rewrites a record carrying a client error into one INFO line naming it, and the
    proxy's report of a status the application set into that report's last line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = client_error(record.exc_info[1]) if record.exc_info else None
        if error is not None:
            record.msg, record.args = "request refused: %s: %s", (type(error).__name__, error)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        elif isinstance(record.msg, str) and "\n" in record.msg and STATUS_SET_BY_APPLICATION in record.msg:
            record.msg, record.args = "request ended with the status its application set: %s", (
                record.msg.strip().splitlines()[-1],)
        return True


def log_client_errors_in_one_line() -> None:
    """Installs the filter on Serve's logger in this process (once)."""
    logger = logging.getLogger(SERVE_LOGGER_NAME)
    if not any(isinstance(existing, ClientErrorLogFilter) for existing in logger.filters):
        logger.addFilter(ClientErrorLogFilter())


class DisconnectWhenReceiveIsCancelled:
    """ASGI middleware: a client that closes an HTTP stream is a disconnect, however Serve says so.

    Serve's replica relays the client's messages by calling its proxy; when the client goes,
    that call usually fails with KeyError, which Serve turns into `http.disconnect`
    (ray-project/ray#43290), but when the proxy cancels the call first `receive()` raises
    TaskCancelledError instead. Starlette's StreamingResponse, listening for the disconnect,
    then fails the request and Serve logs a 40-line traceback for a client that simply left.
    Here that is the disconnect it is, returned again on every later `receive()` as ASGI
    requires; the stream then ends as on any disconnect, cancelling the replica's generation.
    """

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        disconnected = False

        async def receive_or_disconnect() -> dict:
            nonlocal disconnected
            if not disconnected:
                try:
                    return await receive()
                except TaskCancelledError:
                    disconnected = True
            return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)
