"""gRPC server reflection under both protocol versions: `grpc.reflection.v1`, which current
grpcurl and grpcui ask first, and `grpc.reflection.v1alpha`, the one grpcio-reflection ships.
The v1 protocol is v1alpha's messages under a new package name, so v1 is served by
grpcio-reflection's own servicer, its descriptor registered under the v1 name.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
REFLECTION_SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
_V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection v1 and v1alpha on `server`, each advertising `service_names` and both
    reflection services."""
    names = tuple(service_names) + REFLECTION_SERVICE_NAMES
    reflection.enable_server_reflection(names, server)
    add_v1_reflection(names, server)


def add_v1_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Only the v1 service (for servers that already serve v1alpha, like Ray Serve's proxy)."""
    _register_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer(tuple(service_names))
    handler = grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        # v1 and v1alpha messages are the same on the wire: v1alpha's classes parse v1 requests.
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((handler,))


def _register_v1_descriptor() -> None:
    """Adds grpc/reflection/v1/reflection.proto to the default pool (once), so a v1 client
    can ask reflection to describe the v1 service itself."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE_NAME)
        return
    except KeyError:
        pass
    file_proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(file_proto)
    old_prefix, new_prefix = f".{v1alpha_pb2.DESCRIPTOR.package}.", f".{V1_PACKAGE}."
    file_proto.name = _V1_FILE_NAME
    file_proto.package = V1_PACKAGE
    file_proto.ClearField("options")
    for message in file_proto.message_type:
        for field in message.field:
            if field.type_name:  # set on message-typed fields only
                field.type_name = field.type_name.replace(old_prefix, new_prefix)
    for service in file_proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old_prefix, new_prefix)
            method.output_type = method.output_type.replace(old_prefix, new_prefix)
    pool.Add(file_proto)
