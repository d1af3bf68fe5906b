"""Request bytes that do not parse as the method's message (a corrupt wire format, a string
field that is not UTF-8, as clients that skip proto3's UTF-8 check can send) are refused as
INVALID_ARGUMENT (`request: not a valid GenerateRequest: …`), as the cluster's gRPC proxy
refuses them. Left to grpc, the deserializer's DecodeError ends the call as UNKNOWN
("Unexpected <class 'DecodeError'>"), which tells a client the server failed, not its input.
So are bytes over the byte limit (`request: N bytes exceeds the limit of …`), counted before
they are parsed: the parsed message's ByteSize is a whole serialization (10 ms of the event loop
for 4 MiB of token ids), and parsing a message that will be refused costs more (17 ms).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

import grpc
from google.protobuf.message import DecodeError

from replica.errors import InvalidRequestError
from replica.server.request_limits import RequestLimits
from replica.server.status import grpc_status

# The methods whose requests are parsed here: headroom's own services (health checking and
# reflection keep grpc's own handling).
PARSED_METHOD_PREFIX = "/headroom."


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Takes the parsing of unary requests from grpc into the handler, where a request over
    `limits`' byte limit or a DecodeError can end the call with INVALID_ARGUMENT. Behind the auth
    interceptor (after it in the server's list): a call without credentials is refused as such,
    whatever its bytes."""

    def __init__(self, limits: RequestLimits = RequestLimits()):
        self.limits = limits

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Optional[grpc.RpcMethodHandler]:
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(PARSED_METHOD_PREFIX)
                or handler.request_streaming or handler.request_deserializer is None):
            return handler
        return parsing_handler(handler, self.limits)


def parsing_handler(handler: grpc.RpcMethodHandler, limits: RequestLimits) -> grpc.RpcMethodHandler:
    """`handler` taking raw bytes, which it bounds by `limits` and parses with the handler's own
    deserializer."""
    deserialize = handler.request_deserializer
    message_type = getattr(deserialize, "__self__", None)  # the generated code passes Message.FromString
    message_name = getattr(message_type, "__name__", "message")

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            limits.check_request_bytes(len(raw))
            return deserialize(raw)
        except InvalidRequestError as error:
            await context.abort(*grpc_status(error))
        except DecodeError as error:
            await context.abort(*grpc_status(InvalidRequestError("request", f"not a valid {message_name}: {error}")))

    serializers = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await parse(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary, **serializers)
    behavior = handler.unary_stream

    async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> None:
        # A coroutine: grpc then leaves the writes to it (context.write), as headroom's
        # servicers make them; an async generator's responses are written here.
        result = behavior(await parse(raw, context), context)
        if hasattr(result, "__aiter__"):
            async for response in result:
                await context.write(response)
        else:
            await result

    return grpc.unary_stream_rpc_method_handler(stream, **serializers)
