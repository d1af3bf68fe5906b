"""ReplicaServer: one AsyncEngine (the front of an engine-core process) as a grpc.aio service
without Ray: Generation and LoadReporter, standard health checking (NOT_SERVING once the core
is gone) and reflection (v1 and v1alpha), every other method behind the API key when one is
configured (BearerAuthInterceptor; health and reflection stay open), Prometheus metrics kept in step with every load the
core publishes and every output the front streams, and a graceful stop that lets in-flight
streams end cleanly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.front.async_engine import AsyncEngine
from replica.server.auth import BearerAuthInterceptor, Credentials
from replica.server.grpc_reflection import enable_reflection
from replica.server.grpc_service import GenerationServicer, LoadReporterServicer
from replica.server.load_report import LoadReportBuilder
from replica.server.metrics import ReplicaMetrics
from replica.server.request_limits import RequestLimits
from replica.server.request_metrics import RequestMetrics

logger = logging.getLogger(__name__)

SERVICE_NAMES = tuple(pb.DESCRIPTOR.services_by_name[name].full_name for name in ("Generation", "LoadReporter"))
# Without new loads (an idle engine) the gauges are still refreshed this often, so the
# smoothed preemption rate visibly decays to zero.
IDLE_METRICS_REFRESH_S = 1.0
# After the engine has finished or aborted every request, handlers only need this long
# to write their last message.
FINAL_WRITES_GRACE_S = 1.0


class ReplicaServer:
    def __init__(self, engine: AsyncEngine, replica_id: str, model_id: str, metrics: ReplicaMetrics,
                 limits: RequestLimits = RequestLimits(), credentials: Credentials = Credentials()):
        self.engine = engine
        self.credentials = credentials
        self.replica_id = replica_id
        self.model_id = model_id
        self.metrics = metrics
        self.limits = limits
        self.load_reports = LoadReportBuilder(replica_id, engine.stats)
        self.port: Optional[int] = None
        self._server: Optional[grpc.aio.Server] = None
        self._health: Optional[health.aio.HealthServicer] = None
        self._stopping: Optional[asyncio.Event] = None
        self._metrics_task: Optional[asyncio.Task] = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start the engine core (if not yet) and serve on host:port (0 picks a free port); returns the port."""
        await self.engine.start()
        # Every front that streams from this engine (this server's Generate, a Serve
        # deployment's generate) then feeds the same latency histograms.
        self.engine.observe_requests(RequestMetrics(self.metrics, self.engine.engine.clock))
        self._stopping = asyncio.Event()
        server = grpc.aio.server(interceptors=[BearerAuthInterceptor(self.credentials, "API key")]
                                 if self.credentials.required else None)
        pb_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.engine, self.replica_id, self.model_id, self.limits), server
        )
        pb_grpc.add_LoadReporterServicer_to_server(
            LoadReporterServicer(self.engine, self.load_reports, self._stopping), server
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.engine.on_dead(self._core_died)
        enable_reflection(SERVICE_NAMES + (health.SERVICE_NAME,), server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = server.add_insecure_port(address)
        await server.start()
        self._server = server
        self._metrics_task = asyncio.get_running_loop().create_task(self._sync_metrics(), name="replica-metrics")
        logger.info("replica %s serving %s on %s:%d", self.replica_id, self.model_id, host, self.port)
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, refuse new requests (UNAVAILABLE), let in-flight streams finish
        for up to grace_s, end the rest with finish reason ABORT, then close the server."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        self._stopping.set()
        await self.engine.shutdown(grace_s)
        await self._server.stop(FINAL_WRITES_GRACE_S)
        self._metrics_task.cancel()
        try:
            await self._metrics_task
        except asyncio.CancelledError:
            pass
        self._server = None
        logger.info("replica %s stopped", self.replica_id)

    async def _set_health(self, status: int) -> None:
        for service in ("",) + SERVICE_NAMES:  # "" is the whole server, as health clients ask by default
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
