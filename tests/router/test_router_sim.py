"""Smoke test of the router simulation benchmark at --quick size: every policy reports, the
memory-pressured scenario really preempts, and the plot is written."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_bench_module():
    spec = importlib.util.spec_from_file_location("bench_router_sim", REPO / "bench" / "bench_router_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_quick_sim_reports_every_policy_and_preempts_under_pressure(tmp_path):
    bench = load_bench_module()
    plot = tmp_path / "router_sim.png"
    args = bench.parse_args(["--quick", "--workloads", "mixed_long", "--loads", "0.85,0.95", "--seeds", "2",
                             "--plot", str(plot)])
    report = io.StringIO()
    outcome = bench.run_benchmark(args, out=report)

    results = outcome["results"]
    for load in (0.85, 0.95):
        for policy in bench.POLICY_NAMES:
            assert ("mixed_long", load, policy) in results
            assert f"| mixed_long | {load:.0%} | {policy} |" in report.getvalue()
    # Long prompts at 95% of saturation must exhaust some replica's KV pool.
    assert sum(results[("mixed_long", 0.95, policy)].preemptions_per_1k for policy in bench.POLICY_NAMES) > 0
    assert {policy for _, policy in outcome["stale"]} == {"headroom", "least_loaded"}
    # The target point runs twice (seeds 0 and 1); seed 0 reuses the table's run.
    assert all(len(runs) == 2 for runs in outcome["seeds"].values())
    assert outcome["seeds"]["headroom"][0] is results[("mixed_long", 0.85, "headroom")]
    assert "Targets (issue 5), on mixed_long at 85% load (means over 2 seed(s)):" in report.getvalue()
    assert "Splitwise, ISCA 2024" in report.getvalue()
    assert plot.stat().st_size > 0
