"""The single source of truth for headroom's Prometheus metric names, and the replica side.

METRIC_NAMES lists every `headroom_` metric (replica and router) with its type, help text,
labels and matching vLLM metric; docs/metrics.md and the tests read it. ReplicaMetrics
creates the replica's metrics in a registry of its own, so engines in one process never clash.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector

from protos.headroom_pb2 import ReplicaLoad
from replica.core.load import COUNTER_FOR_FIELD, GAUGE_FOR_FIELD, GAUGE_FOR_REPORT_FIELD, SchedulerLoad

# Bucket bounds in seconds, following vLLM's so its dashboards' quantiles translate, with
# a few sub-10 ms buckets added because small models on one GPU decode that fast, and 2 s
# for TTFT: the SLO the docs' examples and benchmarks run, which 1.0 and 2.5 only interpolated.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_REQUEST_LATENCY_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Queueing is part of TTFT, so it gets TTFT's range: near zero on an idle replica,
# minutes when a replica is overloaded.
QUEUE_TIME_BUCKETS_S = (0.0,) + TTFT_BUCKETS_S
# The router watches loads at <= 100 ms intervals; ages beyond a second mean a stale stream.
LOAD_AGE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

REPLICA_LABELS = ("replica", "model")
# Matches replica.core.request.RequestStatus.finish_reason and vLLM's finish_reason label.
FINISH_REASONS = ("stop", "length", "abort")


class MetricSpec(NamedTuple):
    """One metric as exposed on /metrics (counters with their `_total` suffix)."""

    type: str  # "counter", "gauge" or "histogram"
    help: str
    vllm: str | None  # the matching `vllm:` metric, None where vLLM has no equivalent
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # histograms only


METRIC_NAMES: dict[str, MetricSpec] = {
    # Replica: counters.
    "headroom_num_preemptions_total": MetricSpec(
        "counter",
        "Requests preempted since the replica started: KV blocks freed and progress reset to recompute, or (see "
        "headroom_num_swap_preemptions_total) KV swapped to the host tier.",
        "vllm:num_preemptions_total",
        REPLICA_LABELS,
    ),
    "headroom_num_swap_preemptions_total": MetricSpec(
        "counter",
        "Of headroom_num_preemptions_total, the requests whose KV was swapped to the host tier instead of being "
        "recomputed (preemption_mode swap or auto); the rest were recomputed.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_recompute_tokens_avoided_total": MetricSpec(
        "counter",
        "Computed tokens that swapped requests got back from the host KV tier instead of computing them again.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_swapped_out_blocks_total": MetricSpec(
        "counter",
        "KV blocks copied from the device to the host tier by swap preemptions.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_swapped_in_blocks_total": MetricSpec(
        "counter",
        "KV blocks copied back from the host tier to the device for swapped requests to resume (a prefetch taken back unused and made again copies its blocks again).",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_swapped_out_bytes_total": MetricSpec(
        "counter",
        "Bytes of KV copied from the device to the host tier by swap preemptions.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_swapped_in_bytes_total": MetricSpec(
        "counter",
        "Bytes of KV copied back from the host tier to the device when swapped requests resumed.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_spilled_blocks_total": MetricSpec(
        "counter",
        "Prefix-cache blocks copied to the host KV tier (kept, hash and all): written through the step after they "
        "filled, beside its forward pass, so the device evicts them without a copy.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_host_prefix_cache_hit_blocks_total": MetricSpec(
        "counter",
        "Prefix-cache hits found in the host KV tier and copied back to the device instead of prefilled (blocks; "
        "their tokens are counted in headroom_prefix_cache_hits_total too).",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_prefetched_blocks_total": MetricSpec(
        "counter",
        "Of headroom_kv_swapped_in_blocks_total, the blocks prefetched: copied back beside the forward pass of "
        "the step before their request resumed, so no step waited for them (CUDA; the CPU copies in turn).",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_prefetches_cancelled_total": MetricSpec(
        "counter",
        "Swap-in prefetches whose device blocks were taken back before their request resumed (a running request "
        "needed them, or it did not resume the next step): link time spent for nothing; the request stays on "
        "the host.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_copy_wait_steps_total": MetricSpec(
        "counter",
        "Engine steps whose forward pass waited for KV copies between the host tier and the device planned in "
        "the step itself: swap-outs, swap-ins not prefetched, host-tier prefix hits.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_copy_wait_blocks_total": MetricSpec(
        "counter",
        "KV blocks copied by the copies headroom_kv_copy_wait_steps_total counts, which the steps' forward "
        "passes waited for.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_recomputed_tokens_total": MetricSpec(
        "counter",
        "Tokens computed again because their request had been preempted: the compute preemption wastes.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_prompt_tokens_total": MetricSpec(
        "counter",
        "Prompt tokens of requests that started generating, once per request (prefix-cache hits "
        "included, like vLLM; recomputation after preemption is counted in "
        "headroom_recomputed_tokens_total).",
        "vllm:prompt_tokens_total",
        REPLICA_LABELS,
    ),
    "headroom_generation_tokens_total": MetricSpec(
        "counter",
        "Tokens generated.",
        "vllm:generation_tokens_total",
        REPLICA_LABELS,
    ),
    "headroom_prefix_cache_queries_total": MetricSpec(
        "counter",
        "Prompt tokens looked up in the prefix cache (counted in tokens, like vLLM).",
        "vllm:prefix_cache_queries_total",
        REPLICA_LABELS,
    ),
    "headroom_prefix_cache_hits_total": MetricSpec(
        "counter",
        "Prompt tokens found in the prefix cache (counted in tokens, like vLLM).",
        "vllm:prefix_cache_hits_total",
        REPLICA_LABELS,
    ),
    "headroom_request_success_total": MetricSpec(
        "counter",
        "Requests finished, by finish reason (stop, length, abort).",
        "vllm:request_success_total",
        REPLICA_LABELS + ("finish_reason",),
    ),
    "headroom_admissions_held_total": MetricSpec(
        "counter",
        "Requests the admission mode held back at the head of the waiting queue although memory for "
        "their prompt was free: admitting them would have promised more KV than the pool holds "
        "(admission_mode reserve_max_tokens or reserve_expected; 0 under optimistic).",
        None,
        REPLICA_LABELS,
    ),
    "headroom_admissions_relaxed_total": MetricSpec(
        "counter",
        "Requests admitted with part of the growth reserve waived because they had waited: the reserve a held "
        "request needs shrinks to nothing over admission_max_hold_ms, restarted by each admission on the whole "
        "reserve and each preemption on the replica (reserve modes only).",
        None,
        REPLICA_LABELS,
    ),
    "headroom_slo_preemptions_total": MetricSpec(
        "counter",
        "Forward passes aborted between decoder layers to let a request with a nearer TTFT deadline in "
        "(scheduling policy slo); each preempted one running prefill.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_slo_discarded_layers_total": MetricSpec(
        "counter",
        "Decoder layers the aborted forward passes had already run: the work SLO preemption throws away.",
        None,
        REPLICA_LABELS,
    ),
    # Replica: gauges.
    "headroom_kv_cache_usage_ratio": MetricSpec(
        "gauge",
        "Fraction of KV cache blocks in use, 0 to 1.",
        "vllm:kv_cache_usage_perc (formerly vllm:gpu_cache_usage_perc; also 0 to 1)",
        REPLICA_LABELS,
    ),
    "headroom_host_kv_free_blocks": MetricSpec(
        "gauge",
        "Blocks of the host KV tier not held by a swapped request (0 without a host tier).",
        None,
        REPLICA_LABELS,
    ),
    "headroom_host_kv_cache_usage_ratio": MetricSpec(
        "gauge",
        "Fraction of the host KV tier's blocks held by swapped requests, 0 to 1 (0 without a host tier).",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_free_blocks": MetricSpec(
        "gauge",
        "KV cache blocks not held by any request.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_headroom_tokens": MetricSpec(
        "gauge",
        "KV cache room in tokens for admitting new work: free blocks beyond the watermark reserve "
        "(which applies while anything runs), times block size.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_kv_committed_tokens": MetricSpec(
        "gauge",
        "KV cache tokens the live requests (running and waiting) will still claim beyond the blocks "
        "they hold if each runs to max_tokens: memory already promised that free blocks do not show.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_num_requests_running": MetricSpec(
        "gauge",
        "Requests in the running batch.",
        "vllm:num_requests_running",
        REPLICA_LABELS,
    ),
    "headroom_num_requests_waiting": MetricSpec(
        "gauge",
        "Requests in the waiting queue, preempted ones and those waiting for their grammar to compile included.",
        "vllm:num_requests_waiting",
        REPLICA_LABELS,
    ),
    "headroom_preemption_rate": MetricSpec(
        "gauge",
        "Preemptions per second, exponentially smoothed: the rate the router scores replicas with.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_slo_ttft_predictor_per_token_seconds": MetricSpec(
        "gauge",
        "Slope a of the TTFT predictor a * prompt_tokens + c, fitted online from measured prefills.",
        None,
        REPLICA_LABELS,
    ),
    "headroom_slo_ttft_predictor_base_seconds": MetricSpec(
        "gauge",
        "Intercept c of the TTFT predictor a * prompt_tokens + c, fitted online from measured prefills.",
        None,
        REPLICA_LABELS,
    ),
    # Replica: histograms.
    "headroom_time_to_first_token_seconds": MetricSpec(
        "histogram",
        "Time from a request's arrival to its first generated token.",
        "vllm:time_to_first_token_seconds",
        REPLICA_LABELS,
        TTFT_BUCKETS_S,
    ),
    "headroom_inter_token_latency_seconds": MetricSpec(
        "histogram",
        "Time between consecutive generated tokens of one request.",
        "vllm:inter_token_latency_seconds (formerly vllm:time_per_output_token_seconds)",
        REPLICA_LABELS,
        INTER_TOKEN_LATENCY_BUCKETS_S,
    ),
    "headroom_e2e_request_latency_seconds": MetricSpec(
        "histogram",
        "Time from a request's arrival to its last token.",
        "vllm:e2e_request_latency_seconds",
        REPLICA_LABELS,
        E2E_REQUEST_LATENCY_BUCKETS_S,
    ),
    "headroom_request_queue_time_seconds": MetricSpec(
        "histogram",
        "Time a request waited before it was first scheduled.",
        "vllm:request_queue_time_seconds",
        REPLICA_LABELS,
        QUEUE_TIME_BUCKETS_S,
    ),
    # Router (created by router code; listed here so names have one home).
    "headroom_router_decisions_total": MetricSpec(
        "counter",
        "Requests the router sent to each replica, by routing policy.",
        None,
        ("policy", "replica"),
    ),
    "headroom_router_prefix_hit_tokens_total": MetricSpec(
        "counter",
        "Prompt tokens of routed requests that the chosen replica's prefix cache held when the router chose "
        "it, per the router's index of that replica's KV events.",
        None,
        ("policy", "replica"),
    ),
    "headroom_router_prefix_spills_total": MetricSpec(
        "counter",
        "Requests sent to this replica although another one cached more of their prompt: a hot prefix "
        "spreading to more replicas as its holder loads.",
        None,
        ("policy", "replica"),
    ),
    "headroom_router_cached_blocks": MetricSpec(
        "gauge",
        "Prefix-cache blocks of the replica in the router's index, rebuilt from its KV events and set as each batch "
        "is applied; absent while the router holds no index of it (no stream, or a broken one until its next "
        "snapshot).",
        None,
        ("replica",),
    ),
    "headroom_router_kv_event_resyncs_total": MetricSpec(
        "counter",
        "Times the router rebuilt a replica's cache index from a new snapshot (after a broken stream or "
        "missed events).",
        None,
        ("replica",),
    ),
    "headroom_router_load_age_seconds": MetricSpec(
        "histogram",
        "Age of a replica's ReplicaLoad snapshot when the router scored that replica: since it arrived, "
        "plus its load_age_ms.",
        None,
        ("replica",),
        LOAD_AGE_BUCKETS_S,
    ),
    # Autoscaler (exported by each application's ingress, beside its router's, from the
    # decisions Serve's controller publishes: cluster/autoscaling.py).
    "headroom_autoscaler_desired_replicas": MetricSpec(
        "gauge",
        "Replicas the application's autoscaling policy wants now, and why (reason: kv_demand, kv_trend, "
        "waiting_work, preemptions, host_tier, low_demand, steady, pending, min_replicas, max_replicas, "
        "no_stats, awaiting_stats; requests for Serve's request-count policy).",
        None,
        ("application", "policy", "reason"),
    ),
    "headroom_autoscaler_running_replicas": MetricSpec(
        "gauge",
        "Replicas running when the autoscaling policy last decided.",
        None,
        ("application",),
    ),
    "headroom_autoscaler_kv_demand_ratio": MetricSpec(
        "gauge",
        "The headroom policy's input: the cluster's committed KV (held plus expected growth) over the running "
        "replicas' pools (each taken at the reporting replicas' mean pool); the policy adds replicas above its "
        "target_utilization.",
        None,
        ("application",),
    ),
    "headroom_autoscaler_pressure_floor_replicas": MetricSpec(
        "gauge",
        "The headroom policy's pressure floor: replicas it will not scale down below since a scale-down "
        "rebounded (0: none), until the KV demand eases by the hysteresis band.",
        None,
        ("application",),
    ),
}

ROUTER_METRIC_PREFIX = "headroom_router_"
AUTOSCALER_METRIC_PREFIX = "headroom_autoscaler_"
REPLICA_METRIC_NAMES = tuple(name for name in METRIC_NAMES
                             if not name.startswith((ROUTER_METRIC_PREFIX, AUTOSCALER_METRIC_PREFIX)))


def create_metric(name: str, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """Creates the prometheus_client metric METRIC_NAMES describes under `name`."""
    spec = METRIC_NAMES[name]
    if spec.type == "counter":
        # prometheus_client appends `_total` to a counter's name itself.
        return Counter(name.removesuffix("_total"), spec.help, spec.labels, registry=registry)
    if spec.type == "gauge":
        # Under multiprocess metrics (several fronts) one process sets each gauge: the latest
        # value is the gauge's, with no per-process label. Without, the mode is unused.
        return Gauge(name, spec.help, spec.labels, registry=registry, multiprocess_mode="mostrecent")
    return Histogram(name, spec.help, spec.labels, registry=registry, buckets=spec.buckets)


# The metrics each front of an engine core observes for its own streams; the rest follow the
# core's load, which only front 0 records when several fronts share the core.
REQUEST_METRIC_NAMES = ("headroom_request_success_total", "headroom_time_to_first_token_seconds",
                        "headroom_inter_token_latency_seconds", "headroom_e2e_request_latency_seconds",
                        "headroom_request_queue_time_seconds")


def use_multiprocess_metrics(directory: str) -> None:
    """Keep this process's metrics created from now on in `directory` (prometheus_client's
    multiprocess mode), where front 0's /metrics sums them with the other fronts' (counters and
    histograms; each gauge is set by one process). Call before any ReplicaMetrics is made."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    prometheus_values.ValueClass = prometheus_values.MultiProcessValue()


class ReplicaMetrics:
    """One engine's metrics, labelled with its replica id and model, in its own registry.
    engine_metrics=False: only REQUEST_METRIC_NAMES, for a front that is not front 0 of its
    engine core (`update` is then a no-op)."""

    def __init__(self, replica_id: str, model: str, registry: CollectorRegistry | None = None, *,
                 engine_metrics: bool = True):
        self.replica_id = replica_id
        self.model = model
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine_metrics = engine_metrics
        names = REPLICA_METRIC_NAMES if engine_metrics else REQUEST_METRIC_NAMES
        metrics = {name: create_metric(name, self.registry) for name in names}
        # Binding the labels now makes every series appear (at 0) from the first scrape, so
        # dashboards see a replica before its first preemption or request.
        labels = (replica_id, model)
        # Which metric follows which load field is declared with the field (replica/core/load.py).
        if engine_metrics:
            self._counters = {field: metrics[name].labels(*labels) for field, name in COUNTER_FOR_FIELD.items()}
            self._gauges = {field: metrics[name].labels(*labels) for field, name in GAUGE_FOR_FIELD.items()}
            self._report_gauges = {field: metrics[name].labels(*labels)
                                   for field, name in GAUGE_FOR_REPORT_FIELD.items()}
        else:
            self._counters, self._gauges, self._report_gauges = {}, {}, {}
        self._synced_totals = dict.fromkeys(self._counters, 0)
        request_success = metrics["headroom_request_success_total"]
        self._request_success = {reason: request_success.labels(*labels, reason) for reason in FINISH_REASONS}
        self._time_to_first_token = metrics["headroom_time_to_first_token_seconds"].labels(*labels)
        self._inter_token_latency = metrics["headroom_inter_token_latency_seconds"].labels(*labels)
        self._e2e_request_latency = metrics["headroom_e2e_request_latency_seconds"].labels(*labels)
        self._request_queue_time = metrics["headroom_request_queue_time_seconds"].labels(*labels)

    def update(self, load: SchedulerLoad, report: ReplicaLoad) -> None:
        """After each step: the counters follow the load's totals, the gauges its values and the
        report's (the ReplicaLoad the routers see for this load, so the two always agree)."""
        self.sync_counters(load)
        for field, gauge in self._gauges.items():
            gauge.set(getattr(load, field))
        for field, gauge in self._report_gauges.items():
            gauge.set(getattr(report, field))

    def sync_counters(self, totals: object) -> None:
        """Advances every counter to the engine's totals (the SchedulerLoad fields declared with
        a counter), by the delta since the last sync.

        The engine keeps the authoritative totals (the scheduler counts preemptions where
        they happen); the counters follow them. A total below the last synced one is a bug
        (counters never go back), so it raises before any counter moves.
        """
        self._synced_totals = _advance(self._counters, self._synced_totals, totals)

    def observe_ttft(self, seconds: float) -> None:
        self._time_to_first_token.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._inter_token_latency.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e_request_latency.observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        self._request_queue_time.observe(seconds)

    def finished(self, reason: str) -> None:
        """Counts one finished request; `reason` is "stop", "length" or "abort"."""
        if reason not in self._request_success:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {FINISH_REASONS}")
        self._request_success[reason].inc()

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serves this registry on http://addr:port/metrics from a daemon thread; under
        multiprocess metrics, every process's that shares the directory.

        Port 0 picks a free port (read it from `server.server_port`); `server.shutdown()`
        stops it.
        """
        registry = self.registry
        if prometheus_values.ValueClass is not prometheus_values.MutexValue:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, os.environ["PROMETHEUS_MULTIPROC_DIR"])
        return prometheus_client.start_http_server(port, addr, registry=registry)



def _advance(counters: dict, synced_totals: dict[str, int], totals: object) -> dict[str, int]:
    """Increments each counter by its total's delta since the last sync; returns the new
    synced totals. Raises, before any counter moves, if a total went backwards."""
    new_totals = {name: getattr(totals, name) for name in synced_totals}
    for name, total in new_totals.items():
        synced = synced_totals[name]
        if total < synced:
            raise ValueError(f"engine total {name} went backwards from {synced} to {total}")
    for name, total in new_totals.items():
        delta = total - synced_totals[name]
        if delta:
            counters[name].inc(delta)
    return new_totals
