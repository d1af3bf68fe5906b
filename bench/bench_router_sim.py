"""Discrete-event cluster simulation for the routing policies: R real Schedulers (with their
KV cache managers) step on virtual timelines under a step-time cost model, and each policy
routes from the ReplicaLoad snapshots it would really see (every 100 ms, optionally late or lost).

    python bench/bench_router_sim.py [--quick] [--seeds N] [--trace PATH] [--plot PATH]

The tables run one seed; the target point (mixed_long at 85% load) is rerun over --seeds
workload seeds and the targets are checked on the means, since one seed's preemption count
is small-number statistics.

Trace replay: Azure Public Dataset, Azure LLM inference trace 2023 (conversation), Patel et
al., "Splitwise", ISCA 2024; CC-BY 4.0. Read from --trace, never copied into the repository.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from cluster.trace import DEFAULT_TRACE_PATH, read_trace
from protos.headroom_pb2 import ReplicaLoad
from replica.config import EngineConfig, make_engine_config
from replica.engine import StepStats
from replica.grpc_service import DEFAULT_WATCH_INTERVAL_MS
from replica.load_report import LoadReportBuilder
from replica.request import Request, SamplingParams
from replica.scheduler import Scheduler, SchedulerOutput
from router.inflight import InflightTracker
from router.policies import ReplicaView, RoutingPolicy, RoutingRequest, make_policy

TRACE_ATTRIBUTION = (
    "Azure Public Dataset, Azure LLM inference trace 2023, Patel et al., Splitwise, ISCA 2024 (CC-BY 4.0)"
)
BASELINES = ("round_robin", "pow2", "least_loaded")
POLICY_NAMES = ("headroom",) + BASELINES
ORACLE = "oracle"  # a reference row at the target point, see CommittedMemoryOracle
WORKLOADS = ("chat", "mixed_long", "long_output", "azure_trace")
LOADS = (0.50, 0.70, 0.85, 0.95)
# Goodput SLO, from the issue.
TTFT_SLO_S = 2.0
TPOT_SLO_S = 0.100
REPORT_INTERVAL_S = DEFAULT_WATCH_INTERVAL_MS / 1000  # what WatchLoad pushes by default
FOCUS = ("mixed_long", 0.85)  # the target point
LATE_STATS = "headroom, stats 500 ms late"  # the stale-stats target's run, in the per-seed results
WARMUP_FRACTION = 0.10  # the first arrivals find an empty cluster; their latencies are not counted
FAKE_TOKEN_ID = 7  # the model is not simulated: every step samples this token (ignore_eos)


@dataclass(frozen=True)
class CostModel:
    """step_time = fixed + per_batched_token * tokens + per_kv_token_read * context tokens read."""

    fixed_ms: float
    per_batched_token_ms: float
    per_kv_token_read_ms: float

    def step_time_s(self, output: SchedulerOutput) -> float:
        # Attention reads the KV of every position up to the end of each scheduled chunk.
        context_tokens_read = sum(entry.start_pos + entry.num_new_tokens for entry in output.scheduled)
        return (
            self.fixed_ms
            + self.per_batched_token_ms * output.num_scheduled_tokens
            + self.per_kv_token_read_ms * context_tokens_read
        ) / 1000.0


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class StatsFeed:
    """How snapshots reach the router: `delay_s` late, a `drop_fraction` of them never."""

    delay_s: float = 0.0
    drop_fraction: float = 0.0

    @property
    def label(self) -> str:
        if self.drop_fraction:
            return f"{self.drop_fraction:.0%} of updates dropped"
        return f"stats delayed {self.delay_s * 1000:.0f} ms" if self.delay_s else "fresh stats"


@dataclass(frozen=True)
class RunStats:
    num_requests: int  # measured (after warm-up)
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p99_s: float
    preemptions_per_1k: float
    recomputed_fraction: float  # recomputed tokens / all tokens the engines computed
    goodput_rps: float


# ---- workloads ---------------------------------------------------------------------------
def workload_shapes(name: str, num_requests: int, seed: int, trace_path: str) -> tuple[list[tuple[int, int]], list[float]]:
    """(prompt_tokens, max_tokens) per request and unit-rate inter-arrival gaps (mean 1 s).

    Sizes and gaps depend only on the seed, so every policy and load sees the same requests;
    a load only rescales the gaps.
    """
    rng = random.Random(f"{seed}:{name}")
    if name == "azure_trace":
        return trace_shapes(trace_path, num_requests)
    shapes = []
    for _ in range(num_requests):
        if name == "chat":
            shapes.append((rng.randint(64, 1024), rng.randint(64, 512)))
        elif name == "mixed_long":
            if rng.random() < 0.10:
                shapes.append((rng.randint(8192, 16384), rng.randint(64, 512)))
            else:
                shapes.append((rng.randint(64, 1024), rng.randint(64, 512)))
        elif name == "long_output":
            shapes.append((rng.randint(64, 512), rng.randint(512, 2048)))
        else:
            raise ValueError(f"workload: unknown {name!r}; expected one of {WORKLOADS}")
    gaps = [rng.expovariate(1.0) for _ in range(num_requests)]  # Poisson arrivals
    return shapes, gaps


def trace_shapes(trace_path: str, num_requests: int) -> tuple[list[tuple[int, int]], list[float]]:
    """The trace's first requests: their sizes, and their real inter-arrival gaps scaled to mean 1 s."""
    try:
        requests = read_trace(trace_path, num_requests)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    stamps = [request.arrival_s for request in requests]
    gaps = [0.0] + [max(0.0, later - earlier) for earlier, later in zip(stamps, stamps[1:])]
    mean_gap = sum(gaps) / max(len(gaps) - 1, 1)
    return [(r.prompt_tokens, r.output_tokens) for r in requests], [gap / mean_gap for gap in gaps]


def arrivals(shapes: list[tuple[int, int]], gaps: list[float], rate_rps: float) -> list[WorkloadRequest]:
    clock = 0.0
    requests = []
    for (prompt_tokens, max_tokens), gap in zip(shapes, gaps):
        clock += gap / rate_rps
        requests.append(WorkloadRequest(clock, prompt_tokens, max_tokens))
    return requests


def make_request(index: int, spec: WorkloadRequest) -> Request:
    # The first tokens encode the index, so no two prompts share a prefix-cache block.
    prompt = [1 + index % 30000, 1 + index // 30000] + [FAKE_TOKEN_ID] * (spec.prompt_tokens - 2)
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    return Request(f"r{index}", prompt[: spec.prompt_tokens], params, arrival_time=spec.arrival_s)


# ---- the cluster -------------------------------------------------------------------------
class SimReplica:
    """One engine on its own virtual timeline, and the ReplicaLoad reports it publishes:
    built by the replica's own LoadReportBuilder, on the virtual clock."""

    def __init__(self, replica_id: str, config: EngineConfig):
        self.replica_id = replica_id
        self.now = 0.0
        self.scheduler = Scheduler(config, clock=lambda: self.now)
        self.step_stats = StepStats()  # observed after every step, as LLMEngine does
        self.load_reports = LoadReportBuilder(
            replica_id, self.step_stats, monotonic_clock=lambda: self.now, wall_clock=lambda: self.now
        )
        self.busy = False

    def report(self, now: float) -> ReplicaLoad:
        """What this replica's WatchLoad stream would send at `now`."""
        self.now = now
        return self.load_reports.build(self.scheduler.load())


class CommittedMemoryOracle(RoutingPolicy):
    """Reference only, not deployable: reads every replica's exact committed KV demand
    (prompt + max_tokens of each live request) exactly, instantly and in tokens, straight from
    its scheduler (ReplicaLoad.kv_committed_tokens carries it in whole blocks, up to a report
    interval late), and picks the least committed. It bounds what better load
    reports could buy."""

    name = "oracle"

    def __init__(self, replicas: list[SimReplica]):
        self.schedulers = {replica.replica_id: replica.scheduler for replica in replicas}

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        def committed_tokens(view: ReplicaView) -> int:
            live = self.schedulers[view.replica_id].requests.values()
            return sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in live)

        return [view.replica_id for view in sorted(replicas, key=committed_tokens)]


class ClusterSim:
    """Events on one heap: arrivals, step completions, load reports taken and delivered."""

    ARRIVAL, STEP_DONE, REPORT, DELIVER = range(4)

    def __init__(self, config: EngineConfig, num_replicas: int, cost: CostModel, feed: StatsFeed, seed: int):
        self.config = config
        self.num_replicas = num_replicas
        self.cost = cost
        self.feed = feed
        self.seed = seed

    def run(self, policy_name: str, workload: list[WorkloadRequest]) -> RunStats:
        rng = random.Random(f"{self.seed}:{policy_name}")
        feed_rng = random.Random(f"{self.seed}:feed")  # same drops for every policy
        replicas = [SimReplica(f"replica-{i}", self.config) for i in range(self.num_replicas)]
        policy = CommittedMemoryOracle(replicas) if policy_name == ORACLE else make_policy(policy_name, rng)
        latest_load: list[Optional[ReplicaLoad]] = [None] * self.num_replicas
        inflight = InflightTracker()
        events: list[tuple] = []
        tiebreak = itertools.count()

        def push(at: float, kind: int, *payload) -> None:
            heapq.heappush(events, (at, next(tiebreak), kind, payload))

        def start_step(index: int, now: float) -> None:
            replica = replicas[index]
            replica.now = now
            for _ in range(3):  # a step that only preempts schedules nothing; the next one admits
                output = replica.scheduler.schedule()
                if not output.is_empty:
                    step_s = self.cost.step_time_s(output)
                    replica.busy = True
                    push(now + step_s, self.STEP_DONE, index, output, step_s)
                    return
                if not replica.scheduler.has_unfinished_requests():
                    break
            else:
                raise RuntimeError(f"{replica.replica_id} has requests but schedules nothing")
            replica.busy = False

        requests = [make_request(i, spec) for i, spec in enumerate(workload)]
        for index, spec in enumerate(workload):
            push(spec.arrival_s, self.ARRIVAL, index)
        for index in range(self.num_replicas):
            push(rng.uniform(0, REPORT_INTERVAL_S), self.REPORT, index)
        num_warmup = int(len(requests) * WARMUP_FRACTION)
        measured_from_s = workload[num_warmup].arrival_s
        inter_token_gaps: list[float] = []
        num_unfinished = len(requests)

        while events and num_unfinished:
            now, _, kind, payload = heapq.heappop(events)
            if kind == self.ARRIVAL:
                (request_index,) = payload
                request = requests[request_index]
                routing_request = RoutingRequest(request.num_prompt_tokens, request.sampling_params.max_tokens)
                views = [
                    ReplicaView(
                        replica.replica_id,
                        latest_load[i],
                        now - latest_load[i].timestamp if latest_load[i] is not None else math.inf,
                        len(replica.scheduler.requests),
                        inflight.counts(replica.replica_id),
                    )
                    for i, replica in enumerate(replicas)
                ]
                target_id = policy.rank(routing_request, views)[0]
                target = next(i for i, replica in enumerate(replicas) if replica.replica_id == target_id)
                inflight.record_sent(target_id, routing_request.num_blocks(self.config.block_size), now)
                replicas[target].now = now
                replicas[target].scheduler.add_request(request)
                if not replicas[target].busy:
                    start_step(target, now)
            elif kind == self.STEP_DONE:
                index, output, step_s = payload
                replica = replicas[index]
                replica.now = now
                for entry in output.scheduled:
                    request = entry.request
                    if entry.samples and request.last_token_time is not None and request.arrival_time >= measured_from_s:
                        inter_token_gaps.append(now - request.last_token_time)
                sampled = {entry.request.request_id: FAKE_TOKEN_ID for entry in output.scheduled if entry.samples}
                for update in replica.scheduler.update(output, sampled):
                    if update.finished is not None:
                        num_unfinished -= 1
                replica.step_stats.observe(step_s, len(sampled))
                start_step(index, now)
            elif kind == self.REPORT:
                (index,) = payload
                load = replicas[index].report(now)
                if feed_rng.random() >= self.feed.drop_fraction:
                    push(now + self.feed.delay_s, self.DELIVER, index, load)
                push(now + REPORT_INTERVAL_S, self.REPORT, index)
            else:  # DELIVER
                index, load = payload
                if inflight.observe_snapshot(load.replica_id, load.seq, load.timestamp):
                    latest_load[index] = load

        return summarize(requests[num_warmup:], inter_token_gaps, [r.scheduler for r in replicas], len(requests))


def summarize(measured: list[Request], inter_token_gaps: list[float], schedulers: list[Scheduler], num_requests: int) -> RunStats:
    ttfts = np.array([r.first_token_time - r.arrival_time for r in measured])
    tpots = np.array([
        (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else 0.0
        for r in measured
    ])
    good = int(np.sum((ttfts <= TTFT_SLO_S) & (tpots <= TPOT_SLO_S)))
    window_s = measured[-1].arrival_time - measured[0].arrival_time
    preemptions = sum(s.counters.preemptions for s in schedulers)
    recomputed = sum(s.counters.recomputed_tokens for s in schedulers)
    computed = sum(s.counters.scheduled_tokens for s in schedulers)
    return RunStats(
        num_requests=len(measured),
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        itl_p99_s=float(np.percentile(inter_token_gaps, 99)) if inter_token_gaps else 0.0,
        preemptions_per_1k=1000.0 * preemptions / num_requests,
        recomputed_fraction=recomputed / computed if computed else 0.0,
        goodput_rps=good / window_s if window_s > 0 else 0.0,
    )


def measure_saturation_rps(config: EngineConfig, cost: CostModel, shapes: list[tuple[int, int]], num_replicas: int) -> float:
    """Cluster capacity in requests/s: one replica's throughput with an always-full queue
    (every request arrives at once), times the replica count; perfect balance is the ceiling."""
    replica = SimReplica("saturation", config)
    scheduler = replica.scheduler
    for index, (prompt_tokens, max_tokens) in enumerate(shapes):
        scheduler.add_request(make_request(index, WorkloadRequest(0.0, prompt_tokens, max_tokens)))
    finish_times = []
    now = 0.0
    while scheduler.has_unfinished_requests():
        replica.now = now
        output = scheduler.schedule()
        if output.is_empty:
            continue
        now += cost.step_time_s(output)
        replica.now = now
        sampled = {entry.request.request_id: FAKE_TOKEN_ID for entry in output.scheduled if entry.samples}
        finish_times += [now for update in scheduler.update(output, sampled) if update.finished is not None]
    # The middle 80% of completions: the start ramps up and the end drains a short queue.
    first, last = int(0.1 * len(finish_times)), int(0.9 * len(finish_times))
    return num_replicas * (last - first) / (finish_times[last] - finish_times[first])


# ---- report ------------------------------------------------------------------------------
def format_row(workload: str, load: float, policy: str, stats: RunStats, condition: str = "") -> str:
    cells = [workload, f"{load:.0%}"] + ([condition] if condition else []) + [
        policy,
        f"{stats.ttft_p50_s:.3f}",
        f"{stats.ttft_p99_s:.3f}",
        f"{stats.itl_p99_s * 1000:.1f}",
        f"{stats.preemptions_per_1k:.1f}",
        f"{stats.recomputed_fraction:.2%}",
        f"{stats.goodput_rps:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


METRIC_HEADER = "policy | TTFT p50 s | TTFT p99 s | ITL p99 ms | preempt/1k req | recomputed | goodput req/s |"


def target_line(description: str, ratio: float, limit: float, at_most: bool) -> str:
    met = ratio <= limit if at_most else ratio >= limit
    bound = "<=" if at_most else ">="
    return f"- {description}: {ratio:.2f}x (target {bound} {limit}x) {'MET' if met else 'MISSED'}"


def ratio(ours: float, theirs: float) -> float:
    if theirs == 0:
        return 0.0 if ours == 0 else math.inf
    return ours / theirs


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


# The focus-point metrics the targets compare, and whether lower is better.
TARGET_METRICS = {"preemptions_per_1k": True, "ttft_p99_s": True, "goodput_rps": False}


def check_targets(results: dict, per_seed: dict[str, list[RunStats]]) -> list[str]:
    """The issue's targets. Focus-point ones compare means over seeds (each baseline's mean;
    the best of those is the reference) and quote the range of the per-seed ratios."""
    lines = []
    workload, load = FOCUS
    num_seeds = len(per_seed["headroom"])
    lines.append(f"Targets (issue 5), on {workload} at {load:.0%} load (means over {num_seeds} seed(s)):")

    def compare(metric: str, limit: float, label: str, fmt: str, unit: str) -> str:
        lower_is_better = TARGET_METRICS[metric]
        pick = min if lower_is_better else max
        means = {name: mean_spread([getattr(s, metric) for s in per_seed[name]])[0] for name in BASELINES}
        best = pick(means, key=means.get)
        ours = mean_spread([getattr(s, metric) for s in per_seed["headroom"]])[0]
        per_seed_ratios = [
            ratio(getattr(mine, metric), pick(getattr(per_seed[name][i], metric) for name in BASELINES))
            for i, mine in enumerate(per_seed["headroom"])
        ]
        spread = f", per seed {min(per_seed_ratios):.2f}-{max(per_seed_ratios):.2f}x" if num_seeds > 1 else ""
        return target_line(f"{label} {ours:{fmt}}{unit} vs best baseline {means[best]:{fmt}}{unit} ({best}){spread}",
                           ratio(ours, means[best]), limit, lower_is_better)

    lines.append(compare("preemptions_per_1k", 0.5, "preemptions/1k", ".1f", ""))
    lines.append(compare("ttft_p99_s", 0.7, "p99 TTFT", ".3f", " s"))
    lines.append(compare("goodput_rps", 1.15, "goodput", ".2f", " req/s"))
    if LATE_STATS in per_seed:
        late = mean_spread([s.ttft_p99_s for s in per_seed[LATE_STATS]])[0]
        fresh = mean_spread([s.ttft_p99_s for s in per_seed["headroom"]])[0]
        lines.append(target_line(f"p99 TTFT with stats 500 ms late {late:.3f} s vs fresh {fresh:.3f} s",
                                 ratio(late, fresh), 1.10, True))
    worst = max(
        ((ratio(results[(w, l, "headroom")].ttft_p99_s, results[(w, l, "pow2")].ttft_p99_s), w, l)
         for (w, l, p) in results if p == "headroom"),
    )
    lines.append(target_line(
        f"worst p99 TTFT vs pow2 over every workload and load, one seed ({worst[1]} at {worst[2]:.0%})",
        worst[0], 1.05, True))
    return lines


def save_plot(results: dict, workloads: list[str], loads: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(workloads), figsize=(4 * len(workloads), 7), squeeze=False)
    for column, workload in enumerate(workloads):
        for policy in POLICY_NAMES:
            points = [results[(workload, load, policy)] for load in loads]
            percents = [100 * load for load in loads]
            axes[0][column].plot(percents, [s.ttft_p99_s for s in points], marker="o", label=policy)
            axes[1][column].plot(percents, [s.preemptions_per_1k for s in points], marker="o", label=policy)
        axes[0][column].set_title(workload)
        axes[0][column].set_yscale("log")
        axes[0][column].set_ylabel("p99 TTFT (s)")
        axes[1][column].set_ylabel("preemptions / 1k requests")
        axes[1][column].set_xlabel("load (% of saturation)")
    axes[0][0].legend()
    figure.suptitle("headroom router simulation (trace: " + TRACE_ATTRIBUTION + ")", fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- entry point -------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small runs for a smoke test (seconds)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default 3000; 120 with --quick); long_output runs use 40%%")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tables; the first of --seeds")
    parser.add_argument("--seeds", type=int, default=None,
                        help="workload seeds run at the target point (default 5; 1 with --quick)")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE_PATH), help="Azure LLM 2023 conversation trace CSV")
    parser.add_argument("--plot", default="bench/out/router_sim.png")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default=",".join(str(load) for load in LOADS),
                        help="fractions of measured saturation")
    # An 8B-class model on one H100-class GPU, to an order of magnitude: ~5 ms of weight
    # reads per step, ~30k prefill tokens/s, 128 KiB of KV per token at ~3 TB/s.
    parser.add_argument("--fixed-ms", type=float, default=5.0)
    parser.add_argument("--per-batched-token-ms", type=float, default=0.035)
    parser.add_argument("--per-kv-token-read-ms", type=float, default=0.00005)
    parser.add_argument("--num-kv-blocks", type=int, default=3073,
                        help="KV pool per replica incl. the null block (default: 3072 x 16 = 49k tokens)")
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 120 if args.quick else 3000
    if args.seeds is None:
        args.seeds = 1 if args.quick else 5
    if args.seeds < 1:
        parser.error("--seeds: need at least 1")
    if args.requests < 20:
        parser.error("--requests: need at least 20 for percentiles to mean anything")
    args.workloads = args.workloads.split(",")
    for workload in args.workloads:
        if workload not in WORKLOADS:
            parser.error(f"--workloads: unknown {workload!r}; expected some of {','.join(WORKLOADS)}")
    args.loads = [float(load) for load in args.loads.split(",")]
    return args


def engine_config(num_kv_blocks: int) -> EngineConfig:
    # vLLM defaults (block 16, chunked prefill, prefix caching, FCFS, watermark 0) with a
    # 2048-token step budget, and room for a 16k prompt plus its output.
    return make_engine_config(
        block_size=16, num_kv_blocks=num_kv_blocks, max_model_len=20480, max_num_batched_tokens=2048, max_num_seqs=256
    )


def requests_for(workload: str, num_requests: int) -> int:
    # Decode-heavy requests take ~4x longer each; fewer of them keep the run's wall time even.
    return max(20, int(num_requests * 0.4)) if workload == "long_output" else num_requests


def run_benchmark(args: argparse.Namespace, out=sys.stdout) -> dict:
    """Runs every workload x load x policy, the stale-stats runs and the target point over
    seeds, prints the report; returns {"results": {(workload, load, policy): RunStats},
    "stale": {(condition, policy): RunStats}, "seeds": {policy: [RunStats per seed]}}."""
    started = time.perf_counter()
    config = engine_config(args.num_kv_blocks)
    cost = CostModel(args.fixed_ms, args.per_batched_token_ms, args.per_kv_token_read_ms)
    print("# Router simulation benchmark", file=out)
    print(f"{args.replicas} replicas; engine: block {config.block_size}, {config.num_usable_blocks} KV blocks "
          f"({config.num_usable_blocks * config.block_size} tokens), max_num_batched_tokens "
          f"{config.max_num_batched_tokens}, max_num_seqs {config.max_num_seqs}, max_model_len {config.max_model_len}",
          file=out)
    print(f"step time = {cost.fixed_ms} ms + {cost.per_batched_token_ms} ms/batched token + "
          f"{cost.per_kv_token_read_ms} ms/KV token read (assumed; calibrate with bench/bench_engine.py)", file=out)
    print(f"loads every {REPORT_INTERVAL_S * 1000:.0f} ms, stale after 1 s; goodput SLO: TTFT <= {TTFT_SLO_S} s and "
          f"TPOT <= {TPOT_SLO_S * 1000:.0f} ms; seed {args.seed}; first {WARMUP_FRACTION:.0%} of arrivals not measured",
          file=out)
    print(f"trace: {args.trace} -- {TRACE_ATTRIBUTION}", file=out)

    fresh = StatsFeed()
    results: dict = {}
    saturation_by_workload = {}
    for workload in args.workloads:
        num_requests = requests_for(workload, args.requests)
        shapes, gaps = workload_shapes(workload, num_requests, args.seed, args.trace)
        saturation = measure_saturation_rps(config, cost, shapes, args.replicas)
        print(f"\n## {workload}: {num_requests} requests per run, saturation {saturation:.2f} req/s", file=out)
        print("| workload | load | " + METRIC_HEADER, file=out)
        print("|---" * 9 + "|", file=out)
        for load in args.loads:
            workload_requests = arrivals(shapes, gaps, load * saturation)
            for policy in POLICY_NAMES:
                stats = ClusterSim(config, args.replicas, cost, fresh, args.seed).run(policy, workload_requests)
                results[(workload, load, policy)] = stats
                print(format_row(workload, load, policy, stats), file=out, flush=True)
        saturation_by_workload[workload] = (shapes, gaps, saturation)

    stale_results: dict = {}
    per_seed: dict[str, list[RunStats]] = {}
    workload, load = FOCUS
    if workload in args.workloads:
        shapes, gaps, saturation = saturation_by_workload[workload]
        workload_requests = arrivals(shapes, gaps, load * saturation)
        print(f"\n## Stale stats: {workload} at {load:.0%} load", file=out)
        print("round_robin and pow2 read no load reports, so their rows above hold under every condition.", file=out)
        print("| workload | load | condition | " + METRIC_HEADER, file=out)
        print("|---" * 10 + "|", file=out)
        for feed in (StatsFeed(delay_s=0.1), StatsFeed(delay_s=0.5), StatsFeed(delay_s=2.0), StatsFeed(drop_fraction=0.05)):
            for policy in ("headroom", "least_loaded"):
                stats = ClusterSim(config, args.replicas, cost, feed, args.seed).run(policy, workload_requests)
                stale_results[(feed.label, policy)] = stats
                print(format_row(workload, load, policy, stats, feed.label), file=out, flush=True)
        per_seed = run_seeds(args, config, cost, results, stale_results, out)

    print("", file=out)
    if per_seed:
        for line in check_targets(results, per_seed):
            print(line, file=out)
    else:
        print(f"Targets need the {workload} workload in the run; not checked.", file=out)
    if args.plot:
        save_plot(results, args.workloads, args.loads, args.plot)
        print(f"\nplot: {args.plot}", file=out)
    print(f"wall time {time.perf_counter() - started:.0f} s", file=out)
    return {"results": results, "stale": stale_results, "seeds": per_seed}


def run_seeds(args: argparse.Namespace, config: EngineConfig, cost: CostModel, results: dict, stale_results: dict,
              out) -> dict[str, list[RunStats]]:
    """Every policy, the oracle and headroom with 500 ms late stats at the target point, once
    per seed (each seed draws its own requests, gaps and saturation); prints mean and spread.
    The tables' seed reuses their runs. Returns {policy or LATE_STATS: [RunStats per seed]}."""
    workload, load = FOCUS
    late = StatsFeed(delay_s=0.5)
    runs = {name: [] for name in POLICY_NAMES + (ORACLE, LATE_STATS)}
    saturations, ceilings = [], []
    for seed in range(args.seed, args.seed + args.seeds):
        shapes, gaps = workload_shapes(workload, requests_for(workload, args.requests), seed, args.trace)
        saturation = measure_saturation_rps(config, cost, shapes, args.replicas)
        saturations.append(saturation)
        workload_requests = arrivals(shapes, gaps, load * saturation)
        measured = workload_requests[int(len(workload_requests) * WARMUP_FRACTION):]
        # Goodput counts requests over this window, so no policy can beat every request's rate.
        ceilings.append(len(measured) / (measured[-1].arrival_s - measured[0].arrival_s))
        for name in runs:
            reused = results.get((workload, load, name)) if name != LATE_STATS else stale_results.get((late.label, "headroom"))
            if seed == args.seed and reused is not None:
                runs[name].append(reused)
                continue
            feed = late if name == LATE_STATS else StatsFeed()
            policy = "headroom" if name == LATE_STATS else name
            runs[name].append(ClusterSim(config, args.replicas, cost, feed, seed).run(policy, workload_requests))

    print(f"\n## Seeds: {workload} at {load:.0%} load, seeds {args.seed}-{args.seed + args.seeds - 1}", file=out)
    print(f"Mean ± sample standard deviation over {args.seeds} seed(s); saturation per seed "
          + ", ".join(f"{rps:.2f}" for rps in saturations) + " req/s; goodput ceiling (every measured request "
          "good) " + ", ".join(f"{rps:.2f}" for rps in ceilings) + " req/s. "
          f"{ORACLE}: reference, not deployable (least exact committed KV, read from the schedulers).", file=out)
    print("| policy | TTFT p50 s | TTFT p99 s | preempt/1k req | recomputed | goodput req/s |", file=out)
    print("|---" * 6 + "|", file=out)
    for name, stats in runs.items():
        cells = [name]
        for metric, scale, fmt in (("ttft_p50_s", 1, ".3f"), ("ttft_p99_s", 1, ".3f"), ("preemptions_per_1k", 1, ".1f"),
                                   ("recomputed_fraction", 100, ".2f"), ("goodput_rps", 1, ".2f")):
            mean, spread = mean_spread([getattr(s, metric) * scale for s in stats])
            cells.append(f"{mean:{fmt}} ± {spread:{fmt}}" + ("%" if scale == 100 else ""))
        print("| " + " | ".join(cells) + " |", file=out, flush=True)
    return runs


def main(argv: Optional[list[str]] = None) -> None:
    run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
