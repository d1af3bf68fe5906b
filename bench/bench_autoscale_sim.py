"""Autoscaling simulation (issue 25): the replica set changes over time, driven by either
autoscaling policy on the same arrivals, so the two compare on replica-seconds used,
preemptions per 1k requests, p99 TTFT and goodput.

    python bench/bench_autoscale_sim.py [--quick] [--sample-every N] [--compress X] [--trace PATH]

The arrivals are the Azure LLM conversation trace (an hour that rises to a peak and falls
again), every --sample-every'th request, time-compressed --compress times. Replicas are the
router simulation's (bench/bench_router_sim.py): real Schedulers stepping on virtual timelines
under its cost model, routed by the headroom router from 100 ms load reports. Each replica
records its autoscaling stats as the deployment does (cluster/autoscaling.py's
autoscaling_stats for headroom; requests in flight for requests) every record interval;
every control period the policy Serve would run gets an AutoscalingContext of them over
look_back_period_s (raw series and means, as Serve hands them) and the result goes through
Serve's own scaling arithmetic (factors, delays, bounds). A replica added takes --startup-s to serve (and counts from its start); a
replica removed is Serve's choice on one node (one still starting, else the newest), gets no new
requests and counts until its last stream ends.

Both policies run at cluster/config.py's defaults (headroom: target_utilization 0.8,
scale_down_utilization 0.6, preemption threshold 0.5/s, replica_startup_s set to --startup-s
as an operator sets it to their replicas' start time; requests: target_ongoing_requests 32,
the documented default for `policy: requests`; the same delays, look-back and bounds).
Targets (issue 25): headroom <= 0.5x the preemptions per 1k of requests at <= 1.0x its
replica-seconds, and a p99 TTFT at most 5% worse.

Serve's scaling arithmetic is private to ray.serve.autoscaling_policy (its public wrapper
reads the wall clock, which a simulation cannot); this module is the one place that calls
it. Trace: Azure Public Dataset, Azure LLM inference trace 2023 (conversation), Patel et al.,
"Splitwise", ISCA 2024; CC-BY 4.0. Read from --trace, never copied into the repository.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_router_sim, however this file is loaded
from bench_router_sim import (  # noqa: E402
    FAKE_TOKEN_ID, REPORT_INTERVAL_S, TPOT_SLO_S, TRACE_ATTRIBUTION, TTFT_SLO_S, VOCAB, CostModel,
    SimReplica, WorkloadRequest, engine_config, make_request, sampled_last_token, start_replica_step,
)
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue  # noqa: E402
from ray.serve.autoscaling_policy import (  # noqa: E402
    _apply_delay_logic, _apply_scaling_factors, _extract_internal_policy_state,
)
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig  # noqa: E402
from ray.serve.config import AutoscalingContext  # noqa: E402

from cluster.autoscaling import (  # noqa: E402
    POLICY_NAMES, HeadroomAutoscalingPolicy, RequestsAutoscalingPolicy, autoscaling_stats,
)
from cluster.config import AutoscalingConfig  # noqa: E402
from cluster.trace import DEFAULT_TRACE_PATH, read_trace  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.core.request import Request  # noqa: E402
from replica.core.scheduler import SchedulerOutput  # noqa: E402
from router.inflight import InflightCounts, InflightTracker  # noqa: E402
from router.load_subscriber import load_age  # noqa: E402
from router.policies import ReplicaView, RoutingRequest, make_policy  # noqa: E402

OURS, BASELINE = POLICY_NAMES  # headroom, requests
# Serve's control loop runs every 0.1 s; its inputs change only when a replica pushes
# (metrics_interval_s), so deciding every second misses nothing a push could show.
CONTROL_PERIOD_S = 1.0
# Serve records a replica's stats this often within the look-back window (its constant).
RECORD_INTERVAL_FACTOR = 0.2
RUNNING_REQUESTS_STAT = "ongoing_requests"  # the requests policy's input, as Serve counts it per replica
DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="sim")
TARGETS = {"preemptions": 0.5, "replica_seconds": 1.0, "ttft_p99": 1.05}


@dataclass(frozen=True)
class Arrival:
    at_s: float
    spec: WorkloadRequest


def trace_arrivals(trace_path: str, sample_every: int, compress: float, limit: Optional[int]) -> list[Arrival]:
    """Every sample_every'th request of the trace, at its own offset divided by `compress`."""
    try:
        trace = read_trace(trace_path, limit or 10**9)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    seeds = itertools.count(1)
    return [Arrival(request.arrival_s / compress,
                    WorkloadRequest(0.0, request.prompt_tokens, next(seeds), request.output_tokens, request.output_tokens))
            for request in trace[::sample_every]]


@dataclass
class Replica:
    """One replica of the changing set: when it was started (it costs from then), when it
    serves, whether it drains, when it went away; its recorded stats."""

    sim: SimReplica
    started_at: float
    ready_at: float
    replica_id: ReplicaID
    draining: bool = False
    removed_at: Optional[float] = None
    records: deque = field(default_factory=deque)  # (t, {stat: value})

    @property
    def routable(self) -> bool:
        return not self.draining and self.removed_at is None


@dataclass(frozen=True)
class AutoscaleStats:
    num_requests: int
    replica_seconds: float
    mean_replicas: float
    max_replicas: int
    scale_ups: int
    scale_downs: int
    preemptions_per_1k: float
    ttft_p50_s: float
    ttft_p99_s: float
    goodput_rps: float
    duration_s: float


class AutoscaleSim:
    ARRIVAL, STEP_DONE, REPORT, READY, RECORD, CONTROL = range(6)

    def __init__(self, config: EngineConfig, cost: CostModel, autoscaling: AutoscalingConfig, startup_s: float,
                 seed: int, initial_replicas: int):
        self.initial_replicas = initial_replicas
        self.config = config
        self.cost = cost
        self.autoscaling = autoscaling
        self.startup_s = startup_s
        self.seed = seed

    def run(self, policy_name: str, arrivals: list[Arrival], **overrides) -> AutoscaleStats:
        """`policy_name` scaling for `arrivals`, at the config's knobs with `overrides`."""
        autoscaling = AutoscalingConfig(**{**self.autoscaling.model_dump(), "policy": policy_name, **overrides})
        serve_options = autoscaling.serve_autoscaling_config()
        serve_config = ServeAutoscalingConfig(**{key: value for key, value in serve_options.items() if key != "policy"})
        policy = (HeadroomAutoscalingPolicy(**serve_options["policy"]["policy_kwargs"]) if policy_name == OURS
                  else RequestsAutoscalingPolicy())
        look_back_s = serve_config.look_back_period_s
        record_interval_s = min(look_back_s * RECORD_INTERVAL_FACTOR, serve_config.metrics_interval_s)
        router = make_policy("headroom", random.Random(f"{self.seed}:router"))
        block_size = self.config.block_size
        replicas: list[Replica] = []
        latest_load: dict[int, object] = {}
        delivered_at: dict[int, float] = {}  # when each latest_load reached the router (at once)
        inflight = InflightTracker()
        events: list[tuple] = []
        tiebreak = itertools.count()
        live: dict[str, Request] = {}
        spec_of: dict[str, WorkloadRequest] = {}
        finished: list[Request] = []
        target = self.initial_replicas
        policy_state: dict = {}
        scale_ups = scale_downs = 0

        def push(at: float, kind: int, *payload) -> None:
            heapq.heappush(events, (at, next(tiebreak), kind, payload))

        def add_replica(now: float, ready_at: float) -> None:
            index = len(replicas)
            replica = Replica(SimReplica(f"replica-{index}", self.config, self.cost), now, ready_at,
                              ReplicaID(unique_id=f"replica-{index}", deployment_id=DEPLOYMENT))
            replicas.append(replica)
            push(ready_at, self.READY, index)

        def serving(replica: Replica, now: float) -> bool:
            return replica.routable and replica.ready_at <= now

        def start_step(index: int, now: float) -> None:
            if start_replica_step(replicas[index].sim, index, now, self.cost, push, self.STEP_DONE):
                return
            if replicas[index].draining and replicas[index].removed_at is None:
                replicas[index].removed_at = now  # drained: Serve stops it now

        def arrive(arrival: Arrival, request_index: int, now: float) -> None:
            spec = arrival.spec
            prompt = np.random.default_rng(spec.body_seed).integers(3, VOCAB, spec.body_len).tolist()
            request = make_request(request_index, spec, prompt, now)
            routing = RoutingRequest(len(prompt), spec.max_tokens, prompt_token_ids=tuple(prompt))
            candidates = [i for i, replica in enumerate(replicas) if serving(replica, now)]
            views = [
                ReplicaView(replicas[i].sim.replica_id, latest_load.get(i),
                            load_age(latest_load[i], now - delivered_at[i]) if i in latest_load else math.inf,
                            len(replicas[i].sim.scheduler.requests), inflight.counts(replicas[i].sim.replica_id),
                            0, block_size)
                for i in candidates
            ]
            target_id = router.rank(routing, views)[0]
            index = next(i for i in candidates if replicas[i].sim.replica_id == target_id)
            load = latest_load.get(index)
            blocks = routing.expected_blocks(load) if load is not None else routing.num_blocks(block_size)
            send = InflightCounts.one_send(blocks, len(prompt), 0, block_size)
            inflight.record_sent(target_id, send.blocks, now, send.prefill_tokens, request.request_id)
            router.on_routed(routing, target_id, request.request_id, 0)
            request.block_hashes.extend(routing.prefix_hashes(block_size))
            replica = replicas[index].sim
            replica.now = now
            replica.scheduler.add_request(request)
            live[request.request_id] = request
            spec_of[request.request_id] = spec
            if not replica.busy:
                start_step(index, now)

        def step_done(index: int, output: SchedulerOutput, step_s: float, now: float) -> None:
            replica = replicas[index].sim
            replica.now = now
            sampled = {}
            for entry in output.scheduled:
                if entry.samples:
                    request = entry.request
                    spec = spec_of[request.request_id]
                    last = request.num_output_tokens + 1 >= spec.output_tokens
                    sampled[request.request_id] = sampled_last_token(spec) if last else FAKE_TOKEN_ID
                    if request.first_token_time is None:
                        router.on_first_token(request.request_id)
            for update in replica.scheduler.update(output, sampled):
                if update.finished is not None:
                    router.on_finished(update.request.request_id)
                    inflight.record_ended(update.request.request_id, now)  # as the router does
                    finished.append(live.pop(update.request.request_id))
            replica.scheduler.kv_cache.take_kv_events()  # the router here reads no KV events
            replica.step_stats.observe(step_s, len(sampled))
            start_step(index, now)

        def record(index: int, now: float) -> None:
            replica = replicas[index]
            if replica.removed_at is not None:
                return
            report = replica.sim.report(now)
            stats = autoscaling_stats(report) if policy_name == OURS else {}
            stats[RUNNING_REQUESTS_STAT] = float(len(replica.sim.scheduler.requests))
            replica.records.append((now, stats))
            while replica.records and replica.records[0][0] < now - look_back_s:
                replica.records.popleft()
            push(now + record_interval_s, self.RECORD, index)

        def control(now: float) -> None:
            nonlocal target, policy_state, scale_ups, scale_downs
            running = [replica for replica in replicas if replica.routable and replica.ready_at <= now]
            aggregated: dict[str, dict[ReplicaID, float]] = {}
            raw: dict[str, dict[ReplicaID, list[TimeStampedValue]]] = {}
            for replica in running:
                window = [(t, stats) for t, stats in replica.records if t >= now - look_back_s]
                for stat in (window[0][1] if window else {}):
                    aggregated.setdefault(stat, {})[replica.replica_id] = float(np.mean([s[stat] for _, s in window]))
                    raw.setdefault(stat, {})[replica.replica_id] = [TimeStampedValue(t, s[stat]) for t, s in window]
            total_requests = sum(aggregated.get(RUNNING_REQUESTS_STAT, {}).values())
            ctx = AutoscalingContext(
                deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
                current_num_replicas=len(running), target_num_replicas=target,
                running_replicas=[replica.replica_id for replica in running], total_num_requests=total_requests,
                total_queued_requests=0.0, aggregated_metrics=aggregated, raw_metrics=raw,
                capacity_adjusted_min_replicas=autoscaling.min_replicas,
                capacity_adjusted_max_replicas=autoscaling.max_replicas, policy_state=policy_state,
                last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=serve_config,
            )
            desired, user_state = policy(ctx)
            # Serve's wrapper around any policy: scaling factors, then its delays (on its own
            # keys of the previous state, merged into what the policy returned), then bounds.
            desired = _apply_scaling_factors(desired, len(running), serve_config)
            internal = _extract_internal_policy_state(policy_state)
            decided, internal = _apply_delay_logic(max(0, desired), target, serve_config, internal, _now=now)
            policy_state = {**user_state, **internal}
            decided = min(max(decided, autoscaling.min_replicas), autoscaling.max_replicas)
            active = [i for i, replica in enumerate(replicas) if replica.routable]
            if decided > len(active):
                for _ in range(decided - len(active)):
                    add_replica(now, now + self.startup_s)
                scale_ups += 1
            elif decided < len(active):
                # Serve's choice on one node: replicas still starting first, then the newest running
                # ones (across nodes Serve 2.60 also prefers non-head nodes with the fewest replicas).
                by_priority = sorted(active, key=lambda i: (replicas[i].ready_at <= now, -replicas[i].started_at))
                for i in by_priority[: len(active) - decided]:
                    replica = replicas[i]
                    if replica.ready_at > now:
                        replica.removed_at = now  # never served: it just stops
                    else:
                        replica.draining = True
                        if not replica.sim.scheduler.has_unfinished_requests():
                            replica.removed_at = now
                scale_downs += 1
            target = decided
            if len(finished) < len(arrivals):
                push(now + CONTROL_PERIOD_S, self.CONTROL)

        for _ in range(self.initial_replicas):  # Serve's initial_replicas: warm when the trace starts
            add_replica(0.0, 0.0)
        for request_index, arrival in enumerate(arrivals):
            push(arrival.at_s, self.ARRIVAL, arrival, request_index)
        push(CONTROL_PERIOD_S, self.CONTROL)

        now = 0.0
        while events and len(finished) < len(arrivals):
            now, _, kind, payload = heapq.heappop(events)
            if kind == self.ARRIVAL:
                arrive(*payload, now)
            elif kind == self.STEP_DONE:
                step_done(*payload, now)
            elif kind == self.READY:
                (index,) = payload
                if replicas[index].removed_at is None:
                    push(now, self.REPORT, index)
                    push(now, self.RECORD, index)
            elif kind == self.RECORD:
                record(payload[0], now)
            elif kind == self.REPORT:
                (index,) = payload
                if replicas[index].removed_at is None:
                    load = replicas[index].sim.report(now)
                    if inflight.observe_snapshot(load.replica_id, load.seq, load.timestamp):
                        latest_load[index] = load
                        delivered_at[index] = now
                    push(now + REPORT_INTERVAL_S, self.REPORT, index)
            else:
                control(now)
        end = now
        return summarize(finished, replicas, end, scale_ups, scale_downs, len(arrivals))


def summarize(finished: list[Request], replicas: list[Replica], end_s: float, scale_ups: int, scale_downs: int,
              num_requests: int) -> AutoscaleStats:
    ttfts = np.array([r.first_token_time - r.arrival_time for r in finished])
    tpots = np.array([(r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
                      if r.num_output_tokens > 1 else 0.0 for r in finished])
    good = int(np.sum((ttfts <= TTFT_SLO_S) & (tpots <= TPOT_SLO_S)))
    arrivals_window_s = max(r.arrival_time for r in finished) - min(r.arrival_time for r in finished)
    spans = [(replica.started_at, replica.removed_at if replica.removed_at is not None else end_s)
             for replica in replicas]
    replica_seconds = sum(stop - start for start, stop in spans)
    # The most replicas held at once: at some replica's start.
    held_at = [sum(1 for start, stop in spans if start <= at < stop) for at, _ in spans]
    preemptions = sum(replica.sim.scheduler.counters.preemptions for replica in replicas)
    return AutoscaleStats(
        num_requests=len(finished), replica_seconds=replica_seconds, mean_replicas=replica_seconds / end_s,
        max_replicas=max(held_at), scale_ups=scale_ups, scale_downs=scale_downs,
        preemptions_per_1k=1000.0 * preemptions / num_requests,
        ttft_p50_s=float(np.percentile(ttfts, 50)), ttft_p99_s=float(np.percentile(ttfts, 99)),
        goodput_rps=good / arrivals_window_s if arrivals_window_s > 0 else 0.0, duration_s=end_s,
    )


def ratio(ours: float, theirs: float) -> float:
    if theirs == 0:
        return 0.0 if ours == 0 else math.inf
    return ours / theirs


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the trace's first 3,000 requests only")
    parser.add_argument("--limit", type=int, default=None, help="the trace's first N requests only (before sampling)")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE_PATH), help="Azure LLM 2023 conversation trace CSV")
    parser.add_argument("--sample-every", type=int, default=2, help="replay every Nth request of the trace")
    parser.add_argument("--compress", type=float, default=6.0, help="time compression of the trace's arrivals")
    parser.add_argument("--startup-s", type=float, default=30.0,
                        help="seconds from a scale-up decision until the replica serves (model load, warm-up)")
    parser.add_argument("--initial-replicas", type=int, default=3,
                        help="replicas serving when the trace starts (Serve's initial_replicas), for both policies")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-targets", default="16,64",
                        help="reference rows: the requests policy at these target_ongoing_requests too ('' for none)")
    # The router simulation's defaults: an 8B-class model on one H100-class GPU.
    parser.add_argument("--fixed-ms", type=float, default=5.0)
    parser.add_argument("--per-batched-token-ms", type=float, default=0.035)
    parser.add_argument("--per-kv-token-read-ms", type=float, default=0.00005)
    parser.add_argument("--num-kv-blocks", type=int, default=3073,
                        help="KV pool per replica incl. the null block (default: 3072 x 16 = 49k tokens)")
    args = parser.parse_args(argv)
    if args.quick and args.limit is None:
        args.limit = 3000
    if args.limit is not None and args.limit < 10:
        parser.error("--limit: at least 10 requests")
    if args.sample_every < 1 or args.compress <= 0 or args.startup_s < 0:
        parser.error("--sample-every >= 1, --compress > 0 and --startup-s >= 0")
    try:
        args.baseline_targets = [float(target) for target in args.baseline_targets.split(",") if target]
    except ValueError:
        parser.error(f"--baseline-targets: expected numbers separated by commas, got {args.baseline_targets!r}")
    if any(target <= 0 for target in args.baseline_targets):
        parser.error("--baseline-targets: each must be > 0")
    if not 1 <= args.min_replicas <= args.initial_replicas <= args.max_replicas:
        parser.error("--min-replicas <= --initial-replicas <= --max-replicas, all >= 1")
    return args


def run_comparison(args: argparse.Namespace, out=sys.stdout) -> dict[str, AutoscaleStats]:
    """Both policies (and the reference rows) on the same arrivals; prints the report and
    returns each row's stats by its name."""
    started = time.perf_counter()
    arrivals = trace_arrivals(args.trace, args.sample_every, args.compress, args.limit)
    config = engine_config(args.num_kv_blocks)
    cost = CostModel(args.fixed_ms, args.per_batched_token_ms, args.per_kv_token_read_ms)
    # The headroom policy is told how long a replica takes to start, as an operator tells it theirs.
    autoscaling = AutoscalingConfig(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                    replica_startup_s=args.startup_s)
    sim = AutoscaleSim(config, cost, autoscaling, args.startup_s, args.seed, args.initial_replicas)

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    say("# Autoscaling simulation")
    say(f"trace: {args.trace} -- {TRACE_ATTRIBUTION}; 1 in {args.sample_every} requests, time compressed "
        f"{args.compress:g}x: {len(arrivals)} requests over {arrivals[-1].at_s:.0f} s")
    say(f"replicas {args.min_replicas}..{args.max_replicas} ({args.initial_replicas} at the start), "
        f"{args.startup_s:g} s to start; engine: {config.num_usable_blocks * config.block_size} KV tokens, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}, admission {config.admission_mode}; step time = "
        f"{cost.fixed_ms} ms + {cost.per_batched_token_ms} ms/token + {cost.per_kv_token_read_ms} ms/KV token read")
    say(f"autoscaling (cluster/config.py defaults): headroom target_utilization {autoscaling.target_utilization}, "
        f"scale_down_utilization {autoscaling.scale_down_utilization}, preemption_rate_threshold "
        f"{autoscaling.preemption_rate_threshold}/s, replica_startup_s {autoscaling.replica_startup_s:g} "
        f"(--startup-s); requests target_ongoing_requests "
        f"{autoscaling.target_ongoing_requests:g}; both upscale_delay_s {autoscaling.upscale_delay_s:g}, "
        f"downscale_delay_s {autoscaling.downscale_delay_s:g}, look_back_period_s {autoscaling.look_back_period_s:g}, "
        f"metrics_interval_s {autoscaling.metrics_interval_s:g}; goodput SLO TTFT <= {TTFT_SLO_S} s, "
        f"TPOT <= {TPOT_SLO_S * 1000:.0f} ms")
    results = {name: sim.run(name, arrivals) for name in (OURS, BASELINE)}
    # References, not targets: the baseline tuned away from its default.
    for target in args.baseline_targets:
        results[f"{BASELINE} (target_ongoing_requests {target:g})"] = sim.run(
            BASELINE, arrivals, target_ongoing_requests=target)
    say()
    say("policy | replica-seconds | mean replicas | max | scale-ups | scale-downs | preemptions/1k | "
        "TTFT p50 (s) | TTFT p99 (s) | goodput (req/s)")
    say("|".join(["---"] * 10))
    for name, stats in results.items():
        say(f"{name} | {stats.replica_seconds:.0f} | {stats.mean_replicas:.2f} | {stats.max_replicas} | "
            f"{stats.scale_ups} | {stats.scale_downs} | {stats.preemptions_per_1k:.1f} | {stats.ttft_p50_s:.3f} | "
            f"{stats.ttft_p99_s:.3f} | {stats.goodput_rps:.2f}")
    ours, theirs = results[OURS], results[BASELINE]
    checks = [
        ("preemptions per 1k", ratio(ours.preemptions_per_1k, theirs.preemptions_per_1k), TARGETS["preemptions"]),
        ("replica-seconds", ratio(ours.replica_seconds, theirs.replica_seconds), TARGETS["replica_seconds"]),
        ("p99 TTFT", ratio(ours.ttft_p99_s, theirs.ttft_p99_s), TARGETS["ttft_p99"]),
    ]
    say()
    for what, value, limit in checks:
        say(f"headroom / requests {what}: {value:.2f}x (target <= {limit}x): {'met' if value <= limit else 'MISSED'}")
    say(f"headroom / requests goodput: {ratio(ours.goodput_rps, theirs.goodput_rps):.2f}x")
    say(f"wall time {time.perf_counter() - started:.0f} s")
    return results


def main(argv: Optional[list[str]] = None) -> None:
    run_comparison(parse_args(argv))


if __name__ == "__main__":
    main()
