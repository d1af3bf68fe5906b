"""bench/router_sim_points.py: fixed-rate runs of the router simulation with variants of ours.
Variants run beside the baselines with ratios against them, and a malformed variant is a one-line error naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "router_sim_points.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_variant_runs_beside_the_baselines_and_prints_its_ratio():
    done = run("--workload", "chat", "--rates", "4", "--bound", "2", "--seeds", "0", "--requests", "30",
               "--jobs", "1", "--policies", "headroom,pow2",
               "--variant", 'pinned={"knobs": {"pin_prefix_fraction": 0.5}, "engine": {"admission_max_hold_ms": 1}}')
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 4 |")]
    assert [row.split(" | ")[1] for row in rows] == ["headroom", "pow2", "pinned"]
    assert rows[1].endswith("| 1.00x |")  # pow2 is the only baseline: the ratios are against it


def test_a_variant_that_is_not_label_equals_json_is_a_clear_error():
    done = run("--rates", "4", "--bound", "2", "--variant", "pinned={knobs}")
    assert done.returncode != 0
    assert "--variant: 'pinned' is not LABEL=JSON" in done.stderr.strip().splitlines()[-1]


def test_the_full_workload_runs_the_stale_stats_policy_and_prints_the_p99():
    done = run("--workload", "chat", "--rates", "4", "--bound", "2", "--seeds", "0", "--requests", "30",
               "--jobs", "1", "--full-workload", "--policies", "headroom,headroom (stats 500 ms late),pow2")
    assert done.returncode == 0, done.stderr
    assert "TTFT p99 s" in done.stdout and "(the tables workload)" in done.stdout
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| 4 |")]
    assert [row[1] for row in rows] == ["headroom", "headroom (stats 500 ms late)", "pow2"]
    assert all(float(row[5]) >= float(row[4]) > 0 for row in rows)  # p99 >= p90, both measured


def test_the_stale_stats_policy_gets_its_stats_late():
    # The late policy's router reads stats LATE_STATS_DELAY_S late, as bench_router_sim's target
    # points run it (before, the script ran it on fresh stats: the staleness check compared ours
    # with itself on another random stream).
    sys.path.insert(0, str(REPO / "bench"))
    import bench_router_sim as sim

    assert sim.feed_for(sim.LATE_STATS).delay_s == sim.LATE_STATS_DELAY_S == 0.5
    assert sim.feed_for(sim.OURS).delay_s == 0 and sim.feed_for("pow2").delay_s == 0
    assert "sim.feed_for(policy)" in SCRIPT.read_text()


def test_min_span_runs_as_many_requests_as_the_capacity_section_would():
    done = run("--workload", "chat", "--rates", "4", "--bound", "2", "--seeds", "0", "--requests", "30",
               "--jobs", "1", "--policies", "pow2", "--min-span", "10")
    assert done.returncode == 0, done.stderr
    assert "30 requests per run, arrivals at least 10 s" in done.stdout
    sys.path.insert(0, str(REPO / "bench"))
    import bench_router_sim as sim

    assert sim.capacity_requests("chat", 30, 4.0, 10.0) == 40  # 10 s of arrivals at 4 req/s
    assert "setup.capacity_workload(workload, seed, rate, min_span)" in SCRIPT.read_text()  # capacity_requests' count


def test_a_router_runs_over_another_policys_replicas_and_is_not_a_baseline_there(monkeypatch):
    sys.path.insert(0, str(REPO / "bench"))
    import bench_router_sim as sim

    # The probe: the engine config each run's replicas are built with.
    built: list = []

    class Recorded(sim.SimReplica):
        def __init__(self, replica_id, config, cost):
            built.append((config.admission_mode, config.scheduling_policy))
            super().__init__(replica_id, config, cost)

    monkeypatch.setattr(sim, "SimReplica", Recorded)
    args = sim.parse_args(["--capacity-requests", "20"])
    setup = sim.Setup(args, sim.engine_config(args.num_kv_blocks), args.cost)
    workload = setup.capacity_workload("chat", 0, 4.0, 0.0)
    setup.sim(0).run("pow2", workload, 4.0)
    setup.sim(0).run("pow2", workload, 4.0, replicas_of=sim.OURS)
    setup.sim(0).run(sim.OURS, workload, 4.0, replicas_of="pow2")
    # A variant's engine fields go on last: its admission mode was overwritten by the deployment's.
    setup.sim(0).run(sim.OURS, workload, 4.0, engine={"admission_mode": "optimistic"})
    per_run = [set(built[i:i + args.replicas]) for i in range(0, len(built), args.replicas)]
    assert per_run == [{("optimistic", "fcfs")}, {("reserve_expected", "slo")}, {("optimistic", "fcfs")},
                       {("optimistic", "slo")}]

    done = run("--workload", "chat", "--rates", "4", "--bound", "2", "--seeds", "0", "--requests", "30",
               "--jobs", "1", "--policies", "pow2",
               "--variant", 'pow2 over ours={"policy": "pow2", "replicas": "headroom"}')
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 4 |")]
    assert [row.split(" | ")[1] for row in rows] == ["pow2", "pow2 over ours"]
    assert rows[0].endswith("| 1.00x |")  # the ratios are against pow2 as deployed, not over ours' replicas
    bad = run("--rates", "4", "--bound", "2", "--variant", 'x={"replicas": "vllm"}')
    assert bad.returncode != 0 and "replicas 'vllm' is none of" in bad.stderr.strip().splitlines()[-1]
