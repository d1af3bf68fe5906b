"""The one mapping from an error to the gRPC status a client sees (replica/errors.py declares
each class's code); the replica's servicer and the cluster's ingress both answer with it."""

from __future__ import annotations

import logging

import grpc

from protos import headroom_pb2 as pb
from replica.errors import HeadroomError, InvalidRequestError

logger = logging.getLogger(__name__)

# The engine names fields after its own types; clients know the proto's field paths. Each
# field of the proto's SamplingParams carries the engine's SamplingParams field of its name.
PROTO_FIELD_FOR_ENGINE_FIELD = {
    "prompt_token_ids": "token_ids",
    **{name: f"sampling.{name}" for name in pb.SamplingParams.DESCRIPTOR.fields_by_name},
}


def invalid_argument_message(error: InvalidRequestError) -> str:
    """The error's message with the engine's field name replaced by the proto field path."""
    return f"{PROTO_FIELD_FOR_ENGINE_FIELD.get(error.field, error.field)}: {error.message}"


def grpc_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details `error` ends a call with; anything undeclared is INTERNAL."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, invalid_argument_message(error)
    if isinstance(error, HeadroomError):
        return grpc.StatusCode[error.grpc_code], error.client_message
    if isinstance(error, TimeoutError):  # the call's own gRPC deadline
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the request finished"
    logger.error("request failed", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {error}"
