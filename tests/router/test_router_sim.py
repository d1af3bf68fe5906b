"""Smoke test of the router simulation benchmark at a tiny size: latency calibration prints a
rate, every policy reports on a shared-prefix and a memory-pressured workload, routers fed
KV events really hit the prefix cache, and the targets and plot come out; runs spread over
processes print the same report."""

from __future__ import annotations

import importlib.util
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_bench_module():
    spec = importlib.util.spec_from_file_location("bench_router_sim", REPO / "bench" / "bench_router_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_tiny_sim_calibrates_reports_every_policy_and_hits_the_prefix_cache(tmp_path):
    bench = load_bench_module()
    plot = tmp_path / "router_sim.png"
    args = bench.parse_args(["--quick", "--workloads", "multi_tenant,mixed_long", "--loads", "0.85", "--requests", "40",
                             "--calibration-requests", "30", "--calibration-steps", "1", "--plot", str(plot)])
    report = io.StringIO()
    outcome = bench.run_benchmark(args, out=report)
    text = report.getvalue()

    results = outcome["results"]
    for workload in ("multi_tenant", "mixed_long"):
        assert outcome["calibrations"][workload].rate_rps > 0
        assert f"## {workload}: 40 requests per run; calibrated rate" in text
        for policy in bench.POLICY_NAMES:
            assert (workload, 0.85, policy) in results
            assert f"| {workload} | 85% | {policy} |" in text
    # Tenants share 6k-token system prompts: routers that see KV events find them cached.
    for policy in ("headroom", "precise_prefix", "dynamo"):
        assert results[("multi_tenant", 0.85, policy)].prefix_hit_rate > 0.3
    # Ours runs its replicas with reserve_expected admission; mixed_long never shares a prefix.
    assert results[("mixed_long", 0.85, "headroom")].prefix_hit_rate < 0.05
    assert set(outcome["points"]) == {"multi_tenant", "mixed_long"}
    assert "headroom (optimistic admission)" in outcome["points"]["mixed_long"]
    assert "Targets (issue 12), means over seeds:" in text and "multi-tenant P90 TTFT" in text
    assert "Splitwise, ISCA 2024" in text
    assert plot.stat().st_size > 0


def test_rate_search_finds_a_crossing_and_stops_at_its_bound_when_there_is_none():
    bench = load_bench_module()
    crossing = bench.rate_where(lambda rate: rate, threshold=37.0, low=1.0, high=2.0, steps=20)
    assert abs(crossing - 37.0) < 0.01
    calls = []

    def never_crosses(rate: float) -> float:
        calls.append(rate)
        return 0.0

    bound = bench.rate_where(never_crosses, threshold=1.0, low=1.0, high=2.0, steps=3)
    assert bound <= 2.0 * 1e4 * 2 and len(calls) < 40  # before the fix: doubled to inf
    # Calibration asks for `never` instead, so a baseline that never doubles sets no rate.
    assert bench.rate_where(never_crosses, threshold=1.0, low=1.0, high=2.0, steps=3, never=math.inf) == math.inf


def test_parallel_runs_print_the_same_report_and_workloads_do_not_depend_on_the_process(tmp_path):
    bench = load_bench_module()
    argv = ["--quick", "--workloads", "hot_tenant", "--loads", "0.85", "--requests", "30", "--calibration-requests",
            "20", "--calibration-steps", "1", "--seeds", "2", "--plot", ""]
    reports = []
    for jobs in ("1", "2"):
        report = io.StringIO()
        bench.run_benchmark(bench.parse_args(argv + ["--jobs", jobs]), out=report)
        reports.append([line for line in report.getvalue().splitlines() if not line.startswith("wall time")])
    assert reports[0] == reports[1] and any("| hot_tenant | 85% | headroom |" in line for line in reports[0])
    # Another interpreter (its own str hash salt) draws the same requests.
    draw = ("import sys; sys.path[:0] = ['bench', '.']; import bench_router_sim as b; "
            "w = b.make_workload('hot_tenant', 5, 3, ''); print([(r.body_seed, r.body_len) for r in w.requests])")
    draws = {subprocess.run([sys.executable, "-c", draw], capture_output=True, text=True, check=True, cwd=REPO,
                            env={**os.environ, "PYTHONHASHSEED": salt}).stdout for salt in ("1", "2")}
    assert len(draws) == 1 and "(" in draws.pop()


def test_a_baseline_that_never_doubles_sets_no_rate_and_none_doubling_falls_back_to_capacity():
    bench = load_bench_module()
    assert bench.calibrated_rate({"pow2": 7.0, "round_robin": math.inf, "dynamo": 9.5}, 40.0, 12.0) == (9.5, "dynamo")
    assert bench.calibrated_rate({"pow2": math.inf, "dynamo": math.inf}, 40.0, 50.0) == (40.0, bench.CAPACITY_BOUND)


def test_the_calibrated_rate_is_at_most_what_the_cluster_completes():
    bench = load_bench_module()
    # long_output's median TTFT doubled only in a burst far past what 4 replicas complete.
    assert bench.calibrated_rate({"pow2": 280.0, "round_robin": 286.0}, 69.0, 13.7) == (13.7, bench.SATURATED)
    assert bench.calibrated_rate({"pow2": math.inf}, 69.0, 13.7) == (13.7, bench.SATURATED)


def test_the_completion_rate_leaves_out_the_ramp_and_the_drain():
    bench = load_bench_module()
    # 100 requests ending one every 0.1 s, then one straggler 50 s later: 10 per second.
    ends = [0.1 * i for i in range(100)] + [60.0]
    assert bench.completion_rate(ends) == pytest.approx(10.0, rel=0.05)
    assert bench.completion_rate(ends[:5]) == 0.0  # too few to tell


def test_zero_preemptions_meet_an_at_most_target_even_against_a_baseline_with_zero():
    bench = load_bench_module()

    def stats(preemptions: float):
        fields = {name: 0.0 for name in bench.RunStats.__dataclass_fields__}
        return bench.RunStats(**{**fields, "num_requests": 100, "preemptions_per_1k": preemptions})

    runs = {bench.OURS: [stats(0.0)], "dynamo": [stats(0.0)]}
    line = bench.compare_to_best(runs, "preemptions_per_1k", True, ["dynamo"], 0.5, "preemptions", ".1f", "")
    assert line.endswith("0.00x (target <= 0.5x) MET"), line
    runs[bench.OURS] = [stats(2.0)]  # and a nonzero figure against zero still misses
    line = bench.compare_to_best(runs, "preemptions_per_1k", True, ["dynamo"], 0.5, "preemptions", ".1f", "")
    assert line.endswith("MISSED"), line
