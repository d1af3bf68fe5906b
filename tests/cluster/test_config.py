"""The cluster config tree: defaults follow the design, every bad field fails at load time
with its dotted path, deploy/serve_config.yaml is valid for both our schema and Ray Serve's,
and the config maps onto Serve's deployment options."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray import serve
from ray.serve.schema import ServeDeploySchema

from cluster.config import (
    APP_IMPORT_PATH,
    AutoscalingConfig,
    GRPC_SERVICER_FUNCTIONS,
    ClusterConfig,
    LimitsConfig,
    RouterConfig,
    ServeAppsConfig,
    load_config,
    policy_knobs,
    serve_deployment_options,
)
from replica.config import BLOCK_SIZES, MAX_WAIT_S, ConfigError, EngineConfig, make_engine_config
from router.policies import POLICIES

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"


def app_document(**args) -> dict:
    return {"applications": [{"name": "builtin", "args": args}]}


def test_defaults_serve_two_smollm2_replicas_on_the_headroom_router():
    config = ClusterConfig()
    assert config.model == "smollm2-135m" and config.served_model_id == "smollm2-135m"
    assert config.engine == EngineConfig()
    assert config.replicas.num_replicas == 2 and config.replicas.autoscaling is None
    assert config.router.policy == "headroom" and config.router.staleness_s == 1.0
    assert (config.ports.http, config.ports.grpc, config.ports.metrics, config.ports.replica_grpc) == (8000, 9000, 9100, 9300)


def test_model_id_defaults_to_the_model_directory_name():
    assert ClusterConfig(model="/models/Qwen2-0.5B/").served_model_id == "Qwen2-0.5B"
    assert ClusterConfig(model="/models/Qwen2-0.5B", model_id="qwen").served_model_id == "qwen"


def test_router_policy_names_are_the_router_registry():
    assert set(typing.get_args(RouterConfig.model_fields["policy"].annotation)) == set(POLICIES)


@pytest.mark.parametrize("document, message", [
    (app_document(engine={"max_model_len": 0}), "applications[0].args.engine.max_model_len: "),
    (app_document(engine={"max_model_len": 4096, "num_kv_blocks": 8}), "applications[0].args.engine.num_kv_blocks: "),
    (app_document(engine={"watermark": 1.5}), "applications[0].args.engine.watermark: "),
    (app_document(engine={"stream_interval": 0}),
     "applications[0].args.engine.stream_interval: Input should be greater than or equal to 1"),
    (app_document(engine={"stream_interval": 1.5}), "applications[0].args.engine.stream_interval: "),
    (app_document(engine={"max_model_lenn": 4096}), "applications[0].args.engine.max_model_lenn: Extra inputs"),
    (app_document(replicas={"num_replicas": 0}), "applications[0].args.replicas.num_replicas: "),
    (app_document(replicas={"num_replicas": 3, "autoscaling": {}}), "applications[0].args.replicas.num_replicas: "),
    (app_document(replicas={"autoscaling": {"min_replicas": 4, "max_replicas": 2}}),
     "applications[0].args.replicas.autoscaling.max_replicas: 2 is below min_replicas 4"),
    (app_document(replicas={"autoscaling": {"policy": "memory"}}), "applications[0].args.replicas.autoscaling.policy: "),
    (app_document(replicas={"autoscaling": {"target_utilization": 1.2}}),
     "applications[0].args.replicas.autoscaling.target_utilization: Input should be less than or equal to 1"),
    (app_document(replicas={"autoscaling": {"target_utilization": 0}}),
     "applications[0].args.replicas.autoscaling.target_utilization: Input should be greater than 0"),
    (app_document(replicas={"autoscaling": {"scale_down_utilization": 0.9}}),
     "applications[0].args.replicas.autoscaling.scale_down_utilization: 0.9 is above target_utilization 0.8"),
    (app_document(replicas={"autoscaling": {"downscale_delay_s": -1}}),
     "applications[0].args.replicas.autoscaling.downscale_delay_s: Input should be greater than or equal to 0"),
    (app_document(replicas={"autoscaling": {"upscale_delay_s": -0.5}}),
     "applications[0].args.replicas.autoscaling.upscale_delay_s: "),
    (app_document(replicas={"autoscaling": {"replica_startup_s": -30}}),
     "applications[0].args.replicas.autoscaling.replica_startup_s: Input should be greater than or equal to 0"),
    (app_document(replicas={"drain_timeout_s": -1}), "applications[0].args.replicas.drain_timeout_s: "),
    (app_document(router={"policy": "random"}), "applications[0].args.router.policy: "),
    (app_document(router={"policy": "pow2", "knobs": {"preemption_weight": 2}}),
     "applications[0].args.router.knobs.preemption_weight: "),
    (app_document(device="tpu"), "applications[0].args.device: "),
    (app_document(ports={"http": 8001}), "applications[0].args.ports.http: 8001 differs from http_options.port 8000"),
    (app_document(ports={"replica_grpc": 65536}),
     "applications[0].args.ports.replica_grpc: Input should be less than or equal to 65535"),
    (app_document(ports={"replica_grpc": -1}), "applications[0].args.ports.replica_grpc: Input should be greater than"),
    (app_document(ports={"replica_grpc": 9100}),
     "applications[0].args.ports.replica_grpc: 9100 is also ports.metrics; each endpoint needs a port of its own"),
    ({"ports": {"router_metrics": 9100}}, "ports.router_metrics: 9100 is also ports.metrics"),
    ({"ports": {"bind_address": "not an ip"}}, "ports.bind_address: 'not an ip' is neither an IP address nor a host name"),
    ({"ports": {"bind_address": "0.0.0.0"}}, "ports.bind_address: '0.0.0.0' listens everywhere but is also the address"),
    ({"applications": [{"name": "a"}, {"name": "a", "route_prefix": "/b"}]}, "applications[1].name: "),
    ({"applications": [{"name": "a"}, {"name": "b"}]}, "applications[1].route_prefix: "),
    ({"applications": [{"name": "a", "import_path": "my.app:app"}]}, "applications[0].import_path: "),
    ({"applications": []}, "applications: "),
    ({"engine": {"block_size": 0}}, "engine.block_size: "),
    ({"engine": {"preemption_mode": "swap"}}, "engine.preemption_mode: 'swap' needs a host KV tier"),
    ({"engine": {"host_kv_bytes": 1 << 62}}, "engine.host_kv_bytes: 4611686018427387904 bytes exceeds the host's memory"),
    # NaN passes no bound and infinity passed every one: an infinite SLO monitor interval or
    # tensor-parallel timeout overflowed threading / timedelta once the engine started.
    ({"engine": {"slo_monitor_interval_ms": float("inf")}}, "engine.slo_monitor_interval_ms: Input should be a finite"),
    ({"engine": {"tensor_parallel_timeout_s": float("inf")}}, "engine.tensor_parallel_timeout_s: Input should be a finite"),
    ({"engine": {"structured_output_compile_timeout_s": float("inf")}},
     "engine.structured_output_compile_timeout_s: Input should be a finite"),
    ({"replicas": {"drain_timeout_s": float("inf")}}, "replicas.drain_timeout_s: Input should be a finite"),
    ({"replicas": {"autoscaling": {"downscale_delay_s": float("inf")}}},
     "replicas.autoscaling.downscale_delay_s: Input should be a finite"),
    ({"router": {"staleness_s": float("inf")}}, "router.staleness_s: Input should be a finite"),
    ({"router": {"knobs": {"headroom_weight": float("nan")}}}, "router.knobs.headroom_weight: Input should be a finite"),
    # A model path with no last component gives no name to serve it under (was pydantic's
    # traceback about ServeApplication.name).
    ({"model": "/"}, "model_id: model '/' has no name to serve it under; set model_id"),
    ({"model": "."}, "model_id: model '.' has no name"),
    ({"model": ""}, "model: String should have at least 1 character"),
    # Serve's route_prefix rules, which Serve itself applies only after the cluster started.
    ({"applications": [{"name": "a", "route_prefix": "v1"}]}, "applications[0].route_prefix: 'v1' must start with '/'"),
    ({"applications": [{"name": "a", "route_prefix": "/a/"}]}, "applications[0].route_prefix: '/a/' may not end with '/'"),
    ({"applications": [{"name": "a", "route_prefix": "/{x}"}]}, "applications[0].route_prefix: '/{x}' may not contain"),
    # Block sizes other than the powers of two from 1 to 256 (EngineConfig.block_size says why).
    ({"engine": {"block_size": 12}}, "engine.block_size: must be a power of two from 1 to 256, got 12"),
    ({"engine": {"block_size": 512}}, "engine.block_size: must be a power of two from 1 to 256, got 512"),
    # A boolean for a number was read as 1 or 0 (pydantic's lax mode): block_size true ran
    # 1-token blocks, watermark false was 0, a knob true weighed 1.0.
    ({"engine": {"block_size": True}}, "engine.block_size: Input should be a number, not the boolean true"),
    ({"engine": {"max_model_len": True}}, "engine.max_model_len: Input should be a number, not the boolean true"),
    ({"engine": {"watermark": False}}, "engine.watermark: Input should be a number, not the boolean false"),
    ({"engine": {"gpu_memory_utilization": True}},
     "engine.gpu_memory_utilization: Input should be a number, not the boolean true"),
    (app_document(replicas={"autoscaling": {"max_replicas": True}}),
     "applications[0].args.replicas.autoscaling.max_replicas: Input should be a number, not the boolean true"),
    ({"replicas": {"num_gpus": True}}, "replicas.num_gpus: Input should be a number, not the boolean true"),
    ({"router": {"knobs": {"headroom_weight": True}}},
     "router.knobs.headroom_weight: Input should be a number, not the boolean true"),
    ({"ports": {"metrics": True}}, "ports.metrics: Input should be a number, not the boolean true"),
    ({"http_options": {"port": True}, "applications": [{"name": "a"}]},
     "http_options.port: Input should be a number, not the boolean true"),
    ({"limits": {"max_prompt_chars": True}}, "limits.max_prompt_chars: Input should be a number, not the boolean true"),
    # Knob values the policy refuses as it is built, which each ingress did once the cluster ran.
    ({"router": {"knobs": {"placement_margin": -0.1}}}, "router.knobs.placement_margin: must be >= 0"),
    ({"router": {"knobs": {"pin_prefix_fraction": 1.5}}}, "router.knobs.pin_prefix_fraction: must be in [0, 1]"),
    ({"router": {"knobs": {"pin_share_window": 2.5}}}, "router.knobs.pin_share_window: must be a whole number"),
    # Serve's HTTP proxy binds its host only once the cluster runs.
    ({"http_options": {"host": "not a host"}, "applications": [{"name": "a"}]},
     "http_options.host: 'not a host' is neither an IP address nor a host name"),
    # Serve's gRPC proxy takes 4 x max_request_bytes (16 x max_prompt_chars) as a C int option.
    ({"limits": {"max_request_bytes": 1 << 29}},
     "limits.max_request_bytes: Input should be less than or equal to 536870911"),
    ({"limits": {"max_prompt_chars": 1 << 27}},
     "limits.max_prompt_chars: Input should be less than or equal to 134217727"),
    # Finite, but past what a wait takes: OverflowError in the SLO monitor's thread; a collective
    # timeout that torch wraps to a negative count of microseconds.
    ({"engine": {"slo_monitor_interval_ms": 1e13}},
     "engine.slo_monitor_interval_ms: Input should be less than or equal"),
    ({"engine": {"tensor_parallel_timeout_s": 1e13}},
     "engine.tensor_parallel_timeout_s: Input should be less than or equal to 9223372036"),
    # Each failed only as a replica started (a max_model_len of 1, derived from them).
    ({"engine": {"num_kv_blocks": 2, "block_size": 1}}, "engine.num_kv_blocks: 2 blocks of 1 tokens"),
    ({"engine": {"enable_chunked_prefill": False, "max_num_batched_tokens": 1}},
     "engine.max_num_batched_tokens: with chunked prefill off it bounds max_model_len"),
    # Known without a cluster: the GPUs given cannot hold the ranks (refused as the app deployed).
    ({"engine": {"tensor_parallel_size": 2}, "replicas": {"num_gpus": 1}},
     "replicas.num_gpus: 1 GPUs cannot hold engine.tensor_parallel_size 2"),
    # Serve's gRPC proxy routes by the application's name in metadata: printable ASCII only.
    ({"applications": [{"name": "mod\u00e8le"}]}, "applications[0].name: 'mod\u00e8le' must be printable ASCII"),
    ({"model": "builtin", "model_id": " "}, "model_id: ' ' names the application"),
    # Serve imports these in its proxies once the cluster runs; with none it serves no gRPC.
    ({"grpc_options": {"grpc_servicer_functions": []}, "applications": [{"name": "a"}]},
     "grpc_options.grpc_servicer_functions: must include cluster.grpc_proxy.add_generation_to_server"),
    ({"grpc_options": {"grpc_servicer_functions": ["cluster.grpc_proxy.add_generation_to_server", "no.such.fn"]},
      "applications": [{"name": "a"}]}, "grpc_options.grpc_servicer_functions[1]: 'no.such.fn' is not an importable"),
    # A Serve config without (or with a misspelled) applications is no bare ClusterConfig.
    ({"http_options": {"port": 8000}, "applicatons": []}, "applications: required in a Serve config"),
])
def test_bad_field_raises_config_error_naming_its_dotted_path(document, message):
    with pytest.raises(ConfigError) as raised:
        load_config(document)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_power_of_two_block_size_from_1_to_256_loads(block_size):
    assert BLOCK_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert load_config({"engine": {"block_size": block_size}}).applications[0].args.engine.block_size == block_size
    assert make_engine_config(block_size=block_size).block_size == block_size


@pytest.mark.parametrize("overrides, message", [
    (dict(block_size=24), "block_size: must be a power of two from 1 to 256, got 24"),
    (dict(block_size=0), "block_size: must be a power of two from 1 to 256, got 0"),
    (dict(block_size=True), "block_size: Input should be a number, not the boolean true"),
    (dict(num_kv_blocks=False), "num_kv_blocks: Input should be a number, not the boolean false"),
])
def test_make_engine_config_refuses_by_field_name(overrides, message):
    with pytest.raises(ConfigError) as raised:
        make_engine_config(**overrides)
    assert str(raised.value) == message


def test_yaml_booleans_for_numbers_are_refused_but_quoted_and_whole_numbers_read_as_numbers(tmp_path):
    config_file = tmp_path / "config.yaml"
    config_file.write_text("engine:\n  max_num_seqs: yes\n")  # YAML 1.1: yes is true
    with pytest.raises(ConfigError, match=r"^engine\.max_num_seqs: Input should be a number, not the boolean true$"):
        load_config(config_file)
    # A quoted number (a templated value, Helm's --set-string) and a whole float (Helm renders
    # large numbers as floats) are the numbers they spell; a flag still takes 0 / 1 and "false".
    config_file.write_text('engine:\n  block_size: "8"\n  num_kv_blocks: 4096.0\n  enable_prefix_caching: 0\n'
                           '  enforce_eager: "false"\nrouter:\n  knobs: {headroom_weight: "0.5"}\n')
    args = load_config(config_file).applications[0].args
    assert (args.engine.block_size, args.engine.num_kv_blocks) == (8, 4096)
    assert args.engine.enable_prefix_caching is False and args.engine.enforce_eager is False
    assert args.router.knobs == {"headroom_weight": 0.5}
    with pytest.raises(ConfigError, match=r"^engine\.num_kv_blocks: Input should be a valid integer"):
        load_config({"engine": {"num_kv_blocks": 4096.5}})


def test_the_largest_limits_give_a_grpc_message_bound_serves_proxy_takes():
    largest = LimitsConfig(max_request_bytes=LimitsConfig.model_fields["max_request_bytes"].metadata[-1].le,
                           max_prompt_chars=LimitsConfig.model_fields["max_prompt_chars"].metadata[-1].le)
    assert largest.request_limits().message_cap() <= 2**31 - 1


def test_the_longest_accepted_waits_are_what_threading_and_torch_take():
    import datetime
    import threading

    import torch.distributed as dist

    assert MAX_WAIT_S == threading.TIMEOUT_MAX
    config = make_engine_config(tensor_parallel_timeout_s=MAX_WAIT_S, slo_monitor_interval_ms=MAX_WAIT_S * 1000)
    stopped = threading.Event()
    threading.Timer(0.05, stopped.set).start()
    assert stopped.wait(config.slo_monitor_interval_ms / 1000)  # no OverflowError
    options = dist.AllreduceOptions()
    options.timeout = datetime.timedelta(seconds=config.tensor_parallel_timeout_s)
    assert options.timeout > datetime.timedelta(0)


def test_stream_interval_defaults_to_1_and_reaches_the_replicas_engine_config():
    assert EngineConfig().stream_interval == 1
    config = load_config(app_document(engine={"stream_interval": 4}))
    assert config.applications[0].args.engine.stream_interval == 4


def test_router_knobs_are_the_policy_constructor_parameters():
    assert tuple(policy_knobs("headroom")) == (
        "headroom_weight", "backlog_weight", "prefill_weight", "saturated_prefill_weight", "preemption_weight",
        "pin_prefix_fraction", "pin_share_window", "tie_epsilon", "placement_margin", "replicate_hot",
        "hot_min_window")
    config = load_config(app_document(router={"policy": "least_loaded", "knobs": {"kv_cache_weight": 3}}))
    assert config.applications[0].args.router.knobs == {"kv_cache_weight": 3.0}


def test_a_switch_knob_takes_a_boolean_and_a_number_knob_refuses_one():
    config = load_config(app_document(router={"knobs": {"replicate_hot": False, "hot_min_window": 0}}))
    assert config.applications[0].args.router.knobs == {"replicate_hot": 0.0, "hot_min_window": 0.0}
    with pytest.raises(ConfigError, match="knobs.preemption_weight: Input should be a number, not the boolean true"):
        load_config(app_document(router={"knobs": {"preemption_weight": True}}))


def test_bare_cluster_config_becomes_the_only_application_with_its_ports():
    config = load_config({"model_id": "tiny", "ports": {"http": 8080, "grpc": 9090}})
    assert [app.name for app in config.applications] == ["tiny"]
    assert (config.http_options.port, config.grpc_options.port) == (8080, 9090)
    assert config.applications[0].import_path == APP_IMPORT_PATH


def test_unreadable_and_malformed_yaml_files_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("applications: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(a_list)


def test_a_config_file_that_is_no_utf_8_no_one_line_yaml_or_a_key_twice_is_one_line_naming_it(tmp_path):
    for name, content, message in [
        ("latin1.yaml", "model: builtin # caf\xe9\n".encode("latin-1"), "is not UTF-8 text (byte 20)"),
        ("tab.yaml", b"engine:\n\tblock_size: 16\n", "found character '\\t' that cannot start any token at line 2"),
        ("twice.yaml", b"engine:\n  block_size: 16\n  block_size: 32\n", "key 'block_size' given twice at line 3"),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ConfigError) as raised:
            load_config(path)
        assert message in str(raised.value) and "\n" not in str(raised.value), name


def test_yaml_aliases_that_expand_past_any_config_are_refused_before_anything_walks_them(tmp_path):
    # 4 KB that expand to 10^9 values: validating or dumping it took minutes.
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for previous, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 10) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines + ["model: builtin"]) + "\n")
    with pytest.raises(ConfigError, match="values once its YAML aliases are expanded"):
        load_config(bomb)
    # Aliases a config really uses (one engine block for two applications) still load.
    shared = tmp_path / "shared.yaml"
    shared.write_text("applications:\n- name: a\n  route_prefix: /a\n  args: {model: builtin, engine: &e {block_size: 8}}\n"
                      "- name: b\n  route_prefix: /b\n  args: {model: builtin, engine: *e}\n"
                      "- name: c\n  route_prefix: /c\n  args:\n    model: builtin\n    engine:\n      <<: *e\n"
                      "      block_size: 16\n")  # a merge, a key beside it overriding it: no key given twice
    assert [app.args.engine.block_size for app in load_config(shared).applications] == [8, 8, 16]


def test_deploy_serve_config_validates_against_our_schema():
    config = load_config(SERVE_CONFIG)
    app = config.applications[0]
    assert app.import_path == APP_IMPORT_PATH
    assert config.grpc_options.port == 9000
    assert config.grpc_options.grpc_servicer_functions == list(GRPC_SERVICER_FUNCTIONS)
    assert config.http_options.port == 8000 and config.http_options.host == "127.0.0.1"
    assert app.args.router.policy == "headroom"


def test_moving_the_shipped_configs_proxy_ports_moves_the_applications_and_its_endpoints_stay_local():
    """A user who edits http_options.port / grpc_options.port in deploy/serve_config.yaml moves
    them once (the applications' unset ports follow; an application's own port must agree), and
    under `headroom serve` on loopback every endpoint the cluster opens binds 127.0.0.1: the
    shipped file's bind_address is left unset (an explicit null bound them to the node's IP)."""
    from cluster.serve_command import with_local_binds

    document = yaml.safe_load(SERVE_CONFIG.read_text())
    document["http_options"]["port"], document["grpc_options"]["port"] = 28600, 28601
    config = load_config(document)
    assert (config.applications[0].args.ports.http, config.applications[0].args.ports.grpc) == (28600, 28601)
    document["applications"][0]["args"]["ports"]["grpc"] = 9000
    with pytest.raises(ConfigError, match=r"applications\[0\]\.args\.ports\.grpc: 9000 differs from grpc_options.port 28601"):
        load_config(document)
    # an application with no args at all follows them too
    bare = load_config({"http_options": {"port": 8080}, "applications": [{"name": "a"}]})
    assert bare.applications[0].args.ports.http == 8080
    assert load_config(SERVE_CONFIG).applications[0].args.ports.bind_address is None
    assert with_local_binds(load_config(SERVE_CONFIG)).applications[0].args.ports.bind_address == "127.0.0.1"


def uncommented_autoscaling(text: str) -> str:
    """deploy/serve_config.yaml with its commented-out `autoscaling:` block switched on in
    place of the num_replicas line above it."""
    lines = text.splitlines()
    start = next(index for index, line in enumerate(lines) if line.strip() == "# autoscaling:")
    indent = lines[start].index("#")
    end = start + 1
    while lines[end].startswith(" " * indent + "#   "):
        end += 1
    assert lines[start - 1].strip().startswith("num_replicas:"), lines[start - 1]
    block = [line[:indent] + line[indent + 2:] for line in lines[start:end]]
    return "\n".join(lines[:start - 1] + block + lines[end:]) + "\n"


def test_deploy_serve_configs_autoscaling_block_switched_on_is_the_documented_defaults():
    """The commented-out block an operator uncomments names every AutoscalingConfig field, with
    its default value (one source of truth: the comment may not drift from the config)."""
    document = yaml.safe_load(uncommented_autoscaling(SERVE_CONFIG.read_text()))
    replicas = document["applications"][0]["args"]["replicas"]
    assert "num_replicas" not in replicas
    assert replicas["autoscaling"] == AutoscalingConfig().model_dump()
    config = load_config(document)
    assert config.applications[0].args.replicas.autoscaling == AutoscalingConfig()
    ServeDeploySchema.model_validate(document)


def test_deploy_serve_config_validates_against_ray_serves_schema():
    ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))


def test_our_defaults_are_a_valid_ray_serve_config():
    config = ServeAppsConfig(applications=[{"name": "builtin"}])
    ServeDeploySchema.model_validate(config.model_dump(mode="json"))


def test_fixed_replicas_map_to_num_replicas_and_auto_resources():
    on_cpus = serve_deployment_options(ClusterConfig(), cluster_gpus=0)
    assert on_cpus["num_replicas"] == 2 and "autoscaling_config" not in on_cpus
    assert on_cpus["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    on_gpus = serve_deployment_options(ClusterConfig(), cluster_gpus=8)
    assert on_gpus["ray_actor_options"]["num_gpus"] == 1.0


def test_explicit_resources_win_over_auto():
    config = ClusterConfig(replicas={"num_cpus": 4, "num_gpus": 0})
    assert serve_deployment_options(config, cluster_gpus=8)["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 0.0}


def test_a_tensor_parallel_replica_reserves_a_gpu_per_rank_in_one_strict_pack_bundle():
    config = ClusterConfig(engine={"tensor_parallel_size": 4})
    options = serve_deployment_options(config, cluster_gpus=8)
    assert options["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 4.0}
    assert options["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 4.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    on_cpus = serve_deployment_options(config, cluster_gpus=0)
    assert on_cpus["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 0.0}
    assert on_cpus["placement_group_bundles"] == [{"CPU": 4.0}]
    assert "placement_group_bundles" not in serve_deployment_options(ClusterConfig(), cluster_gpus=8)
    serve.deployment(lambda: None).options(**options)  # Serve's own check: the actor fits its first bundle
    ServeDeploySchema.model_validate(ServeAppsConfig(applications=[{"name": "tp", "args": {
        "engine": {"tensor_parallel_size": 2}}}]).model_dump(mode="json"))


def test_fewer_gpus_than_tensor_parallel_ranks_is_a_config_error():
    # Refused as the config loads, before any cluster (it was refused only as the app deployed).
    with pytest.raises(ConfigError, match="^replicas.num_gpus: 2 GPUs cannot hold engine.tensor_parallel_size 4"):
        load_config({"engine": {"tensor_parallel_size": 4}, "replicas": {"num_gpus": 2}})


def test_headroom_autoscaling_is_the_default_policy_and_keeps_its_delays_out_of_serves():
    config = ClusterConfig(replicas={"autoscaling": {"min_replicas": 1, "max_replicas": 6, "downscale_delay_s": 90}})
    options = serve_deployment_options(config, cluster_gpus=0)
    assert "num_replicas" not in options
    autoscaling = options["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (1, 6)
    # Serve's wrapper would add its delays to the policy's own: the policy's are in its kwargs.
    assert autoscaling["upscale_delay_s"] == autoscaling["downscale_delay_s"] == 0.0
    policy = autoscaling["policy"]
    assert policy["policy_function"] == "cluster.autoscaling:HeadroomAutoscalingPolicy"
    assert policy["policy_kwargs"]["downscale_delay_s"] == 90 and policy["policy_kwargs"]["target_utilization"] == 0.8
    ServeAutoscalingConfig.model_validate(autoscaling)  # Serve accepts it (and imports the policy)


def test_requests_autoscaling_is_serves_policy_on_requests_in_flight_with_serves_delays():
    config = ClusterConfig(replicas={"autoscaling": {"policy": "requests", "target_ongoing_requests": 64}})
    autoscaling = serve_deployment_options(config, cluster_gpus=0)["autoscaling_config"]
    assert autoscaling["target_ongoing_requests"] == 64.0
    assert (autoscaling["upscale_delay_s"], autoscaling["downscale_delay_s"]) == (5.0, 60.0)
    assert autoscaling["policy"] == {"policy_function": "cluster.autoscaling:RequestsAutoscalingPolicy"}
    ServeAutoscalingConfig.model_validate(autoscaling)


def test_a_removed_replica_may_finish_its_streams_for_the_drain_timeout():
    options = serve_deployment_options(ClusterConfig(replicas={"drain_timeout_s": 120}), cluster_gpus=0)
    assert options["graceful_shutdown_timeout_s"] == 120.0


def test_max_ongoing_requests_admits_what_the_engine_can_hold():
    config = ClusterConfig(engine={"max_num_seqs": 32, "max_waiting_requests": 100})
    assert serve_deployment_options(config, cluster_gpus=0)["max_ongoing_requests"] == 132


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_routing_policy_loads_and_its_router_builds_it(policy):
    """The load-time check built every policy with staleness_s, which round_robin, pow2,
    approx_prefix and dynamo do not take: `--policy pow2` was a traceback (exit 1) where the
    docs list all seven."""
    from router.headroom_router import HeadroomRouter

    config = load_config({"applications": [{"name": "a", "import_path": APP_IMPORT_PATH,
                                            "args": {"model": "builtin", "router": {"policy": policy}}}]})
    router = config.applications[0].args.router
    assert router.policy == policy
    assert HeadroomRouter(router.policy, staleness_s=router.staleness_s, knobs=router.knobs).policy.name == policy


def test_a_chat_template_file_is_read_where_the_config_loads_and_a_bad_one_named(tmp_path):
    """The ingresses render chat on Ray workers, perhaps on other nodes: the config carries the
    template's text, read from the file where the config loads (or given inline, as vLLM takes it)."""
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(text)
    assert load_config({"chat_template": str(tmp_path / "chat.jinja")}).applications[0].args.chat_template == text
    assert load_config({"chat_template": text}).applications[0].args.chat_template == text
    assert load_config({}).applications[0].args.chat_template is None
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    for value, says in ((str(tmp_path / "missing.jinja"), "no such file"),
                        (str(tmp_path / "broken.jinja"), "does not compile")):
        with pytest.raises(ConfigError, match=f"^applications\\[0\\]\\.args\\.chat_template: .*{says}"):
            load_config({"applications": [{"name": "a", "import_path": "cluster.app:build_app",
                                            "args": {"chat_template": value}}]})


def test_an_ipv6_bind_address_is_announced_in_brackets_as_grpc_and_prometheus_dial_it():
    # `fd00::1:9300` does not resolve: every router fell back to Serve's choice (logged at DEBUG).
    from replica.server.auth import host_port

    assert host_port("fd00::1", 9300) == "[fd00::1]:9300" and host_port("[::1]", 9100) == "[::1]:9100"
    assert host_port("10.1.2.3", 9300) == "10.1.2.3:9300" and host_port("node-a.local", 9300) == "node-a.local:9300"
