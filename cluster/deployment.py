"""The LLMReplica Ray Serve deployment: one AsyncEngine per replica (the front of its own
engine-core process), streaming generations to Serve callers (each output as the front made
it, beside the replica's id), with a replica-internal ReplicaServer beside it (LoadReporter
only, behind the cluster token, on ports.replica_grpc) whose WatchLoad and WatchKVEvents
streams feed the routers. The replica announces that endpoint (and its /metrics) through
`record_routing_stats`; HeadroomRequestRouter routes; `running_replicas` lists them from Serve's
controller. If the core dies, `check_health` fails and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Mapping, Optional
from wsgiref.simple_server import WSGIServer

import ray
from ray import serve
from ray.serve import context as serve_context
from ray.serve.config import RequestRouterConfig
from ray.serve.context import _get_global_client
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cluster.autoscaling import autoscaling_stats
from cluster.config import ClusterConfig, resolve_device, serve_deployment_options
from cluster.serve_logging import log_client_errors_in_one_line
from cluster.serve_private import SERVE_NAMESPACE
from protos import headroom_pb2 as pb
from replica.front.async_engine import AsyncEngine
from replica.config import make_engine_config
from replica.core.outputs import RequestOutput
from replica.server.grpc_service import TTFTTargets, model_info_proto
from replica.server.metrics import ReplicaMetrics
from replica.core.request import SamplingParams
from replica.server.auth import Credentials, host_port
from replica.server.replica_server import ReplicaServer
from replica.core.process import freeze_startup_heap
from replica.ipc.messages import CoreSpec
from router.cluster_token import CREDENTIAL_NAME, cluster_token
from router.headroom_router import ROUTING_KWARG
from router.policies import RoutingRequest
from router.serve_router import LOAD_ENDPOINT_STAT, REPLICA_ID_STAT

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "LLMReplica"
REQUEST_ROUTER_CLASS = "router.serve_router:HeadroomRequestRouter"
# Routing stats never change after start-up, so the controller only needs to ask soon
# after a replica starts; asking often would be wasted actor calls.
ROUTING_STATS_PERIOD_S = 30.0
# Co-located replicas (ingresses) count up from ports.metrics, ports.replica_grpc
# (ports.router_metrics); more than this on one node would be a configuration mistake.
PORT_SEARCH = 64
# How often a base port waited for (serve_metrics_on_free_port) is tried again.
BASE_PORT_RETRY_S = 0.25
# On stop, in-flight requests may finish for this long before they are aborted.
SHUTDOWN_GRACE_S = 5.0
# How often Serve asks check_health (a dict lookup): a replica whose engine core died is
# replaced within about this long instead of Serve's default 10 s.
HEALTH_CHECK_PERIOD_S = 2.0
# The routing-stats key of a replica's Prometheus endpoint (host:port); routers ignore it.
METRICS_ENDPOINT_STAT = "metrics_endpoint"
# How long a call to the controller or a replica may take when listing replicas.
LIST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as a Serve caller sends it. The prompt comes tokenized (the ingress
    tokenizes at the edge), so the router knows its exact size."""

    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Lower values are served first, as in the engine (and vLLM).
    priority: int = 0
    request_id: Optional[str] = None
    # Relative to arrival: each replica's engine keeps its own clock.
    ttft: TTFTTargets = TTFTTargets(slo_ms=None, deadline_ms=None)

    def routing_request(self) -> RoutingRequest:
        """The size the router needs, passed as the call's `routing` keyword argument."""
        return RoutingRequest(len(self.prompt_token_ids), self.sampling.max_tokens, self.priority,
                              tuple(self.prompt_token_ids))


class LLMReplica:
    """One engine replica. `engine_overrides_by_rank` replaces EngineConfig fields for the
    replica of that rank (0-based), e.g. a deliberately tiny KV pool on replica 0 to show
    the router steering around it."""

    async def __init__(
        self,
        config: ClusterConfig,
        engine_overrides_by_rank: Optional[Mapping[int, Mapping[str, object]]] = None,
    ):
        log_client_errors_in_one_line()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        overrides = dict((engine_overrides_by_rank or {}).get(context.rank.rank, {}))
        engine_config = make_engine_config(**{**config.engine.model_dump(), **overrides})
        self.engine = AsyncEngine(CoreSpec(
            engine_config,
            config.model,
            device=resolve_device(config, num_gpus=len(ray.get_gpu_ids())),
            dtype=None if config.dtype == "auto" else config.dtype,
            attention_backend=config.attention_backend,
        ))
        self.model_id = config.served_model_id
        metrics = ReplicaMetrics(self.replica_id, config.served_model_id)
        # Generations reach the replica through Serve handles only: its own endpoint serves the
        # routers' load and KV-event streams, to holders of the cluster token.
        self.server = ReplicaServer(self.engine, self.replica_id, config.served_model_id, metrics,
                                    config.limits.request_limits(), generation=False,
                                    credentials=Credentials([cluster_token()]), credential_name=CREDENTIAL_NAME)
        host = bind_address(config)
        # /metrics answers before the engine loads (minutes for a large checkpoint): on
        # Kubernetes the replica PodMonitor scrapes a worker pod from its start, and a port
        # nobody serves for a minute fires HeadroomReplicaDown on a replica that is only loading.
        self.metrics_http = await serve_metrics_on_free_port(metrics.start_http_server, host, config.ports.metrics,
                                                             "ports.metrics")
        self.metrics_endpoint = host_port(host, self.metrics_http.server_port)
        try:  # binds, then spawns the engine core and waits for its engine
            port = await self.server.start(host, config.ports.replica_grpc, PORT_SEARCH)
        except OSError as error:
            raise RuntimeError(f"ports.replica_grpc: {error}") from None
        self.load_endpoint = host_port(host, port)
        logger.info("replica %s (rank %d) announces load at %s", self.replica_id, context.rank.rank, self.load_endpoint)
        # This actor's process is the replica's front: as `headroom replica` does, its startup
        # heap (Ray, Serve, torch, grpc) leaves the collector's reach, so no full collection
        # stops every stream and every new request mid-serving.
        freeze_startup_heap()

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine core died can serve nothing again."""
        if self.engine.dead is not None:
            raise RuntimeError(f"replica {self.replica_id}: {self.engine.dead}")

    def engine_core_pid(self) -> int:
        """The engine-core process's pid on this replica's node (operators, failure tests)."""
        return self.engine.core.pid

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler reads when it runs the headroom policy (cluster/autoscaling.py):
        KV capacity and demand, waiting prefill and preemption rate, from this replica's load report."""
        return autoscaling_stats(self.server.load_reports.build(self.engine.load()))

    def record_routing_stats(self) -> dict[str, str]:
        return {LOAD_ENDPOINT_STAT: self.load_endpoint, REPLICA_ID_STAT: self.replica_id,
                METRICS_ENDPOINT_STAT: self.metrics_endpoint}

    async def generate(
        self, request: GenerationRequest, routing: Optional[RoutingRequest] = None
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Streams (this replica's id, output) for each of the request's outputs, the output as
        the front made it, not copied (call with `handle.options(stream=True)`). The request
        was validated at the ingress: the front trusts it. `routing` is for the router, which
        reads it from the call before it reaches here."""
        replica_id = self.replica_id
        async for output in self.engine.generate(
            request.prompt_token_ids, request.sampling, request_id=request.request_id, priority=request.priority,
            ttft_slo_ms=request.ttft.slo_ms, first_token_timeout_s=request.ttft.first_token_timeout_s,
        ):
            yield replica_id, output

    def model_info(self) -> pb.ModelInfo:
        return model_info_proto(self.engine.engine, self.model_id)

    async def __del__(self) -> None:
        # Serve calls this once it has drained the replica: its routers dropped it when the
        # controller chose it for removal, and Serve waited (up to replicas.drain_timeout_s)
        # for its streams. Anything still running gets a last grace here.
        await self.server.stop(SHUTDOWN_GRACE_S)
        self.metrics_http.shutdown()
        self.metrics_http.server_close()  # the port, for the next replica on this node at once


def running_replicas(app_name: Optional[str] = None) -> list[tuple[str, dict]]:
    """(application, Serve's details of the replica) for every RUNNING LLMReplica, of every
    application or of `app_name` (needs Ray connected and Serve running; blocks on the controller)."""
    details = _get_global_client().get_serve_details()
    replicas = []
    for name, application in sorted(details.get("applications", {}).items()):
        deployment = application.get("deployments", {}).get(DEPLOYMENT_NAME)
        if deployment is None or app_name not in (None, name):
            continue
        replicas.extend((name, replica) for replica in deployment.get("replicas", []) if replica.get("state") == "RUNNING")
    return replicas


@dataclass(frozen=True)
class ReplicaCounts:
    """One application's LLMReplica count as Serve's controller has it."""

    target: int  # what Serve is scaling to
    running: int
    draining: int  # chosen for removal: Serve routes nothing new to them while their streams finish
    autoscaling: bool


def replica_counts() -> dict[str, ReplicaCounts]:
    """Every application's LLMReplica counts (needs Ray connected; blocks on the controller)."""
    details = _get_global_client().get_serve_details()
    counts = {}
    for name, application in sorted(details.get("applications", {}).items()):
        deployment = application.get("deployments", {}).get(DEPLOYMENT_NAME)
        if deployment is None:
            continue
        states = [replica.get("state") for replica in deployment.get("replicas", [])]
        counts[name] = ReplicaCounts(deployment.get("target_num_replicas", 0), states.count("RUNNING"),
                                     states.count("STOPPING"),
                                     deployment.get("deployment_config", {}).get("autoscaling_config") is not None)
    return counts


def routing_stats(replica: dict) -> dict[str, str]:
    """What one replica (an entry of Serve's details) announces; blocks on the replica."""
    actor = ray.get_actor(replica["actor_name"], namespace=SERVE_NAMESPACE)
    return ray.get(actor.record_routing_stats.remote(), timeout=LIST_TIMEOUT_S)


def bind_address(config: ClusterConfig) -> str:
    """Where this process' endpoints listen (and are announced): ports.bind_address, else the node's IP."""
    return config.ports.bind_address or node_ip()


def node_ip() -> str:
    """This node's address, so routers on other nodes reach the load endpoint."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # no usable address (e.g. an offline machine): same-node routers still can
        return "127.0.0.1"


async def serve_metrics_on_free_port(
    start_http_server: Callable[[int, str], tuple[WSGIServer, threading.Thread]], host: str, base_port: int,
    config_field: str, base_port_wait_s: float = 0.0,
) -> WSGIServer:
    """Serves /metrics on the first free port from `base_port` up: processes sharing a node
    take consecutive ports, which Prometheus' scrape config can list. `config_field` names the
    config field of `base_port` for the error. `base_port_wait_s`: how long `base_port` may be
    waited for before counting up, for a process whose predecessor may still hold it (an
    in-place update starts the new ingress while the old one drains), where the next port up
    would be kept for good and a PodMonitor scrapes the base port."""
    deadline, waited = time.monotonic() + base_port_wait_s, False
    while True:
        try:
            return _serve_metrics(start_http_server, host, base_port)
        except OSError:  # taken: by a predecessor draining, a co-located replica, anything else
            if time.monotonic() >= deadline:
                break
            if not waited:
                logger.info("%s %d is taken: waiting up to %.0f s for it to come free (a predecessor draining?)",
                            config_field, base_port, base_port_wait_s)
                waited = True
            await asyncio.sleep(BASE_PORT_RETRY_S)
    if waited:
        logger.warning("%s %d still taken after %.0f s: counting up from it", config_field, base_port, base_port_wait_s)
    for port in range(base_port + 1, min(base_port + PORT_SEARCH, 65536)):
        try:
            return _serve_metrics(start_http_server, host, port)
        except OSError:
            continue
    raise RuntimeError(f"{config_field}: no free port in {base_port}..{base_port + PORT_SEARCH - 1}")


def _serve_metrics(start_http_server: Callable[[int, str], tuple[WSGIServer, threading.Thread]], host: str,
                   port: int) -> WSGIServer:
    server, _ = start_http_server(port, host)
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return server


def llm_replica_deployment(config: ClusterConfig, cluster_gpus: float) -> serve.Deployment:
    """The LLMReplica deployment with replicas, resources and router taken from `config`.
    cluster_gpus: GPUs the Ray cluster has (`ray.cluster_resources().get("GPU", 0)`)."""
    router = config.router
    return serve.deployment(LLMReplica).options(
        name=DEPLOYMENT_NAME,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=RequestRouterConfig(
            request_router_class=REQUEST_ROUTER_CLASS,
            request_router_kwargs={"policy": router.policy, "staleness_s": router.staleness_s, "knobs": dict(router.knobs)},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        **serve_deployment_options(config, cluster_gpus),
    )


def build_llm_replica(
    config: ClusterConfig,
    *,
    engine_overrides_by_rank: Optional[Mapping[int, Mapping[str, object]]] = None,
) -> serve.Application:
    """The bound LLMReplica application (needs a connected Ray, to count its GPUs). Makes the
    cluster token, if this Ray cluster has none yet, before any replica or router needs it."""
    cluster_token()
    cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
    return llm_replica_deployment(config, cluster_gpus).bind(config, engine_overrides_by_rank)


def generate_stream(handle: DeploymentHandle, request: GenerationRequest) -> DeploymentResponseGenerator:
    """Calls LLMReplica.generate through `handle`, routed on the request's size.

    A call made while serving a request inherits that request's internal id, by which Serve's
    router keys the calls it has yet to place: two concurrent calls of one request (the
    choices of n > 1) would collide and one would never be placed. Each call gets an id of
    its own (Ray Serve 2.60's request context)."""
    current = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    try:
        return handle.options(stream=True).generate.remote(request, **{ROUTING_KWARG: request.routing_request()})
    finally:
        serve_context._serve_request_context.reset(token)
