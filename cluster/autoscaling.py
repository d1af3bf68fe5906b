"""Autoscaling on memory pressure (issue 25): the `headroom` policy Ray Serve's autoscaler runs
for the LLMReplica deployment, the stats each replica reports to it, and the board where every
decision is published for the metric and `headroom status`.

Each replica reports, from the load it already streams (`autoscaling_stats`, called by
`LLMReplica.record_autoscaling_stats`): its KV capacity, its KV demand (tokens its requests
hold plus what they are committed to grow by under its admission mode), its waiting prefill,
its smoothed preemption rate and, with a host KV tier, that tier's size and the KV parked in
it by swapped-out requests. Serve keeps them over `look_back_period_s` and hands them to
the policy in an `AutoscalingContext`; the policy reads each replica's newest point, and
`decide`, a pure function, turns them into a replica count: enough replicas to hold the
cluster's KV demand at `target_utilization`, at least one per
`waiting_prefill_tokens_per_replica` of waiting prefill, one more at once when the mean
preemption rate passes `preemption_rate_threshold` or the KV parked in the host tiers passes
`target_utilization` of them (the next preemptions would recompute); fewer only when the
demand would fit the smaller count at `scale_down_utilization` (hysteresis) for
`downscale_delay_s`, the mean preemption rate is at most its threshold and nothing is
parked, and then half the surplus at a time; and once a scale-down has rebounded (a backlog
or a step at once asked for the count it left), never below that count again until the demand
has eased by the same band (the pressure floor).

The host tier is not capacity: a request parked there makes no progress until it is back on
the device. Its KV stays in the demand (a swapped-out request is a waiting one, whose tokens
and growth the committed KV counts), so parking never hides demand from the arithmetic.

`requests` (Serve's own policy on requests in flight, `target_ongoing_requests`) is the
baseline; `RequestsAutoscalingPolicy` runs Serve's function unchanged and only publishes its
decisions beside ours.

This module is cloudpickled by value into Serve's controller (Serve does that to a policy's
module), so it imports nothing of headroom's: the controller needs only Ray. Ray itself is imported
where it is used, so the config (which reads the policy names here) stays light.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

logger = logging.getLogger(__name__)

POLICY_NAMES = ("headroom", "requests")
# Serve's import paths of the two policies (AutoscalingConfig.policy.policy_function).
POLICY_FUNCTIONS = {
    "headroom": "cluster.autoscaling:HeadroomAutoscalingPolicy",
    "requests": "cluster.autoscaling:RequestsAutoscalingPolicy",
}

# The keys of a replica's autoscaling stats (record_autoscaling_stats), each a number.
KV_CAPACITY_STAT = "kv_capacity_tokens"
KV_DEMAND_STAT = "kv_demand_tokens"
WAITING_PREFILL_STAT = "waiting_prefill_tokens"
PREEMPTION_RATE_STAT = "preemption_rate"
HOST_CAPACITY_STAT = "host_kv_capacity_tokens"  # 0 without a host tier
HOST_PARKED_STAT = "host_kv_parked_tokens"  # KV of swapped-out requests, in the host tier
STAT_KEYS = (KV_CAPACITY_STAT, KV_DEMAND_STAT, WAITING_PREFILL_STAT, PREEMPTION_RATE_STAT, HOST_CAPACITY_STAT,
             HOST_PARKED_STAT)

# Why the policy wants the count it wants: the `reason` label of
# headroom_autoscaler_desired_replicas.
REASONS = (
    "steady",         # the count holds the demand; nothing to change
    "kv_demand",      # more replicas hold the committed KV at the target utilisation
    "kv_trend",       # ... once its rise over replica_startup_s is added: more than today's needs
    "waiting_work",   # the waiting prefill needs more replicas than the KV does
    "preemptions",    # the preemption rate passed its threshold: one more replica, at once
    "host_tier",      # the KV parked in the host tiers passed the target utilisation: one more, at once
    "low_demand",     # the demand fits fewer replicas at the scale-down utilisation, for the delay
    "pending",        # a change is wanted but its delay has not passed
    "min_replicas",   # the wanted count was below the bounds
    "max_replicas",   # the wanted count was above the bounds
    "no_stats",       # no replica has reported yet: the count stays
    "awaiting_stats", # a running replica has yet to report: no step at once and no scale-down (for a while)
    "requests",       # the requests-in-flight policy (its reasons are its own arithmetic)
)
# Signs that the cluster is already out of device KV: a step up for them skips upscale_delay_s.
AT_ONCE_REASONS = ("preemptions", "host_tier")


def autoscaling_stats(load: Any) -> dict[str, float]:
    """A replica's autoscaling stats from its load report (a ReplicaLoad or anything with its
    fields): capacity and demand in tokens, waiting prefill, preemptions per second, and the
    host tier's size and the KV parked in it (the host blocks swapped-out requests hold: its
    free blocks count the spilled prefix-cache ones, which any swap-out may reuse)."""
    held_tokens = (load.kv_blocks_total - load.kv_blocks_free) * load.block_size
    return {
        KV_CAPACITY_STAT: float(load.kv_blocks_total * load.block_size),
        KV_DEMAND_STAT: float(held_tokens + load.kv_committed_tokens),
        WAITING_PREFILL_STAT: float(load.waiting_prefill_tokens),
        PREEMPTION_RATE_STAT: float(load.preemption_rate),
        HOST_CAPACITY_STAT: float(load.host_kv_blocks_total * load.block_size),
        HOST_PARKED_STAT: float((load.host_kv_blocks_total - load.host_kv_blocks_free) * load.block_size),
    }


@dataclass(frozen=True)
class ReplicaSignal:
    """One replica's stats as the policy reads them."""

    kv_capacity_tokens: float
    kv_demand_tokens: float
    waiting_prefill_tokens: float = 0.0
    preemption_rate: float = 0.0
    host_kv_capacity_tokens: float = 0.0
    host_kv_parked_tokens: float = 0.0

    @classmethod
    def from_stats(cls, stats: Mapping[str, float]) -> Optional["ReplicaSignal"]:
        """None when the replica has not reported a capacity yet (it is still starting), or
        reported a value that is no finite number (one such replica must not stop the policy)."""
        if not stats.get(KV_CAPACITY_STAT, 0.0) > 0 or not all(map(math.isfinite, stats.values())):
            return None
        return cls(stats[KV_CAPACITY_STAT], stats.get(KV_DEMAND_STAT, 0.0),
                   stats.get(WAITING_PREFILL_STAT, 0.0), stats.get(PREEMPTION_RATE_STAT, 0.0),
                   stats.get(HOST_CAPACITY_STAT, 0.0), stats.get(HOST_PARKED_STAT, 0.0))


@dataclass(frozen=True)
class HeadroomPolicyParams:
    """The headroom policy's knobs. cluster/config.py's AutoscalingConfig validates them and
    passes every one; these defaults, which apply to a Serve config naming the policy without
    policy_kwargs, are the same (a test holds them equal: this module imports nothing of
    headroom's, so it cannot read them from there)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_utilization: float = 0.8
    scale_down_utilization: float = 0.6
    preemption_rate_threshold: float = 0.5
    waiting_prefill_tokens_per_replica: float = 16384.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    replica_startup_s: float = 30.0
    # replicas.drain_timeout_s: how long a replica removed may still hold requests, and so how
    # long its demand, which it stops reporting, is remembered (PolicyState.demand_before_scale_down).
    drain_timeout_s: float = 300.0


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between decisions: since when it has wanted more (fewer)
    replicas than the target, for the delays; the cluster's KV demand over the last
    replica_startup_s, for its trend."""

    wants_up_since: Optional[float] = None
    wants_down_since: Optional[float] = None
    demand_history: tuple[tuple[float, float], ...] = ()  # (time, KV demand), oldest first
    # The cluster's KV demand when it last scaled down. The replica removed stops reporting
    # while its requests still run (it drains), so the demand measured drops and then climbs
    # back as arrivals go to the replicas left: that climb, up to this level, is the same
    # demand moving, not a trend to scale for; nor is the dip a drop to scale down further for.
    demand_before_scale_down: Optional[float] = None
    scaled_down_at: Optional[float] = None  # when; the level is forgotten drain_timeout_s later
    # Since when fewer replicas have reported than Serve runs (None: all have).
    partial_since: Optional[float] = None
    # The count before the latest scale-down, and when: a backlog or a step at once asking for
    # it again within drain_timeout_s is a rebound (the smaller count could not carry the load).
    scaled_down_from: int = 0
    scaled_down_from_at: Optional[float] = None
    # After a rebound, the most replicas a backlog (the waiting prefill) or the preemption or
    # host-tier step asked for beyond those running: scale-downs go no lower. The backlog that
    # built at fewer is gone at this count, so what it measures here never says fewer would do.
    # Kept for downscale_delay_s after it was last asked for, then while the KV demand stays
    # above scale_down_utilization / target_utilization of the demand at that point (the band
    # the KV arithmetic has: the load that built the backlog has not eased by it). Only after a
    # rebound: a one-off burst that scaled up once leaves no floor, so the count comes back.
    pressure_floor: int = 0
    pressure_floor_asked_at: Optional[float] = None
    pressure_floor_demand: Optional[float] = None  # the demand it stands for, once its delay has passed


# The demand history keeps at most one point per this many seconds (Serve decides every 0.1 s;
# a replica's stats change once per metrics_interval_s), and needs this many for a trend.
DEMAND_HISTORY_SPACING_S = 1.0
DEMAND_TREND_MIN_POINTS = 3
# How long a running replica that has yet to report holds back steps at once and scale-downs
# (a new one reports within metrics_interval_s, 2 s by default): past this, one whose stats
# never parse must not stop the policy, which goes on with those that report.
UNREPORTED_GRACE_S = 10.0


@dataclass(frozen=True)
class Decision:
    """The replica count the policy wants now, why, and the inputs it came from."""

    desired_replicas: int
    reason: str
    kv_demand_tokens: float = 0.0
    kv_capacity_tokens: float = 0.0  # per replica, the mean of those reporting
    waiting_prefill_tokens: float = 0.0
    preemption_rate: float = 0.0  # per replica, the mean of those reporting
    host_kv_parked_tokens: float = 0.0  # in all host tiers (already part of kv_demand_tokens)
    host_kv_usage: float = 0.0  # the parked KV over the host tiers' size (0 without host tiers)
    kv_demand_growth_tokens: float = 0.0  # what the demand's trend adds over replica_startup_s
    kv_replicas: int = 0  # replicas that hold the demand (and its growth) at the target utilisation
    waiting_replicas: int = 0  # replicas the waiting prefill asks for
    # The pressure floor after this decision (PolicyState.pressure_floor): no scale-down below
    # this many (0: none); held at least until pressure_floor_until (a time, while its
    # downscale_delay_s runs), then until the KV demand falls to pressure_floor_release_tokens.
    pressure_floor: int = 0
    pressure_floor_until: Optional[float] = None
    pressure_floor_release_tokens: float = 0.0


def decide(signals: Sequence[ReplicaSignal], running: int, target: int, params: HeadroomPolicyParams,
           now: float, state: PolicyState = PolicyState()) -> tuple[Decision, PolicyState]:
    """The replica count for `signals` (one per reporting replica), given `running` replicas
    and Serve's current `target` (above `running` while replicas start).

    Scale up to the larger of what the KV demand needs at the target utilisation and what the
    waiting prefill needs, once that has been wanted for upscale_delay_s. The demand is the
    one a replica started now will meet: today's plus its rise over the last
    replica_startup_s (the least-squares slope of the cluster's demand, never negative)
    continued for as long again, since a replica added when the demand reaches the target
    serves only after it has grown that much more (a history shorter than that, as after a
    restart, is continued only as far as it reaches). A preemption rate
    above the threshold asks for one replica more than run now, at once (a replica already
    starting counts: one step per start), and so does KV parked in the host tiers beyond the
    target utilisation of their size: a swap-out is the cheap preemption, and once the tiers
    are that full the next victims are recomputed. Scale down towards what holds the demand
    at the lower scale-down utilisation, after downscale_delay_s of wanting it, and never
    while preempting above the threshold or while KV is parked (its requests wait for a
    device): the band between the two utilisations keeps a demand near a boundary from
    flapping the count, and the pressure floor keeps the count the waiting prefill or a step at
    once asked for beyond those running (PolicyState.pressure_floor) until the demand falls by
    that band; while a replica removed drains (until the demand is back at its level
    before the scale-down, or drain_timeout_s), that level stands in for the demand it holds
    unseen. Nothing is taken at once and nothing scaled down while a replica Serve runs has not
    reported yet (for UNREPORTED_GRACE_S at most: reason awaiting_stats). A scale-down removes at most half the replicas it could (rounded
    up), then waits downscale_delay_s
    again: the demand a smaller set carries is larger than the larger set measured (the same
    arrivals in bigger batches take longer, so more of them are live at once), and it is
    measured before the next step. The replica removed stops reporting while it drains, so the
    demand measured dips and climbs back as its share moves to the others: up to the level
    before the scale-down that climb is no trend. A preemption or host-tier step is taken at
    once even when the KV demand asks for more (the rest follows after upscale_delay_s), and a
    clock that steps back (Serve's is the wall's) restarts the history and the delays.
    """
    if not signals:
        return Decision(_bounded(target, params)[0], "no_stats"), PolicyState()
    if _clock_went_back(state, now):  # Serve's clock is the wall's: its history and delays restart
        state = PolicyState()
    demand = sum(signal.kv_demand_tokens for signal in signals)
    moved = state.demand_before_scale_down
    if moved is not None and demand >= moved:
        # The drained replica's share is back: the trend starts afresh from here.
        state, moved = replace(state, demand_history=(), demand_before_scale_down=None, scaled_down_at=None), None
    elif moved is not None and state.scaled_down_at is not None and now - state.scaled_down_at >= params.drain_timeout_s:
        # Whatever the drained replica held has ended by now: a demand still below is a fall.
        state, moved = replace(state, demand_before_scale_down=None, scaled_down_at=None), None
    # A replica Serve counts as running reports its first stats up to metrics_interval_s after it
    # serves: until every one has, the means leave it out (a preemption rate it would halve) and
    # the demand misses what it holds. No step at once and no scale-down on such a partial view,
    # for UNREPORTED_GRACE_S at most.
    partial_since = None
    if len(signals) < running:
        partial_since = state.partial_since if state.partial_since is not None else now
    all_reporting = partial_since is None or now - partial_since >= UNREPORTED_GRACE_S
    history = _recorded(state.demand_history, now, demand, params.replica_startup_s)
    # Continued as far ahead as it was measured, up to replica_startup_s: a slope fitted on the
    # 2-3 s after the history restarts, projected 30 s ahead, made one low sample a scale-up of
    # three replicas (bench_autoscale_sim, 2026-11-30).
    span = history[-1][0] - history[0][0] if history else 0.0
    growth = max(0.0, _slope(history)) * min(params.replica_startup_s, span)
    if moved is not None:  # a climb back towards the demand before the scale-down is no growth
        growth = min(growth, moved - demand)
    capacity = sum(signal.kv_capacity_tokens for signal in signals) / len(signals)
    waiting = sum(signal.waiting_prefill_tokens for signal in signals)
    preemption_rate = sum(signal.preemption_rate for signal in signals) / len(signals)
    host_capacity = sum(signal.host_kv_capacity_tokens for signal in signals)
    parked = sum(signal.host_kv_parked_tokens for signal in signals)
    host_usage = parked / host_capacity if host_capacity > 0 else 0.0
    kv_replicas = math.ceil((demand + growth) / (params.target_utilization * capacity))
    waiting_replicas = math.ceil(waiting / params.waiting_prefill_tokens_per_replica)
    inputs = dict(kv_demand_tokens=demand, kv_capacity_tokens=capacity, waiting_prefill_tokens=waiting,
                  preemption_rate=preemption_rate, host_kv_parked_tokens=parked, host_kv_usage=host_usage,
                  kv_demand_growth_tokens=growth, kv_replicas=kv_replicas, waiting_replicas=waiting_replicas)
    kept = PolicyState(demand_history=history, demand_before_scale_down=moved,
                       scaled_down_at=state.scaled_down_at if moved is not None else None, partial_since=partial_since,
                       scaled_down_from=state.scaled_down_from, scaled_down_from_at=state.scaled_down_from_at)

    wanted, reason = (kv_replicas, "kv_demand") if kv_replicas >= waiting_replicas else (waiting_replicas, "waiting_work")
    if reason == "kv_demand" and kv_replicas > math.ceil(demand / (params.target_utilization * capacity)):
        reason = "kv_trend"
    # Preempting, or the host tiers filling, is one replica more at once, whatever else asks for more.
    at_once: Optional[tuple[int, str]] = None
    if all_reporting and preemption_rate > params.preemption_rate_threshold:
        at_once = (running + 1, "preemptions")
    elif all_reporting and host_usage > params.target_utilization:
        at_once = (running + 1, "host_tier")
    if at_once is not None and at_once[0] >= wanted:
        wanted, reason = at_once
    kept = _with_pressure_floor(kept, state, max(waiting_replicas, at_once[0] if at_once is not None else 0),
                                running, demand, now, params)
    inputs.update(_pressure_floor_inputs(kept, params))
    if wanted > target:
        since = state.wants_up_since if state.wants_up_since is not None else now
        if reason in AT_ONCE_REASONS or now - since >= params.upscale_delay_s:
            return _decision(wanted, reason, params, inputs), kept
        if at_once is not None and at_once[0] > target:  # the rest of the step after the delay
            return _decision(at_once[0], at_once[1], params, inputs), replace(kept, wants_up_since=since)
        return _decision(target, "pending", params, inputs), replace(kept, wants_up_since=since)

    # While a removed replica drains, the demand it holds is not measured: the level before the
    # scale-down stands for it, or the next step would size the cluster without it.
    held = max(demand + growth, moved) if moved is not None else demand + growth
    fits = max(math.ceil(held / (params.scale_down_utilization * capacity)), waiting_replicas, kept.pressure_floor, 1)
    fewer = _bounded(target - math.ceil((target - fits) / 2), params)[0] if fits < target else target
    if fewer < target and all_reporting and preemption_rate <= params.preemption_rate_threshold and parked == 0:
        since = state.wants_down_since if state.wants_down_since is not None else now
        if now - since >= params.downscale_delay_s:
            return (_decision(fewer, "low_demand", params, inputs),
                    replace(kept, demand_before_scale_down=max(demand, moved or 0.0), scaled_down_at=now,
                            scaled_down_from=target, scaled_down_from_at=now))
        return _decision(target, "pending", params, inputs), replace(kept, wants_down_since=since)
    return _decision(target, "steady" if all_reporting else "awaiting_stats", params, inputs), kept


def _with_pressure_floor(kept: PolicyState, state: PolicyState, asked: int, running: int, demand: float, now: float,
                         params: HeadroomPolicyParams) -> PolicyState:
    """`kept` with the pressure floor (PolicyState.pressure_floor) after this decision: `asked`
    is the count the waiting prefill or a step at once asks for. Without it, a backlog that
    builds at N-1 replicas and drains at N scaled 1 -> 2 -> 1 ... every downscale_delay_s and
    replica startup, the backlog's latency at every return to N-1. It is set by a rebound (the
    count a scale-down left asked for again within drain_timeout_s), not by the first scale-up:
    a floor from every backlog kept the replica a one-off burst added while a steady load it
    left behind stayed above the band."""
    floor, asked_at, floor_demand = state.pressure_floor, state.pressure_floor_asked_at, state.pressure_floor_demand
    rebound = (state.scaled_down_from_at is not None and now - state.scaled_down_from_at <= params.drain_timeout_s
               and asked >= state.scaled_down_from)
    if asked > running and (rebound or asked_at is not None):  # this many are too few for the load
        floor, asked_at, floor_demand = max(asked, floor if asked_at is not None else 0), now, None
    elif asked_at is not None and now - asked_at >= params.downscale_delay_s:
        if floor_demand is None:  # the demand the count carries with the backlog gone
            floor_demand = demand
        elif demand <= params.scale_down_utilization / params.target_utilization * floor_demand:
            floor, asked_at, floor_demand = 0, None, None  # the load eased by the band: fewer may do
    return replace(kept, pressure_floor=floor, pressure_floor_asked_at=asked_at, pressure_floor_demand=floor_demand)


def _pressure_floor_inputs(state: PolicyState, params: HeadroomPolicyParams) -> dict[str, Any]:
    """The Decision fields that show `state`'s pressure floor: its count, and what holds it (its
    delay's end, or once that has passed, the KV demand it is lifted at)."""
    if not state.pressure_floor or state.pressure_floor_asked_at is None:
        return {}
    if state.pressure_floor_demand is None:
        return dict(pressure_floor=state.pressure_floor,
                    pressure_floor_until=state.pressure_floor_asked_at + params.downscale_delay_s)
    return dict(pressure_floor=state.pressure_floor, pressure_floor_release_tokens=(
        params.scale_down_utilization / params.target_utilization * state.pressure_floor_demand))


def _clock_went_back(state: PolicyState, now: float) -> bool:
    """Whether `now` is before a time `state` holds (a wall clock stepped back): its history
    would keep a stale trend, and its delays would wait as long as the step."""
    times = [t for t in (state.wants_up_since, state.wants_down_since, state.pressure_floor_asked_at,
                         state.scaled_down_from_at) if t is not None]
    if state.demand_history:
        times.append(state.demand_history[-1][0])
    return any(now < t for t in times)


def _recorded(history: tuple[tuple[float, float], ...], now: float, demand: float,
              window_s: float) -> tuple[tuple[float, float], ...]:
    """`history` with (now, demand) added (unless its newest point is under
    DEMAND_HISTORY_SPACING_S old) and the points older than window_s dropped."""
    if window_s <= 0:
        return ()
    if not history or now - history[-1][0] >= DEMAND_HISTORY_SPACING_S:
        history += ((now, demand),)
    return tuple(point for point in history if point[0] >= now - window_s)


def _slope(history: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of (time, demand), in tokens per second; 0 for too few points."""
    if len(history) < DEMAND_TREND_MIN_POINTS:
        return 0.0
    mean_t = sum(t for t, _ in history) / len(history)
    mean_demand = sum(demand for _, demand in history) / len(history)
    spread = sum((t - mean_t) ** 2 for t, _ in history)
    if spread == 0:
        return 0.0
    return sum((t - mean_t) * (demand - mean_demand) for t, demand in history) / spread


def _bounded(count: int, params: HeadroomPolicyParams) -> tuple[int, Optional[str]]:
    if count < params.min_replicas:
        return params.min_replicas, "min_replicas"
    if count > params.max_replicas:
        return params.max_replicas, "max_replicas"
    return count, None


def _decision(count: int, reason: str, params: HeadroomPolicyParams, inputs: dict) -> Decision:
    bounded, bound = _bounded(count, params)
    return Decision(bounded, bound or reason, **inputs)


# ---- in Serve's controller ---------------------------------------------------------------
_STATE_KEYS = {"wants_up_since": "headroom.wants_up_since", "wants_down_since": "headroom.wants_down_since",
               "demand_history": "headroom.demand_history",
               "demand_before_scale_down": "headroom.demand_before_scale_down",
               "scaled_down_at": "headroom.scaled_down_at", "partial_since": "headroom.partial_since",
               "scaled_down_from": "headroom.scaled_down_from", "scaled_down_from_at": "headroom.scaled_down_from_at",
               "pressure_floor": "headroom.pressure_floor", "pressure_floor_asked_at": "headroom.pressure_floor_asked_at",
               "pressure_floor_demand": "headroom.pressure_floor_demand"}


def latest_stats(ctx: AutoscalingContext) -> dict[Any, dict[str, float]]:
    """Each replica's newest stats in `ctx` (its raw series' last point), else Serve's means
    over look_back_period_s. The newest, because a mean over the window trails a rising
    demand by half the window, and a replica started late costs the startup time on top; the
    delays, not the averaging, keep a spike from starting one."""
    by_replica: dict[Any, dict[str, float]] = {}
    for stat, series_by_replica in (ctx.raw_metrics or {}).items():
        if stat in STAT_KEYS:
            for replica_id, series in series_by_replica.items():
                if series:
                    by_replica.setdefault(replica_id, {})[stat] = max(series, key=lambda point: point.timestamp).value
    if by_replica:
        return by_replica
    for stat, values in (ctx.aggregated_metrics or {}).items():
        if stat in STAT_KEYS:
            for replica_id, value in values.items():
                by_replica.setdefault(replica_id, {})[stat] = value
    return by_replica


class HeadroomAutoscalingPolicy:
    """Serve's policy callable for `replicas.autoscaling.policy: headroom` (Serve builds one
    per deployment from `policy_kwargs`, the HeadroomPolicyParams, and calls it every control
    loop). Its delays are its own: the deployment sets Serve's upscale/downscale delays to 0,
    which Serve's wrapper would otherwise add on top."""

    def __init__(self, **params: Any):
        self.params = HeadroomPolicyParams(**params)
        self.board = DecisionPublisher()

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        by_replica = latest_stats(ctx)
        signals = [signal for stats in by_replica.values() if (signal := ReplicaSignal.from_stats(stats)) is not None]
        params = HeadroomPolicyParams(**{**asdict(self.params), "min_replicas": ctx.capacity_adjusted_min_replicas,
                                         "max_replicas": ctx.capacity_adjusted_max_replicas})
        state = PolicyState(**{field: ctx.policy_state[key] for field, key in _STATE_KEYS.items()
                               if ctx.policy_state.get(key) is not None})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        decision, state = decide(signals, ctx.current_num_replicas, ctx.target_num_replicas, params, now, state)
        self.board.publish(ctx.app_name, decision, ctx.current_num_replicas, ctx.target_num_replicas, "headroom")
        policy_state = dict(ctx.policy_state)
        policy_state.update({key: getattr(state, field) for field, key in _STATE_KEYS.items()})
        return decision.desired_replicas, policy_state


class RequestsAutoscalingPolicy:
    """Serve's own request-count policy (`replicas.autoscaling.policy: requests`), unchanged,
    publishing its decisions on the board as ours does."""

    def __init__(self) -> None:
        self.board = DecisionPublisher()

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

        desired, policy_state = replica_queue_length_autoscaling_policy(ctx)
        count = min(max(math.ceil(desired), ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        self.board.publish(ctx.app_name, Decision(count, "requests"), ctx.current_num_replicas,
                           ctx.target_num_replicas, "requests")
        return desired, policy_state


# ---- the decision board --------------------------------------------------------------------
# Serve's controller runs the policy and offers no way out for what it decided but the
# replica count. The board, a named actor, holds each application's latest decision; the
# ingress exports it as headroom_autoscaler_desired_replicas and `headroom status` prints it.
BOARD_NAME = "headroom-autoscaler-decisions"
BOARD_NAMESPACE = "headroom"
# A policy that found no board looks again after this long (the ingress creates it at start).
BOARD_LOOKUP_PERIOD_S = 1.0


class DecisionPublisher:
    """The policy's side of the board: fire-and-forget, never blocking the controller's loop
    for more than a name lookup now and then.

    Serve runs the policy as soon as an application deploys, which can be before its ingress
    has created the board: what it decides meanwhile is kept (each application's latest
    decision and its last BOARD_CHANGES_KEPT count changes) and handed over, in order, once the
    board is found, so a scale-up decided in an application's first seconds is not lost."""

    def __init__(self) -> None:
        self._board = None
        self._looked_up_at = -math.inf
        self._unsent_changes: collections.deque = collections.deque(maxlen=BOARD_CHANGES_KEPT)
        self._unsent_latest: dict[str, dict[str, Any]] = {}

    def publish(self, app_name: Optional[str], decision: Decision, running: int, target: int, policy: str) -> None:
        record = {**asdict(decision), "running_replicas": running, "target_replicas": target, "policy": policy,
                  "timestamp": time.time()}
        app_name = app_name or ""
        board = self._lookup()
        if board is None:
            if is_new_change(record, self._unsent_latest.get(app_name)):
                self._unsent_changes.append((app_name, record))
            self._unsent_latest[app_name] = record
            return
        try:
            for unsent_app, unsent in self._unsent_records():
                board.record.remote(unsent_app, unsent)
            board.record.remote(app_name, record)
        except Exception:  # the board died with its ingress: find the next one
            self._board = None

    def _unsent_records(self) -> list[tuple[str, dict[str, Any]]]:
        """What was decided while no board was found, each application's in order: the count
        changes, then its latest decision where that was not the last change (the board records a
        change when it gets one); emptied."""
        records = list(self._unsent_changes)
        changes = {id(record) for _, record in records}
        records += [(app, record) for app, record in self._unsent_latest.items() if id(record) not in changes]
        self._unsent_changes.clear()
        self._unsent_latest.clear()
        return records

    def _lookup(self):
        if self._board is None and time.monotonic() - self._looked_up_at >= BOARD_LOOKUP_PERIOD_S:
            self._looked_up_at = time.monotonic()
            import ray

            if not ray.is_initialized():  # called outside a Ray process (tests): nowhere to publish
                return None
            try:
                self._board = ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
            except ValueError:  # not created yet
                self._board = None
        return self._board


# Decisions that changed an application's count, kept per application (for `headroom status`
# and tests: a change lasts one control loop, 0.1 s, before Serve's target follows it).
BOARD_CHANGES_KEPT = 32
# What makes one change another: the same wish decided again is the change already kept.
CHANGE_KEYS = ("desired_replicas", "target_replicas", "reason", "policy")


def is_new_change(record: dict[str, Any], previous: Optional[dict[str, Any]]) -> bool:
    """Whether `record` changes the count, other than the decision before it did. Serve applies
    the `requests` policy's delays after the policy, which is asked every control loop: through
    an upscale delay each loop published the same wish again, and the kept changes were all
    that one, `headroom status`'s "last change" dated to the last loop."""
    return record["desired_replicas"] != record["target_replicas"] and (
        previous is None or any(record[key] != previous[key] for key in CHANGE_KEYS))


class DecisionBoard:
    """The latest decision per application, and its latest decisions that changed the count
    (see decision_board())."""

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        self.changes: dict[str, list[dict[str, Any]]] = {}

    def record(self, app_name: str, record: dict[str, Any]) -> None:
        if is_new_change(record, self.latest.get(app_name)):
            changes = self.changes.setdefault(app_name, [])
            changes.append(record)
            del changes[:-BOARD_CHANGES_KEPT]
        self.latest[app_name] = record

    def get(self, app_name: str) -> Optional[dict[str, Any]]:
        return self.latest.get(app_name)

    def get_changes(self, app_name: str) -> list[dict[str, Any]]:
        return self.changes.get(app_name, [])


def decision_board():
    """The board's actor handle, created if it does not exist (needs Ray connected); detached,
    so it outlives the ingress that created it and a restarted ingress finds the same one."""
    import ray

    return ray.remote(DecisionBoard).options(
        name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
    ).remote()


def latest_decision(app_name: str, timeout_s: float = 5.0) -> Optional[dict[str, Any]]:
    """The application's latest autoscaling decision, or None (no board, or no decision yet)."""
    board = _board()
    return None if board is None else ray_get(board.get.remote(app_name), timeout_s)


def decision_changes(app_name: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The application's latest decisions that changed its replica count, oldest first."""
    board = _board()
    return [] if board is None else ray_get(board.get_changes.remote(app_name), timeout_s)


def _board():
    import ray

    try:
        return ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
    except ValueError:
        return None


def ray_get(ref: Any, timeout_s: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout_s)
