"""A real ReplicaServer on loopback for tests: its event loop runs in a background thread, so
one server can outlive many tests while each test drives its gRPC client with asyncio.run.
The engine runs in its own engine-core process, as in production; tests read its state
through the core's utility calls and load reports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import urllib.request
from typing import Any, Callable, Coroutine, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.front.async_engine import AsyncEngine
from replica.config import make_engine_config
from replica.server.metrics import ReplicaMetrics
from replica.server.request_limits import RequestLimits
from replica.server.replica_server import ReplicaServer
from replica.ipc.messages import CoreSpec

REPLICA_ID = "test-replica"
MODEL_ID = "builtin"


class RunningReplica:
    def __init__(self, engine_factory: str = CoreSpec._field_defaults["engine_factory"],
                 limits: RequestLimits = RequestLimits(), server_options: Optional[dict[str, Any]] = None,
                 port: int = 0, port_search: int = 1, model: str = "builtin", **engine_config: Any):
        """server_options: ReplicaServer's keyword options (generation, credentials, ...);
        port, port_search: where it binds, as ReplicaServer.start takes them; model: what it serves."""
        self.spec = CoreSpec(make_engine_config(**engine_config), model, device="cpu", engine_factory=engine_factory)
        self.limits = limits
        self.server_options = server_options or {}
        self.metrics = ReplicaMetrics(REPLICA_ID, MODEL_ID)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="replica-loop", daemon=True)
        self._thread.start()
        self.port = self.call(self._start(port, port_search))
        self.address = f"127.0.0.1:{self.port}"
        self._metrics_http, _ = self.metrics.start_http_server(0, "127.0.0.1")
        self.metrics_url = f"http://127.0.0.1:{self._metrics_http.server_port}/metrics"

    async def _start(self, port: int, port_search: int) -> int:
        self.async_engine = AsyncEngine(self.spec)
        self.server = ReplicaServer(self.async_engine, REPLICA_ID, MODEL_ID, self.metrics, self.limits,
                                    **self.server_options)
        return await self.server.start("127.0.0.1", port, port_search)

    def call(self, coro: Coroutine, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop (where the engine may be inspected) and wait."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def engine(self):
        """The front's view of the engine (tokenizer, config, ...)."""
        return self.async_engine.engine

    def core_call(self, method: str, *args: Any) -> Any:
        """One of EngineCore.UTILITIES, run in the core process between steps."""
        return self.call(self.async_engine.core.call_utility(method, *args))

    def on_loop(self, function: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return function()

        return self.call(run())

    def stop_in_background(self, grace_s: float):
        """Start a graceful stop; returns a concurrent.futures.Future of its completion."""
        return asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop)

    def close(self) -> None:
        # The metrics endpoint's serve_forever sees a shutdown at its next 0.5 s poll: it ends on
        # a thread of its own, not waited for (0.35-0.5 s of every close).
        threading.Thread(target=self._metrics_http.shutdown, name="metrics-shutdown", daemon=True).start()
        self.call(self.server.stop(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def scrape(self) -> dict[tuple[str, tuple], float]:
        """Every sample on /metrics, keyed by (sample name, sorted labels)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def wait_until_idle(self, timeout: float = 30.0) -> pb.ReplicaLoad:
        """Poll GetLoad until nothing runs or waits; returns that load."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.LoadReporterStub(channel)
            while True:
                load = stub.GetLoad(pb.LoadRequest())
                if load.num_running == 0 and load.num_waiting == 0:
                    return load
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica still busy: {load}")
                time.sleep(0.02)

    def health_status(self, service: str = "") -> int:
        with grpc.insecure_channel(self.address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def start_replicas(*configs: dict[str, Any]) -> list[RunningReplica]:
    """RunningReplicas of these keyword arguments, started side by side: each mostly waits on its
    own engine-core process's start, so two take about one's wait on two cores. If one fails, the
    others are closed and its error raised."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(configs)) as pool:
        starting = [pool.submit(lambda config=config: RunningReplica(**config)) for config in configs]
    errors = [future.exception() for future in starting if future.exception() is not None]
    if errors:
        for future in starting:
            if future.exception() is None:
                future.result().close()
        raise errors[0]
    return [future.result() for future in starting]


async def collect_stream(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, **call_kwargs) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(request, **call_kwargs)]


def sampling(**fields: Any) -> pb.SamplingParams:
    return pb.SamplingParams(**fields)


def reflect(channel: grpc.Channel, version: str, symbol: str, metadata=()) -> tuple[list[str], list]:
    """What a reflection client (grpcurl) learns over `version` ("v1" or "v1alpha"): the
    listed service names and the file descriptors that define `symbol`. v1 and v1alpha
    messages are the same on the wire, so v1alpha's classes speak both."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)]
    listed, described = list(call(iter(requests), timeout=30, metadata=metadata))
    services = [service.name for service in listed.list_services_response.service]
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    return services, files


def load_reporter_calls(channel: grpc.Channel) -> dict[str, Callable[[Any], Any]]:
    """LoadReporter's methods on `channel`, each called with the metadata it is given: GetLoad's
    answer, and each stream's first message (the stream then cancelled)."""
    loads = pb_grpc.LoadReporterStub(channel)

    def first(stream):
        try:
            return next(stream)
        finally:
            stream.cancel()

    return {
        "GetLoad": lambda metadata: loads.GetLoad(pb.LoadRequest(), metadata=metadata, timeout=30),
        "WatchLoad": lambda metadata: first(loads.WatchLoad(pb.WatchLoadRequest(), metadata=metadata, timeout=30)),
        "WatchKVEvents": lambda metadata: first(loads.WatchKVEvents(pb.WatchKVEventsRequest(), metadata=metadata,
                                                                    timeout=30)),
    }
