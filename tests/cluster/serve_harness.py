"""Helpers for the live Ray Serve tests: a small CPU config of the built-in model (ports chosen
per test module, away from the defaults a real cluster on this machine may hold), gRPC and
OpenAI-over-HTTP clients, and Ray started the way `headroom serve` starts it, its applications
deployed as `headroom serve` deploys them or from a config file as KubeRay's RayService does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import grpc
import requests
import yaml

from cluster.config import ServeAppsConfig, load_config
from cluster.ingress import APPLICATION_METADATA_KEY
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from cluster.deployment import GenerationRequest

APP_NAME = "builtin"  # the model, and the application serving it
# Small enough to start in seconds on two shared cores, big enough for a few dozen requests.
ENGINE = {
    "block_size": 16,
    "num_kv_blocks": 256,
    "max_model_len": 256,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 16,
    "max_waiting_requests": 64,
}
GRPC_TIMEOUT_S = 120.0  # every call is bounded: a hang fails the test instead of stalling it
DEPLOY_TIMEOUT_S = 300.0  # replicas start in seconds; a loaded shared machine can take minutes


def enable_local_ray() -> None:
    # As `headroom serve` starts Ray: with its token auth (its default for a local cluster).
    os.environ.pop("RAY_AUTH_MODE", None)


# The live modules share one Ray (marked `shared_ray`; tests/conftest.py runs them one after
# another and shuts it down after the last): each shuts Serve down when it ends, and the next
# keeps the Ray if it would have started it the same way. A Ray start-up and shut-down costs
# ~5 s on two quiet cores (11 s and 2 s at load 8). Ray's CPUs are a scheduling count, not
# cores: every module gets the same 4, enough for two applications' replicas at once.
SHARED_RAY_CPUS = 4
_shared_ray_started_with: Optional[frozenset] = None


def _ray_environment() -> frozenset:
    """What Ray's processes inherit from this one that a module may set: Ray's, ours, OpenMP's."""
    return frozenset((name, value) for name, value in os.environ.items()
                     if name.startswith(("RAY_", "HEADROOM_", "OMP_", "GOMP_", "KMP_")))


def shared_ray() -> None:
    """Ray for a live module, started as `headroom serve` starts it: the one already running if
    it was started with this environment, else a fresh one (set the environment first)."""
    import ray

    global _shared_ray_started_with
    enable_local_ray()
    environment = _ray_environment()
    if ray.is_initialized() and _shared_ray_started_with != environment:
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, num_cpus=SHARED_RAY_CPUS, log_to_driver=False)
        _shared_ray_started_with = environment


def release_shared_ray() -> None:
    import ray

    ray.shutdown()


@contextlib.contextmanager
def local_ray(config: ServeAppsConfig):
    """Ray as `headroom serve` starts it for `config` (its endpoints on loopback), the module's
    shared one where it can be; yields that config, and shuts Serve down on exit."""
    from ray import serve

    from cluster.serve_command import set_ray_environment, with_local_binds

    config = with_local_binds(config)
    set_ray_environment(config)
    shared_ray()
    try:
        yield config
    finally:
        serve.shutdown()


@contextlib.contextmanager
def local_cluster(config: ServeAppsConfig):
    """Ray and the applications as `headroom serve` starts them, torn down on exit."""
    from cluster.serve_command import start_applications

    with local_ray(config) as config:
        start_applications(config)
        yield config


def deploy_from_config_file(config: ServeAppsConfig, config_file: Path,
                            timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    """Deploys `config` as KubeRay's RayService, `serve deploy` and `serve run CONFIG` do:
    written to `config_file` and submitted by Ray Serve's own CLI (`serve run --non-blocking`,
    in this process, on the Ray it is connected to), which starts Serve's proxies from the
    file's options and hands the applications to Serve's controller (apply_config, the call
    the dashboard's REST API makes). The controller builds each application
    (import_path cluster.app:build_app) in a task of its own: nothing of it is built here.
    Returns once every application is RUNNING; raises with Serve's message if one fails."""
    from ray import serve
    from ray.serve.scripts import cli as serve_cli

    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    serve_cli.main(["run", "--non-blocking", str(config_file)], standalone_mode=False)
    names = {app.name for app in config.applications}
    deadline = time.monotonic() + timeout_s
    while True:
        applications = serve.status().applications
        statuses = {name: applications[name].status for name in names if name in applications}
        failed = {name: applications[name].message for name, status in statuses.items() if status == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"Serve could not deploy {failed}")
        if len(statuses) == len(names) and set(statuses.values()) == {"RUNNING"}:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not RUNNING after {timeout_s:.0f} s: {statuses}")
        time.sleep(1.0)


def _targets_dir(base_port: int) -> str:
    """A Prometheus targets directory of the test's own, removed when the test process exits
    (the ingress removes its files at shutdown, not the directory: 290 empty ones had piled up
    under /tmp)."""
    directory = tempfile.mkdtemp(prefix=f"headroom-targets-{base_port}-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def small_config(base_port: int, *, engine: Optional[dict[str, Any]] = None, num_cpus: float = 1,
                 proxy_location: str = "EveryNode", model: str = APP_NAME, num_replicas: int = 2,
                 limits: Optional[dict[str, Any]] = None) -> ServeAppsConfig:
    """One application (named after its model) on CPU replicas; HTTP, gRPC, replica and router
    metrics and the replicas' internal endpoints on base_port, +1, +10, +20 and +30; Prometheus
    targets in a directory of its own (a real cluster on this machine writes the default one)."""
    ports = {"http": base_port, "grpc": base_port + 1, "metrics": base_port + 10, "router_metrics": base_port + 20,
             "replica_grpc": base_port + 30}
    return load_config({
        "proxy_location": proxy_location,
        "http_options": {"host": "127.0.0.1", "port": ports["http"]},
        "grpc_options": {"port": ports["grpc"]},
        "applications": [{
            "name": model,
            "route_prefix": "/",
            "args": {
                "model": model,
                "engine": {**ENGINE, **(engine or {})},
                # A stream a test leaves open delays Serve's shutdown by at most this long
                # (the default, 300 s, lets a production replica's long generations finish).
                "replicas": {"num_replicas": num_replicas, "num_cpus": num_cpus, "drain_timeout_s": 30},
                # Generous, so a snapshot delayed on a busy shared machine never sends a
                # request down the stale-load fallback.
                "router": {"staleness_s": 5.0},
                "ports": ports,
                "limits": limits or {},
                "monitoring": {"targets_dir": _targets_dir(base_port)},
            },
        }],
    })


def generate_on_replica(app_name: str, replica_id: str, request: GenerationRequest):
    """LLMReplica.generate on one chosen replica, past every router: the call a handle makes
    to the replica's Serve actor once its router has chosen (Ray Serve 2.60's internals,
    test-only; a cluster replica's own endpoint serves no Generate). Returns the Ray streaming
    generator of its chunks, which runs whether read or not; `ray.cancel` aborts it."""
    import ray
    from ray.serve._private.common import RequestMetadata

    from cluster.deployment import DEPLOYMENT_NAME
    from cluster.serve_private import SERVE_NAMESPACE

    actor = ray.get_actor(f"SERVE_REPLICA::{app_name}#{DEPLOYMENT_NAME}#{replica_id}", namespace=SERVE_NAMESPACE)
    request_id = uuid.uuid4().hex
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method="generate",
                               is_streaming=True)
    return actor.handle_request_streaming.options(num_returns="streaming").remote(pickle.dumps(metadata), request)


def grpc_target(config: ServeAppsConfig) -> str:
    return f"127.0.0.1:{config.grpc_options.port}"


def http_base(config: ServeAppsConfig) -> str:
    return f"http://127.0.0.1:{config.http_options.port}"


def generate_request(max_tokens: int, *, prompt: str = "hello", **sampling: Any) -> pb.GenerateRequest:
    sampling = {"temperature": 0.0, "ignore_eos": True, **sampling}
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


@dataclass
class StreamResult:
    """What a client saw of one Generate stream."""

    responses: list[pb.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    @property
    def replica_id(self) -> Optional[str]:
        return self.responses[0].replica_id if self.responses else None

    @property
    def token_ids(self) -> list[int]:
        return [token for response in self.responses for token in response.token_ids]

    @property
    def num_tokens(self) -> int:
        return sum(len(response.token_ids) for response in self.responses)


def stream_generate(channel: grpc.Channel, request: pb.GenerateRequest, on_response=None,
                    application: Optional[str] = None, timeout_s: float = GRPC_TIMEOUT_S,
                    on_call=None) -> StreamResult:
    """One Generate stream to its end; `application` names the one to call where Serve runs
    several; `on_call` receives the call as it starts (another thread may cancel it)."""
    result = StreamResult()
    metadata = ((APPLICATION_METADATA_KEY, application),) if application else None
    try:
        call = pb_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s, metadata=metadata)
        if on_call is not None:
            on_call(call)
        for response in call:
            result.responses.append(response)
            if on_response is not None:
                on_response(result)
    except grpc.RpcError as error:
        result.code, result.details = error.code(), error.details()
    return result


def sse_events(response: requests.Response) -> list[Any]:
    """The `data:` payloads of an SSE response, JSON-decoded except the final `[DONE]`."""
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
