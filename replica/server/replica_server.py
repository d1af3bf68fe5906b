"""ReplicaServer: one AsyncEngine (the front of an engine-core process) as a grpc.aio service
without Ray: Generation and LoadReporter, standard health checking (NOT_SERVING once the core
is gone) and reflection (v1 and v1alpha), request bytes over the byte limit or that do not parse
refused as INVALID_ARGUMENT (MalformedRequestInterceptor), Prometheus metrics kept in step with
every load the core publishes and every output the front streams, and a graceful stop that lets
in-flight streams end cleanly. Every other method is behind bearer credentials when some are
configured (BearerAuthInterceptor; health checking and reflection stay open).

`headroom replica` serves both services, behind its API keys. A cluster replica serves only
LoadReporter (its generations come through Serve handles), behind the cluster token:
`generation=False`, `credentials`, `credential_name="cluster token"`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Awaitable, Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from protos.keepalive import SERVER_KEEPALIVE_OPTIONS
from replica.front.async_engine import AsyncEngine
from replica.server.auth import BearerAuthInterceptor, Credentials, host_port
from replica.server.grpc_reflection import enable_reflection
from replica.server.grpc_service import GenerationServicer, LoadReporterServicer
from replica.server.load_report import LoadReportBuilder
from replica.server.malformed_requests import MalformedRequestInterceptor
from replica.server.metrics import ReplicaMetrics
from replica.server.request_limits import RequestLimits
from replica.server.request_metrics import RequestMetrics

logger = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
LOAD_REPORTER_SERVICE = pb.DESCRIPTOR.services_by_name["LoadReporter"].full_name
# gRPC sets SO_REUSEPORT by default: two servers on one port would silently share its
# connections. Off, a taken port fails to bind, so the next one can be tried. The fronts of
# one replica (`headroom replica --api-server-count N`) share theirs on purpose: the kernel
# spreads new connections over them.
# Routers' streams ping every KEEPALIVE_TIME_MS (protos/keepalive.py): accepted, with or without data.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),) + SERVER_KEEPALIVE_OPTIONS
SHARED_PORT_SERVER_OPTIONS = (("grpc.so_reuseport", 1),) + SERVER_KEEPALIVE_OPTIONS
# Without new loads (an idle engine) the gauges are still refreshed this often, so the
# smoothed preemption rate visibly decays to zero.
IDLE_METRICS_REFRESH_S = 1.0
# After the engine has finished or aborted every request, handlers only need this long
# to write their last message.
FINAL_WRITES_GRACE_S = 1.0


class ReplicaServer:
    def __init__(self, engine: AsyncEngine, replica_id: str, model_id: str, metrics: ReplicaMetrics,
                 limits: RequestLimits = RequestLimits(), *, generation: bool = True,
                 credentials: Credentials = Credentials(), credential_name: str = "API key",
                 shared_port: bool = False):
        """generation: serve headroom.v1.Generation beside LoadReporter (a cluster replica does
        not: a direct Generate answers UNIMPLEMENTED). credentials: the bearer secrets every
        call but health checking and reflection must carry (none: open); credential_name
        names them in the refusal ("API key", "cluster token"). shared_port: bind with
        SO_REUSEPORT, as one of several fronts of one engine core (see `start`)."""
        self.engine = engine
        self.replica_id = replica_id
        self.model_id = model_id
        self.metrics = metrics
        self.limits = limits
        self.load_reports = LoadReportBuilder(replica_id, engine.stats)
        self.generation = generation
        self.service_names = ((GENERATION_SERVICE,) if generation else ()) + (LOAD_REPORTER_SERVICE,)
        self.credentials = credentials
        self.credential_name = credential_name
        self.shared_port = shared_port
        self.port: Optional[int] = None
        self._server: Optional[grpc.aio.Server] = None
        self._health: Optional[health.aio.HealthServicer] = None
        self._stopping: Optional[asyncio.Event] = None
        self._metrics_task: Optional[asyncio.Task] = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, port_search: int = 1, *,
                    join: bool = False) -> int:
        """Serve on host:port, or the first free port of the `port_search` from `port` up (0
        picks any free port), then start the engine core (if not yet); returns the port.
        Raises OSError, before the engine core starts, when none of them is free. With
        `shared_port`, the first front takes a port nothing holds (it is checked with a plain
        bind first: SO_REUSEPORT alone would join another server's port) and the others
        `join` it (exactly `port`)."""
        self._stopping = asyncio.Event()
        interceptors = [BearerAuthInterceptor(self.credentials, self.credential_name)] if self.credentials.required else []
        interceptors.append(MalformedRequestInterceptor(self.limits))  # after auth: unauthenticated calls are refused as such
        options = (SHARED_PORT_SERVER_OPTIONS if self.shared_port else SERVER_OPTIONS) + (
            ("grpc.max_receive_message_length", self.limits.receive_cap()),)
        server = grpc.aio.server(interceptors=interceptors, options=options)
        pb_grpc.add_LoadReporterServicer_to_server(
            LoadReporterServicer(self.engine, self.load_reports, self._stopping), server
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        enable_reflection(self.service_names + (health.SERVICE_NAME,), server)
        self.port = _bind_first_free(server, host, port, 1 if join else port_search, check_free=not join)
        await self.engine.start()
        if self.generation:  # after the start: the servicer builds its grammar compiler from the engine's tokenizer
            pb_grpc.add_GenerationServicer_to_server(
                GenerationServicer(self.engine, self.replica_id, self.model_id, self.limits), server
            )
        # Every front that streams from this engine (this server's Generate, a Serve
        # deployment's generate) then feeds the same latency histograms.
        self.engine.observe_requests(RequestMetrics(self.metrics, self.engine.engine.clock))
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.engine.on_dead(self._core_died)
        await server.start()
        self._server = server
        self._metrics_task = asyncio.get_running_loop().create_task(self._sync_metrics(), name="replica-metrics")
        logger.info("replica %s serving %s on %s:%d", self.replica_id, self.model_id, host, self.port)
        return self.port

    async def stop(self, grace_s: float = 5.0,
                   before_core_exit: Optional[Callable[[], Awaitable[None]]] = None) -> None:
        """Report NOT_SERVING, refuse new requests (UNAVAILABLE), let in-flight streams finish
        for up to grace_s, end the rest with finish reason ABORT, then close the server.
        before_core_exit: awaited before this front stops the engine core (the other fronts'
        own drains)."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        self._stopping.set()
        await self.engine.shutdown(grace_s, before_core_exit=before_core_exit)
        await self._server.stop(FINAL_WRITES_GRACE_S)
        self._metrics_task.cancel()
        try:
            await self._metrics_task
        except asyncio.CancelledError:
            pass
        self._server = None
        logger.info("replica %s stopped", self.replica_id)

    async def _set_health(self, status: int) -> None:
        for service in ("",) + self.service_names:  # "" is the whole server, as health clients ask by default
            await self._health.set(service, status)

    def _core_died(self, error: Exception) -> None:
        # Nothing here can serve again: load balancers and Serve's health check must move on.
        logger.error("replica %s is NOT_SERVING: %s", self.replica_id, error)
        asyncio.get_running_loop().create_task(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def _sync_metrics(self) -> None:
        """Advance the Prometheus counters and gauges after every load the engine publishes."""
        version = self.engine.load_version
        while True:
            version = await self.engine.wait_for_load(version, timeout=IDLE_METRICS_REFRESH_S)
            load = self.engine.load()
            self.metrics.update(load, self.load_reports.build(load))


def _bind_first_free(server: grpc.aio.Server, host: str, base_port: int, port_search: int,
                     check_free: bool = False) -> int:
    """Binds `server` on `host` to the first port it can have from `base_port` up (at most
    `port_search` of them; port 0 is any free one); returns it. check_free: skip a port a
    plain bind cannot take, before gRPC tries it: a server that binds with SO_REUSEPORT would
    share a port another such server holds, and any other logged gRPC's "Failed to add port"
    error for each taken port (co-located replicas count up from one base port). A front
    joining a shared port does not check."""
    last_port = base_port if base_port == 0 else min(base_port + port_search, 65536) - 1
    for port in range(base_port, last_port + 1):
        if check_free and port and not port_is_free(host, port):
            continue
        try:
            return server.add_insecure_port(host_port(host, port))
        except RuntimeError:  # grpc's "Failed to bind": taken (or not an address of this host)
            continue
    raise OSError(f"no free port on {host} in {base_port}..{last_port}")


# The addresses gRPC binds for a wildcard host: both families.
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def port_is_free(host: str, port: int) -> bool:
    """Whether no socket holds `port` on any address `host` names (both families for a
    wildcard), by a plain bind as gRPC's own (SO_REUSEADDR, so a closed connection's TIME_WAIT
    does not count) without SO_REUSEPORT (which a listener that set it would let in)."""
    hosts = ("0.0.0.0", "::") if host in _WILDCARD_HOSTS else (host.strip("[]"),)
    try:
        addresses = {(info[0], info[4][:2]) for name in hosts
                     for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
    except socket.gaierror:
        return True  # not an address of this host: gRPC's bind says so
    for family, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return False  # other errors (no IPv6 on this host): that address cannot clash
    return True
