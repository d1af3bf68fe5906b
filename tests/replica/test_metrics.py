"""Specification of the replica's Prometheus metrics, their names and their documentation."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import make_dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from protos.headroom_pb2 import ReplicaLoad
from replica.core.load import COUNTER_FOR_FIELD, SchedulerLoad
from replica.server.metrics import (
    FINISH_REASONS,
    METRIC_NAMES,
    REPLICA_METRIC_NAMES,
    REQUEST_METRIC_NAMES,
    ReplicaMetrics,
)

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
LABELS = {"replica": "replica-0", "model": "tiny-llama"}


# What the engine passes to sync_counters: its SchedulerLoad's counter fields (declared once, in
# replica/core/load.py), each 0 unless a test sets it.
Totals = make_dataclass("Totals", [(name, int, 0) for name in COUNTER_FOR_FIELD], frozen=True)


@pytest.fixture
def metrics() -> ReplicaMetrics:
    return ReplicaMetrics(replica_id=LABELS["replica"], model=LABELS["model"])


def value(metrics: ReplicaMetrics, sample_name: str, **extra_labels: str) -> float | None:
    return metrics.registry.get_sample_value(sample_name, {**LABELS, **extra_labels})


def expected_sample_names(metric_name: str) -> set[str]:
    if METRIC_NAMES[metric_name].type == "histogram":
        return {f"{metric_name}_bucket", f"{metric_name}_count", f"{metric_name}_sum"}
    return {metric_name}


def scraped_samples(exposition: str) -> list:
    return [sample for family in text_string_to_metric_families(exposition) for sample in family.samples]


# The table.


def test_every_metric_is_prefixed_and_every_counter_ends_in_total():
    for name, spec in METRIC_NAMES.items():
        assert name.startswith("headroom_"), name
        assert spec.type in ("counter", "gauge", "histogram"), name
        assert name.endswith("_total") == (spec.type == "counter"), name


def test_vllm_equivalents_are_vllm_names_or_none():
    for name, spec in METRIC_NAMES.items():
        assert spec.vllm is None or spec.vllm.startswith("vllm:"), name
    assert METRIC_NAMES["headroom_num_preemptions_total"].vllm == "vllm:num_preemptions_total"
    assert METRIC_NAMES["headroom_recomputed_tokens_total"].vllm is None


def test_replica_metrics_carry_replica_and_model_labels():
    for name in REPLICA_METRIC_NAMES:
        assert METRIC_NAMES[name].labels[:2] == ("replica", "model"), name


def test_router_metrics_are_in_the_table_but_not_created_by_the_replica():
    assert METRIC_NAMES["headroom_router_decisions_total"].labels == ("policy", "replica")
    assert "headroom_router_load_age_seconds" in METRIC_NAMES
    assert not any(name.startswith("headroom_router_") for name in REPLICA_METRIC_NAMES)


def test_latency_histograms_have_sorted_buckets_from_milliseconds_to_minutes():
    for name, spec in METRIC_NAMES.items():
        if spec.type != "histogram":
            assert spec.buckets == (), name
            continue
        assert list(spec.buckets) == sorted(set(spec.buckets)), name
        if name.startswith("headroom_router_"):
            continue
        assert spec.buckets[0] <= 0.01, name
        assert spec.buckets[-1] >= 60.0, name


# Exposed names.


def test_exposition_has_exactly_the_documented_replica_sample_names(metrics: ReplicaMetrics):
    exposition = generate_latest(metrics.registry).decode()
    scraped = {sample.name for sample in scraped_samples(exposition) if not sample.name.endswith("_created")}
    expected = set().union(*(expected_sample_names(name) for name in REPLICA_METRIC_NAMES))
    assert scraped == expected


def test_counters_are_exposed_with_a_single_total_suffix(metrics: ReplicaMetrics):
    exposition = generate_latest(metrics.registry).decode()
    assert "# TYPE headroom_num_preemptions_total counter" in exposition
    assert "_total_total" not in exposition


def test_every_series_exists_at_zero_before_anything_happens(metrics: ReplicaMetrics):
    assert value(metrics, "headroom_num_preemptions_total") == 0.0
    assert value(metrics, "headroom_kv_headroom_tokens") == 0.0
    assert value(metrics, "headroom_time_to_first_token_seconds_count") == 0.0
    for reason in FINISH_REASONS:
        assert value(metrics, "headroom_request_success_total", finish_reason=reason) == 0.0


# Counters.


def test_sync_counters_sets_each_counter_to_the_engine_total(metrics: ReplicaMetrics):
    metrics.sync_counters(
        Totals(
            preemptions_total=3,
            recomputed_tokens_total=480,
            prompt_tokens_total=1024,
            generation_tokens_total=64,
            prefix_cache_queries=1024,
            prefix_cache_hits=256,
            admissions_held_total=7,
            admissions_relaxed_total=2,
        )
    )
    assert value(metrics, "headroom_num_preemptions_total") == 3
    assert value(metrics, "headroom_recomputed_tokens_total") == 480
    assert value(metrics, "headroom_prompt_tokens_total") == 1024
    assert value(metrics, "headroom_generation_tokens_total") == 64
    assert value(metrics, "headroom_prefix_cache_queries_total") == 1024
    assert value(metrics, "headroom_prefix_cache_hits_total") == 256
    assert value(metrics, "headroom_admissions_held_total") == 7
    assert value(metrics, "headroom_admissions_relaxed_total") == 2


def test_sync_counters_increments_by_the_delta_since_the_last_sync(metrics: ReplicaMetrics):
    metrics.sync_counters(Totals(preemptions_total=3, generation_tokens_total=10))
    metrics.sync_counters(Totals(preemptions_total=5, generation_tokens_total=10))
    metrics.sync_counters(Totals(preemptions_total=5, generation_tokens_total=42))
    assert value(metrics, "headroom_num_preemptions_total") == 5
    assert value(metrics, "headroom_generation_tokens_total") == 42


def test_sync_counters_rejects_a_total_that_went_backwards_and_moves_no_counter(metrics: ReplicaMetrics):
    metrics.sync_counters(Totals(preemptions_total=5, generation_tokens_total=10))
    with pytest.raises(ValueError, match="preemptions_total went backwards from 5 to 4"):
        metrics.sync_counters(Totals(preemptions_total=4, generation_tokens_total=20))
    assert value(metrics, "headroom_generation_tokens_total") == 10
    metrics.sync_counters(Totals(preemptions_total=6, generation_tokens_total=20))
    assert value(metrics, "headroom_num_preemptions_total") == 6


def test_sync_counters_accepts_the_schedulers_load_snapshot(metrics: ReplicaMetrics):
    from replica.core.load import COUNTER_FOR_FIELD, SchedulerLoad

    fields = {name: 0 for name in SchedulerLoad.__dataclass_fields__}
    load = SchedulerLoad(**{**fields, "preemptions_total": 9, "prefix_cache_hits": 32, "kv_usage": 0.5})
    metrics.sync_counters(load)
    assert value(metrics, "headroom_num_preemptions_total") == 9
    assert value(metrics, "headroom_prefix_cache_hits_total") == 32


def test_finished_counts_requests_by_finish_reason(metrics: ReplicaMetrics):
    metrics.finished("stop")
    metrics.finished("stop")
    metrics.finished("length")
    assert value(metrics, "headroom_request_success_total", finish_reason="stop") == 2
    assert value(metrics, "headroom_request_success_total", finish_reason="length") == 1
    assert value(metrics, "headroom_request_success_total", finish_reason="abort") == 0


def test_finished_rejects_an_unknown_reason(metrics: ReplicaMetrics):
    with pytest.raises(ValueError, match="unknown finish reason 'eos'"):
        metrics.finished("eos")


# Gauges and histograms.


def load_with(**values) -> SchedulerLoad:
    return SchedulerLoad(**{**{name: 0 for name in SchedulerLoad.__dataclass_fields__}, **values})


def test_update_sets_the_gauges_from_the_load_and_the_report_the_router_sees(metrics: ReplicaMetrics):
    load = load_with(kv_blocks_total=1000, kv_blocks_free=250, kv_usage=0.75, headroom_tokens=3200,
                     kv_committed_tokens=1600, num_running=12, num_waiting=4,
                     ttft_predictor_per_token_s=0.00025, ttft_predictor_base_s=0.03)
    report = ReplicaLoad(replica_id=LABELS["replica"], preemption_rate=0.5)
    metrics.update(load, report)
    assert value(metrics, "headroom_kv_cache_usage_ratio") == 0.75
    assert value(metrics, "headroom_kv_free_blocks") == 250
    assert value(metrics, "headroom_kv_headroom_tokens") == 3200
    assert value(metrics, "headroom_kv_committed_tokens") == 1600
    assert value(metrics, "headroom_num_requests_running") == 12
    assert value(metrics, "headroom_num_requests_waiting") == 4
    assert value(metrics, "headroom_preemption_rate") == 0.5
    assert value(metrics, "headroom_slo_ttft_predictor_per_token_seconds") == 0.00025
    assert value(metrics, "headroom_slo_ttft_predictor_base_seconds") == 0.03


def test_negative_headroom_is_reported_as_is(metrics: ReplicaMetrics):
    metrics.update(load_with(headroom_tokens=-64), ReplicaLoad())
    assert value(metrics, "headroom_kv_headroom_tokens") == -64


def test_every_replica_counter_and_gauge_follows_a_declared_load_field():
    # A metric declared in METRIC_NAMES that no load field (or report field) feeds would sit
    # at 0 forever; one a field names that METRIC_NAMES lacks would fail at start-up.
    from replica.core.load import COUNTER_FOR_FIELD, GAUGE_FOR_FIELD, GAUGE_FOR_REPORT_FIELD

    fed = set(COUNTER_FOR_FIELD.values()) | set(GAUGE_FOR_FIELD.values()) | set(GAUGE_FOR_REPORT_FIELD.values())
    fed_elsewhere = {"headroom_request_success_total"}  # per finished request, not per load
    scalar = {name for name in REPLICA_METRIC_NAMES if METRIC_NAMES[name].type in ("counter", "gauge")}
    assert fed | fed_elsewhere == scalar


@pytest.mark.parametrize(
    ("observe", "histogram"),
    [
        ("observe_ttft", "headroom_time_to_first_token_seconds"),
        ("observe_itl", "headroom_inter_token_latency_seconds"),
        ("observe_e2e", "headroom_e2e_request_latency_seconds"),
        ("observe_queue_time", "headroom_request_queue_time_seconds"),
    ],
)
def test_each_latency_goes_into_its_own_histogram(metrics: ReplicaMetrics, observe: str, histogram: str):
    getattr(metrics, observe)(0.05)
    getattr(metrics, observe)(3.0)
    assert value(metrics, f"{histogram}_count") == 2
    assert value(metrics, f"{histogram}_sum") == pytest.approx(3.05)
    assert value(metrics, f"{histogram}_bucket", le="0.1") == 1
    assert value(metrics, f"{histogram}_bucket", le="5.0") == 2
    histograms = {name for name in REPLICA_METRIC_NAMES if METRIC_NAMES[name].type == "histogram"}
    for other in histograms - {histogram}:
        assert value(metrics, f"{other}_count") == 0, other


# Registries.


def test_two_engines_in_one_process_get_separate_registries():
    first = ReplicaMetrics(replica_id="replica-0", model="tiny-llama")
    second = ReplicaMetrics(replica_id="replica-0", model="tiny-llama")
    first.sync_counters(Totals(preemptions_total=7))
    assert first.registry is not second.registry
    assert value(second, "headroom_num_preemptions_total") == 0


def test_metrics_register_in_a_given_registry():
    registry = CollectorRegistry()
    metrics = ReplicaMetrics(replica_id="replica-1", model="tiny-llama", registry=registry)
    assert metrics.registry is registry
    labels = {"replica": "replica-1", "model": "tiny-llama"}
    assert registry.get_sample_value("headroom_num_preemptions_total", labels) == 0


def test_a_front_other_than_front_0_records_only_its_streams_metrics_and_ignores_loads():
    assert set(REQUEST_METRIC_NAMES) < set(REPLICA_METRIC_NAMES)
    front = ReplicaMetrics(replica_id="replica-0", model="tiny-llama", engine_metrics=False)
    front.update(load_with(preemptions_total=3, num_running=2), ReplicaLoad())
    front.observe_ttft(0.5)
    front.finished("length")
    names = {family.name for family in text_string_to_metric_families(generate_latest(front.registry).decode())
             if not family.name.endswith("_created")}
    assert names == {name.removesuffix("_total") for name in REQUEST_METRIC_NAMES}
    assert value(front, "headroom_time_to_first_token_seconds_count") == 1


# The HTTP endpoint.


def test_http_endpoint_serves_every_replica_metric_with_its_labels(metrics: ReplicaMetrics):
    metrics.sync_counters(Totals(preemptions_total=2))
    server, thread = metrics.start_http_server(port=0, addr="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            exposition = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    samples = scraped_samples(exposition)
    scraped_names = {sample.name for sample in samples}
    for name in REPLICA_METRIC_NAMES:
        assert expected_sample_names(name) <= scraped_names, name
    for sample in samples:
        assert sample.labels["replica"] == LABELS["replica"] and sample.labels["model"] == LABELS["model"]
    preemptions = [sample.value for sample in samples if sample.name == "headroom_num_preemptions_total"]
    assert preemptions == [2.0]


# The documentation.


def documented_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOCS_PATH.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `headroom_"):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_docs_list_exactly_the_metric_names_table():
    assert list(documented_rows()) == list(METRIC_NAMES)


def test_docs_rows_match_type_labels_help_and_vllm_equivalent():
    for name, (doc_type, doc_labels, doc_meaning, doc_vllm) in documented_rows().items():
        spec = METRIC_NAMES[name]
        assert doc_type == spec.type, name
        assert tuple(re.findall(r"`([^`]+)`", doc_labels)) == spec.labels, name
        assert doc_meaning == spec.help, name
        assert doc_vllm.replace("`", "") == (spec.vllm or "none"), name
