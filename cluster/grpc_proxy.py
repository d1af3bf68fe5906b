"""What headroom adds to Ray Serve's gRPC proxy, through its one extension point (a
`grpc_servicer_functions` entry, called with the proxy's server before it starts): standard
health checking (`grpc.health.v1`) and reflection v1 beside Serve's own v1alpha, both
answered by the proxy itself rather than routed to an application.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import headroom_pb2 as pb
from replica.grpc_reflection import V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME, add_v1_reflection

GENERATION_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# The services a reflection client sees on the cluster port, the proxy's own included.
ADVERTISED_SERVICE_NAMES = (GENERATION_SERVICE_NAME, health.SERVICE_NAME, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


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
