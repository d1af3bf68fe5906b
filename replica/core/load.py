"""The replica's load, declared once.

`SchedulerLoad` is the one record of what an engine carries. Each field says where it goes
beyond the front's copy: `proto=True` copies it under the same name into the `ReplicaLoad`
the routers score (protos/headroom.proto), `counter=` names the Prometheus counter that
follows it as a total since start, `gauge=` the gauge set from it. The load report
(replica/server/load_report.py), the metrics (replica/server/metrics.py) and the wire
between the engine core and the front (replica/ipc/messages.py) are derived from these
declarations, so a new load field is this record, its value in `Scheduler.load()` and, when
routers see it, its line in the proto (tests/replica/test_load_report.py checks the three
agree). Metric names and help text stay in `replica.server.metrics.METRIC_NAMES`.

Light on purpose: no torch, nothing from the engine, so the front and the router import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


def reported(*, proto: bool = False, counter: Optional[str] = None, gauge: Optional[str] = None,
             default: Any = dataclasses.MISSING) -> Any:
    """A SchedulerLoad field and where it is reported (see the module docstring)."""
    metadata = {"proto": proto, "counter": counter, "gauge": gauge}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class SchedulerLoad:
    """Cheap snapshot of what this engine carries, taken after every step."""

    kv_blocks_total: int = reported(proto=True)
    kv_blocks_free: int = reported(proto=True, gauge="headroom_kv_free_blocks")
    block_size: int = reported(proto=True)
    kv_usage: float = reported(proto=True, gauge="headroom_kv_cache_usage_ratio")
    headroom_tokens: int = reported(proto=True, gauge="headroom_kv_headroom_tokens")
    # KV tokens (whole blocks) the live requests, running and waiting, will still claim
    # beyond the blocks they hold if each runs to max_tokens (to its expected length under
    # admission_mode reserve_expected): memory already promised that free blocks do not show.
    kv_committed_tokens: int = reported(proto=True, gauge="headroom_kv_committed_tokens")
    num_running: int = reported(proto=True, gauge="headroom_num_requests_running")
    num_waiting: int = reported(proto=True, gauge="headroom_num_requests_waiting")
    waiting_prefill_tokens: int = reported(proto=True)
    preemptions_total: int = reported(proto=True, counter="headroom_num_preemptions_total")
    recomputed_tokens_total: int = reported(proto=True, counter="headroom_recomputed_tokens_total")
    prefix_cache_queries: int = reported(counter="headroom_prefix_cache_queries_total")
    prefix_cache_hits: int = reported(counter="headroom_prefix_cache_hits_total")
    prompt_tokens_total: int = reported(counter="headroom_prompt_tokens_total")
    generation_tokens_total: int = reported(counter="headroom_generation_tokens_total")
    max_num_seqs: int = reported(proto=True)
    slo_preemptions_total: int = reported(counter="headroom_slo_preemptions_total", default=0)
    slo_discarded_layers_total: int = reported(counter="headroom_slo_discarded_layers_total", default=0)
    admissions_held_total: int = reported(proto=True, counter="headroom_admissions_held_total", default=0)
    admissions_relaxed_total: int = reported(counter="headroom_admissions_relaxed_total", default=0)
    # Of a new request, under reserve_expected admission; else 0.
    expected_output_tokens: int = reported(proto=True, default=0)
    ttft_predictor_per_token_s: float = reported(gauge="headroom_slo_ttft_predictor_per_token_seconds", default=0.0)
    ttft_predictor_base_s: float = reported(gauge="headroom_slo_ttft_predictor_base_seconds", default=0.0)
    # The host KV tier (all 0 without one): its blocks, the free ones (cached-free included),
    # and what preemption moved through it (replica/core/preemption_mode.py).
    host_kv_blocks_total: int = reported(proto=True, default=0)
    host_kv_blocks_free: int = reported(proto=True, gauge="headroom_host_kv_free_blocks", default=0)
    host_kv_usage: float = reported(gauge="headroom_host_kv_cache_usage_ratio", default=0.0)
    # Of preemptions_total, the victims swapped to the host tier (the rest were recomputed).
    swap_preemptions_total: int = reported(proto=True, counter="headroom_num_swap_preemptions_total", default=0)
    recompute_tokens_avoided_total: int = reported(proto=True, counter="headroom_recompute_tokens_avoided_total",
                                                   default=0)
    swapped_out_blocks_total: int = reported(counter="headroom_kv_swapped_out_blocks_total", default=0)
    swapped_in_blocks_total: int = reported(counter="headroom_kv_swapped_in_blocks_total", default=0)
    swapped_out_bytes_total: int = reported(counter="headroom_kv_swapped_out_bytes_total", default=0)
    swapped_in_bytes_total: int = reported(counter="headroom_kv_swapped_in_bytes_total", default=0)
    # A host-tier prefix hit's copy back over the prefill it saves (routers weigh host hits by it).
    host_hit_cost_ratio: float = reported(proto=True, default=0.0)
    # Prefix-cache blocks written through to the host tier, and hits there copied back.
    spilled_blocks_total: int = reported(counter="headroom_kv_spilled_blocks_total", default=0)
    host_prefix_hit_blocks_total: int = reported(counter="headroom_host_prefix_cache_hit_blocks_total", default=0)
    # Of swapped_in_blocks_total, those prefetched (copied beside the step before their request
    # resumed), and the prefetches given back unused; the steps whose forward pass waited for
    # copies planned in the step (swap-outs, swap-ins not prefetched, host hits), and those blocks.
    prefetched_blocks_total: int = reported(proto=True, counter="headroom_kv_prefetched_blocks_total", default=0)
    prefetches_cancelled_total: int = reported(counter="headroom_kv_prefetches_cancelled_total", default=0)
    copy_wait_steps_total: int = reported(proto=True, counter="headroom_kv_copy_wait_steps_total", default=0)
    copy_wait_blocks_total: int = reported(proto=True, counter="headroom_kv_copy_wait_blocks_total", default=0)


_FIELDS = dataclasses.fields(SchedulerLoad)
LOAD_FIELDS: tuple[str, ...] = tuple(f.name for f in _FIELDS)  # in order: the wire's tuple
PROTO_FIELDS: tuple[str, ...] = tuple(f.name for f in _FIELDS if f.metadata["proto"])
COUNTER_FOR_FIELD: dict[str, str] = {f.name: f.metadata["counter"] for f in _FIELDS if f.metadata["counter"]}
GAUGE_FOR_FIELD: dict[str, str] = {f.name: f.metadata["gauge"] for f in _FIELDS if f.metadata["gauge"]}

# The ReplicaLoad fields the load report adds to those declared proto=True above: its
# identity, when the core took the load and how old it was when sent, and what is measured
# over time rather than per step (replica/server/load_report.py).
REPORT_FIELDS: tuple[str, ...] = ("replica_id", "seq", "timestamp", "load_age_ms", "preemption_rate",
                                  "preemption_rate_per_running", "step_time_ms", "generation_tokens_per_s")
GAUGE_FOR_REPORT_FIELD: dict[str, str] = {"preemption_rate": "headroom_preemption_rate"}
