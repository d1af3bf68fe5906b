"""The Helm chart: lints and renders for the CPU defaults and values-gpu.yaml; core
manifests, and the pod templates and Service inside the RayService, pass kubernetes-validate;
serveConfigV2 is our config schema; dashboard and rules are deploy/'s, byte for byte; the API
key reaches both pod templates from a Secret, and so do the HTTPS certificate and key (tls), with
a readiness probe that speaks HTTPS; the NetworkPolicy keeps the replicas' internal
port inside the release and lets clients, Prometheus and KubeRay's operator in."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import DeploymentSchema

from cluster.config import PortsConfig, load_config, serve_deployment_options
from cluster.grpc_proxy import PROXY_MAX_REQUEST_BYTES_ENV, SERVE_GRPC_MAX_MESSAGE_SIZE_ENV
from cluster.ingress import INGRESS_DEL_S, INGRESS_DRAIN_S

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's Go SDK for Python) not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "headroom"
GPU_VALUES = CHART / "values-gpu.yaml"
GPU_TP_VALUES = CHART / "values-gpu-tp.yaml"
# Custom resources, which kubernetes-validate has no schema for; their core parts are
# validated on their own below.
CRD_KINDS = {("ray.io/v1", "RayService"), ("monitoring.coreos.com/v1", "PodMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule")}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest known.
KUBERNETES_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
VALUES_FILES = {"cpu-defaults": None, "gpu": GPU_VALUES, "gpu-tp": GPU_TP_VALUES}


def values_of(values_file: Path | None) -> dict[str, Any] | None:
    return None if values_file is None else helm.values_from_yaml(values_file.read_text())


def render(values: dict[str, Any] | None = None, release: str = "hr") -> list[dict[str, Any]]:
    """Every manifest `helm template` renders, parsed."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=release, namespace="serving", is_install=True)
    return [document for path, text in rendered.items() if not path.endswith("NOTES.txt")
            for document in yaml.safe_load_all(text) if document]


def only(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [document for document in documents if document["kind"] == kind]


def rayservice(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = only(documents, "RayService")
    return found


def pod_templates(service: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [group["template"] for group in cluster["workerGroupSpecs"]]


def worker_container(service: dict[str, Any]) -> dict[str, Any]:
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    return container


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


@pytest.fixture(scope="module", params=list(VALUES_FILES), ids=list(VALUES_FILES))
def values_file(request) -> Path | None:
    return VALUES_FILES[request.param]


@pytest.fixture(scope="module")
def documents(values_file) -> list[dict[str, Any]]:
    return render(values_of(values_file))


def test_helm_lint_finds_no_warnings_or_errors(values_file):
    report = helm.lint(CHART, values_of(values_file), strict=True)
    problems = [message for message in report["messages"] if message["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_renders_one_rayservice_three_podmonitors_a_rule_a_dashboard_and_a_network_policy(documents):
    kinds = sorted((document["apiVersion"], document["kind"]) for document in documents)
    assert kinds == [("monitoring.coreos.com/v1", "PodMonitor")] * 3 + [
        ("monitoring.coreos.com/v1", "PrometheusRule"), ("networking.k8s.io/v1", "NetworkPolicy"),
        ("ray.io/v1", "RayService"), ("v1", "ConfigMap")]


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_core_manifests_pass_kubernetes_validate(documents, kubernetes_version):
    core = [document for document in documents if (document["apiVersion"], document["kind"]) not in CRD_KINDS]
    assert core
    for document in core:
        kubernetes_validate.validate(document, kubernetes_version, strict=True)


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_rayservice_pod_templates_and_serve_service_pass_kubernetes_validate(documents, kubernetes_version):
    service = rayservice(documents)
    for template in pod_templates(service):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod_template, kubernetes_version, strict=True)
    serve_service = {"apiVersion": "v1", "kind": "Service", **service["spec"]["serveService"]}
    kubernetes_validate.validate(serve_service, kubernetes_version, strict=True)


def test_serve_config_v2_is_our_config_schema_and_the_values(documents, values_file):
    serve_config = yaml.safe_load(rayservice(documents)["spec"]["serveConfigV2"])
    config = load_config(serve_config)
    with helm.Chart.load(CHART) as chart:
        expected = chart.merge_values(values_of(values_file))["serve"]
    # The values, each application's router metrics port written in (headroom.routerMetricsPorts),
    # with the wait for it.
    for index, app in enumerate(expected["applications"]):
        ports = app.setdefault("args", {}).setdefault("ports", {})
        ports["router_metrics"] = ports.get("router_metrics") or PortsConfig().router_metrics + index
        ports.setdefault("router_metrics_wait_s", INGRESS_DRAIN_S + INGRESS_DEL_S)
    assert serve_config == expected
    assert config.grpc_options.port == 9000 and config.http_options.port == 8000


def test_gpu_values_give_each_worker_pod_and_replica_one_gpu():
    service = rayservice(render(values_of(GPU_VALUES)))
    resources = worker_container(service)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1
    args = load_config(yaml.safe_load(service["spec"]["serveConfigV2"])).applications[0].args
    assert args.replicas.num_gpus == 1 and args.device == "cuda"


def test_tensor_parallel_values_give_each_worker_pod_all_of_one_replicas_gpus():
    service = rayservice(render(values_of(GPU_TP_VALUES)))
    resources = worker_container(service)["resources"]
    args = load_config(yaml.safe_load(service["spec"]["serveConfigV2"])).applications[0].args
    ranks = args.engine.tensor_parallel_size
    assert ranks == 2 and resources["limits"]["nvidia.com/gpu"] == ranks == resources["requests"]["nvidia.com/gpu"]
    options = serve_deployment_options(args, cluster_gpus=ranks)
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 2.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"


def test_cpu_defaults_request_no_gpu():
    resources = worker_container(rayservice(render()))["resources"]
    assert "nvidia.com/gpu" not in resources["limits"] and "nvidia.com/gpu" not in resources["requests"]


def test_grpc_port_is_exposed_as_serve_grpc_with_http_as_serve(documents):
    service = rayservice(documents)
    (head,) = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert {"serve": 8000, "serve-grpc": 9000}.items() <= container_ports(head).items()
    serve_ports = {port["name"]: port["port"] for port in service["spec"]["serveService"]["spec"]["ports"]}
    assert serve_ports == {"serve": 8000, "serve-grpc": 9000}


def test_container_port_names_are_what_the_api_server_accepts(documents):
    # IANA service names (at most 15 characters): the API server checks this, the schema cannot.
    for template in pod_templates(rayservice(documents)):
        for container in template["spec"]["containers"]:
            for name in container_ports(container):
                assert re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", name) and re.search("[a-z]", name), name


def test_podmonitor_scrapes_the_replica_metrics_port_as_the_alerts_job(documents):
    service = rayservice(documents)
    replicas_monitor = next(m for m in only(documents, "PodMonitor") if m["metadata"]["name"].endswith("-replicas"))
    (endpoint,) = replicas_monitor["spec"]["podMetricsEndpoints"]
    worker_labels = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert replicas_monitor["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()
    metrics_port = load_config(yaml.safe_load(service["spec"]["serveConfigV2"])).applications[0].args.ports.metrics
    assert container_ports(worker_container(service))[endpoint["port"]] == metrics_port
    # deploy/prometheus.yml, this PodMonitor and the HeadroomReplicaDown rule share one job name.
    (job,) = [relabel["replacement"] for relabel in endpoint["relabelings"] if relabel.get("targetLabel") == "job"]
    # A pod still pulling its image (no replica yet) is not scraped, so no `up == 0` pages for it.
    assert {"sourceLabels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"} in endpoint["relabelings"]
    scrape_jobs = [job["job_name"] for job in yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())["scrape_configs"]]
    assert job in scrape_jobs
    assert f'up{{job="{job}"}}' in (REPO / "deploy" / "alerts.yml").read_text()


def router_endpoints(documents: list[dict[str, Any]]) -> dict[str, int]:
    """The router PodMonitor's head-pod ports by the application its relabeling names, after
    checking each endpoint is one of the head's ports and the scrape config's job."""
    service = rayservice(documents)
    router_monitor = next(m for m in only(documents, "PodMonitor") if m["metadata"]["name"].endswith("-router"))
    head_template = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert router_monitor["spec"]["selector"]["matchLabels"].items() <= head_template["metadata"]["labels"].items()
    (head,) = head_template["spec"]["containers"]
    scrape_jobs = [job["job_name"] for job in yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())["scrape_configs"]]
    ports = {}
    for endpoint in router_monitor["spec"]["podMetricsEndpoints"]:
        labels = {relabel["targetLabel"]: relabel["replacement"] for relabel in endpoint["relabelings"]}
        assert labels["job"] in scrape_jobs
        # Labelled with the application as the file-based discovery labels them, so the dashboard's
        # router panels, which select application=~"$application", have data on Kubernetes too.
        ports[labels["application"]] = container_ports(head)[endpoint["port"]]
    return ports


def test_router_podmonitor_scrapes_the_heads_router_metrics_port_as_the_scrape_configs_job(documents):
    serve_config = load_config(yaml.safe_load(rayservice(documents)["spec"]["serveConfigV2"]))
    assert router_endpoints(documents) == {app.name: app.args.ports.router_metrics for app in serve_config.applications}


def test_each_applications_router_metrics_get_a_port_of_their_own_scraped_under_its_name():
    # Every ingress binds the first free port from its own router_metrics: with one shared
    # base, whichever started first took it, and the others' series went unscraped.
    values = {"serve": {"applications": [{"name": name, "route_prefix": f"/{name}", "import_path": "cluster.app:build_app",
                                          "args": {}} for name in ("a", "b", "c")]}}
    values["serve"]["applications"][2]["args"] = {"ports": {"router_metrics": 9500}}
    documents = render(values)
    base = PortsConfig().router_metrics
    assert router_endpoints(documents) == {"a": base, "b": base + 1, "c": 9500}
    serve_config = load_config(yaml.safe_load(rayservice(documents)["spec"]["serveConfigV2"]))
    assert [app.args.ports.router_metrics for app in serve_config.applications] == [base, base + 1, 9500]
    (policy,) = only(documents, "NetworkPolicy")
    admitted = {port["port"] for rule in policy["spec"]["ingress"] for port in rule.get("ports", [])}
    assert {base, base + 1, 9500} <= admitted


def test_each_ingress_waits_for_its_router_metrics_port_through_an_update_as_long_as_its_predecessor_holds_it():
    """The PodMonitor scrapes each application's configured port alone, so a new ingress that
    counted up past the port its draining predecessor still held went unscraped for good. The
    chart asks for the wait (ports.router_metrics_wait_s), which outside it is 0: applications
    sharing a base port there each waited 25 s at every start."""
    assert PortsConfig().router_metrics_wait_s == 0
    values = {"serve": {"applications": [{"name": "a", "route_prefix": "/a", "args": {}},
                                         {"name": "b", "route_prefix": "/b",
                                          "args": {"ports": {"router_metrics_wait_s": 3}}}]}}
    serve_config = load_config(yaml.safe_load(rayservice(render(values))["spec"]["serveConfigV2"]))
    assert [app.args.ports.router_metrics_wait_s for app in serve_config.applications] == [
        INGRESS_DRAIN_S + INGRESS_DEL_S, 3]


def test_applications_sharing_a_router_metrics_port_fail_to_render():
    values = {"serve": {"applications": [{"name": "a", "route_prefix": "/a", "args": {"ports": {"router_metrics": 9200}}},
                                         {"name": "b", "route_prefix": "/b", "args": {"ports": {"router_metrics": 9200}}}]}}
    with pytest.raises(helm.HelmError, match=r"serve.applications\[1\].args.ports.router_metrics: 9200"):
        render(values)


def test_every_pod_the_replica_podmonitor_scrapes_hosts_one_replica(documents, values_file):
    """HeadroomReplicaDown fires on a scraped pod whose metrics port nobody serves: with the
    chart's values each worker pod offers exactly one replica's CPUs (and GPUs), and there are
    as many worker pods as replicas, so every scraped pod has its replica."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if values_file is not None:
        values = {**values, **yaml.safe_load(values_file.read_text())}
    service = rayservice(documents)
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    apps = load_config(yaml.safe_load(service["spec"]["serveConfigV2"])).applications
    # Pods at start: one per replica Serve starts (an autoscaled application starts its minimum).
    assert group["replicas"] == sum(starting_replicas(app.args.replicas) for app in apps)
    for app in apps:
        # num_cpus is per tensor-parallel rank: a replica of N ranks reserves N times it.
        assert float(group["rayStartParams"]["num-cpus"]) == (app.args.replicas.num_cpus
                                                              * app.args.engine.tensor_parallel_size)
        assert app.args.ports.bind_address is None  # the pod IP, where the PodMonitor scrapes
        assert app.args.monitoring.targets_dir is None
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["host"] == "0.0.0.0"


def starting_replicas(replicas) -> int:
    return replicas.autoscaling.min_replicas if replicas.autoscaling is not None else replicas.num_replicas


def test_serve_autoscales_with_the_headroom_policy_and_kuberay_adds_the_pods(documents):
    """Serve's autoscaler runs our policy within the worker group's bounds, and KubeRay's
    in-tree autoscaler gives each replica Serve adds a pod; the rendered serveConfigV2
    becomes deployment options Ray Serve's own schema accepts."""
    service = rayservice(documents)
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    # A pod whose replica was scaled away goes before HeadroomReplicaDown's minute (KubeRay: 60 s).
    alert_for = next(rule["for"] for group in yaml.safe_load((REPO / "deploy" / "alerts.yml").read_text())["groups"]
                     for rule in group["rules"] if rule["alert"] == "HeadroomReplicaDown")
    assert alert_for == "1m" and cluster["autoscalerOptions"]["idleTimeoutSeconds"] < 60
    (group,) = cluster["workerGroupSpecs"]
    for app in load_config(yaml.safe_load(service["spec"]["serveConfigV2"])).applications:
        autoscaling = app.args.replicas.autoscaling
        assert autoscaling is not None and autoscaling.policy == "headroom"
        assert group["minReplicas"] <= autoscaling.min_replicas <= autoscaling.max_replicas <= group["maxReplicas"]
        options = serve_deployment_options(app.args, cluster_gpus=0)
        schema = DeploymentSchema.model_validate({"name": "LLMReplica", **options})
        assert schema.autoscaling_config["policy"]["policy_function"] == "cluster.autoscaling:HeadroomAutoscalingPolicy"
        assert schema.graceful_shutdown_timeout_s == app.args.replicas.drain_timeout_s


def test_an_engine_knob_in_the_values_reaches_the_replicas_config():
    values = {"serve": {"applications": [{"name": "builtin", "import_path": "cluster.app:build_app",
                                          "args": {"engine": {"stream_interval": 4}}}]}}
    serve_config = yaml.safe_load(rayservice(render(values))["spec"]["serveConfigV2"])
    assert load_config(serve_config).applications[0].args.engine.stream_interval == 4


def test_worker_metrics_port_defaults_to_the_config_default():
    values = {"serve": {"applications": [{"name": "builtin", "import_path": "cluster.app:build_app", "args": {}}]}}
    assert container_ports(worker_container(rayservice(render(values))))["replica-metrics"] == PortsConfig().metrics


def test_applications_with_different_metrics_ports_fail_to_render():
    values = {"serve": {"applications": [{"name": "a", "route_prefix": "/a", "args": {"ports": {"metrics": 9100}}},
                                         {"name": "b", "route_prefix": "/b", "args": {"ports": {"metrics": 9200}}}]}}
    with pytest.raises(helm.HelmError, match=r"serve.applications\[\].args.ports.metrics"):
        render(values)


def test_worker_replica_grpc_port_defaults_to_the_config_default():
    values = {"serve": {"applications": [{"name": "builtin", "import_path": "cluster.app:build_app", "args": {}}]}}
    assert container_ports(worker_container(rayservice(render(values))))["replica-grpc"] == PortsConfig().replica_grpc


def test_applications_with_different_replica_grpc_ports_fail_to_render():
    values = {"serve": {"applications": [{"name": "a", "route_prefix": "/a", "args": {"ports": {"replica_grpc": 9300}}},
                                         {"name": "b", "route_prefix": "/b", "args": {"ports": {"replica_grpc": 9400}}}]}}
    with pytest.raises(helm.HelmError, match=r"serve.applications\[\].args.ports.replica_grpc"):
        render(values)


# ---- the API key --------------------------------------------------------------------------
def api_key_env(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [variable for variable in container.get("env", []) if variable["name"] == "HEADROOM_API_KEY"]


def test_an_existing_secret_reaches_the_head_and_worker_containers_as_headroom_api_key():
    documents = render({"apiKey": {"existingSecret": "serving-keys", "secretKey": "keys"}})
    templates = pod_templates(rayservice(documents))
    assert len(templates) == 2
    for template in templates:
        (container,) = template["spec"]["containers"]
        (variable,) = api_key_env(container)
        assert variable["valueFrom"] == {"secretKeyRef": {"name": "serving-keys", "key": "keys"}}
        # A blank value in that Secret fails the start (replica.server.auth), not opens the doors.
        assert {"name": "HEADROOM_API_KEY_REQUIRED", "value": "1"} in container["env"]
        for kubernetes_version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": template}, kubernetes_version, strict=True)
    assert only(documents, "Secret") == []  # the operator's Secret, not the chart's


def test_a_value_becomes_the_charts_secret_which_the_containers_read():
    documents = render({"apiKey": {"value": "sk-chart-made"}})
    (secret,) = only(documents, "Secret")
    for kubernetes_version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(secret, kubernetes_version, strict=True)
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "sk-chart-made"
    for template in pod_templates(rayservice(documents)):
        (container,) = template["spec"]["containers"]
        (variable,) = api_key_env(container)
        assert variable["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "api-key"}
        assert "sk-chart-made" not in json.dumps(template)


def test_without_a_key_no_container_gets_one_and_both_sources_at_once_fail_to_render(documents):
    for template in pod_templates(rayservice(documents)):
        (container,) = template["spec"]["containers"]
        assert api_key_env(container) == []
        assert all(variable["name"] != "HEADROOM_API_KEY_REQUIRED" for variable in container["env"])
    with pytest.raises(helm.HelmError, match="apiKey: set existingSecret"):
        render({"apiKey": {"existingSecret": "serving-keys", "value": "sk-1"}})


def api_key_annotations(documents: list[dict[str, Any]]) -> list[str | None]:
    return [template["metadata"].get("annotations", {}).get("checksum/api-key")
            for template in pod_templates(rayservice(documents))]


def test_a_rotated_key_changes_both_pod_templates_so_the_old_key_stops_being_accepted():
    """The containers read HEADROOM_API_KEY from the Secret as they start: `helm upgrade --set
    apiKey.value=NEW` changed only the Secret, so no pod restarted and the old key stayed valid."""
    first, again, rotated = (api_key_annotations(render({"apiKey": {"value": key}}))
                             for key in ("sk-first", "sk-first", "sk-rotated"))
    assert len(first) == 2 and len(set(first)) == 1 and first[0]
    assert again == first and set(rotated).isdisjoint(first)
    assert "sk-first" not in json.dumps(first)
    # An existing Secret, rotated outside Helm: apiKey.revision is what changes the pods.
    secret = {"existingSecret": "serving-keys", "secretKey": "keys"}
    revisions = [api_key_annotations(render({"apiKey": {**secret, **extra}})) for extra in ({}, {"revision": 2},
                                                                                         {"revision": 3})]
    assert all(len(set(annotations)) == 1 and annotations[0] for annotations in revisions)
    assert len({annotations[0] for annotations in revisions}) == 3
    assert api_key_annotations(render()) == [None, None]  # no key: nothing to restart for


def test_with_a_revision_the_value_stays_out_of_the_pod_templates_annotation():
    """The annotation was a sha256 of apiKey.value, which anyone who can read the pods sees (a
    short key is found from it by guessing). With apiKey.revision set, the revision alone drives
    it, as with an existing Secret: a new value with the same revision rolls nothing."""
    import hashlib

    by_value = {key: api_key_annotations(render({"apiKey": {"value": key, "revision": 7}}))
                for key in ("sk-first", "sk-rotated")}
    assert by_value["sk-first"] == by_value["sk-rotated"] and by_value["sk-first"][0]
    assert hashlib.sha256(b"sk-first").hexdigest() not in by_value["sk-first"]
    assert api_key_annotations(render({"apiKey": {"value": "sk-first", "revision": 8}})) != by_value["sk-first"]
    # Without one, the value's unsalted sha256, as the chart's values and README say.
    assert api_key_annotations(render({"apiKey": {"value": "sk-first"}}))[0] == hashlib.sha256(b"sk-first").hexdigest()


def test_replica_grpc_port_0_is_any_free_port_not_the_default():
    """`| default 9300` took 0 (any free port) for unset: the pod declared, and the NetworkPolicy
    named, a port the replicas never bound."""
    values = {"serve": {"applications": [{"name": "builtin", "args": {"ports": {"replica_grpc": 0}}}]}}
    documents = render(values)
    service = rayservice(documents)
    assert "replica-grpc" not in container_ports(worker_container(service))
    (policy,) = only(documents, "NetworkPolicy")
    assert not any(port["port"] in (0, PortsConfig().replica_grpc) for rule in policy["spec"]["ingress"]
                   for port in rule.get("ports", []))
    release = policy["spec"]["podSelector"]["matchLabels"]
    assert {"from": [{"podSelector": {"matchLabels": release}}]} in policy["spec"]["ingress"]  # every port
    for kubernetes_version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(policy, kubernetes_version, strict=True)
        for template in pod_templates(service):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": template}, kubernetes_version, strict=True)


def test_every_pod_caps_serves_grpc_messages_as_headroom_serve_does():
    """Serve's gRPC proxy takes 2 GiB per message by default and buffers it whole before any
    check (the API key's included): every pod gets the cap `headroom serve` sets, from the
    largest application's limits, with the config's defaults where the values name none; and
    the proxy's size bound (INVALID_ARGUMENT naming `request`), the largest max_request_bytes,
    without which a pod's proxy refused an application's larger limit at the 4 MiB default."""
    def env(values):
        documents = render(values)
        serve_config = load_config(yaml.safe_load(rayservice(documents)["spec"]["serveConfigV2"]))
        expected = {
            SERVE_GRPC_MAX_MESSAGE_SIZE_ENV: str(max(
                app.args.limits.request_limits().message_cap()
                for app in serve_config.applications)),
            PROXY_MAX_REQUEST_BYTES_ENV: str(max(app.args.limits.max_request_bytes
                                                 for app in serve_config.applications))}
        found = {name: {variable["value"] for template in pod_templates(rayservice(documents))
                        for variable in template["spec"]["containers"][0]["env"] if variable["name"] == name}
                 for name in expected}
        return found, expected

    found, expected = env(None)
    assert found == {name: {value} for name, value in expected.items()}
    assert expected == {SERVE_GRPC_MAX_MESSAGE_SIZE_ENV: str(32 << 20), PROXY_MAX_REQUEST_BYTES_ENV: str(4 << 20)}
    bigger = {"serve": {"applications": [
        {"name": "a", "route_prefix": "/a", "import_path": "cluster.app:build_app", "args": {}},
        {"name": "b", "route_prefix": "/b", "import_path": "cluster.app:build_app",
         "args": {"limits": {"max_request_bytes": 16 << 20, "max_prompt_chars": 2 << 20}}}]}}
    found, expected = env(bigger)
    assert found == {name: {value} for name, value in expected.items()}
    assert expected == {SERVE_GRPC_MAX_MESSAGE_SIZE_ENV: str(64 << 20), PROXY_MAX_REQUEST_BYTES_ENV: str(16 << 20)}


# ---- HTTPS on Serve's HTTP proxy ---------------------------------------------------------
def test_a_tls_secret_gives_serves_http_proxy_https_on_every_pod_with_a_probe_that_speaks_it():
    documents = render({"tls": {"existingSecret": "serve-cert"}})
    service = rayservice(documents)
    http_options = load_config(yaml.safe_load(service["spec"]["serveConfigV2"])).http_options
    assert (http_options.ssl_certfile, http_options.ssl_keyfile) == ("/etc/headroom/tls/tls.crt",
                                                                     "/etc/headroom/tls/tls.key")
    for template in pod_templates(service):  # Serve's proxies run on the head and on every worker
        assert template["spec"]["volumes"] == [{"name": "serve-tls", "secret": {"secretName": "serve-cert"}}]
        (container,) = template["spec"]["containers"]
        assert container["volumeMounts"] == [{"name": "serve-tls", "mountPath": "/etc/headroom/tls", "readOnly": True}]
        for kubernetes_version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": template}, kubernetes_version, strict=True)
    # KubeRay's injected probe would ask http://localhost:8000/-/healthz; the chart's asks HTTPS
    # (test_api_keys runs this command against a live HTTPS proxy).
    raylet_check, proxy_check = worker_container(service)["readinessProbe"]["exec"]["command"][2].split(" && ")
    assert "http://localhost:52365/api/local_raylet_healthz" in raylet_check
    assert "https://localhost:8000/-/healthz" in proxy_check and proxy_check.endswith("| grep success")


def test_without_tls_serve_speaks_plain_http_and_kuberay_keeps_its_own_probes(documents):
    service = rayservice(documents)
    http_options = yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]
    assert "ssl_certfile" not in http_options and "ssl_keyfile" not in http_options
    for template in pod_templates(service):
        (container,) = template["spec"]["containers"]
        assert "volumes" not in template["spec"] and "volumeMounts" not in container
        assert "readinessProbe" not in container  # KubeRay injects its own where none is set


def test_a_tls_secret_beside_ssl_options_of_its_own_fails_to_render():
    with pytest.raises(helm.HelmError, match="tls: set tls.existingSecret or serve.http_options.ssl_certfile"):
        render({"tls": {"existingSecret": "serve-cert"},
                "serve": {"http_options": {"ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem"}}})


# ---- the NetworkPolicy ----------------------------------------------------------------------
def rules_admitting(policy: dict[str, Any], port: int) -> list[dict[str, Any]]:
    """The ingress rules that admit TCP `port` (a rule without ports admits every port)."""
    return [rule for rule in policy["spec"]["ingress"]
            if "ports" not in rule or any(entry["port"] == port for entry in rule["ports"])]


def test_ssl_ca_certs_fails_to_render_since_serve_would_never_request_client_certificates():
    with pytest.raises(helm.HelmError, match="serve.http_options.ssl_ca_certs: refused"):
        render({"serve": {"http_options": {"ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem",
                                           "ssl_ca_certs": "/ca.pem"}}})


def test_only_the_releases_pods_reach_the_replicas_internal_port(documents):
    (policy,) = only(documents, "NetworkPolicy")
    service = rayservice(documents)
    release = policy["spec"]["podSelector"]["matchLabels"]
    assert release == {"app.kubernetes.io/name": "headroom", "app.kubernetes.io/instance": "hr"}
    for template in pod_templates(service):  # the policy covers the head and the workers
        assert release.items() <= template["metadata"]["labels"].items()
    internal_port = load_config(yaml.safe_load(service["spec"]["serveConfigV2"])).applications[0].args.ports.replica_grpc
    assert container_ports(worker_container(service))["replica-grpc"] == internal_port
    admitting = rules_admitting(policy, internal_port)
    assert any({"port": internal_port, "protocol": "TCP"} in rule.get("ports", []) for rule in admitting)  # named
    for rule in admitting:  # and every rule that admits it admits this release's pods alone
        assert rule.get("from") == [{"podSelector": {"matchLabels": release}}], rule


def test_clients_prometheus_and_kuberays_operator_still_reach_their_ports(documents):
    (policy,) = only(documents, "NetworkPolicy")
    from_anywhere = [rule for rule in policy["spec"]["ingress"] if not rule.get("from")]
    open_ports = {entry["port"] for rule in from_anywhere for entry in rule.get("ports", [])}
    assert {8000, 9000} <= open_ports  # the public doors (API keys guard them)
    for monitor in only(documents, "PodMonitor"):  # every port a PodMonitor scrapes, on the pods it selects
        selector = monitor["spec"]["selector"]["matchLabels"]
        templates = [template for template in pod_templates(rayservice(documents))
                     if selector.items() <= template["metadata"]["labels"].items()]
        assert templates
        for template in templates:
            (container,) = template["spec"]["containers"]
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert container_ports(container)[endpoint["port"]] in open_ports, (monitor["metadata"]["name"], endpoint)
    # The dashboard takes Ray jobs: KubeRay's operator in its own namespace alone, not any pod
    # labelled as it anywhere (an empty namespaceSelector).
    (dashboard_rule,) = [rule for rule in rules_admitting(policy, 8265) if "ports" in rule]
    assert dashboard_rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
                                       "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]
    (elsewhere,) = only(render({"networkPolicy": {"operatorNamespace": "ray-system"}}), "NetworkPolicy")
    (rule,) = [rule for rule in rules_admitting(elsewhere, 8265) if "ports" in rule]
    assert rule["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}}


def test_network_policy_peers_are_configurable_and_it_can_be_switched_off():
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    (policy,) = only(render({"networkPolicy": {"metricsFrom": monitoring}}), "NetworkPolicy")
    (metrics_rule,) = [rule for rule in rules_admitting(policy, PortsConfig().metrics) if "ports" in rule]
    assert metrics_rule["from"] == monitoring
    for kubernetes_version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(policy, kubernetes_version, strict=True)
    assert only(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []


def test_dashboard_configmap_is_deploys_dashboard_for_grafanas_sidecar(documents):
    deployed = REPO / "deploy" / "grafana_dashboard.json"
    assert (CHART / "dashboards" / "grafana_dashboard.json").read_bytes() == deployed.read_bytes()
    (configmap,) = only(documents, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (dashboard_json,) = configmap["data"].values()
    assert json.loads(dashboard_json) == json.loads(deployed.read_text())


def test_prometheus_rule_is_deploys_alert_rules(documents):
    deployed = REPO / "deploy" / "alerts.yml"
    assert (CHART / "rules" / "alerts.yml").read_bytes() == deployed.read_bytes()
    (rule,) = only(documents, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(deployed.read_text())


def test_monitoring_can_be_switched_off():
    off = {"monitoring": {"podMonitor": {"enabled": False}, "prometheusRule": {"enabled": False},
                          "dashboard": {"enabled": False}}}
    assert sorted(document["kind"] for document in render(off)) == ["NetworkPolicy", "RayService"]


# Maps whose keys are free-form (Kubernetes or Ray fields) or are documented by a schema of
# their own (`serve`: cluster.config) are documented as one value.
DOCUMENTED_AS_ONE_VALUE = {"serve", "resources", "rayStartParams", "labels", "annotations"}


def value_paths(values: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in DOCUMENTED_AS_ONE_VALUE:
            paths += value_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = [path for path in value_paths(values) if f"| `{path}` |" not in readme]
    assert undocumented == []


def test_the_longest_release_name_helm_takes_renders_names_kuberay_and_the_api_server_take():
    """Helm takes release names up to 53 characters; KubeRay refuses a RayService name over 47
    and the API server a Service name over 63 (kubernetes-validate checks neither)."""
    documents = render(release="r" * 53)
    assert len(rayservice(documents)["metadata"]["name"]) <= 47
    assert len(rayservice(documents)["spec"]["serveService"]["metadata"]["name"]) <= 63
    for document in documents:
        assert len(document["metadata"]["name"]) <= 63, document["metadata"]["name"]
