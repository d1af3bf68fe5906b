"""Smoke test of the router simulation benchmark at a tiny size: latency calibration prints a
rate, every policy reports on a shared-prefix and a memory-pressured workload, routers fed
KV events really hit the prefix cache, and the targets and plot come out; runs spread over
processes print the same report."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_bench_module():
    spec = importlib.util.spec_from_file_location("bench_router_sim", REPO / "bench" / "bench_router_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def safe_to_fork():
    """Around a run whose Runner forks processes: what earlier tests in this process left to the
    collector is collected here, and the rest frozen, so a child's collector never visits it (in
    a child, clearing gRPC's asyncio objects joins threads a fork does not copy: two children of a
    full tests/router run spun at 100% CPU there for minutes)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_tiny_sim_calibrates_reports_every_policy_and_hits_the_prefix_cache(tmp_path):
    bench = load_bench_module()
    plot = tmp_path / "router_sim.png"
    # Two processes (the two workloads' tables side by side): the report one process prints
    # (test_parallel_runs_print_the_same_report checks that; so did these arguments' own, when
    # this was set, 2026-12-01), 13 s -> 8 s on two cores.
    args = bench.parse_args(["--quick", "--sections", "tables", "--workloads", "multi_tenant,mixed_long", "--loads", "0.85", "--requests", "40",
                             "--calibration-requests", "30", "--calibration-steps", "1", "--plot", str(plot), "--jobs", "2"])
    report = io.StringIO()
    with safe_to_fork():
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
    argv = ["--quick", "--sections", "tables", "--workloads", "hot_tenant", "--loads", "0.85", "--requests", "30", "--calibration-requests",
            "20", "--calibration-steps", "1", "--seeds", "2", "--plot", ""]
    # The one-process run in an interpreter of its own (its own str hash salt too), beside the
    # two-process run in this one; and two more interpreters, each with its own salt, draw requests.
    prelude = "import sys; sys.path[:0] = ['bench', '.']; import bench_router_sim as b; "
    serial = subprocess.Popen([sys.executable, "-c", prelude + "b.run_benchmark(b.parse_args(sys.argv[1:]))", *argv,
                               "--jobs", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    draw = prelude + "w = b.make_workload('hot_tenant', 5, 3, ''); print([(r.body_seed, r.body_len) for r in w.requests])"
    drawing = [subprocess.Popen([sys.executable, "-c", draw], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO, env={**os.environ, "PYTHONHASHSEED": salt}) for salt in ("1", "2")]
    report = io.StringIO()
    with safe_to_fork():
        bench.run_benchmark(bench.parse_args(argv + ["--jobs", "2"]), out=report)
    outputs = [process.communicate(timeout=300) for process in [serial] + drawing]
    assert [process.returncode for process in [serial] + drawing] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    reports = [[line for line in text.splitlines() if not line.startswith("wall time")]
               for text in (outputs[0][0], report.getvalue())]
    assert reports[0] == reports[1] and any("| hot_tenant | 85% | headroom |" in line for line in reports[0])
    # Another interpreter (its own str hash salt) draws the same requests.
    draws = {out for out, _ in outputs[1:]}
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
    # Weighted by size: a run that puts its big requests (19 of 199, 10x the tokens) off to the
    # drain ends small ones at 10 a second, which is 10 / the mean size of its own mix.
    sizes = [1.0] * 180 + [10.0] * 19
    big_last = [0.1 * i for i in range(180)] + [100.0 + i for i in range(19)]
    assert bench.completion_rate(big_last) == pytest.approx(10.0, rel=0.05)
    assert bench.completion_rate(big_last, sizes) == pytest.approx(10.0 / (sum(sizes) / len(sizes)), rel=0.05)
    assert bench.completion_rate(ends, [1.0] * len(ends)) == pytest.approx(bench.completion_rate(ends), rel=0.05)
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


def test_capacity_at_slo_finds_a_rate_that_holds_and_reports_goodput_past_the_best_baseline(tmp_path):
    bench = load_bench_module()
    plot = tmp_path / "goodput.png"
    # Two processes: the searches and goodput runs are virtual-time simulations, the report the
    # same as one process prints (checked when this was set, 2026-12-01); 14 s -> 8 s on two cores.
    args = bench.parse_args(["--quick", "--sections", "capacity", "--workloads", "multi_tenant", "--capacity-requests",
                             "40", "--calibration-requests", "30", "--capacity-steps", "2", "--seeds", "2",
                             "--capacity-policies", "headroom,approx_prefix", "--goodput-plot", str(plot), "--jobs", "2"])
    report = io.StringIO()
    with safe_to_fork():
        outcome = bench.run_benchmark(args, out=report)
    text = report.getvalue()
    result = outcome["capacity"]["multi_tenant"]
    assert 0 < result.bound.ttft_p90_s <= bench.TTFT_SLO_S
    assert set(result.capacity) == {"headroom", "approx_prefix"}
    for policy, capacities in result.capacity.items():
        assert len(capacities) == 2 and all(rate > 0 for rate in capacities), (policy, capacities)
        assert f"| multi_tenant | {result.bound.ttft_p90_s:.3f} | {policy} |" in text
    # What the search reports holds: the same run at that rate keeps P90 TTFT and TPOT in bounds.
    setup = bench.Setup(args, bench.engine_config(args.num_kv_blocks), args.cost)
    rate = result.capacity["headroom"][0]
    workload = setup.capacity_workload("multi_tenant", 0, rate, result.bound.min_span_s)
    assert result.bound.excess(setup.sim(0).run("headroom", workload, rate, ttft_slo_s=result.bound.ttft_p90_s)) < 1.0
    for multiple in bench.GOODPUT_CURVE:
        assert all(len(runs) == 2 for runs in result.goodput[multiple].values())
    # The physical limit: what each policy completes offered past every capacity, and the ceiling.
    for multiple in bench.GOODPUT_CURVE + bench.SATURATION_OFFERED:
        assert all(len(runs) == 2 and all(rps > 0 for rps in runs)
                   for runs in (result.completed(multiple, policy) for policy in result.goodput[multiple]))
    most, whose, _ = result.most_completed()
    assert whose in result.capacity and most > 0
    assert f"| multi_tenant | {result.best_baseline()} | {result.mean_capacity(result.best_baseline()):.2f} | {most:.2f} ({whose}," in text
    assert "Targets (issue 27), means over seeds:" in text and "goodput at 1.5x" in text
    assert "cost model: assumed" in text
    assert plot.stat().st_size > 0


def test_ours_replicas_queue_by_the_runs_ttft_slo_and_the_baselines_first_come_first_served(monkeypatch):
    bench = load_bench_module()
    configs = {}
    real_replica = bench.SimReplica

    def recording_replica(replica_id, config, cost):
        configs.setdefault(policy, config)
        return real_replica(replica_id, config, cost)

    monkeypatch.setattr(bench, "SimReplica", recording_replica)
    workload = bench.make_workload("multi_tenant", 12, 0, "")
    for policy in (bench.OURS, "approx_prefix"):
        bench.ClusterSim(bench.engine_config(3072), 2, bench.ASSUMED, bench.StatsFeed(), 0).run(
            policy, workload, 5.0, ttft_slo_s=0.25)
    assert configs[bench.OURS].scheduling_policy == "slo" and configs[bench.OURS].default_ttft_slo_ms == 250.0
    assert configs[bench.OURS].admission_mode == "reserve_expected"
    assert configs["approx_prefix"].scheduling_policy == "fcfs" and configs["approx_prefix"].default_ttft_slo_ms is None


def test_the_slo_bound_is_five_unloaded_medians_or_the_unloaded_p99_and_at_most_2_s():
    bench = load_bench_module()

    def unloaded(p50: float, p99: float):
        fields = {name: 0.0 for name in bench.RunStats.__dataclass_fields__}
        return bench.RunStats(**{**fields, "num_requests": 100, "ttft_p50_s": p50, "ttft_p99_s": p99})

    assert bench.SLOBound.of(unloaded(0.047, 0.136)).ttft_p90_s == pytest.approx(0.235)
    assert bench.SLOBound.of(unloaded(0.025, 0.58)).ttft_p90_s == pytest.approx(0.58)  # long prompts' prefill
    assert bench.SLOBound.of(unloaded(1.0, 3.0)).ttft_p90_s == 2.0


def test_a_capacity_run_spans_five_unloaded_request_durations_whatever_its_rate():
    bench = load_bench_module()
    fields = {name: 0.0 for name in bench.RunStats.__dataclass_fields__}
    bound = bench.SLOBound.of(bench.RunStats(**{**fields, "num_requests": 100, "ttft_p50_s": 0.016,
                                                "ttft_p99_s": 0.03, "latency_mean_s": 6.5}))
    assert bound.min_span_s == pytest.approx(32.5)
    # long_output's 160 requests at 340 req/s were a 0.47 s burst: now 11,050 requests, 32.5 s.
    assert bench.capacity_requests("long_output", 400, 340.0, bound.min_span_s) == 11050
    assert bench.capacity_requests("long_output", 400, 4.0, bound.min_span_s) == 160  # 40 s already
    args = bench.parse_args(["--quick"])
    setup = bench.Setup(args, bench.engine_config(args.num_kv_blocks), args.cost)
    workload = setup.capacity_workload("long_output", 0, 20.0, bound.min_span_s)
    assert len(workload.requests) == 650
    # The first requests are the shorter run's: a longer run adds requests, it changes none.
    shorter = setup.capacity_workload("long_output", 0, 1.0, bound.min_span_s).requests  # --quick: 40 requests
    assert len(shorter) == 40 and workload.requests[:40] == shorter


def test_the_cost_model_fit_recovers_its_coefficients_and_keeps_them_non_negative(tmp_path):
    load_bench_module()  # puts bench/ on the path
    import cost_model

    truth = cost_model.CostModel(4.0, 0.03, 0.0002)
    samples = [(tokens, kv, truth.step_ms(tokens, kv)) for tokens in (1, 8, 64, 512, 2048) for kv in (100, 5_000, 40_000)]
    fitted = cost_model.fit(samples, source="synthetic")
    assert (fitted.fixed_ms, fitted.per_batched_token_ms, fitted.per_kv_token_read_ms) == pytest.approx(
        (4.0, 0.03, 0.0002), rel=1e-6)
    assert fitted.fit_r2 == pytest.approx(1.0) and fitted.fit_steps == len(samples)
    # A step time that falls with KV reads (noise) would fit a negative coefficient: held at 0.
    falling = [(tokens, kv, 2.0 + 0.01 * tokens - 0.0001 * kv) for tokens, kv, _ in samples]
    clamped = cost_model.fit(falling, source="synthetic")
    assert clamped.per_kv_token_read_ms == 0.0 and clamped.fixed_ms >= 0 and clamped.per_batched_token_ms > 0
    path = tmp_path / "fit.json"
    fitted.save(path)
    assert cost_model.CostModel.load(path) == fitted
    path.write_text('{"fixed_ms": 1, "per_batched_token_ms": -1, "per_kv_token_read_ms": 0}')
    with pytest.raises(ValueError, match=r"--cost-model .*fit.json: .*per_batched_token_ms must be >= 0"):
        cost_model.CostModel.load(path)


def test_the_sim_runs_the_cost_model_file_it_is_given_and_says_which(tmp_path):
    bench = load_bench_module()
    path = tmp_path / "slow.json"
    bench.CostModel(50.0, 0.35, 0.0005, source="ten times the assumed model").save(path)
    args = bench.parse_args(["--quick", "--cost-model", str(path)])
    assert args.cost == bench.CostModel.load(path)
    setup = bench.Setup(args, bench.engine_config(args.num_kv_blocks), args.cost)
    workload = setup.workload("chat", 0, capacity=True)
    slow = setup.sim(0).run("pow2", workload, 1.0)
    fast = bench.Setup(args, setup.config, bench.ASSUMED).sim(0).run("pow2", workload, 1.0)
    assert slow.ttft_p50_s > 5 * fast.ttft_p50_s  # every step costs 10x
    with pytest.raises(SystemExit):
        bench.parse_args(["--cost-model", str(tmp_path / "missing.json")])


def test_every_shipped_fit_loads_by_name_and_says_where_it_came_from():
    bench = load_bench_module()
    shipped = sorted(bench.SHIPPED_DIR.glob("*.json"))
    assert shipped, "bench/cost_models/ ships the CPU fit"
    for path in shipped:
        model = bench.parse_args(["--cost-model", path.stem]).cost
        assert model == bench.CostModel.load(path)
        assert model.source.startswith("fitted by bench/bench_engine.py") and model.fit_steps > 0


# ---- the host KV tier in the simulation (issue 23) -------------------------------------------------
def crowded_replica(bench, host_kv_blocks: int, cost=None):
    """One replica whose 300-block pool holds about a fifth of 12 long outputs that arrive at
    once: every run preempts (13 times on this workload)."""
    config = bench.make_engine_config(block_size=16, num_kv_blocks=301, max_model_len=4096,
                                      max_num_batched_tokens=2048, max_num_seqs=256)
    return bench.ClusterSim(config, 1, cost or bench.ASSUMED, bench.StatsFeed(), 0, host_kv_blocks)


def test_the_sim_swaps_a_victim_when_swap_is_cheaper_recomputes_when_the_host_is_full_and_conserves_tokens():
    bench = load_bench_module()
    workload = bench.make_workload("long_output", 12, 0, "")
    # Prompts are unique: each prompt and output token is computed once (the last sampled
    # token never is), plus what preemption threw away.
    expected = sum(spec.body_len + spec.output_tokens - 1 for spec in workload.requests)

    def preemptions(stats) -> tuple[int, int]:
        return round(stats.preemptions_per_1k * 12 / 1000), round(stats.swap_preemptions_per_1k * 12 / 1000)

    recompute = crowded_replica(bench, 1000).run(bench.OURS, workload, 100.0)
    assert preemptions(recompute)[0] > 0 and preemptions(recompute)[1] == 0 and recompute.recomputed_tokens > 1000
    assert recompute.copied_blocks_per_1k == 0  # no host tier: nothing crosses the link
    # The assumed GPU: a block's round trip to the host ~0.17 ms, its re-prefill ~0.87 ms.
    roomy = crowded_replica(bench, 1000).run(bench.OURS_AUTO, workload, 100.0)
    num_preempted, num_swapped = preemptions(roomy)
    assert num_swapped == num_preempted > 0 and roomy.recomputed_tokens == 0 and roomy.copied_blocks_per_1k > 0
    # 150 host blocks hold some victims' KV, not all: the rest are recomputed.
    full = crowded_replica(bench, 150).run(bench.OURS_AUTO, workload, 100.0)
    num_preempted, num_swapped = preemptions(full)
    assert 0 < num_swapped < num_preempted and 0 < full.recomputed_tokens < recompute.recomputed_tokens
    # A link 10x slower: a block's round trip (~1.7 ms) is dearer than its re-prefill, but a
    # victim whose blocks were written through copies them only back (~0.84 ms): some swap.
    slower = crowded_replica(bench, 1000, replace(bench.ASSUMED, swap_bytes_per_s=2.5e9)).run(bench.OURS_AUTO,
                                                                                             workload, 100.0)
    assert 0 < preemptions(slower)[1] < preemptions(slower)[0]
    # 20x slower, even the way back alone (~1.7 ms a block) is dearer: recompute.
    slow = crowded_replica(bench, 1000, replace(bench.ASSUMED, swap_bytes_per_s=1.25e9)).run(bench.OURS_AUTO, workload,
                                                                                            100.0)
    assert preemptions(slow)[0] > 0 and preemptions(slow)[1] == 0
    for stats in (recompute, roomy, full, slower, slow):
        assert stats.computed_tokens == expected + stats.recomputed_tokens


def test_a_steps_copies_over_the_host_link_are_charged_at_its_bandwidth_and_set_the_engines_rates():
    bench = load_bench_module()
    import cost_model
    from replica.core.host_pool import BlockCopies
    from replica.core.scheduler import SchedulerOutput

    model = cost_model.ASSUMED
    assert model.kv_block_bytes(16) == 2 * 2**20  # an 8B-class model: 128 KiB of KV per token
    assert model.block_copy_ms(16) == pytest.approx(2 * 2**20 / 25e9 * 1000)
    empty = SchedulerOutput(0, [], 0, [], [])
    copying = SchedulerOutput(0, [], 0, [], [], block_copies=BlockCopies(((1, 1), (2, 2)), ((3, 4),)))
    assert model.step_time_s(copying, 16) - model.step_time_s(empty, 16) == pytest.approx(3 * model.block_copy_ms(16) / 1000)
    costs = model.preemption_costs(bench.engine_config(3073))  # what an engine measures at start-up
    assert costs.recompute_s_per_token == pytest.approx(model.step_ms(256, 256) / 256 / 1000)
    assert costs.swap_s_per_block == pytest.approx(model.block_copy_ms(16) / 1000)


def test_write_throughs_overlap_the_step_on_the_host_link_and_delay_the_next_only_by_what_is_left():
    bench = load_bench_module()
    import cost_model
    from replica.core.request import Request, SamplingParams

    # A link slow enough that four blocks' write-through outlasts a decode step's compute.
    cost = replace(cost_model.ASSUMED, swap_bytes_per_s=2e8)
    copy_s = cost.block_copy_ms(16) / 1000
    config = bench.make_engine_config(block_size=16, num_kv_blocks=65, max_model_len=512,
                                      max_num_batched_tokens=2048, num_host_kv_blocks=64)
    replica = bench.SimReplica("r0", config, cost)
    replica.scheduler.add_request(Request("a", list(range(100, 164)), SamplingParams(max_tokens=8, temperature=0.0,
                                                                                     ignore_eos=True)))
    pushed = []
    now = 0.0
    steps = []
    for _ in range(3):
        assert bench.start_replica_step(replica, 0, now, cost, lambda at, *payload: pushed.append((at, payload)), 1)
        at, (_, _, output, step_s) = pushed[-1]
        steps.append((now, output, step_s))
        replica.scheduler.update(output, {"a": 7} if output.scheduled[0].samples else {})
        now = at
    (start1, prefill, step1), (start2, decode, step2), (start3, third, step3) = steps
    assert cost_model.blocks_written_through(prefill) == 0 and step1 == pytest.approx(cost.compute_time_s(prefill))
    # The prompt's four blocks go through the link beside the first decode step, not before it...
    assert cost_model.blocks_written_through(decode) == 4 and cost_model.blocks_copied(decode) == 0
    assert step2 == pytest.approx(cost.compute_time_s(decode))
    assert 4 * copy_s > step2, "the link outlasts the step"
    # ...and the next step's forward pass waits only for what is left of them.
    assert step3 == pytest.approx(start2 + 4 * copy_s - start3 + cost.compute_time_s(third))


def test_the_swap_section_reports_ours_with_auto_and_recompute_against_every_baseline_at_each_load():
    bench = load_bench_module()
    args = bench.parse_args(["--quick", "--sections", "swap", "--workloads", "long_output", "--requests", "50", "--replicas", "2",
                             "--num-kv-blocks", "301", "--host-kv-blocks", "600"])
    setup = bench.Setup(args, bench.make_engine_config(block_size=16, num_kv_blocks=301, max_model_len=4096,
                                                       max_num_batched_tokens=2048, max_num_seqs=256), args.cost)
    # A crowded rate given, not calibrated (calibration alone runs dozens of simulations).
    setup.calibrations["long_output"] = bench.Calibration(2.0, "pow2", {"pow2": 0.05}, {"pow2": 2.0}, {"pow2": 3.0})
    report = io.StringIO()
    with safe_to_fork(), bench.Runner(2) as runner:  # two processes: virtual time, the figures one process gets
        results = bench.run_swap(setup, report, runner)
    text = report.getvalue()
    assert set(results) == {("long_output", load, policy) for load in bench.SWAP_LOADS for policy in bench.SWAP_POLICIES}
    for load in bench.SWAP_LOADS:
        for policy in bench.SWAP_POLICIES:
            assert f"| long_output | {load:.0%} | {policy} |" in text
        assert f"- long_output at {load:.0%}: vs headroom: recomputed tokens" in text
        auto, recompute = (results[("long_output", load, name)][0] for name in (bench.OURS_AUTO, bench.OURS))
        assert auto.swap_preemptions_per_1k > 0 and auto.recomputed_tokens < recompute.recomputed_tokens
    assert "600 host blocks per replica beside 300 on the device" in text
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "swap", "--workloads", "multi_tenant"])


def test_each_seed_runs_its_own_window_of_the_trace(tmp_path):
    """The seed drew only token ids, which nothing in the trace shares: seeds 0-4 were one
    sample five times. Seed s now runs the requests from s x TRACE_SEED_STRIDE on."""
    bench = load_bench_module()
    stride = bench.TRACE_SEED_STRIDE
    trace = tmp_path / "trace.csv"
    rows = [f"2023-11-16 18:{minute:02d}:{second:02d}.0000000,{100 + index},{10 + index % 7}"
            for index, (minute, second) in enumerate((i // 60 % 60, i % 60) for i in range(2 * stride + 5))]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    first = bench.make_workload("azure_trace", 5, 0, str(trace))
    second = bench.make_workload("azure_trace", 5, 1, str(trace))
    assert [r.body_len for r in first.requests] == [100, 101, 102, 103, 104]
    assert [r.body_len for r in second.requests] == [100 + stride + i for i in range(5)]
    assert bench.make_workload("azure_trace", 5, 0, str(trace)).requests == first.requests  # the same per seed
    with pytest.raises(SystemExit, match="this seed's window needs"):
        bench.make_workload("azure_trace", 10, 2, str(trace))
