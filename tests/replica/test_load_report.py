"""ReplicaLoad snapshots: numbered, stamped, carrying the smoothed preemption rate, and the
rule for which load changes a WatchLoad subscriber hears about at once."""

from __future__ import annotations

import dataclasses

import pytest

from replica.core.outputs import StepStats
from replica.server.load_report import LoadReportBuilder, is_significant_change
from replica.core.load import SchedulerLoad

IDLE = SchedulerLoad(
    kv_blocks_total=100, kv_blocks_free=100, block_size=16, kv_usage=0.0, headroom_tokens=1600, kv_committed_tokens=0,
    num_running=0, num_waiting=0, waiting_prefill_tokens=0, preemptions_total=0, recomputed_tokens_total=0,
    prefix_cache_queries=0, prefix_cache_hits=0, prompt_tokens_total=0, generation_tokens_total=0, max_num_seqs=8,
)


@pytest.mark.parametrize("change, significant", [
    (dict(preemptions_total=1), True),
    (dict(num_running=1), True),
    (dict(num_waiting=1), True),
    (dict(kv_blocks_free=94), True),  # 6 blocks: more than 5% of 100
    (dict(kv_blocks_free=95), False),  # exactly 5%
    (dict(generation_tokens_total=50, waiting_prefill_tokens=10), False),
])
def test_push_at_once_on_preemption_count_change_or_more_than_5_percent_of_blocks(change, significant):
    assert is_significant_change(IDLE, dataclasses.replace(IDLE, **change)) is significant


def test_snapshots_are_numbered_stamped_and_carry_the_engine_load():
    now = [100.0]
    builder = LoadReportBuilder("r1", StepStats(step_time_s=0.004, generation_tokens_per_s=250.0),
                                monotonic_clock=lambda: now[0], wall_clock=lambda: 1_700_000_000.0)
    first = builder.build(IDLE)
    second = builder.build(dataclasses.replace(IDLE, num_running=3, kv_blocks_free=40, kv_committed_tokens=480))
    assert (first.seq, second.seq) == (1, 2)
    assert first.replica_id == "r1" and first.timestamp == 1_700_000_000.0
    assert second.num_running == 3 and second.kv_blocks_free == 40 and second.max_num_seqs == 8
    assert second.kv_committed_tokens == 480
    assert second.step_time_ms == pytest.approx(4.0) and second.generation_tokens_per_s == 250.0


def test_a_report_carries_when_the_core_took_its_load_and_how_old_it_was_when_sent():
    """Not when it was sent: a load sent again, the core not having stepped since, must neither
    claim the router's sends since (timestamp) nor look fresh (load_age_ms), unless it is
    current: an idle core's load stays true however old."""
    builder = LoadReportBuilder("r1", StepStats(), wall_clock=lambda: 1_700_000_000.0)
    busy = dataclasses.replace(IDLE, num_running=2)
    old = builder.build(busy, taken_s_ago=0.25)
    assert old.timestamp == pytest.approx(1_699_999_999.75, abs=1e-6) and old.load_age_ms == pytest.approx(250.0)
    idle = builder.build(IDLE, taken_s_ago=30.0, current=True)
    assert idle.timestamp == pytest.approx(1_699_999_970.0, abs=1e-6) and idle.load_age_ms == 0.0
    fresh = builder.build(busy)  # read now, as the router simulation reads its scheduler
    assert fresh.timestamp == 1_700_000_000.0 and fresh.load_age_ms == 0.0


def test_preemption_rate_rises_with_preemptions_and_is_split_across_running_requests():
    now = [0.0]
    builder = LoadReportBuilder("r1", StepStats(), monotonic_clock=lambda: now[0])
    assert builder.build(IDLE).preemption_rate == 0.0
    now[0] = 1.0
    load = builder.build(dataclasses.replace(IDLE, preemptions_total=4, num_running=2))
    assert load.preemption_rate > 0
    assert load.preemption_rate_per_running == pytest.approx(load.preemption_rate / 2)
    now[0] = 60.0
    assert builder.build(dataclasses.replace(IDLE, preemptions_total=4)).preemption_rate < load.preemption_rate / 100


def test_the_replica_load_proto_is_the_declared_load_fields_plus_the_reports_own():
    # One definition of the load (replica/core/load.py): a field declared proto=True must
    # exist in ReplicaLoad under its name, and every ReplicaLoad field must come from the
    # record or from the report builder, so neither side can drift from the other.
    from protos.headroom_pb2 import ReplicaLoad
    from replica.core.load import PROTO_FIELDS, REPORT_FIELDS

    proto = {field.name for field in ReplicaLoad.DESCRIPTOR.fields}
    assert set(PROTO_FIELDS) | set(REPORT_FIELDS) == proto
    assert not set(PROTO_FIELDS) & set(REPORT_FIELDS)
    report = LoadReportBuilder("r1", StepStats()).build(dataclasses.replace(IDLE, num_waiting=5, expected_output_tokens=7))
    assert all(getattr(report, name) == getattr(dataclasses.replace(IDLE, num_waiting=5, expected_output_tokens=7), name)
               for name in PROTO_FIELDS)
