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
    RouterConfig,
    ServeAppsConfig,
    load_config,
    policy_knobs,
    serve_deployment_options,
)
from replica.config import ConfigError, EngineConfig
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
])
def test_bad_field_raises_config_error_naming_its_dotted_path(document, message):
    with pytest.raises(ConfigError) as raised:
        load_config(document)
    assert str(raised.value).startswith(message)


def test_stream_interval_defaults_to_1_and_reaches_the_replicas_engine_config():
    assert EngineConfig().stream_interval == 1
    config = load_config(app_document(engine={"stream_interval": 4}))
    assert config.applications[0].args.engine.stream_interval == 4


def test_router_knobs_are_the_policy_constructor_parameters():
    assert policy_knobs("headroom") == (
        "headroom_weight", "backlog_weight", "prefill_weight", "saturated_prefill_weight", "preemption_weight",
        "pin_prefix_fraction", "pin_share_window", "tie_epsilon", "placement_margin")
    config = load_config(app_document(router={"policy": "least_loaded", "knobs": {"kv_cache_weight": 3}}))
    assert config.applications[0].args.router.knobs == {"kv_cache_weight": 3.0}


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


def test_deploy_serve_config_validates_against_our_schema():
    config = load_config(SERVE_CONFIG)
    app = config.applications[0]
    assert app.import_path == APP_IMPORT_PATH
    assert config.grpc_options.port == 9000
    assert config.grpc_options.grpc_servicer_functions == list(GRPC_SERVICER_FUNCTIONS)
    assert config.http_options.port == 8000 and config.http_options.host == "127.0.0.1"
    assert app.args.router.policy == "headroom"


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
    config = ClusterConfig(engine={"tensor_parallel_size": 4}, replicas={"num_gpus": 2})
    with pytest.raises(ConfigError, match="^replicas.num_gpus: 2 GPUs cannot hold engine.tensor_parallel_size 4"):
        serve_deployment_options(config, cluster_gpus=8)


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
