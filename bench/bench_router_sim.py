"""Discrete-event cluster simulation for the routing policies: R real Schedulers (with their
KV cache managers, prefix caches and admission modes) step on virtual timelines under a
step-time cost model; each policy routes from what it would really see: ReplicaLoad
snapshots every 100 ms and each replica's KV events (optionally late or lost), real prompt
token ids hashed into the same prefix-cache keys the replicas use.

    python bench/bench_router_sim.py [--quick] [--sections capacity,tables,swap] [--seeds N] [--jobs N]
                                     [--cost-model assumed|NAME|FILE] [--trace PATH] [--plot PATH]
                                     [--host-kv-blocks N]

The headline (--sections capacity): per workload and policy, the highest offered rate at which
P90 TTFT stays within the workload's bound and P90 TPOT within 100 ms (bisection per seed), its
ratio to the best prefix-aware baseline, and goodput at 1.2x and 1.5x of that baseline's
capacity. The step-time model is bench/cost_model.py's (assumed, or a fit by bench_engine.py).

The fixed-load tables (--sections tables): load points are fractions of a latency-calibrated rate per workload: the rate at which the
best baseline's median TTFT doubles over its unloaded value, at most the rate at which the
best baseline completes requests when saturated (both printed). The tables run one
seed; the target points rerun over --seeds workload seeds and the targets are checked on
the means.

The host KV tier (--sections swap, issue 23; not run by default): mixed_long and long_output
at 85%, 100% and 120% of the calibrated rate, ours over replicas with a host tier whose every
preemption swaps or recomputes its victim, whichever the engine's own choice
(replica/core/preemption_mode.py, inside each replica's real Scheduler) finds cheaper at the
rates the cost model gives, against ours recomputing and every baseline (recompute only, as
deployed): recomputed tokens, p99 TTFT and ITL, goodput. Copies over the host link are a term
of the cost model (bytes per block / link bandwidth), charged before the step that needs them.

Trace replay: Azure Public Dataset, Azure LLM inference trace 2023 (conversation), Patel et
al., "Splitwise", ISCA 2024; CC-BY 4.0. Read from --trace, never copied into the repository.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import math
import multiprocessing
import random
import sys
import time
import zlib
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/cost_model.py, however this file is loaded
from cost_model import ASSUMED, SHIPPED_DIR, CostModel, blocks_copied, blocks_copied_beside, blocks_written_through  # noqa: E402  (re-exported: the sim's one step-time model)
from cluster.trace import DEFAULT_TRACE_PATH, read_trace
from protos.headroom_pb2 import ReplicaLoad
from replica.core.admission import AdmissionMode
from replica.core.kv_events import medium_of
from replica.config import EngineConfig, make_engine_config
from replica.core.outputs import StepStats
from replica.server.grpc_service import DEFAULT_WATCH_INTERVAL_MS
from replica.server.load_report import LoadReportBuilder
from replica.core.request import Request, SamplingParams
from replica.core.scheduler import Scheduler, SchedulerOutput
from router.cache_index import ReplicaCache
from router.inflight import InflightCounts, InflightTracker
from router.load_subscriber import load_age
from router.policies import ReplicaView, RoutingPolicy, RoutingRequest, make_policy

TRACE_ATTRIBUTION = (
    "Azure Public Dataset, Azure LLM inference trace 2023, Patel et al., Splitwise, ISCA 2024 (CC-BY 4.0)"
)
OURS = "headroom"
LOAD_ONLY = ("round_robin", "pow2", "least_loaded")
PREFIX_AWARE = ("approx_prefix", "precise_prefix", "dynamo")
BASELINES = LOAD_ONLY + PREFIX_AWARE
POLICY_NAMES = (OURS,) + BASELINES
# Reference rows at the target points (not deployable as-is, or not ours as configured).
OPTIMISTIC_OURS = "headroom (optimistic admission)"
ORACLE = "oracle"
LATE_STATS = "headroom (stats 500 ms late)"
LATE_STATS_DELAY_S = 0.5  # how late LATE_STATS' load reports and KV events reach the router
# Ours over replicas with a host KV tier (issue 23), each preemption swapping or recomputing
# its victim, whichever costs less; every other name runs without one: recompute only, as
# vLLM v1 (and so every baseline as deployed) does.
OURS_AUTO = "headroom (host tier, auto)"
HOST_TIER = (OURS_AUTO,)
# Ours runs its replicas with the admission mode it was built with; the baselines run vLLM's
# (optimistic), which is what they are deployed on.
ADMISSION: dict[str, AdmissionMode] = {OURS: "reserve_expected", LATE_STATS: "reserve_expected",
                                       OURS_AUTO: "reserve_expected"}
# Ours' requests carry the run's TTFT SLO (the goodput bound) and its replicas queue by it
# (scheduling_policy "slo": rescuable requests by earliest deadline, those that can no longer
# make theirs after everyone else), so under overload the requests already late do not make
# the rest late too; the engine then holds a request that can still make its SLO for growth at
# most until its latest start, and one past it for admission_max_hold_late_ms (under the reserve
# admission modes; scheduler._reserve_share).
# The baselines' replicas queue first come, first served, as vLLM does.
SLO_SCHEDULED = (OURS, OPTIMISTIC_OURS, LATE_STATS, OURS_AUTO)
WORKLOADS = ("multi_tenant", "multi_turn", "hot_tenant", "chat", "mixed_long", "long_output", "azure_trace")
LOADS = (0.5, 0.85, 1.2)  # of the workload's latency-calibrated rate
# Goodput SLO.
TTFT_SLO_S = 2.0
TPOT_SLO_S = 0.100
REPORT_INTERVAL_S = DEFAULT_WATCH_INTERVAL_MS / 1000  # what WatchLoad pushes by default
WARMUP_FRACTION = 0.10  # the first arrivals find an empty cluster; their latencies are not counted
FAKE_TOKEN_ID = 7  # the model is not simulated: every step samples this token...
EOS_TOKEN_ID = 2  # ...or, at a request's natural output length below max_tokens, this one
VOCAB = 256  # prompt ids are drawn below it (Python's small ints: cheap to hold by the million)
TARGET_TTFT_P90_S = 2.0  # multi-tenant target point: where load-only routing's P90 TTFT passes this


# ---- workloads ---------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload. Its prompt is a shared prefix (a tenant's system prompt)
    followed by its own tokens, or, for a conversation's next turn, the previous turn's
    prompt and answer followed by its own tokens; those are drawn from `body_seed`."""

    gap_s: float  # unit-rate gap before this first turn (a load rescales it); unused for follow-ups
    body_len: int
    body_seed: int
    max_tokens: int
    output_tokens: int  # natural output length: EOS comes then, unless it is max_tokens
    prefix: int = -1  # index into Workload.prefixes
    after: int = -1  # this is the next turn of request `after`: it arrives think_s after that one ends
    think_s: float = 0.0


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    prefixes: list[list[int]] = field(default_factory=list)
    followers: dict[int, int] = field(default_factory=dict)  # turn index -> next turn's index

    def __post_init__(self) -> None:
        self.followers = {spec.after: index for index, spec in enumerate(self.requests) if spec.after >= 0}

    def body(self, index: int) -> list[int]:
        spec = self.requests[index]
        return np.random.default_rng(spec.body_seed).integers(3, VOCAB, spec.body_len).tolist()

    def prompt(self, index: int, built: dict[int, list[int]]) -> list[int]:
        """Request `index`'s prompt; `built` holds the prompts of earlier turns still needed."""
        spec = self.requests[index]
        if spec.after >= 0:
            previous = self.requests[spec.after]
            answer = [FAKE_TOKEN_ID] * (previous.output_tokens - 1) + [sampled_last_token(previous)]
            return built.pop(spec.after) + answer + self.body(index)
        head = self.prefixes[spec.prefix] if spec.prefix >= 0 else []
        return head + self.body(index)


def sampled_last_token(spec: WorkloadRequest) -> int:
    return EOS_TOKEN_ID if spec.output_tokens < spec.max_tokens else FAKE_TOKEN_ID


def make_workload(name: str, num_requests: int, seed: int, trace_path: str) -> Workload:
    """Sizes, prompts and gaps depend only on the seed, so every policy and load sees the same
    requests; a load only rescales the gaps (and conversations' next turns follow their answers)."""
    rng = random.Random(f"{seed}:{name}")
    # crc32, not hash(): str hashes are salted per process, and every process (and every
    # rerun) must draw the same requests.
    seeds = itertools.count(zlib.crc32(f"{seed}:{name}".encode()))

    def unique(prompt_tokens: int, max_tokens: int, output_tokens: Optional[int] = None) -> WorkloadRequest:
        return WorkloadRequest(rng.expovariate(1.0), prompt_tokens, next(seeds), max_tokens,
                               output_tokens if output_tokens is not None else max_tokens)

    if name in ("multi_tenant", "hot_tenant"):
        return tenant_workload(name, num_requests, rng, seeds, hot_share=0.5 if name == "hot_tenant" else 0.0)
    if name == "multi_turn":
        return conversation_workload(num_requests, rng, seeds)
    if name == "azure_trace":
        return trace_workload(trace_path, num_requests, seeds, skip=seed * TRACE_SEED_STRIDE)
    requests = []
    for _ in range(num_requests):
        if name == "chat":
            requests.append(unique(rng.randint(64, 1024), rng.randint(64, 512)))
        elif name == "mixed_long":
            long_prompt = rng.random() < 0.10
            requests.append(unique(rng.randint(8192, 16384) if long_prompt else rng.randint(64, 1024), rng.randint(64, 512)))
        elif name == "long_output":
            requests.append(unique(rng.randint(64, 512), rng.randint(512, 2048)))
        else:
            raise ValueError(f"workload: unknown {name!r}; expected one of {WORKLOADS}")
    return Workload(name, requests)


# Multi-tenant shared prefixes after llm-d's benchmark (150 tenants with a 6k-token system
# prompt, 1.2k-token questions, 8 pods), scaled to 4 replicas of 49k tokens: 16 tenants, so
# their prefixes fill about half the cluster's cache when each sits on one replica.
NUM_TENANTS = 16
SYSTEM_PROMPT_TOKENS = 6000


def tenant_workload(name: str, num_requests: int, rng: random.Random, seeds, hot_share: float) -> Workload:
    prefixes = [np.random.default_rng(next(seeds)).integers(3, VOCAB, SYSTEM_PROMPT_TOKENS).tolist()
                for _ in range(NUM_TENANTS)]
    requests = []
    for _ in range(num_requests):
        tenant = 0 if rng.random() < hot_share else rng.randrange(NUM_TENANTS)
        requests.append(WorkloadRequest(rng.expovariate(1.0), rng.randint(1000, 1400), next(seeds),
                                        max_tokens=1024, output_tokens=rng.randint(64, 512), prefix=tenant))
    return Workload(name, requests, prefixes)


def conversation_workload(num_requests: int, rng: random.Random, seeds) -> Workload:
    """Conversations of 3-8 turns: each turn's prompt is the previous prompt and answer plus a
    new user message; the user reads for a few seconds before sending it."""
    system = np.random.default_rng(next(seeds)).integers(3, VOCAB, 300).tolist()  # shared by all
    requests: list[WorkloadRequest] = []
    while len(requests) < num_requests:
        previous = -1
        for turn in range(rng.randint(3, 8)):
            output_tokens = rng.randint(64, 512)
            spec = WorkloadRequest(rng.expovariate(1.0) if turn == 0 else 0.0, rng.randint(100, 600), next(seeds),
                                   max_tokens=1024, output_tokens=output_tokens, prefix=0 if turn == 0 else -1,
                                   after=previous, think_s=rng.expovariate(1 / 3.0) if turn else 0.0)
            requests.append(spec)
            previous = len(requests) - 1
    return Workload("multi_turn", requests, [system])


# Each seed runs its own window of the trace: seed s its requests from s x this on. With the
# seed only drawing token ids (which nothing shares), seeds 0-4 were one sample five times.
TRACE_SEED_STRIDE = 2000


def trace_workload(trace_path: str, num_requests: int, seeds, skip: int = 0) -> Workload:
    """The trace's requests from `skip` on: their sizes, and their real inter-arrival gaps scaled to mean 1 s."""
    try:
        trace = read_trace(trace_path, num_requests, skip)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if len(trace) < num_requests:
        raise SystemExit(f"--trace: {trace_path} holds {skip + len(trace)} requests; this seed's window needs "
                         f"{skip + num_requests} (requests {skip}-{skip + num_requests - 1})")
    stamps = [request.arrival_s for request in trace]
    gaps = [0.0] + [max(0.0, later - earlier) for earlier, later in zip(stamps, stamps[1:])]
    mean_gap = sum(gaps) / max(len(gaps) - 1, 1)
    return Workload("azure_trace", [
        WorkloadRequest(gap / mean_gap, r.prompt_tokens, next(seeds), r.output_tokens, r.output_tokens)
        for r, gap in zip(trace, gaps)
    ])


# ---- the cluster -------------------------------------------------------------------------
@dataclass(frozen=True)
class StatsFeed:
    """How snapshots and KV events reach the router: `delay_s` late, a `drop_fraction` of the
    load snapshots never (the KV event stream is reliable: a gap makes the router resync). A
    late snapshot arrives aged by its delay, as a replica whose loads come late says
    (ReplicaLoad.load_age_ms), so the router sees its age as before that field: its time
    since arriving plus that."""

    delay_s: float = 0.0
    drop_fraction: float = 0.0

    @property
    def label(self) -> str:
        if self.drop_fraction:
            return f"{self.drop_fraction:.0%} of updates dropped"
        return f"stats delayed {self.delay_s * 1000:.0f} ms" if self.delay_s else "fresh stats"


def feed_for(name: str) -> StatsFeed:
    """How stats reach policy `name`'s router: LATE_STATS_DELAY_S late for LATE_STATS, else fresh."""
    return StatsFeed(delay_s=LATE_STATS_DELAY_S) if name == LATE_STATS else StatsFeed()


@dataclass(frozen=True)
class RunStats:
    num_requests: int  # measured (after warm-up)
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_p99_s: float
    tpot_p90_s: float  # each measured request's mean time per output token after the first
    preemptions_per_1k: float
    recomputed_fraction: float  # recomputed tokens / all tokens the engines computed
    prefix_hit_rate: float  # prompt tokens served from the prefix cache / prompt tokens looked up
    output_tokens_per_s: float  # over the measured requests' window, arrival of the first to end of the last
    completed_rps: float  # measured requests ending per second between the 10th and 90th percentile of their ends
    goodput_rps: float
    spills_per_1k: float  # sent where fewer prompt blocks were cached than on the best holder
    recomputed_tokens: int = 0  # computed tokens preemption threw away and the engines computed again
    computed_tokens: int = 0  # every token the engines computed (prompts, outputs, recompute)
    swap_preemptions_per_1k: float = 0.0  # of the preemptions, the victims swapped to the host tier
    copied_blocks_per_1k: float = 0.0  # KV blocks over the host link either way (swaps, spills, host hits)
    # Of those, the blocks a step waited for before its forward pass (swaps, host hits); the rest
    # are the prefix cache's write-throughs and prefetched swap-ins, which overlap the forward pass.
    waited_blocks_per_1k: float = 0.0
    latency_mean_s: float = 0.0  # measured requests' mean arrival to last token
    # completed_rps weighted by size (prompt + output tokens): the run's own mix per second
    completed_mix_rps: float = 0.0
    # The workload's share of first turns (first_turn_share): a completion rate times this is in
    # the offered rate's units
    first_turn_share: float = 1.0


class SimReplica:
    """One engine on its own virtual timeline, the ReplicaLoad reports it publishes (built by
    the replica's own LoadReportBuilder, on the virtual clock) and its KV events."""

    def __init__(self, replica_id: str, config: EngineConfig, cost: CostModel):
        self.replica_id = replica_id
        self.now = 0.0
        self.scheduler = Scheduler(config, clock=lambda: self.now)
        # What an engine of the modelled device measures at start-up for its per-victim choice
        # between swap and recompute (replica/core/preemption_mode.py), as LLMEngine sets it.
        self.scheduler.preemption.costs = cost.preemption_costs(config)
        self.scheduler.kv_block_bytes = cost.kv_block_bytes(config.block_size)
        self.step_stats = StepStats()  # observed after every step, as LLMEngine does
        self.load_reports = LoadReportBuilder(
            replica_id, self.step_stats, monotonic_clock=lambda: self.now, wall_clock=lambda: self.now
        )
        self.busy = False
        self.link_free_s = 0.0  # when the host link has copied everything queued on it (start_replica_step)

    def report(self, now: float) -> ReplicaLoad:
        """What this replica's WatchLoad stream would send at `now`."""
        self.now = now
        return self.load_reports.build(self.scheduler.load())


class CommittedMemoryOracle(RoutingPolicy):
    """Reference only, not deployable: reads every replica's exact committed KV demand
    (prompt + max_tokens of each live request) exactly, instantly and in tokens, straight from
    its scheduler, and picks the least committed. It bounds what better load reports buy."""

    name = "oracle"

    def __init__(self, replicas: list[SimReplica]):
        self.schedulers = {replica.replica_id: replica.scheduler for replica in replicas}

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        def committed_tokens(view: ReplicaView) -> int:
            live = self.schedulers[view.replica_id].requests.values()
            return sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in live)

        return [view.replica_id for view in sorted(replicas, key=committed_tokens)]


class RouterCacheView:
    """The router's index of one replica's cache, fed the replica's KV events as they arrive."""

    def __init__(self) -> None:
        self.cache = ReplicaCache()
        self.pending: collections.deque = collections.deque()  # (deliver_at, events)

    def catch_up(self, now: float) -> None:
        pending = self.pending
        while pending and pending[0][0] <= now:
            self.cache.apply_events((event[0], event[1], medium_of(event)) for event in pending.popleft()[1])


def policy_for(name: str, rng: random.Random, replicas: list[SimReplica]) -> RoutingPolicy:
    if name == ORACLE:
        return CommittedMemoryOracle(replicas)
    return make_policy(OURS if name in (OPTIMISTIC_OURS, LATE_STATS, OURS_AUTO) else name, rng)


class ClusterSim:
    """Events on one heap: arrivals, step completions, load reports taken and delivered."""

    ARRIVAL, STEP_DONE, REPORT, DELIVER = range(4)

    def __init__(self, config: EngineConfig, num_replicas: int, cost: CostModel, feed: StatsFeed, seed: int,
                 host_kv_blocks: int = 0):
        self.config = config
        self.num_replicas = num_replicas
        self.cost = cost
        self.feed = feed
        self.seed = seed
        self.host_kv_blocks = host_kv_blocks  # per replica, for the policies in HOST_TIER

    def run(self, name: str, workload: Workload, rate_rps: float, ttft_slo_s: float = TTFT_SLO_S,
            replicas_of: Optional[str] = None, engine: Optional[dict] = None) -> RunStats:
        """`name` routing `workload` offered at `rate_rps`; goodput counts requests within
        `ttft_slo_s` and TPOT_SLO_S. `replicas_of`: the replicas policy `replicas_of` is deployed
        on (admission and queue) instead of `name`'s own, to separate a router from its replicas.
        `engine`: EngineConfig fields set last, over what the deployment sets (its admission mode too)."""
        # Ours with and without the host tier, and with stats late, draw the same stream: what
        # differs is the tier or the stats' delay (a late run on a stream of its own differed
        # from fresh by as much as the delay did: seed 0's fresh p99 1.94-6.29 s over 8 streams).
        rng = random.Random(f"{self.seed}:{OURS if name in (OURS_AUTO, LATE_STATS) else name}")
        feed_rng = random.Random(f"{self.seed}:feed")  # same drops for every policy
        deployed = name if replicas_of is None else replicas_of
        update = {"admission_mode": ADMISSION.get(deployed, "optimistic")}
        if deployed in SLO_SCHEDULED:
            update.update(scheduling_policy="slo", default_ttft_slo_ms=ttft_slo_s * 1000)
        else:  # vLLM's prefix cache: plain LRU
            update.update(prefix_cache_protected_share=0.0)
        if name in HOST_TIER:
            update.update(num_host_kv_blocks=self.host_kv_blocks, preemption_mode="auto")
        config = self.config.model_copy(update={**update, **(engine or {})})
        replicas = [SimReplica(f"replica-{i}", config, self.cost) for i in range(self.num_replicas)]
        policy = policy_for(name, rng, replicas)
        block_size = config.block_size
        latest_load: list[Optional[ReplicaLoad]] = [None] * self.num_replicas
        delivered_at = [0.0] * self.num_replicas  # when each latest_load reached the router
        caches = [RouterCacheView() for _ in replicas]
        inflight = InflightTracker()
        events: list[tuple] = []
        tiebreak = itertools.count()
        specs = workload.requests
        built: dict[int, list[int]] = {}  # prompts of turns whose next turn has not arrived yet
        live: dict[str, Request] = {}
        index_of: dict[str, int] = {}
        finished: list[Request] = []
        arrival_order: list[float] = []
        gap_arrivals, gaps = array("d"), array("d")  # inter-token gaps, by their request's arrival
        spills = 0

        def push(at: float, kind: int, *payload) -> None:
            heapq.heappush(events, (at, next(tiebreak), kind, payload))

        def start_step(index: int, now: float) -> None:
            start_replica_step(replicas[index], index, now, self.cost, push, self.STEP_DONE)

        def arrive(request_index: int, now: float) -> None:
            nonlocal spills
            spec = specs[request_index]
            prompt = workload.prompt(request_index, built)
            if request_index in workload.followers:
                built[request_index] = prompt
            request = make_request(request_index, spec, prompt, now)
            routing = RoutingRequest(len(prompt), spec.max_tokens, prompt_token_ids=tuple(prompt))
            hashes = routing.prefix_hashes(block_size)
            cached, on_device = [], []
            for cache, load in zip(caches, latest_load):
                cache.catch_up(now)
                hit, device_hit = cache.cache.hits(hashes, load) if hashes else (0, 0)
                cached.append(hit)
                on_device.append(device_hit)
            views = [
                ReplicaView(replica.replica_id, latest_load[i],
                            load_age(latest_load[i], now - delivered_at[i]) if latest_load[i] is not None else math.inf,
                            len(replica.scheduler.requests), inflight.counts(replica.replica_id),
                            cached[i], block_size, on_device[i])
                for i, replica in enumerate(replicas)
            ]
            target_id = policy.rank(routing, views)[0]
            target = int(target_id.rsplit("-", 1)[1])
            spills += cached[target] < max(cached)
            load = latest_load[target]
            sequence_blocks = routing.expected_blocks(load) if load is not None else routing.num_blocks(block_size)
            send = InflightCounts.one_send(sequence_blocks, len(prompt), cached[target], block_size, on_device[target])
            inflight.record_sent(target_id, send.blocks, now, send.prefill_tokens, request.request_id)
            policy.on_routed(routing, target_id, request.request_id, cached[target])
            request.block_hashes.extend(hashes)  # the same chain the replica would compute
            replica = replicas[target]
            replica.now = now
            replica.scheduler.add_request(request)
            live[request.request_id] = request
            index_of[request.request_id] = request_index
            arrival_order.append(now)
            if not replica.busy:
                start_step(target, now)

        def step_done(index: int, output: SchedulerOutput, step_s: float, now: float) -> None:
            replica = replicas[index]
            replica.now = now
            sampled = {}
            for entry in output.scheduled:
                if entry.samples:
                    request = entry.request
                    spec = specs[index_of[request.request_id]]
                    last = request.num_output_tokens + 1 >= spec.output_tokens
                    sampled[request.request_id] = sampled_last_token(spec) if last else FAKE_TOKEN_ID
                    if request.first_token_time is None:
                        policy.on_first_token(request.request_id)
                    else:
                        gap_arrivals.append(request.arrival_time)
                        gaps.append(now - request.last_token_time)
            for update in replica.scheduler.update(output, sampled):
                if update.finished is not None:
                    request = update.request
                    policy.on_finished(request.request_id)
                    inflight.record_ended(request.request_id, now)  # as the router does
                    finished.append(live.pop(request.request_id))
                    follower = workload.followers.get(index_of[request.request_id])
                    if follower is not None:
                        push(now + specs[follower].think_s, self.ARRIVAL, follower)
            kv_events = replica.scheduler.kv_cache.take_kv_events()
            if kv_events:
                caches[index].pending.append((now + self.feed.delay_s, kv_events))
            replica.step_stats.observe(step_s, len(sampled))
            start_step(index, now)

        clock = 0.0
        for index, spec in enumerate(specs):
            if spec.after < 0:
                clock += spec.gap_s / rate_rps
                push(clock, self.ARRIVAL, index)
        for index in range(self.num_replicas):
            push(rng.uniform(0, REPORT_INTERVAL_S), self.REPORT, index)

        while events and len(finished) < len(specs):
            now, _, kind, payload = heapq.heappop(events)
            if kind == self.ARRIVAL:
                arrive(payload[0], now)
            elif kind == self.STEP_DONE:
                step_done(*payload, now)
            elif kind == self.REPORT:
                (index,) = payload
                load = replicas[index].report(now)
                if feed_rng.random() >= self.feed.drop_fraction:
                    push(now + self.feed.delay_s, self.DELIVER, index, load)
                push(now + REPORT_INTERVAL_S, self.REPORT, index)
            else:  # DELIVER
                index, load = payload
                load.load_age_ms = (now - load.timestamp) * 1000.0  # the feed's delay (StatsFeed)
                if inflight.observe_snapshot(load.replica_id, load.seq, load.timestamp):
                    latest_load[index] = load
                    delivered_at[index] = now

        measured_from_s = sorted(arrival_order)[int(len(arrival_order) * WARMUP_FRACTION)]
        measured = [r for r in finished if r.arrival_time >= measured_from_s]
        measured_gaps = [gap for arrival, gap in zip(gap_arrivals, gaps) if arrival >= measured_from_s]
        return replace(summarize(measured, measured_gaps, [r.scheduler for r in replicas], len(specs), spills, ttft_slo_s),
                       first_turn_share=first_turn_share(workload))


def start_replica_step(replica: "SimReplica", index: int, now: float, cost: CostModel, push: Callable,
                       step_done: object) -> bool:
    """Schedule `replica`'s next step at `now` and push its completion event (step_done, index,
    output, step seconds); False, the replica idle, when it has nothing to run.

    The host link is one queue, as the engine's copy stream is: a step's copies (swaps, host
    hits) start once the link has finished everything queued before them,
    its forward pass starts once they are done, and its write-throughs and prefetched swap-ins
    follow them on the link beside the forward pass (replica.link_free_s: when the link is next
    idle)."""
    replica.now = now
    copy_s = cost.block_copy_ms(replica.scheduler.config.block_size) / 1000.0
    link_s = max(now, replica.link_free_s)
    for _ in range(3):  # a step that only preempts schedules nothing; the next one admits
        output = replica.scheduler.schedule()
        link_s += blocks_copied(output) * copy_s  # copies of a step that scheduled nothing run before the next one's
        replica.link_free_s = link_s + blocks_copied_beside(output) * copy_s
        if not output.is_empty:
            # (waited for the link) + compute: exactly the compute where the link was idle, so a
            # replica without a host tier steps as it did before the link had a queue.
            step_s = (link_s - now) + cost.compute_time_s(output)
            replica.busy = True
            push(now + step_s, step_done, index, output, step_s)
            return True
        link_s = replica.link_free_s
        if not replica.scheduler.has_unfinished_requests():
            break
    else:
        raise RuntimeError(f"{replica.replica_id} has requests but schedules nothing")
    replica.busy = False
    return False


def make_request(index: int, spec: WorkloadRequest, prompt: list[int], arrival_s: float) -> Request:
    stops = spec.output_tokens < spec.max_tokens
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=not stops)
    return Request(f"r{index}", prompt, params, eos_token_ids=(EOS_TOKEN_ID,), arrival_time=arrival_s)


def summarize(measured: list[Request], inter_token_gaps: list[float], schedulers: list[Scheduler], num_requests: int,
              spills: int, ttft_slo_s: float = TTFT_SLO_S) -> RunStats:
    ttfts = np.array([r.first_token_time - r.arrival_time for r in measured])
    tpots = np.array([
        (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else 0.0
        for r in measured
    ])
    good = int(np.sum((ttfts <= ttft_slo_s) & (tpots <= TPOT_SLO_S)))
    start = min(r.arrival_time for r in measured)
    arrivals_window_s = max(r.arrival_time for r in measured) - start
    makespan_s = max(r.last_token_time for r in measured) - start
    preemptions = sum(s.counters.preemptions for s in schedulers)
    recomputed = sum(s.counters.recomputed_tokens for s in schedulers)
    computed = sum(s.counters.scheduled_tokens for s in schedulers)
    queries = sum(s.kv_cache.prefix_cache_queries for s in schedulers)
    waited = sum(s.kv_cache.swapped_out_blocks + s.kv_cache.swapped_in_blocks - s.kv_cache.prefetched_blocks
                 + s.kv_cache.host_hit_blocks for s in schedulers)
    # Beside the forward pass: written through, and swap-ins prefetched a step ahead.
    copied = waited + sum(s.kv_cache.spilled_blocks + s.kv_cache.prefetched_blocks for s in schedulers)
    hits = sum(s.kv_cache.prefix_cache_hits for s in schedulers)
    return RunStats(
        num_requests=len(measured),
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p90_s=float(np.percentile(ttfts, 90)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        itl_p99_s=float(np.percentile(inter_token_gaps, 99)) if inter_token_gaps else 0.0,
        tpot_p90_s=float(np.percentile(tpots, 90)),
        preemptions_per_1k=1000.0 * preemptions / num_requests,
        recomputed_fraction=recomputed / computed if computed else 0.0,
        prefix_hit_rate=hits / queries if queries else 0.0,
        output_tokens_per_s=sum(r.num_output_tokens for r in measured) / makespan_s if makespan_s > 0 else 0.0,
        completed_rps=completion_rate([r.last_token_time for r in measured]),
        goodput_rps=good / arrivals_window_s if arrivals_window_s > 0 else 0.0,
        spills_per_1k=1000.0 * spills / num_requests,
        recomputed_tokens=recomputed,
        computed_tokens=computed,
        swap_preemptions_per_1k=1000.0 * sum(s.counters.swap_preemptions for s in schedulers) / num_requests,
        copied_blocks_per_1k=1000.0 * copied / num_requests,
        waited_blocks_per_1k=1000.0 * waited / num_requests,
        latency_mean_s=float(np.mean([r.last_token_time - r.arrival_time for r in measured])),
        completed_mix_rps=completion_rate([r.last_token_time for r in measured],
                                          [r.num_prompt_tokens + r.num_output_tokens for r in measured]),
    )


def completion_rate(end_times: list[float], sizes: Optional[list[float]] = None) -> float:
    """Requests ending per second between the 10th and 90th percentile of their ends: the
    cluster's pace with the ramp up and the drain (a run's last, longest requests) left out.
    With `sizes` (each request's tokens), the requests of the run's own mix per second: the
    tokens of those that ended in that window over their mean size. A scheduler that puts the
    big requests off to the drain (ours' SLO queue under overload, mixed_long's 8-16k-token
    prompts) finishes more small ones in the window than it could sustain; this does not count them."""
    if len(end_times) < 10:
        return 0.0
    first, last = np.percentile(end_times, [10, 90])
    if last <= first:
        return math.inf
    if sizes is None:
        return 0.8 * len(end_times) / (last - first)
    ends, weights = np.asarray(end_times), np.asarray(sizes, dtype=float)
    return float(weights[(ends >= first) & (ends <= last)].sum() / weights.mean() / (last - first))


# ---- load calibration ----------------------------------------------------------------------
def token_capacity_rps(workload: Workload, config: EngineConfig, cost: CostModel, num_replicas: int) -> float:
    """A coarse upper bound on the cluster's request rate: every step full of prompt tokens
    (none cached), decodes riding along; it only brackets the latency search below."""
    specs = workload.requests
    prompt = np.mean([spec.body_len + (SYSTEM_PROMPT_TOKENS if spec.prefix >= 0 and workload.name != "multi_turn"
                                       else 0) for spec in specs])
    output = np.mean([spec.output_tokens for spec in specs])
    step_s = cost.fixed_ms / 1000 + cost.per_batched_token_ms / 1000 * config.max_num_batched_tokens
    tokens_per_s = config.max_num_batched_tokens / step_s
    return num_replicas * tokens_per_s / (prompt + output)


def rate_where(metric: Callable[[float], float], threshold: float, low: float, high: float, steps: int,
               never: Optional[float] = None) -> float:
    """The rate at which `metric` (increasing in the rate, give or take noise) crosses
    `threshold`: geometric bisection of [low, high] after widening it to bracket the crossing.
    A metric still below the threshold 1e4x past `high` never crosses: then `never` if given,
    else that bound."""
    # Widen at most 1e4x past the bracket given: a metric that never crosses (a workload that
    # cannot be loaded that far) ends at the bound instead of doubling the rate to infinity.
    floor, ceiling = low, high
    while metric(high) < threshold:
        if high >= ceiling * 1e4:
            if never is not None:
                return never
            break
        low, high = high, high * 2
    # Narrow at most 100x below it: at rates that low every request runs alone, and each run
    # costs virtual time in proportion (load reports every 100 ms).
    while metric(low) >= threshold and low > floor * 1e-2:
        low, high = low / 2, low
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if metric(middle) < threshold else (low, middle)
    return math.sqrt(low * high)


@dataclass(frozen=True)
class Calibration:
    rate_rps: float  # the best baseline's doubling rate, at most what the cluster can complete (below)
    best: str  # whose doubling rate, or SATURATED / CAPACITY_BOUND
    unloaded_ttft_p50_s: dict[str, float]
    doubling_rps: dict[str, float]
    saturated_rps: dict[str, float]  # per baseline, requests it completes per second with all of them queued


def calibrate(workload: Workload, config: EngineConfig, cost: CostModel, num_replicas: int, seed: int,
              steps: int, policies: Sequence[str] = BASELINES) -> Calibration:
    """Per baseline: its median TTFT with the cluster almost idle, then the rate at which it
    doubles; the calibrated rate is the highest of those (the best baseline's). A baseline
    whose median never doubles (inf: a run of this size cannot load the cluster that way, as
    when every conversation of multi_turn starts at once and their think times still spread
    the turns) sets no rate; if none doubles, the token-capacity bound is the rate.

    The rate is at most the best baseline's saturated throughput: the pace at which it
    completes requests offered at twice the token-capacity bound. Optimistic admission keeps
    the median TTFT low past that rate (it admits whatever fits and pays in preemptions and
    slower decoding), so on long outputs the median TTFT doubles only in a burst many times
    what the cluster can finish: long_output's doubled at 286 req/s where 4 replicas
    complete about 14 a second."""
    capacity = token_capacity_rps(workload, config, cost, num_replicas)
    sim = ClusterSim(config, num_replicas, cost, StatsFeed(), seed)
    # The same requests almost idle: a subset's median need not be the whole's (the trace's
    # first requests are shorter than its average, and then no rate ever looked unloaded).
    unloaded, doubling, saturated = {}, {}, {}
    for name in policies:
        unloaded[name] = sim.run(name, workload, capacity * 0.01).ttft_p50_s
        doubling[name] = rate_where(lambda rate: sim.run(name, workload, rate).ttft_p50_s / unloaded[name], 2.0,
                                    capacity * 0.05, capacity, steps, never=math.inf)
        saturated[name] = (stats := sim.run(name, workload, capacity * 2)).completed_rps * stats.first_turn_share
    rate, best = calibrated_rate(doubling, capacity, max(saturated.values()))
    return Calibration(rate, best, unloaded, doubling, saturated)


def first_turn_share(workload: Workload) -> float:
    """The share of the workload's requests that are first turns: an offered rate scales only
    first turns' gaps (the next turns follow answers), so a completion rate times this is in
    the offered rate's units (1 but for multi_turn)."""
    return sum(1 for spec in workload.requests if spec.after < 0) / len(workload.requests)


CAPACITY_BOUND = "none (token-capacity bound)"
SATURATED = "saturated throughput"


def calibrated_rate(doubling_rps: dict[str, float], capacity_rps: float, saturated_rps: float) -> tuple[float, str]:
    """(rate, whose): the highest finite doubling rate and its baseline; a baseline whose
    median never doubles (inf) sets none, and with none finite the capacity bound is the rate.
    Either is capped at the best saturated throughput (then whose is SATURATED)."""
    crossing = {name: rate for name, rate in doubling_rps.items() if math.isfinite(rate)}
    rate, best = (max((rate, name) for name, rate in crossing.items()) if crossing
                  else (capacity_rps, CAPACITY_BOUND))
    return (saturated_rps, SATURATED) if saturated_rps < rate else (rate, best)


# ---- report ------------------------------------------------------------------------------
METRIC_COLUMNS = (  # (header, RunStats field, scale, format)
    ("TTFT p50 s", "ttft_p50_s", 1, ".3f"),
    ("TTFT p90 s", "ttft_p90_s", 1, ".3f"),
    ("TTFT p99 s", "ttft_p99_s", 1, ".3f"),
    ("ITL p99 ms", "itl_p99_s", 1000, ".1f"),
    ("preempt/1k req", "preemptions_per_1k", 1, ".1f"),
    ("recomputed %", "recomputed_fraction", 100, ".2f"),
    ("prefix hits %", "prefix_hit_rate", 100, ".1f"),
    ("output tok/s", "output_tokens_per_s", 1, ".0f"),
    ("goodput req/s", "goodput_rps", 1, ".2f"),
    ("spills/1k", "spills_per_1k", 1, ".0f"),
)
METRIC_HEADER = "policy | " + " | ".join(header for header, *_ in METRIC_COLUMNS) + " |"


def metric_cells(stats: RunStats) -> list[str]:
    return [f"{getattr(stats, name) * scale:{fmt}}" for _, name, scale, fmt in METRIC_COLUMNS]


def format_row(workload: str, load: float, policy: str, stats: RunStats, condition: str = "") -> str:
    cells = [workload, f"{load:.0%}"] + ([condition] if condition else []) + [policy] + metric_cells(stats)
    return "| " + " | ".join(cells) + " |"


def table_header(*leading: str) -> str:
    columns = len(leading) + 1 + len(METRIC_COLUMNS)
    return "| " + " | ".join(leading) + " | " + METRIC_HEADER + "\n" + "|---" * columns + "|"


def target_line(description: str, ratio_value: float, limit: float, at_most: bool) -> str:
    met = ratio_value <= limit if at_most else ratio_value >= limit
    bound = "<=" if at_most else ">="
    return f"- {description}: {ratio_value:.2f}x (target {bound} {limit}x) {'MET' if met else 'MISSED'}"


def ratio(ours: float, theirs: float) -> float:
    if theirs == 0:
        return 1.0 if ours == 0 else math.inf
    return ours / theirs


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def mean_of(runs: Sequence[RunStats], metric: str) -> float:
    return mean_spread([getattr(stats, metric) for stats in runs])[0]


@dataclass(frozen=True)
class TargetPoint:
    """A workload and load the issue's targets are judged at, over seeds."""

    label: str
    workload: str
    load: float  # fraction of the calibrated rate
    policies: tuple[str, ...]


def compare_to_best(runs: dict[str, list[RunStats]], metric: str, lower_is_better: bool, among: Sequence[str],
                    limit: float, label: str, fmt: str, unit: str) -> str:
    """Ours against the best of `among` on the means over seeds, with the per-seed ratio range."""
    pick = min if lower_is_better else max
    means = {name: mean_of(runs[name], metric) for name in among}
    best = pick(means, key=means.get)
    ours = mean_of(runs[OURS], metric)
    per_seed = [ratio(getattr(mine, metric), getattr(runs[best][i], metric)) for i, mine in enumerate(runs[OURS])]
    spread = f", per seed {min(per_seed):.2f}-{max(per_seed):.2f}x" if len(per_seed) > 1 else ""
    # Nothing is lower than none: zero (preemptions) meets an "at most a fraction" target.
    overall = 0.0 if lower_is_better and ours == 0 else ratio(ours, means[best])
    return target_line(f"{label} {ours:{fmt}}{unit} vs {means[best]:{fmt}}{unit} ({best}){spread}",
                       overall, limit, lower_is_better)


def check_targets(results: dict, points: dict[str, dict[str, list[RunStats]]]) -> list[str]:
    """The issue's targets; target-point ones on means over seeds."""
    lines = ["Targets (issue 12), means over seeds:"]
    if "multi_tenant" in points:
        runs = points["multi_tenant"]
        lines.append(compare_to_best(runs, "ttft_p90_s", True, PREFIX_AWARE, 0.5,
                                     "multi-tenant P90 TTFT", ".3f", " s"))
        lines.append(compare_to_best(runs, "output_tokens_per_s", False, PREFIX_AWARE, 1.1,
                                     "multi-tenant output throughput", ".0f", " tok/s"))
    if "hot_tenant" in points:
        runs = points["hot_tenant"]
        lines.append(compare_to_best(runs, "ttft_p99_s", True, PREFIX_AWARE, 0.7, "hot tenant p99 TTFT", ".3f", " s"))
        lines.append(compare_to_best(runs, "preemptions_per_1k", True, PREFIX_AWARE, 1.0,
                                     "hot tenant preemptions/1k", ".1f", ""))
    if "mixed_long" in points:
        runs = points["mixed_long"]
        lines.append(compare_to_best(runs, "preemptions_per_1k", True, BASELINES, 0.5,
                                     "mixed_long preemptions/1k", ".1f", ""))
        lines.append(compare_to_best(runs, "ttft_p99_s", True, BASELINES, 0.7, "mixed_long p99 TTFT", ".3f", " s"))
        ours = mean_of(runs[OURS], "output_tokens_per_s")
        optimistic = mean_of(runs[OPTIMISTIC_OURS], "output_tokens_per_s")
        lines.append(target_line(f"mixed_long output throughput {ours:.0f} vs optimistic admission {optimistic:.0f} "
                                 "tok/s", ratio(ours, optimistic), 0.97, False))
        late, fresh = mean_of(runs[LATE_STATS], "ttft_p99_s"), mean_of(runs[OURS], "ttft_p99_s")
        lines.append(target_line(f"mixed_long p99 TTFT with stats 500 ms late {late:.3f} s vs fresh {fresh:.3f} s",
                                 ratio(late, fresh), 1.10, True))
    worst = max((ratio(results[(w, l, OURS)].ttft_p99_s, results[(w, l, "pow2")].ttft_p99_s), w, l)
                for (w, l, p) in results if p == OURS)
    lines.append(target_line(f"worst p99 TTFT vs pow2 over every workload and load, one seed ({worst[1]} at "
                             f"{worst[2]:.0%})", worst[0], 1.05, True))
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
        axes[1][column].set_xlabel("load (% of the calibrated rate)")
    axes[0][0].legend()
    figure.suptitle("headroom router simulation (trace: " + TRACE_ATTRIBUTION + ")", fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- capacity at SLO (the headline) ------------------------------------------------------
# Policies whose capacity is searched: ours, the prefix-aware baselines it is judged against,
# and pow2 (Ray Serve's default, the floor ours must never fall below); --capacity-policies all
# adds the other load-only ones.
CAPACITY_POLICIES = (OURS,) + PREFIX_AWARE + ("pow2",)
TPOT_P90_BOUND_S = TPOT_SLO_S
# A workload's P90 TTFT bound: 5x its unloaded median, or its unloaded P99 where that is
# higher (mixed_long: the unloaded P90 sits on the edge of the 10% of 8-16k-token prompts, and
# a bound below their unloaded prefill would leave no capacity at all), never above 2 s.
CAPACITY_TTFT_MULTIPLE = 5.0
CAPACITY_TTFT_CAP_S = TTFT_SLO_S
# A capacity or goodput run's arrivals span at least this many of the workload's unloaded mean
# request durations (arrival to last token), whatever its rate: a run shorter than that is a
# burst the cluster absorbs at once, not a load it sustains (Little's law: a run of N requests
# at rate r holds N / (r W) times the requests in flight at once). long_output's 160 requests
# at 340 req/s were 0.47 s of arrivals against a 6.5 s request: every request was admitted
# before the first finished, and the capacity found was 22x the 15 req/s the cluster completes.
# The other workloads' 400 requests span 7-19 durations at their capacity; the rule adds none.
CAPACITY_MIN_SPAN_DURATIONS = 5.0
OVERLOADS = (1.2, 1.5)  # goodput targets: these multiples of the best baseline's capacity
GOODPUT_CURVE = (1.0,) + OVERLOADS  # the plot's offered rates, in the same multiples
# Saturated throughput, the physical limit on capacity: what each policy completes per second
# (completion_rate: ramp and drain left out) offered these multiples of the best baseline's
# capacity, sustained as goodput runs; the second doubles the first, to show it rises no more.
# The limit is the most completed at any offered multiple (these and GOODPUT_CURVE's).
SATURATION_OFFERED = (2.0, 4.0)


@dataclass(frozen=True)
class SLOBound:
    """A workload's capacity SLO: P90 TTFT <= ttft_p90_s and P90 TPOT <= TPOT_P90_BOUND_S."""

    ttft_p90_s: float
    unloaded_p50_s: float  # precise_prefix (exact cache knowledge) almost idle (1% of the token-capacity bound)
    unloaded_p99_s: float
    unloaded_duration_s: float = 0.0  # mean arrival to last token, unloaded

    @classmethod
    def of(cls, unloaded: "RunStats") -> "SLOBound":
        bound = max(CAPACITY_TTFT_MULTIPLE * unloaded.ttft_p50_s, unloaded.ttft_p99_s)
        return cls(min(CAPACITY_TTFT_CAP_S, bound), unloaded.ttft_p50_s, unloaded.ttft_p99_s,
                   unloaded.latency_mean_s)

    @property
    def min_span_s(self) -> float:
        """The shortest arrival window of a capacity or goodput run (CAPACITY_MIN_SPAN_DURATIONS)."""
        return CAPACITY_MIN_SPAN_DURATIONS * self.unloaded_duration_s

    def excess(self, stats: "RunStats") -> float:
        """How far a run is past the SLO: < 1 within it."""
        return max(stats.ttft_p90_s / self.ttft_p90_s, stats.tpot_p90_s / TPOT_P90_BOUND_S)


def slo_bound(setup: "Setup", workload_name: str) -> SLOBound:
    workload = setup.workload(workload_name, setup.args.seed, calibration=True)
    idle_rps = 0.01 * token_capacity_rps(workload, setup.config, setup.cost, setup.args.replicas)
    return SLOBound.of(setup.sim(setup.args.seed).run("precise_prefix", workload, idle_rps))


def capacity_at_slo(setup: "Setup", workload_name: str, policy: str, seed: int, bound: SLOBound,
                    hint: Optional[float] = None) -> float:
    """The highest offered rate at which `policy` was seen to keep the workload (seed `seed`)
    within `bound`: bracketed from `hint` (another policy's capacity on the same requests:
    [hint / 1.4, hint x 1.4]) or else from the token-capacity bound ([a quarter of it, it]),
    doubling while the SLO still holds at the top and halving while it fails at the bottom
    (to 1/64 of the token-capacity bound at most, below which the capacity is reported as 0),
    then --capacity-steps geometric bisections."""
    sim = setup.sim(seed)
    seen: dict[float, bool] = {}

    def holds(rate: float) -> bool:
        if rate not in seen:
            workload = setup.capacity_workload(workload_name, seed, rate, bound.min_span_s)
            seen[rate] = bound.excess(sim.run(policy, workload, rate, ttft_slo_s=bound.ttft_p90_s)) < 1.0
        return seen[rate]

    workload = setup.workload(workload_name, seed, capacity=True)
    token_bound = token_capacity_rps(workload, setup.config, setup.cost, setup.args.replicas)
    low, high = (hint / 1.4, hint * 1.4) if hint else (token_bound / 4, token_bound)
    while not holds(low):
        if low < token_bound / 64:
            return 0.0
        low, high = low / 2, low
    while holds(high) and high < token_bound * 64:
        low, high = high, high * 2
    for _ in range(setup.args.capacity_steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low


def goodput_run(setup: "Setup", workload_name: str, policy: str, seed: int, rate_rps: float,
                bound: SLOBound) -> RunStats:
    return setup.sim(seed).run(policy, setup.capacity_workload(workload_name, seed, rate_rps, bound.min_span_s), rate_rps,
                               ttft_slo_s=bound.ttft_p90_s)


@dataclass
class CapacityResult:
    """One workload's capacity table: per policy, per seed."""

    bound: SLOBound
    capacity: dict[str, list[float]]  # req/s, per seed
    # multiple of the best baseline's capacity (GOODPUT_CURVE + SATURATION_OFFERED) -> policy -> per seed
    goodput: dict[float, dict[str, list[RunStats]]]

    def mean_capacity(self, policy: str) -> float:
        return mean_spread(self.capacity[policy])[0]

    def completed(self, multiple: float, policy: str, counted: bool = False) -> list[float]:
        """Per seed, the goodput run's requests of the workload's mix completed per second
        (completed_mix_rps), in the offered rate's units (first turns: calibrate's rule);
        `counted`: requests counted whatever their size (completed_rps)."""
        return [(stats.completed_rps if counted else stats.completed_mix_rps) * stats.first_turn_share
                for stats in self.goodput[multiple][policy]]

    def most_completed(self, counted: bool = False) -> tuple[float, str, float]:
        """(req/s, policy, offered multiple): the highest mean completion rate of any policy at
        any offered multiple: the cluster's saturated throughput (`counted`: requests counted
        whatever their size)."""
        return max((mean_spread(self.completed(multiple, policy, counted))[0], policy, multiple)
                   for multiple, by_policy in self.goodput.items() for policy in by_policy)

    def best_baseline(self, among: Sequence[str] = PREFIX_AWARE) -> str:
        present = [name for name in among if name in self.capacity]
        return max(present, key=self.mean_capacity)


def run_capacity(setup: "Setup", out, runner: "Runner") -> dict[str, CapacityResult]:
    """Capacity at SLO per workload and policy over the seeds, then goodput at multiples of
    the best prefix-aware baseline's capacity; prints the headline tables."""
    args = setup.args
    seeds = range(args.seed, args.seed + args.seeds)
    policies = args.capacity_policies
    bounds = dict(zip(args.workloads, runner.map(slo_bound, [(setup, name) for name in args.workloads])))
    # A coarse search of the first prefix-aware baseline (from the token-capacity bound) gives
    # the bracket every policy's search then starts from, that baseline's own again included:
    # the same bracket and steps give every policy the same precision. (That baseline's coarse
    # result once stood as its capacity: a final interval twice as wide, and the search reports
    # its low end, so the first baseline came out ~1% low, against ~0.5% for the others.)
    first = next(policy for policy in policies if policy in PREFIX_AWARE)
    results = {name: CapacityResult(bounds[name], {policy: [] for policy in policies}, {}) for name in args.workloads}
    pairs = [(name, seed) for name in args.workloads for seed in seeds]
    hints = dict(zip(pairs, runner.map(capacity_at_slo, [(setup, name, first, seed, bounds[name]) for name, seed in pairs])))
    searches = [(setup, name, policy, seed, bounds[name], hints[(name, seed)] or None)
                for name in args.workloads for policy in policies for seed in seeds]
    found = dict(zip([(job[1], job[2], job[3]) for job in searches], runner.map(capacity_at_slo, searches)))
    for name, seed in pairs:
        for policy in policies:
            results[name].capacity[policy].append(found[(name, policy, seed)])
    goodput_jobs, multiples = [], []
    for name in args.workloads:
        result = results[name]
        base = result.mean_capacity(result.best_baseline())
        for multiple in GOODPUT_CURVE + SATURATION_OFFERED:
            result.goodput[multiple] = {policy: [] for policy in policies}
            for policy in policies:
                for seed in seeds:
                    goodput_jobs.append((setup, name, policy, seed, multiple * base, result.bound))
                    multiples.append(multiple)
    measured = runner.map(goodput_run, goodput_jobs)
    for (_, name, policy, _, _, _), multiple, stats in zip(goodput_jobs, multiples, measured):
        results[name].goodput[multiple][policy].append(stats)
    for line in capacity_report(results, seeds, args.capacity_requests):
        print(line, file=out)
    return results


def capacity_report(results: dict[str, CapacityResult], seeds: range, capacity_requests_flag: int = 0) -> list[str]:
    lines = [f"\n## Capacity at SLO (seeds {seeds.start}-{seeds.stop - 1}: mean ± sample standard deviation)",
             f"Capacity: the highest offered rate at which P90 TTFT <= the workload's bound (max({CAPACITY_TTFT_MULTIPLE:g}x "
             f"the unloaded median, the unloaded P99), at most "
             f"{CAPACITY_TTFT_CAP_S:g} s) and P90 TPOT <= {TPOT_P90_BOUND_S * 1000:.0f} ms. Goodput: requests per "
             f"second within both, offered at multiples of the best prefix-aware baseline's capacity.",
             "", "| workload | P90 TTFT bound s | policy | capacity req/s | vs best prefix-aware (per seed) | "
             + " | ".join(f"goodput at {m:g}x req/s" for m in OVERLOADS) + " | "
             + " | ".join(f"goodput vs best at {m:g}x" for m in OVERLOADS) + " |",
             "|---" * (5 + 2 * len(OVERLOADS)) + "|"]
    for name, result in results.items():
        best = result.best_baseline()
        for policy, capacities in result.capacity.items():
            mean, spread = mean_spread(capacities)
            per_seed = [ratio(mine, theirs) for mine, theirs in zip(capacities, result.capacity[best])]
            vs = (f"{ratio(mean, result.mean_capacity(best)):.2f}x ({min(per_seed):.2f}-{max(per_seed):.2f})"
                  if policy != best else "(best)")
            goodputs = [mean_spread([s.goodput_rps for s in result.goodput[m][policy]]) for m in OVERLOADS]
            best_goodputs = [mean_of(result.goodput[m][best], "goodput_rps") for m in OVERLOADS]
            lines.append(f"| {name} | {result.bound.ttft_p90_s:.3f} | {policy} | {mean:.2f} ± {spread:.2f} | {vs} | "
                         + " | ".join(f"{g:.2f} ± {sd:.2f}" for g, sd in goodputs) + " | "
                         + " | ".join(f"{ratio(g, b):.2f}x" for (g, _), b in zip(goodputs, best_goodputs)) + " |")
    lines.append("")
    lines.append(f"Runs: --capacity-requests (long_output 40%), or more so that arrivals span at least "
                 f"{CAPACITY_MIN_SPAN_DURATIONS:g} unloaded mean request durations: "
                 + "; ".join(f"{name} {r.bound.min_span_s:.1f} s (duration {r.bound.unloaded_duration_s:.2f} s; "
                             f"{capacity_requests(name, capacity_requests_flag, r.mean_capacity(r.best_baseline()), r.bound.min_span_s)} "
                             f"requests at the best baseline's capacity)"
                             for name, r in results.items()))
    lines += saturation_report(results)
    lines += capacity_targets(results)
    return lines


def saturation_report(results: dict[str, CapacityResult]) -> list[str]:
    """The physical limit: capacity at a P90 TTFT bound cannot exceed what the cluster completes,
    so the most completed / the best baseline's capacity (the ceiling) is the most a router
    could reach over that baseline on this engine and cost model, with these admissions."""
    offered = sorted(next(iter(results.values())).goodput)
    low, high = SATURATION_OFFERED
    lines = ["", f"Requests of the workload's mix completed per second (tokens of the requests ending between the 10th "
                 f"and 90th percentile of the ends, over the mean request's), offered multiples of the best prefix-aware "
                 f"baseline's capacity as goodput runs: the cluster's saturated throughput is the most it completes at "
                 f"any (doubling {low:g}x to {high:g}x shows whether it still rises); ceiling = the most of any policy / "
                 f"the best baseline's capacity. Counted: requests whatever their size, the most at any multiple.",
             "", "| workload | policy | capacity req/s | " + " | ".join(f"completed at {m:g}x req/s" for m in offered)
             + f" | {high:g}x / {low:g}x | counted req/s | capacity / most completed |", "|---" * (6 + len(offered)) + "|"]
    for name, result in results.items():
        most = result.most_completed()[0]
        for policy, capacities in result.capacity.items():
            rates = {m: mean_spread(result.completed(m, policy)) for m in offered}
            counted = max(mean_spread(result.completed(m, policy, counted=True))[0] for m in offered)
            lines.append(f"| {name} | {policy} | {mean_spread(capacities)[0]:.2f} | "
                         + " | ".join(f"{mean:.2f} ± {sd:.2f}" for mean, sd in rates.values())
                         + f" | {ratio(rates[high][0], rates[low][0]):.3f} | {counted:.2f} | "
                         f"{ratio(mean_spread(capacities)[0], most):.2f} |")
    lines += ["", "| workload | best baseline | its capacity req/s | most completed req/s (whose, offered) | ceiling | "
                  + f"{OURS} capacity / most completed | most counted req/s (whose, offered) |", "|---" * 7 + "|"]
    for name, result in results.items():
        best = result.best_baseline()
        most, whose, multiple = result.most_completed()
        counted, counted_whose, counted_multiple = result.most_completed(counted=True)
        ours = f"{ratio(result.mean_capacity(OURS), most):.2f}" if OURS in result.capacity else "not run"
        lines.append(f"| {name} | {best} | {result.mean_capacity(best):.2f} | {most:.2f} ({whose}, {multiple:g}x) | "
                     f"{ratio(most, result.mean_capacity(best)):.3f}x | {ours} | "
                     f"{counted:.2f} ({counted_whose}, {counted_multiple:g}x) |")
    return lines


def capacity_targets(results: dict[str, CapacityResult]) -> list[str]:
    """Issue 27's targets on the means over seeds."""
    lines = ["", "Targets (issue 27), means over seeds:"]
    if OURS not in next(iter(results.values())).capacity:
        return lines + ["- ours not run"]
    ratios = {name: ratio(r.mean_capacity(OURS), r.mean_capacity(r.best_baseline())) for name, r in results.items()}
    leading = [name for name, value in ratios.items() if value >= 1.15]
    lines.append(target_line(f"capacity >= 1.15x the best prefix-aware baseline on {len(leading)} workload(s) "
                             f"({', '.join(leading) or 'none'}; need 3)", len(leading) / 3, 1.0, False))
    worst = min(ratios, key=ratios.get)
    lines.append(target_line(f"capacity vs the best prefix-aware baseline, worst workload ({worst})",
                             ratios[worst], 0.97, False))
    for multiple in OVERLOADS:
        goodput = {name: ratio(mean_of(r.goodput[multiple][OURS], "goodput_rps"),
                               max(mean_of(r.goodput[multiple][b], "goodput_rps") for b in PREFIX_AWARE if b in r.capacity))
                   for name, r in results.items()}
        worst = min(goodput, key=goodput.get)
        lines.append(target_line(f"goodput at {multiple:g}x the best baseline's capacity vs the best baseline there, "
                                 f"worst workload ({worst})", goodput[worst], 1.0, False))
    if all("pow2" in r.capacity for r in results.values()):
        vs_pow2 = {name: ratio(r.mean_capacity(OURS), r.mean_capacity("pow2")) for name, r in results.items()}
        worst = min(vs_pow2, key=vs_pow2.get)
        lines.append(target_line(f"capacity vs pow2, worst workload ({worst})", vs_pow2[worst], 1.0, False))
    return lines


def save_goodput_plot(results: dict[str, CapacityResult], path: str) -> None:
    """Goodput against offered rate per policy, one panel per workload (means over seeds), at
    every offered multiple the capacity section ran (up to 4x: where goodput collapses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names):
        result = results[name]
        base = result.mean_capacity(result.best_baseline())
        offered = sorted(result.goodput)  # GOODPUT_CURVE and the saturation runs' SATURATION_OFFERED
        for policy in result.capacity:
            rates = [m * base for m in offered]
            goodputs = [mean_of(result.goodput[m][policy], "goodput_rps") for m in offered]
            axis.plot(rates, goodputs, marker="o", label=policy)
        axis.plot([0, offered[-1] * base], [0, offered[-1] * base], color="grey", linewidth=0.5)
        axis.set_title(f"{name} (P90 TTFT <= {result.bound.ttft_p90_s:.2g} s)", fontsize=9)
        axis.set_xlabel("offered req/s")
    axes[0][0].set_ylabel("goodput req/s")
    axes[0][0].legend(fontsize=7)
    figure.suptitle("headroom router simulation: goodput vs offered rate (trace: " + TRACE_ATTRIBUTION + ")", fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- the host KV tier: swap or recompute per victim (issue 23) ----------------------------
# The workloads that preempt (long prompts beside short ones; long outputs), at and around the
# calibrated rate; ours with a host tier and `preemption_mode: auto` against ours recomputing
# and every baseline as deployed (recompute only).
SWAP_WORKLOADS = ("mixed_long", "long_output")
SWAP_LOADS = (0.85, 1.0, 1.2)
SWAP_POLICIES = (OURS_AUTO, OURS) + BASELINES
SWAP_COLUMNS = (  # (header, RunStats field, scale, format)
    ("preempt/1k req", "preemptions_per_1k", 1, ".1f"),
    ("swapped/1k req", "swap_preemptions_per_1k", 1, ".1f"),
    ("recomputed tokens", "recomputed_tokens", 1, ".0f"),
    ("recomputed %", "recomputed_fraction", 100, ".2f"),
    ("TTFT p99 s", "ttft_p99_s", 1, ".3f"),
    ("ITL p99 ms", "itl_p99_s", 1000, ".1f"),
    ("goodput req/s", "goodput_rps", 1, ".2f"),
    ("output tok/s", "output_tokens_per_s", 1, ".0f"),
    ("blocks over the link/1k req", "copied_blocks_per_1k", 1, ".0f"),
    ("of which waited for/1k req", "waited_blocks_per_1k", 1, ".0f"),
)


def run_swap(setup: Setup, out, runner: Runner) -> dict[tuple[str, float, str], list[RunStats]]:
    """SWAP_WORKLOADS at SWAP_LOADS of their calibrated rate (the tables' calibration when
    that section ran, else calibrated here), every policy of SWAP_POLICIES over --seeds;
    prints the table (means ± sample standard deviation) and the ratios; returns
    {(workload, load, policy): [RunStats per seed]}."""
    args = setup.args
    names = [name for name in SWAP_WORKLOADS if name in args.workloads]
    uncalibrated = [name for name in names if name not in setup.calibrations]
    for name, calibration in zip(uncalibrated, runner.map(calibrate_workload, [(setup, n) for n in uncalibrated])):
        setup.calibrations[name] = calibration
    seeds = range(args.seed, args.seed + args.seeds)
    keys = [(name, load, policy) for name in names for load in SWAP_LOADS for policy in SWAP_POLICIES]
    jobs = [(setup, seed, StatsFeed(), policy, name, load * setup.calibrations[name].rate_rps)
            for name, load, policy in keys for seed in seeds]
    outcomes = iter(runner.map(simulate, jobs))
    results = {key: [next(outcomes) for _ in seeds] for key in keys}
    cost, config = setup.cost, setup.config
    costs = cost.preemption_costs(config)
    print(f"\n## Host KV tier: swap or recompute per victim (issue 23), seeds {seeds.start}-{seeds.stop - 1}: "
          f"mean ± sample standard deviation", file=out)
    print(f"{OURS_AUTO}: {args.host_kv_blocks} host blocks per replica beside {config.num_usable_blocks} on the "
          f"device, preemption_mode auto; {OURS} and every baseline recompute (no host tier). The replicas' "
          f"rates, from the cost model as an engine measures them at start-up: recompute "
          f"{costs.recompute_s_per_token * 1e3:.4f} ms per token ({costs.recompute_s_per_token * 1e3 * config.block_size:.3f} "
          f"ms per block), a block's copy {costs.swap_s_per_block * 1e3:.4f} ms each way "
          f"({cost.kv_block_bytes(config.block_size) / 2**20:.3g} MiB at {cost.swap_bytes_per_s / 1e9:.3g} GB/s): "
          f"swaps and host hits charged before the step that needs them, the prefix cache's write-throughs and the "
          f"swap-ins prefetched a step ahead on the link beside the step (a step waits for them only where they "
          f"outlast the one before). Goodput: TTFT <= {TTFT_SLO_S} s and TPOT <= "
          f"{TPOT_SLO_S * 1000:.0f} ms.", file=out)
    for name in names:
        calibration = setup.calibrations[name]
        print(f"{name}: {requests_for(name, args.requests)} requests per run; calibrated rate "
              f"{calibration.rate_rps:.2f} req/s ({calibration_reason(calibration)})", file=out)
    print("\n| workload | load | policy | " + " | ".join(header for header, *_ in SWAP_COLUMNS) + " |\n"
          + "|---" * (3 + len(SWAP_COLUMNS)) + "|", file=out)
    for (name, load, policy), runs in results.items():
        cells = [name, f"{load:.0%}", policy] + [
            "{0:{2}} ± {1:{2}}".format(*mean_spread([getattr(s, metric) * scale for s in runs]), fmt)
            if len(runs) > 1 else f"{getattr(runs[0], metric) * scale:{fmt}}"
            for _, metric, scale, fmt in SWAP_COLUMNS]
        print("| " + " | ".join(cells) + " |", file=out)
    print("", file=out)
    for line in swap_report(results, names):
        print(line, file=out)
    return results


def swap_report(results: dict[tuple[str, float, str], list[RunStats]], names: Sequence[str]) -> list[str]:
    """Per workload and load, on the means over seeds: ours with auto against ours recomputing
    and against the baseline with the most goodput there."""
    lines = [f"{OURS_AUTO} vs {OURS} (recompute) and vs the baseline with the most goodput, means over seeds:"]
    for name in names:
        for load in SWAP_LOADS:
            def mean(policy: str, metric: str) -> float:
                return mean_of(results[(name, load, policy)], metric)

            best = max(BASELINES, key=lambda policy: mean(policy, "goodput_rps"))
            parts = []
            for other in (OURS, best):
                parts.append(f"vs {other}: recomputed tokens {mean(OURS_AUTO, 'recomputed_tokens'):.0f} vs "
                             f"{mean(other, 'recomputed_tokens'):.0f} "
                             f"({ratio(mean(OURS_AUTO, 'recomputed_tokens'), mean(other, 'recomputed_tokens')):.2f}x), "
                             + ", ".join(f"{label} {ratio(mean(OURS_AUTO, metric), mean(other, metric)):.2f}x"
                                         for label, metric in (("p99 TTFT", "ttft_p99_s"), ("p99 ITL", "itl_p99_s"),
                                                               ("goodput", "goodput_rps"))))
            lines.append(f"- {name} at {load:.0%}: " + "; ".join(parts))
    return lines


# ---- entry point -------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small runs for a smoke test")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default 1000; 150 with --quick); long_output runs use 40%%")
    parser.add_argument("--calibration-requests", type=int, default=None,
                        help="requests per calibration run (default 400; 100 with --quick)")
    parser.add_argument("--calibration-steps", type=int, default=None, help="bisection steps (default 5; 2 quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tables; the first of --seeds")
    parser.add_argument("--seeds", type=int, default=None,
                        help="workload seeds run at the target points (default 5; 1 with --quick)")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE_PATH), help="Azure LLM 2023 conversation trace CSV")
    parser.add_argument("--plot", default="bench/out/router_sim.png")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes running simulations at once (virtual time: the figures do not change)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default=",".join(str(load) for load in LOADS),
                        help="fractions of the latency-calibrated rate")
    parser.add_argument("--cost-model", default="assumed", metavar="FILE",
                        help="step-time model: a JSON fit written by bench/bench_engine.py --cost-model, a "
                             "shipped fit by name (bench/cost_models/NAME.json), or 'assumed' (bench/cost_model.py's ASSUMED)")
    parser.add_argument("--sections", default="capacity,tables",
                        help="capacity (the headline: capacity at SLO, goodput past it), tables (fixed loads, "
                             "stale stats, the issue-12 target points), swap (issue 23: a host KV tier, swap or "
                             "recompute per victim, on mixed_long and long_output at 85-120%% load)")
    parser.add_argument("--capacity-policies", default=",".join(CAPACITY_POLICIES),
                        help="policies whose capacity is searched ('all': every policy)")
    parser.add_argument("--capacity-requests", type=int, default=None,
                        help="requests per capacity and goodput run (default 400; 100 with --quick)")
    parser.add_argument("--capacity-steps", type=int, default=None,
                        help="bisection steps of each capacity search (default 6: brackets of 4x / 2x end "
                             "2%% / 1%% wide; 2 quick)")
    parser.add_argument("--goodput-plot", default="bench/out/router_sim_goodput.png")
    parser.add_argument("--num-kv-blocks", type=int, default=3073,
                        help="KV pool per replica incl. the null block (default: 3072 x 16 = 49k tokens)")
    parser.add_argument("--host-kv-blocks", type=int, default=None,
                        help="host KV tier per replica of the swap section's ours (default: twice the device "
                             "pool; 12 GiB of the assumed model's KV by default)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.requests = args.requests or (150 if quick else 1000)
    args.calibration_requests = args.calibration_requests or (100 if quick else 400)
    args.calibration_steps = args.calibration_steps if args.calibration_steps is not None else (2 if quick else 5)
    args.seeds = args.seeds or (1 if quick else 5)
    args.capacity_requests = args.capacity_requests or (100 if quick else 400)
    args.capacity_steps = args.capacity_steps if args.capacity_steps is not None else (2 if quick else 6)
    if args.capacity_requests < 20:
        parser.error("--capacity-requests: need at least 20 for percentiles to mean anything")
    args.sections = args.sections.split(",")
    for section in args.sections:
        if section not in ("capacity", "tables", "swap"):
            parser.error(f"--sections: unknown {section!r}; expected some of capacity,tables,swap")
    args.capacity_policies = (list(POLICY_NAMES) if args.capacity_policies == "all"
                              else args.capacity_policies.split(","))
    for policy in args.capacity_policies:
        if policy not in POLICY_NAMES:
            parser.error(f"--capacity-policies: unknown {policy!r}; expected some of {','.join(POLICY_NAMES)} or all")
    if "capacity" in args.sections and not any(policy in PREFIX_AWARE for policy in args.capacity_policies):
        parser.error("--capacity-policies: include a prefix-aware baseline (the capacity ratios are against the best one)")
    try:
        args.cost = ASSUMED if args.cost_model == "assumed" else CostModel.load(shipped_or_path(args.cost_model))
    except ValueError as error:
        parser.error(str(error))
    if args.requests < 20 or args.calibration_requests < 20:
        parser.error("--requests / --calibration-requests: need at least 20 for percentiles to mean anything")
    args.workloads = args.workloads.split(",")
    for workload in args.workloads:
        if workload not in WORKLOADS:
            parser.error(f"--workloads: unknown {workload!r}; expected some of {','.join(WORKLOADS)}")
    args.loads = [float(load) for load in args.loads.split(",")]
    if args.host_kv_blocks is None:
        args.host_kv_blocks = 2 * (args.num_kv_blocks - 1)
    elif args.host_kv_blocks < 1:
        parser.error(f"--host-kv-blocks: must be >= 1, got {args.host_kv_blocks}")
    if "swap" in args.sections and not any(name in args.workloads for name in SWAP_WORKLOADS):
        parser.error(f"--workloads: the swap section runs {' and '.join(SWAP_WORKLOADS)}; include one")
    return args


def shipped_or_path(name: str) -> str:
    """A shipped fit by name (bench/cost_models/<name>.json), else the path as given."""
    shipped = SHIPPED_DIR / f"{name}.json"
    return str(shipped) if "/" not in name and not name.endswith(".json") and shipped.exists() else name


def engine_config(num_kv_blocks: int) -> EngineConfig:
    # vLLM defaults (block 16, chunked prefill, prefix caching, FCFS, watermark 0) with a
    # 2048-token step budget, and room for a 16k prompt plus its output.
    return make_engine_config(
        block_size=16, num_kv_blocks=num_kv_blocks, max_model_len=20480, max_num_batched_tokens=2048, max_num_seqs=256
    )


def requests_for(workload: str, num_requests: int) -> int:
    # Decode-heavy requests take ~4x longer each; fewer of them keep the run's wall time even.
    return max(20, int(num_requests * 0.4)) if workload == "long_output" else num_requests


def capacity_requests(workload: str, num_requests: int, rate_rps: float, min_span_s: float) -> int:
    """requests_for(workload, num_requests), or enough that their arrivals at `rate_rps` span
    `min_span_s` (CAPACITY_MIN_SPAN_DURATIONS)."""
    return max(requests_for(workload, num_requests), math.ceil(rate_rps * min_span_s))


@dataclass
class Setup:
    args: argparse.Namespace
    config: EngineConfig
    cost: CostModel
    calibrations: dict[str, Calibration] = field(default_factory=dict)

    def sim(self, seed: int, feed: StatsFeed = StatsFeed()) -> ClusterSim:
        return ClusterSim(self.config, self.args.replicas, self.cost, feed, seed, self.args.host_kv_blocks)

    def workload(self, name: str, seed: int, calibration: bool = False, capacity: bool = False) -> Workload:
        args = self.args
        num = args.calibration_requests if calibration else args.capacity_requests if capacity else args.requests
        return make_workload(name, requests_for(name, num), seed, self.args.trace)

    def capacity_workload(self, name: str, seed: int, rate_rps: float, min_span_s: float) -> Workload:
        """A capacity or goodput run's requests at `rate_rps`: --capacity-requests (long_output
        40%), or more where their arrivals would span less than `min_span_s` (SLOBound.min_span_s)."""
        num = capacity_requests(name, self.args.capacity_requests, rate_rps, min_span_s)
        return make_workload(name, num, seed, self.args.trace)


def run_benchmark(args: argparse.Namespace, out=sys.stdout) -> dict:
    """The sections asked for: capacity at SLO per workload and policy with goodput past it
    (the headline), then the fixed-load tables (calibrates each workload's rate, runs every
    workload x load x policy, the stale-stats runs and the target points over seeds); prints
    the report; returns {"capacity": {workload: CapacityResult}, "results": {(workload,
    load, policy): RunStats}, "stale": {(condition, policy): RunStats}, "points": {target:
    {policy: [RunStats per seed]}}, "swap": {(workload, load, policy): [RunStats per seed]},
    "calibrations": {workload: Calibration}} (empty for a section not run)."""
    started = time.perf_counter()
    setup = Setup(args, engine_config(args.num_kv_blocks), args.cost)
    config, cost = setup.config, setup.cost
    print("# Router simulation benchmark", file=out)
    print(f"{args.replicas} replicas; engine: block {config.block_size}, {config.num_usable_blocks} KV blocks "
          f"({config.num_usable_blocks * config.block_size} tokens), max_num_batched_tokens "
          f"{config.max_num_batched_tokens}, max_num_seqs {config.max_num_seqs}, max_model_len {config.max_model_len}; "
          f"admission: {OURS} reserve_expected (a request held for growth at most "
          f"{config.admission_max_hold_ms:g} ms, one that can still make its TTFT SLO only until its latest start, one "
          f"past it {config.admission_max_hold_late_ms:g} ms: the engine's rule), queued by TTFT SLO; prefix cache "
          f"keeps shared blocks longest (up to {config.prefix_cache_protected_share:g} of the pool); baselines "
          f"optimistic, first come first served, plain LRU",
          file=out)
    print(f"cost model: {args.cost_model} -- {cost.describe()}", file=out)
    print(f"loads every {REPORT_INTERVAL_S * 1000:.0f} ms, KV events every step, stale after 1 s; goodput SLO: "
          f"TTFT <= {TTFT_SLO_S} s and TPOT <= {TPOT_SLO_S * 1000:.0f} ms (capacity section: the workload's "
          f"bound); seed {args.seed}; first {WARMUP_FRACTION:.0%} of arrivals not measured", file=out)
    print(f"trace: {args.trace} -- {TRACE_ATTRIBUTION}", file=out)

    capacity: dict = {}
    results: dict = {}
    stale: dict = {}
    points: dict = {}
    swap: dict = {}
    with Runner(args.jobs) as runner:
        if "capacity" in args.sections:
            capacity = run_capacity(setup, out, runner)
            if args.goodput_plot:
                save_goodput_plot(capacity, args.goodput_plot)
                print(f"\nplot: {args.goodput_plot}", file=out)
        if "tables" in args.sections:
            run_tables(setup, results, out, runner)
            stale = run_stale_stats(setup, out, runner)
            points = run_target_points(setup, results, out, runner)
        if "swap" in args.sections:
            swap = run_swap(setup, out, runner)
    if "tables" in args.sections:
        print("", file=out)
        for line in check_targets(results, points):
            print(line, file=out)
        if args.plot:
            save_plot(results, args.workloads, args.loads, args.plot)
            print(f"\nplot: {args.plot}", file=out)
    print(f"wall time {time.perf_counter() - started:.0f} s", file=out)
    return {"capacity": capacity, "results": results, "stale": stale, "points": points, "swap": swap,
            "calibrations": setup.calibrations}


def run_tables(setup: Setup, results: dict, out, runner: "Runner") -> None:
    """Each workload's calibration and fixed-load table (seed --seed), into `results`."""
    args = setup.args
    tables = runner.map(workload_table, [(setup, name) for name in args.workloads])
    for workload_name, (calibration, num_requests, rows) in zip(args.workloads, tables):  # in order, as done
        setup.calibrations[workload_name] = calibration
        print(f"\n## {workload_name}: {num_requests} requests per run; calibrated rate "
              f"{calibration.rate_rps:.2f} req/s ({calibration_reason(calibration)}); doubling rates (inf: never) "
              + ", ".join(f"{name} {rate:.2f}" for name, rate in calibration.doubling_rps.items())
              + "; saturated throughputs " + ", ".join(f"{name} {rate:.2f}"
                                                       for name, rate in calibration.saturated_rps.items()),
              file=out)
        print(table_header("workload", "load"), file=out)
        for load, policy, stats in rows:
            results[(workload_name, load, policy)] = stats
            print(format_row(workload_name, load, policy, stats), file=out, flush=True)


def calibration_reason(calibration: Calibration) -> str:
    if calibration.best == CAPACITY_BOUND:
        return "no baseline's median TTFT doubles at any rate a run this size can offer: the token-capacity bound"
    if calibration.best == SATURATED:
        return ("the best baseline's saturated throughput, below every rate at which a median TTFT doubles: "
                "past it optimistic admission turns load into preemptions, not TTFT")
    return (f"median TTFT of {calibration.best} doubles over its unloaded "
            f"{calibration.unloaded_ttft_p50_s[calibration.best] * 1000:.0f} ms")


class Runner:
    """Runs simulations in `jobs` processes (forked: each inherits the imported modules), or
    in this one when jobs is 1; `map` yields results in the order of its items."""

    def __init__(self, jobs: int):
        self.executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) if jobs > 1 else None

    def map(self, fn: Callable, items: Sequence[tuple]):
        """fn(*item) for each item (argument tuples)."""
        if not items:
            return iter(())
        return (self.executor.map if self.executor is not None else map)(fn, *zip(*items))

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)


def workload_table(setup: Setup, workload_name: str) -> tuple[Calibration, int, list[tuple[float, str, RunStats]]]:
    """One workload's calibration and its table rows (load, policy, stats), on the table seed."""
    args = setup.args
    calibration = calibrate_workload(setup, workload_name)
    workload = setup.workload(workload_name, args.seed)
    rows = [(load, policy, setup.sim(args.seed).run(policy, workload, load * calibration.rate_rps))
            for load in args.loads for policy in POLICY_NAMES]
    return calibration, len(workload.requests), rows


def calibrate_workload(setup: Setup, workload_name: str) -> Calibration:
    args = setup.args
    return calibrate(setup.workload(workload_name, args.seed, calibration=True), setup.config, setup.cost,
                     args.replicas, args.seed, args.calibration_steps)


def simulate(setup: Setup, seed: int, feed: StatsFeed, policy: str, workload_name: str, rate_rps: float) -> RunStats:
    return setup.sim(seed, feed).run(policy, setup.workload(workload_name, seed), rate_rps)


def run_stale_stats(setup: Setup, out, runner: Runner) -> dict:
    """Ours and the load-reading baselines on mixed_long at 85% with late or lost updates."""
    args = setup.args
    if "mixed_long" not in setup.calibrations:
        return {}
    rate = 0.85 * setup.calibrations["mixed_long"].rate_rps
    print("\n## Stale stats: mixed_long at 85% load", file=out)
    print("round_robin, pow2, approx_prefix and dynamo read no load reports; KV events are delayed alike.", file=out)
    print(table_header("workload", "load", "condition"), file=out)
    runs = [(feed, policy)
            for feed in (StatsFeed(delay_s=0.1), StatsFeed(delay_s=0.5), StatsFeed(delay_s=2.0), StatsFeed(drop_fraction=0.05))
            for policy in (OURS, "least_loaded", "precise_prefix")]
    stale = {}
    outcomes = runner.map(simulate, [(setup, args.seed, feed, policy, "mixed_long", rate) for feed, policy in runs])
    for (feed, policy), stats in zip(runs, outcomes):
        stale[(feed.label, policy)] = stats
        print(format_row("mixed_long", 0.85, policy, stats, feed.label), file=out, flush=True)
    return stale


def target_points(setup: Setup, out) -> list[TargetPoint]:
    """The issue's target points among the workloads run. The multi-tenant one sits where
    load-only routing (least_loaded: queue + KV utilization, llm-d's load-aware scheduler)
    passes a P90 TTFT of 2 s."""
    args, points = setup.args, []
    everyone = POLICY_NAMES
    if "multi_tenant" in setup.calibrations:
        calibration = setup.calibrations["multi_tenant"]
        workload = setup.workload("multi_tenant", args.seed, calibration=True)
        sim = setup.sim(args.seed)
        rate = rate_where(lambda r: sim.run("least_loaded", workload, r).ttft_p90_s, TARGET_TTFT_P90_S,
                          calibration.rate_rps * 0.5, calibration.rate_rps * 2, args.calibration_steps)
        print(f"\nmulti_tenant target point: least_loaded P90 TTFT passes {TARGET_TTFT_P90_S} s at {rate:.2f} req/s "
              f"= {rate / calibration.rate_rps:.0%} of the calibrated rate", file=out)
        points.append(TargetPoint("multi_tenant", "multi_tenant", rate / calibration.rate_rps, everyone))
    if "hot_tenant" in setup.calibrations:
        points.append(TargetPoint("hot_tenant", "hot_tenant", 0.85, everyone))
    if "mixed_long" in setup.calibrations:
        points.append(TargetPoint("mixed_long", "mixed_long", 0.85, everyone + (OPTIMISTIC_OURS, ORACLE, LATE_STATS)))
    return points


def run_target_points(setup: Setup, results: dict, out, runner: Runner) -> dict[str, dict[str, list[RunStats]]]:
    """Each target point once per seed (each seed draws its own requests; the rate is the
    table seed's calibration); prints mean and spread. Table runs are reused for seed 0."""
    args = setup.args
    points = target_points(setup, out)
    outcome = {point.label: {name: [] for name in point.policies} for point in points}
    slots, todo = [], []  # every run not in the tables, all points at once, so --jobs keeps every process busy
    for point in points:
        rate = point.load * setup.calibrations[point.workload].rate_rps
        for seed in range(args.seed, args.seed + args.seeds):
            for name in point.policies:
                reused = results.get((point.workload, point.load, name)) if seed == args.seed else None
                if reused is None:
                    todo.append((setup, seed, feed_for(name), name, point.workload, rate))
                slots.append((outcome[point.label][name], reused))
    simulated = iter(runner.map(simulate, todo))
    for runs, reused in slots:  # in the order the slots were made, which is the order of `todo`
        runs.append(reused if reused is not None else next(simulated))
    for point in points:
        rate = point.load * setup.calibrations[point.workload].rate_rps
        runs = outcome[point.label]
        print(f"\n## Seeds: {point.workload} at {point.load:.0%} load ({rate:.2f} req/s), seeds {args.seed}-"
              f"{args.seed + args.seeds - 1}: mean ± sample standard deviation", file=out)
        print("| " + METRIC_HEADER + "\n" + "|---" * (1 + len(METRIC_COLUMNS)) + "|", file=out)
        for name, stats in runs.items():
            cells = [name] + [
                "{0:{2}} ± {1:{2}}".format(*mean_spread([getattr(s, metric) * scale for s in stats]), fmt)
                for _, metric, scale, fmt in METRIC_COLUMNS
            ]
            print("| " + " | ".join(cells) + " |", file=out, flush=True)
    return outcome


def main(argv: Optional[list[str]] = None) -> None:
    run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
