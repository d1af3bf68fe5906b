"""Smoke test of the autoscaling simulation at a tiny size: on the same trace arrivals both
policies change the replica set (a burst onto one small replica makes each add replicas),
every request completes, and the report prints the rows and the issue's targets."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

from cluster.trace import DEFAULT_TRACE_PATH

REPO = Path(__file__).resolve().parents[2]


def load_bench_module():
    spec = importlib.util.spec_from_file_location("bench_autoscale_sim", REPO / "bench" / "bench_autoscale_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not DEFAULT_TRACE_PATH.is_file(), reason="the Azure trace is not in ../shared/traces")
def test_tiny_sim_scales_both_policies_and_reports_the_targets():
    bench = load_bench_module()
    # 200 requests 6x faster than the trace onto one replica of 24k KV tokens, 5 s to start more.
    args = bench.parse_args(["--limit", "200", "--sample-every", "1", "--compress", "6", "--startup-s", "5",
                             "--initial-replicas", "1", "--max-replicas", "4", "--num-kv-blocks", "1537",
                             "--baseline-targets", "16"])
    report = io.StringIO()
    results = bench.run_comparison(args, out=report)
    text = report.getvalue()
    assert set(results) == {"headroom", "requests", "requests (target_ongoing_requests 16)"}
    for stats in results.values():
        assert stats.num_requests == 200
        assert stats.scale_ups >= 1 and stats.max_replicas >= 2
        assert 0 < stats.replica_seconds <= stats.max_replicas * stats.duration_s
    assert "headroom / requests preemptions per 1k:" in text and "(target <= 0.5x)" in text
    assert "headroom / requests replica-seconds:" in text and "Splitwise, ISCA 2024" in text
