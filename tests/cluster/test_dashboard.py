"""The Grafana dashboard and the alert rules: the dashboard opens on preemptions per replica,
and every metric either queries is in METRIC_NAMES and exported by a live replica or a
router; promtool accepts the rules, the scrape config and every dashboard query."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import asdict
from pathlib import Path

import prometheus_client
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster.autoscaler_metrics import AutoscalerCollector
from cluster.autoscaling import Decision
from replica.server.metrics import AUTOSCALER_METRIC_PREFIX, METRIC_NAMES, REPLICA_METRIC_NAMES
from router.metrics import RouterMetrics
from tests.cluster.prometheus_harness import prometheus_tool, prometheus_unavailable, with_grafana_variables
from tests.replica.replica_harness import RunningReplica

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana_dashboard.json"
ALERTS = DEPLOY / "alerts.yml"
SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(node=None) -> list[str]:
    """Every PromQL string in the dashboard: panel targets' `expr` and template variables' queries."""
    node = dashboard() if node is None else node
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        if isinstance(node.get("definition"), str):
            found.append(node["definition"])
        return found + [query for value in node.values() for query in dashboard_queries(value)]
    if isinstance(node, list):
        return [query for value in node for query in dashboard_queries(value)]
    return []


def alert_expressions() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def metric_of(series: str) -> str:
    """The metric a series belongs to: a histogram's _bucket, _sum and _count series name it."""
    for suffix in SERIES_SUFFIXES:
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def metric_names(query: str) -> set[str]:
    return {metric_of(series) for series in re.findall(r"headroom_\w+", query)}


def queried_metric_names() -> set[str]:
    return {name for query in dashboard_queries() + alert_expressions() for name in metric_names(query)}


def rows_with_panels() -> list[tuple[str, list[dict]]]:
    rows: list[tuple[str, list[dict]]] = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            rows.append((panel["title"], []))
        else:
            rows[-1][1].append(panel)
    return rows


def test_first_row_is_preemptions_recompute_kv_usage_and_headroom_per_replica():
    first_row = rows_with_panels()[0][1]
    expected = [
        ("rate(headroom_num_preemptions_total", "Preemptions per second"),
        ("rate(headroom_recomputed_tokens_total", "Recomputed tokens"),
        ("headroom_kv_cache_usage_ratio", "KV cache usage"),
        ("headroom_kv_headroom_tokens", "KV headroom"),
    ]
    # The preemption and recompute panels show, second, what the host KV tier took over:
    # preemptions that swapped instead of recomputing, and the recompute they avoided.
    swap_series = {0: "rate(headroom_num_swap_preemptions_total", 1: "rate(headroom_recompute_tokens_avoided_total"}
    assert len(first_row) == len(expected)
    for index, (panel, (query_part, title_part)) in enumerate(zip(first_row, expected)):
        target, *others = panel["targets"]
        assert query_part in target["expr"] and title_part in panel["title"]
        assert "by (replica)" in target["expr"] and target["legendFormat"] == "{{replica}}"
        assert [other["expr"].split("{")[0] for other in others] == (
            [f"sum by (replica) ({swap_series[index]}"] if index in swap_series else [])
        assert panel["gridPos"]["y"] == 1


def test_later_rows_hold_latency_quantiles_queue_depth_and_router_decisions():
    later_queries = [target["expr"] for _, panels in rows_with_panels()[1:] for panel in panels
                     for target in panel["targets"]]
    for histogram in ("headroom_time_to_first_token_seconds", "headroom_inter_token_latency_seconds"):
        assert any(q.startswith("histogram_quantile(0.99") and f"{histogram}_bucket" in q for q in later_queries)
    assert any("headroom_num_requests_running" in q for q in later_queries)
    assert any("headroom_num_requests_waiting" in q for q in later_queries)
    assert any("rate(headroom_router_decisions_total" in q and "replica" in q for q in later_queries)


def test_every_panel_selects_the_dashboards_model_or_application():
    # With several applications a panel that does not select one mixes them all: replica
    # series carry the model id ($model), the router's and the autoscaler's the application
    # ($application; a config may name an application otherwise than its model id).
    panel_queries = [query for query in dashboard_queries(dashboard()["panels"])]
    assert panel_queries
    for query in panel_queries:
        assert 'model=~"$model"' in query or 'application=~"$application"' in query, query
    variables = {variable["name"]: variable["query"]["query"] for variable in dashboard()["templating"]["list"]
                 if variable["type"] == "query"}
    assert variables == {"model": "label_values(headroom_num_requests_running, model)",
                         "application": "label_values(application)"}


def alert_rules() -> dict[str, dict]:
    return {rule["alert"]: rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}


def test_alert_rules_cover_sustained_preemptions_full_kv_cache_and_replicas_down():
    rules = alert_rules()
    assert "rate(headroom_num_preemptions_total[5m])" in rules["HeadroomSustainedPreemptions"]["expr"]
    assert rules["HeadroomSustainedPreemptions"]["for"] == "10m"
    assert rules["HeadroomKVCacheNearlyFull"]["expr"].endswith("headroom_kv_cache_usage_ratio) > 0.95")
    assert rules["HeadroomKVCacheNearlyFull"]["for"] == "5m"
    assert rules["HeadroomReplicaDown"]["expr"] == 'up{job="headroom-replica"} == 0'
    assert rules["HeadroomNoReplicaUp"]["expr"] == 'absent(up{job="headroom-replica"} == 1)'


def test_every_queried_metric_is_in_metric_names():
    queried = queried_metric_names()
    assert queried, "no headroom_ metric found in the dashboard or alert rules"
    assert queried <= set(METRIC_NAMES), f"not in replica.server.metrics.METRIC_NAMES: {sorted(queried - set(METRIC_NAMES))}"


def test_every_queried_replica_metric_is_on_a_live_replicas_metrics_endpoint():
    running = RunningReplica(max_model_len=128, block_size=16, num_kv_blocks=64)
    try:
        scraped = {series for (series, _labels) in running.scrape()}
    finally:
        running.close()
    exported = {metric_of(series) for series in scraped}
    replica_queried = queried_metric_names() & set(REPLICA_METRIC_NAMES)
    assert replica_queried, "the dashboard queries no replica metric"
    assert replica_queried <= exported, f"not on a live /metrics: {sorted(replica_queried - exported)}"


def test_autoscaling_row_follows_the_first_with_desired_vs_running_replicas_and_kv_demand():
    title, panels = rows_with_panels()[1]
    assert title.startswith("Autoscaling")
    queries = [target["expr"] for panel in panels for target in panel["targets"]]
    assert any("headroom_autoscaler_desired_replicas" in q and "reason" in q for q in queries)
    assert any("headroom_autoscaler_running_replicas" in q for q in queries)
    assert any("headroom_autoscaler_kv_demand_ratio" in q for q in queries)
    assert any("headroom_autoscaler_pressure_floor_replicas" in q for q in queries)


def test_every_queried_autoscaler_metric_is_in_the_ingress_exposition():
    autoscaler_queried = {name for name in queried_metric_names() if name.startswith(AUTOSCALER_METRIC_PREFIX)}
    assert autoscaler_queried, "the dashboard queries no autoscaler metric"
    decision = {**asdict(Decision(3, "kv_demand", kv_demand_tokens=12000.0, kv_capacity_tokens=8000.0,
                                  pressure_floor=2)),
                "running_replicas": 2, "target_replicas": 2, "policy": "headroom"}
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(AutoscalerCollector("builtin", read=lambda app: decision))
    exposition = prometheus_client.generate_latest(registry).decode()
    exported = {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
    assert autoscaler_queried <= exported, f"not in the ingress' exposition: {sorted(autoscaler_queried - exported)}"
    assert registry.get_sample_value("headroom_autoscaler_desired_replicas", {
        "application": "builtin", "policy": "headroom", "reason": "kv_demand"}) == 3
    assert registry.get_sample_value("headroom_autoscaler_kv_demand_ratio", {"application": "builtin"}) == 0.75
    assert registry.get_sample_value("headroom_autoscaler_pressure_floor_replicas", {"application": "builtin"}) == 2


def test_every_queried_router_metric_is_in_a_routers_exposition():
    router_queried = {name for name in queried_metric_names() - set(REPLICA_METRIC_NAMES)
                      if not name.startswith(AUTOSCALER_METRIC_PREFIX)}
    assert router_queried, "the dashboard queries no router metric"
    metrics = RouterMetrics("headroom")
    # Labelled series appear once used: one decision and one scored load.
    metrics.decided("replica-0")
    metrics.observe_load_age("replica-0", 0.05)
    exposition = prometheus_client.generate_latest(metrics.registry).decode()
    exported = {metric_of(sample.name) for family in text_string_to_metric_families(exposition)
                for sample in family.samples}
    assert router_queried <= exported, f"not in a router's exposition: {sorted(router_queried - exported)}"


def promtool() -> str:
    """promtool (from PATH, the headroom cache, or Debian's package); skips without it."""
    found = prometheus_tool("promtool")
    if found is None:
        pytest.skip(prometheus_unavailable() or "promtool not installed")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_alert_rules():
    checked = run_promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_promtool_accepts_the_scrape_config():
    checked = run_promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_promtool_parses_every_dashboard_query(tmp_path):
    # promtool parses PromQL only inside rule files: each panel query becomes a recording
    # rule, with Grafana's variables replaced by values they take.
    rules = []
    for index, query in enumerate(q for q in dashboard_queries() if not q.startswith("label_values(")):
        query = with_grafana_variables(query)
        rules.append({"record": f"dashboard:query_{index}", "expr": query})
    rule_file = tmp_path / "dashboard_rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = run_promtool("check", "rules", str(rule_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr


# Two replicas as the default deployment and the Helm chart run them, for 30 minutes.
REPLICAS = ("10.0.0.1:9100", "10.0.0.2:9100")


def replica_series(metric: str, values: tuple[str, str]) -> list[dict]:
    labels = 'job="headroom-replica", model="builtin"'
    return [{"series": f'{metric}{{{labels}, instance="{instance}", replica="r{index}"}}', "values": value}
            for index, (instance, value) in enumerate(zip(REPLICAS, values))]


def promtool_test(tmp_path, input_series: list[dict], alert_tests: list[dict], expr_tests: list[dict]):
    test_file = tmp_path / "alerts_test.yml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": alert_tests,
                   "promql_expr_test": expr_tests}],
    }))
    return run_promtool("test", "rules", str(test_file))


def test_no_alert_fires_on_a_healthy_two_replica_deployment(tmp_path):
    """Both replicas up and scraped, KV 40% used, a preemption every 2 s: busy but healthy."""
    series = (replica_series("up", ("1x30", "1x30"))
              + replica_series("headroom_kv_cache_usage_ratio", ("0.4x30", "0.4x30"))
              + replica_series("headroom_num_preemptions_total", ("0+30x30", "0+30x30")))
    quiet = [{"eval_time": "25m", "alertname": name, "exp_alerts": []} for name in alert_rules()]
    checked = promtool_test(tmp_path, series, quiet, [])
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_alert_expression_holds_on_its_symptom(tmp_path):
    """A replica's endpoint down, a full KV cache, 2 preemptions/s: each alert's expression
    returns the replica (the firing itself waits out each rule's `for`)."""
    series = (replica_series("up", ("1x30", "0x30"))
              + replica_series("headroom_kv_cache_usage_ratio", ("0.4x30", "0.97x30"))
              + replica_series("headroom_num_preemptions_total", ("0+30x30", "0+120x30")))
    rules = alert_rules()
    down = {"job": "headroom-replica", "model": "builtin", "instance": REPLICAS[1], "replica": "r1"}
    expr_tests = [
        {"expr": rules["HeadroomReplicaDown"]["expr"], "eval_time": "20m",
         "exp_samples": [{"labels": "up" + "{" + ", ".join(f'{k}="{v}"' for k, v in down.items()) + "}", "value": 0}]},
        {"expr": rules["HeadroomKVCacheNearlyFull"]["expr"], "eval_time": "20m",
         "exp_samples": [{"labels": '{model="builtin", replica="r1"}', "value": 0.97}]},
        {"expr": rules["HeadroomSustainedPreemptions"]["expr"], "eval_time": "20m",
         "exp_samples": [{"labels": '{model="builtin", replica="r1"}', "value": 2}]},
    ]
    checked = promtool_test(tmp_path, series, [], expr_tests)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_no_replica_up_fires_when_no_replica_answers(tmp_path):
    series = replica_series("up", ("0x30", "0x30"))
    fired = [{"eval_time": "20m", "alertname": "HeadroomNoReplicaUp", "exp_alerts": [{
        "exp_labels": {"severity": "critical"},
        "exp_annotations": {key: value for key, value in alert_rules()["HeadroomNoReplicaUp"]["annotations"].items()},
    }]}]
    checked = promtool_test(tmp_path, series, fired, [])
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("app_name", ["meta-llama/Llama-3.1-8B-Instruct", "../../escaped", "a%2Fb"])
def test_target_files_of_any_application_name_are_where_the_scrape_configs_globs_read(tmp_path, app_name):
    """An application named as a model id (`org/model`) wrote its target files into a
    subdirectory the globs never read (every panel empty, HeadroomNoReplicaUp on a healthy
    cluster), and `..` out of the directory; the names are percent-encoded into one file each."""
    import asyncio
    import fnmatch

    from cluster.config import DEFAULT_TARGETS_DIR
    from cluster.prometheus_targets import PrometheusTargets

    async def write() -> tuple[dict[str, list], list]:
        async def endpoints() -> list[str]:
            return ["10.0.0.1:9100"]

        targets = PrometheusTargets(tmp_path / "targets", app_name, "10.0.0.2:9200", endpoints)
        targets.start()
        for _ in range(100):
            await asyncio.sleep(0.01)
            written = [path for path in tmp_path.rglob("*") if path.is_file()]
            if len(written) == 2:
                break
        files = {path.name: json.loads(path.read_text()) for path in written}
        targets.stop()
        return files, written

    files, written = asyncio.run(write())
    assert {path.parent for path in written} == {tmp_path / "targets"}  # not in or above a subdirectory
    globs = [pattern for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
             if job["job_name"].startswith("headroom-") for config in job["file_sd_configs"]
             for pattern in config["files"]]
    read = {job: [name for name in files for pattern in globs
                  if fnmatch.fnmatch(f"{DEFAULT_TARGETS_DIR}/{name}", pattern) and job in pattern]
            for job in ("replicas", "router")}
    assert all(len(names) == 1 for names in read.values()), read
    assert files[read["replicas"][0]] == [{"targets": ["10.0.0.1:9100"], "labels": {"application": app_name}}]
    assert files[read["router"][0]] == [{"targets": ["10.0.0.2:9200"], "labels": {"application": app_name}}]


def test_target_files_never_follow_a_planted_symlink_nor_land_in_another_users_directory(tmp_path):
    """The default directory is under the shared /tmp: a fixed temporary name another local
    user planted as a symlink redirected the write into any file this user can write."""
    import pwd

    from cluster.prometheus_targets import UnsafeTargetsDir, replicas_file, write_targets

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    directory = tmp_path / "targets"
    directory.mkdir()
    path = replicas_file(directory, "app")
    for planted in (path.with_suffix(".tmp"), directory / f".{path.name}.tmp"):
        planted.symlink_to(victim)
    write_targets(path, ["10.0.0.1:9100"], {"application": "app"})
    assert victim.read_text() == "precious\n"
    assert json.loads(path.read_text())[0]["targets"] == ["10.0.0.1:9100"] and not path.is_symlink()
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)  # Prometheus may run as another user
    if os.getuid() == 0:  # another user's directory: not written there (root can hand it over)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(UnsafeTargetsDir, match="belongs to another user"):
            write_targets(theirs / "app-replicas.json", [], {})
        # An application refused there leaves that user's files alone when it stops.
        import asyncio

        from cluster.prometheus_targets import PrometheusTargets

        (theirs / "app-router.json").write_text("theirs\n")

        async def start_and_stop() -> None:
            async def endpoints() -> list[str]:
                return []

            targets = PrometheusTargets(theirs, "app", "10.0.0.2:9200", endpoints)
            targets.start()
            targets.stop()

        asyncio.run(start_and_stop())
        assert (theirs / "app-router.json").read_text() == "theirs\n"
