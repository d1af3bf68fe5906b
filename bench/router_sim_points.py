"""The router simulation at fixed offered rates: goodput (requests within the workload's P90
TTFT bound and 100 ms TPOT) per policy over seeds, with variants of ours (policy knobs, engine
overrides) beside the baselines in the same run, and any router over another policy's replicas
(`"replicas"`: ours' admission by expected growth and TTFT-SLO queue, or a baseline's vLLM-style
optimistic admission and FCFS), which separates what a router buys from what its replicas do.
For probing what bounds a capacity or an overload figure (issue 27) without a whole capacity
search.

    python bench/router_sim_points.py --workload multi_tenant --rates 15.6,19.5 --bound 0.236 \
        [--seeds 0-4] [--policies headroom,approx_prefix,precise_prefix] \
        [--variant 'pinned={"knobs": {"pin_prefix_fraction": 0.3, "prefill_weight": 16}}'] \
        [--variant 'no holds={"engine": {"admission_max_hold_ms": 1}}'] \
        [--variant 'approx_prefix over ours={"policy": "approx_prefix", "replicas": "headroom"}'] \
        [--requests 400] [--jobs 2]

Runs are bench_router_sim.py's ClusterSim (each replica a real Scheduler), requests per run as
its capacity section (--capacity-requests), or with --full-workload its fixed-load tables'
workload (--requests per run): with --bound 2 (the tables' TTFT SLO) and 1,000 requests, the
never-worse-than-pow2 p99 check (--policies headroom,pow2 at 120% of the calibrated rate) and
the staleness check (--policies 'headroom,headroom (stats 500 ms late)'). Virtual time: the
figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router_sim as sim  # noqa: E402

MAKE_POLICY = sim.make_policy  # before any run replaces it with one that adds its variant's knobs

FIELDS = (("goodput req/s", "goodput_rps", "{:.2f}"), ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
          ("TTFT p90 s", "ttft_p90_s", "{:.3f}"), ("TTFT p99 s", "ttft_p99_s", "{:.3f}"),
          ("preempt/1k", "preemptions_per_1k", "{:.1f}"),
          ("prefix hit", "prefix_hit_rate", "{:.3f}"), ("spills/1k", "spills_per_1k", "{:.1f}"))


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, spec = text.partition("=")
    try:
        variant = json.loads(spec)
    except json.JSONDecodeError as error:
        raise SystemExit(f"--variant: {label!r} is not LABEL=JSON ({error})") from None
    unknown = set(variant) - {"knobs", "engine", "policy", "replicas"}
    if not label or unknown:
        raise SystemExit(f"--variant: {text!r}: want LABEL={{\"knobs\": ..., \"engine\": ..., \"policy\": ..., "
                         f"\"replicas\": ...}}")
    if variant.get("replicas", sim.OURS) not in sim.POLICY_NAMES:
        raise SystemExit(f"--variant: {label!r}: replicas {variant['replicas']!r} is none of {', '.join(sim.POLICY_NAMES)}")
    return label, variant


def run_one(job: tuple) -> tuple:
    """One run: (label, variant, workload, seed, rate, bound, requests, full, min_span) -> (label, rate, seed, RunStats)."""
    label, variant, workload, seed, rate, bound, requests, full, min_span = job
    knobs = variant.get("knobs", {})

    def with_knobs(name, rng=None, **more):
        return MAKE_POLICY(name, rng, **(knobs if name == sim.OURS else {}), **more)

    sim.make_policy = with_knobs  # this process's runs only (each job sets its own)
    args = sim.parse_args(["--requests" if full else "--capacity-requests", str(requests)])
    setup = sim.Setup(args, sim.engine_config(args.num_kv_blocks), args.cost)
    policy = variant.get("policy", sim.OURS)
    runs = setup.workload(workload, seed) if full else setup.capacity_workload(workload, seed, rate, min_span)
    stats = setup.sim(seed, sim.feed_for(policy)).run(policy, runs, rate, ttft_slo_s=bound,
                                                      replicas_of=variant.get("replicas"), engine=variant.get("engine"))
    return label, rate, seed, stats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="multi_tenant", choices=sim.WORKLOADS)
    parser.add_argument("--rates", required=True, help="offered rates, req/s, comma-separated")
    parser.add_argument("--bound", type=float, required=True, help="the workload's P90 TTFT bound, s (goodput SLO)")
    parser.add_argument("--seeds", default="0-4", help="FIRST-LAST")
    parser.add_argument("--policies", default="headroom,approx_prefix,precise_prefix")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                        help='ours with {"knobs": {...}} (HeadroomPolicy) and/or {"engine": {...}} (EngineConfig)')
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--min-span", type=float, default=0.0, metavar="S",
                        help="more requests where the capacity section would run more: arrivals span at least S "
                             "seconds (its report's per-workload span: 5 unloaded request durations)")
    parser.add_argument("--full-workload", action="store_true",
                        help="the fixed-load tables' workload (--requests per run, long_output 40%%) instead of the "
                             "capacity section's; with --bound 2 and 1,000 requests, the never-worse-than-pow2 and "
                             "staleness checks")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    first, _, last = args.seeds.partition("-")
    seeds = range(int(first), int(last or first) + 1)
    rates = [float(rate) for rate in args.rates.split(",")]
    runs = {name: {"policy": name} for name in args.policies.split(",")}
    for name in runs:
        if name not in sim.POLICY_NAMES and name not in (sim.OPTIMISTIC_OURS, sim.LATE_STATS):
            raise SystemExit(f"--policies: unknown {name!r}; expected some of {', '.join(sim.POLICY_NAMES)}")
    runs.update(parse_variant(text) for text in args.variant)
    jobs = [(label, variant, args.workload, seed, rate, args.bound, args.requests, args.full_workload, args.min_span)
            for rate in rates for label, variant in runs.items() for seed in seeds]
    results: dict = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for label, rate, seed, stats in pool.map(run_one, jobs):
            results.setdefault((rate, label), []).append(stats)
    print(f"{args.workload}, P90 TTFT bound {args.bound} s, seeds {seeds.start}-{seeds.stop - 1}, "
          f"{args.requests} requests per run{' (the tables workload)' if args.full_workload else ''}"
          f"{f', arrivals at least {args.min_span:g} s' if args.min_span and not args.full_workload else ''} "
          "(means; goodput per seed in brackets)")
    print("| rate req/s | policy | " + " | ".join(header for header, _, _ in FIELDS) + " | goodput vs best baseline |")
    print("|---" * (3 + len(FIELDS)) + "|")
    for rate in rates:
        # The baselines as deployed: a variant that runs one on other replicas is not one.
        baselines = [label for label in runs if runs[label].get("policy") in sim.BASELINES
                     and not runs[label].get("engine") and not runs[label].get("replicas")]
        best = max((np.mean([s.goodput_rps for s in results[(rate, b)]]) for b in baselines), default=0.0)
        for label in runs:
            stats = results[(rate, label)]
            cells = [fmt.format(np.mean([getattr(s, field) for s in stats])) for _, field, fmt in FIELDS]
            cells[0] += " (" + " ".join(f"{s.goodput_rps:.2f}" for s in stats) + ")"
            vs = sim.ratio(np.mean([s.goodput_rps for s in stats]), best) if best else float("nan")
            print(f"| {rate:g} | {label} | " + " | ".join(cells) + f" | {vs:.2f}x |")


if __name__ == "__main__":
    main()
