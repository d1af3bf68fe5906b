"""TTFT-SLO attainment of the fcfs, priority and slo scheduling policies on one replica: the
real Scheduler and SLOMonitor on a virtual clock, step times from the router benchmark's
cost model, and the monitor's checks and layer-boundary aborts simulated inside each step.

Two tenant tiers: urgent (TTFT SLO 300 ms, short prompts) and relaxed (5 s, long prompts),
at rising load, the same arrivals for every policy. Target: urgent attainment >= 1.5x fcfs's
at the load where fcfs attains 50%, throughput loss <= 5%, relaxed attainment >= fcfs - 5 pts.

    python bench/bench_slo.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router_sim import FAKE_TOKEN_ID, CostModel  # noqa: E402  (the router benchmark's step-time model)

from replica.config import EngineConfig, make_engine_config  # noqa: E402
from replica.core.request import Request, SamplingParams  # noqa: E402
from replica.core.scheduler import Scheduler  # noqa: E402
from replica.core.slo import SLOView  # noqa: E402
from replica.core.slo_monitor import SLOMonitor  # noqa: E402

POLICIES = ("fcfs", "priority", "slo")
NUM_LAYERS = 32  # an 8B-class model: the abort lands on one of 32 layer boundaries


@dataclass(frozen=True)
class Tier:
    name: str
    ttft_slo_ms: float
    priority: int  # for the priority policy
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    share: float  # of arrivals


TIERS = (
    Tier("urgent", 300.0, 0, (32, 256), (16, 64), 0.5),
    Tier("relaxed", 5000.0, 1, (2048, 8192), (64, 256), 0.5),
)


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    tier: Tier
    prompt_tokens: int
    max_tokens: int


def make_workload(rate_rps: float, duration_s: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    while True:
        now += rng.expovariate(rate_rps)
        if now >= duration_s:
            return arrivals
        tier = TIERS[0] if rng.random() < TIERS[0].share else TIERS[1]
        arrivals.append(Arrival(now, tier, rng.randint(*tier.prompt_tokens), rng.randint(*tier.output_tokens)))


@dataclass
class RunStats:
    attainment: dict[str, float]
    throughput_tps: float  # generated tokens per second of makespan
    makespan_s: float
    aborted_steps: int
    discarded_s: float  # step time thrown away by aborted passes
    recomputed_tokens: int
    memory_preemptions: int


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(config: EngineConfig, cost: CostModel, workload: list[Arrival], seed: int) -> RunStats:
    """One replica serving the workload. Like AsyncEngine, requests that arrive during a step
    reach the scheduler after it; under "slo" the monitor sees them as arrivals meanwhile."""
    clock = VirtualClock()
    scheduler = Scheduler(config, clock=clock)
    monitor = SLOMonitor(config, scheduler.ttft_predictor, clock) if config.scheduling_policy == "slo" else None
    rng = random.Random(seed)
    requests: list[tuple[Request, Tier]] = []
    for index, arrival in enumerate(workload):
        prompt = [rng.randrange(32000) for _ in range(arrival.prompt_tokens)]  # no accidental prefix sharing
        params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(f"{arrival.tier.name}-{index}", prompt, params, arrival_time=arrival.arrival_s,
                          priority=arrival.tier.priority,
                          ttft_deadline=arrival.arrival_s + arrival.tier.ttft_slo_ms / 1000.0)
        requests.append((request, arrival.tier))
    max_abort_layer = int(config.slo_abort_max_layer_fraction * NUM_LAYERS)
    next_arrival = 0
    discarded_s = 0.0
    generated = 0
    while next_arrival < len(requests) or scheduler.has_unfinished_requests():
        while next_arrival < len(requests) and requests[next_arrival][0].arrival_time <= clock.now:
            scheduler.add_request(requests[next_arrival][0])
            next_arrival += 1
        if not scheduler.has_unfinished_requests():
            clock.now = requests[next_arrival][0].arrival_time
            continue
        output = scheduler.schedule()
        step_start, step_s = clock.now, cost.step_time_s(output, config.block_size)
        aborted_at = None
        if monitor is not None:
            aborted_at = _monitor_during_step(monitor, scheduler, output, requests, next_arrival, step_start, step_s,
                                              max_abort_layer)
        if aborted_at is not None:
            layer, victim = aborted_at
            clock.now = step_start + layer * step_s / NUM_LAYERS
            discarded_s += clock.now - step_start
            scheduler.abort_step(output, victim, layer)
            continue
        clock.now = step_start + step_s
        updates = scheduler.update(output, {entry.request.request_id: FAKE_TOKEN_ID
                                            for entry in output.scheduled if entry.samples})
        generated += len(updates)

    met = {tier.name: [0, 0] for tier in TIERS}
    for request, tier in requests:
        met[tier.name][1] += 1
        if request.first_token_time - request.arrival_time <= tier.ttft_slo_ms / 1000.0:
            met[tier.name][0] += 1
    counters = scheduler.counters
    return RunStats(
        attainment={name: hits / total if total else math.nan for name, (hits, total) in met.items()},
        throughput_tps=generated / clock.now,
        makespan_s=clock.now,
        aborted_steps=counters.slo_preemptions,
        discarded_s=discarded_s,
        recomputed_tokens=counters.recomputed_tokens,
        memory_preemptions=counters.preemptions,
    )


def _monitor_during_step(monitor, scheduler, output, requests, next_arrival, step_start, step_s, max_abort_layer):
    """The monitor's checks, every interval of the step's virtual time; returns (layer, victim)
    when one aborts the pass (at the next layer boundary), else None."""
    clock = scheduler.clock
    monitor.publish_step(scheduler.slo_snapshot(output))
    layer_s = step_s / NUM_LAYERS
    arrivals: list[SLOView] = []
    check_at = step_start + monitor.interval_s
    try:
        while check_at < step_start + step_s:
            clock.now = check_at
            while (next_arrival + len(arrivals) < len(requests)
                   and requests[next_arrival + len(arrivals)][0].arrival_time <= check_at):
                arrivals.append(SLOView.of(requests[next_arrival + len(arrivals)][0]))
            monitor.publish_arrivals(tuple(arrivals))
            order = monitor.check()
            if order is not None:
                layer = math.ceil((check_at - step_start) / layer_s)
                # Past the stubbornness limit the pass refuses; the order stays for this step only.
                return (layer, order.victim_request_id) if layer <= max_abort_layer else None
            check_at += monitor.interval_s
        return None
    finally:
        clock.now = step_start
        monitor.publish_step(None)
        monitor.publish_arrivals(())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer loads")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed-ms", type=float, default=5.0)
    parser.add_argument("--per-batched-token-ms", type=float, default=0.035)
    parser.add_argument("--per-kv-token-read-ms", type=float, default=0.00005)
    args = parser.parse_args()
    cost = CostModel(args.fixed_ms, args.per_batched_token_ms, args.per_kv_token_read_ms)
    duration_s = 60.0 if args.quick else args.duration_s
    loads = (2.0, 4.0, 6.0, 7.0, 8.0, 9.0) if args.quick else (2.0, 4.0, 5.0, 6.0, 6.5, 7.0, 7.5, 8.0, 9.0, 10.0)
    base = dict(max_model_len=8192 + 256 + 1, num_kv_blocks=8192, max_num_batched_tokens=2048, max_num_seqs=128)

    print(f"step time = {cost.fixed_ms} ms + {cost.per_batched_token_ms} ms/batched token + "
          f"{cost.per_kv_token_read_ms} ms/KV token read; {NUM_LAYERS} layers; budget "
          f"{base['max_num_batched_tokens']} tokens; {duration_s:.0f} s of arrivals per run")
    print("tiers: " + "; ".join(f"{t.name} TTFT SLO {t.ttft_slo_ms:.0f} ms, prompts {t.prompt_tokens}, "
                                f"outputs {t.output_tokens}, {t.share:.0%}" for t in TIERS))
    header = (f"{'load rps':>8} {'policy':>8} {'urgent':>7} {'relaxed':>7} {'tok/s':>8} "
              f"{'aborts':>6} {'discard s':>9} {'waste':>6} {'recomp tok':>10} {'mem preempt':>11}")
    print(header)
    rows: dict[float, dict[str, RunStats]] = {}
    for load in loads:
        workload = make_workload(load, duration_s, args.seed)
        rows[load] = {}
        for policy in POLICIES:
            config = make_engine_config(scheduling_policy=policy, **base)
            stats = simulate(config, cost, workload, args.seed)
            rows[load][policy] = stats
            print(f"{load:>8.1f} {policy:>8} {stats.attainment['urgent']:>7.1%} {stats.attainment['relaxed']:>7.1%} "
                  f"{stats.throughput_tps:>8.0f} {stats.aborted_steps:>6} {stats.discarded_s:>9.2f} "
                  f"{stats.discarded_s / stats.makespan_s:>6.1%} "
                  f"{stats.recomputed_tokens:>10} {stats.memory_preemptions:>11}", flush=True)

    load = min(loads, key=lambda l: abs(rows[l]["fcfs"].attainment["urgent"] - 0.5))
    fcfs, slo = rows[load]["fcfs"], rows[load]["slo"]
    urgent_ratio = slo.attainment["urgent"] / fcfs.attainment["urgent"] if fcfs.attainment["urgent"] else math.inf
    throughput_loss = 1.0 - slo.throughput_tps / fcfs.throughput_tps
    relaxed_delta_pts = 100.0 * (slo.attainment["relaxed"] - fcfs.attainment["relaxed"])
    met = urgent_ratio >= 1.5 and throughput_loss <= 0.05 and relaxed_delta_pts >= -5.0
    print(f"\nat {load} rps fcfs urgent attainment is {fcfs.attainment['urgent']:.1%} (closest to 50%):")
    print(f"  urgent attainment slo / fcfs = {urgent_ratio:.2f}x (target >= 1.5x)")
    print(f"  throughput loss = {throughput_loss:.1%} (target <= 5%)")
    print(f"  relaxed attainment slo - fcfs = {relaxed_delta_pts:+.1f} pts (target >= -5)")
    print(f"target: {'MET' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
