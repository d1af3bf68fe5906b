"""Autoscaling on memory pressure, live, against Serve's request count on the same ramp.

Two applications serve the built-in model in one Ray: one scaled by the headroom policy, one by
`requests` (Serve's own policy at target_ongoing_requests 32, what `--autoscaling requests`
configures). The same ramp (the same prompts, greedy, the same arrival offsets) goes to each in
turn: twelve long generations that together commit nearly all of one replica's KV, then a tail
of sixteen more once the headroom application's second replica serves (to the requests
application at the same point of the ramp: as many KV blocks held, or as long after its start). Under headroom, the
committed KV asks for a second replica while the ramp arrives, long before any preemption, and
the tail goes to it; when the ramp ends, the demand fits one replica again and Serve removes
the newer one while the tail's long streams still run, and they finish; requests sent while it
is being removed all go to the other one (the router dropped it at once). Under requests, 28
streams are less than one replica's worth (32): its one replica takes the tail too, its pool
runs out and it preempts, again and again, with no scale-up (the run is cancelled once it has
preempted CONTRAST_PREEMPTIONS times or its rate passed the threshold, its streams having sent
the same tokens as far as they got). Each event is probed from
Serve's replica states and the replicas' own load over time, not inferred.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

ray = pytest.importorskip("ray")

from cluster import cli  # noqa: E402
from cluster.autoscaling import decision_changes, latest_decision  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.deployment import replica_counts  # noqa: E402
from cluster.status_command import replica_statuses  # noqa: E402
from tests.cluster.serve_harness import (  # noqa: E402
    StreamResult, generate_request, grpc_target, local_cluster, small_config, stream_generate,
)
import grpc  # noqa: E402

# The module's one test starts Ray and two applications, runs the ramp twice and shuts them
# down: ~5 minutes on two quiet cores, over 10 on a loaded machine (the timeout counts all).
pytestmark = [pytest.mark.timeout(900), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

# 894 usable blocks of 16 = 14,304 tokens per replica. A stream commits its whole length
# (optimistic admission counts its growth to max_tokens) and its prompt ("ramp 10": 7 tokens),
# so the ramp's twelve commit 888 blocks, above 0.8 x 14,304 tokens: the headroom policy wants
# a second replica as the tenth arrives, though the twelve never overfill the pool.
ENGINE = {"num_kv_blocks": 895, "max_model_len": 2048, "max_num_seqs": 32}
RAMP_STREAMS = 12
RAMP_MAX_TOKENS = 1170
RAMP_GAP_S = 0.25
# The tail, sent once the headroom application's second replica runs, commits 792 blocks
# more, which only an empty replica holds (with a hundred to spare, so the router's fit never
# has to yield, whatever order the tail's streams reach it in): on the first, where the
# request count leaves it, the pool runs out while the tail's short streams are young, and
# they are preempted, newest first, one after another. The ramp lasts long enough on two shared cores that the tail
# meets it growing, however long the second replica took to start.
# The tail's four long streams share a replica's steps as the ramp's twelve do, and outlast
# the ramp by far; alone they fit one replica at the scale-down utilisation (8,064 tokens of
# 0.6 x 14,304 = 8,582): once the ramp and the short ones are done, the headroom policy
# removes the newer replica while they stream.
LONG_TAIL_STREAMS = 4
TAIL_MAX_TOKENS = [2000] * LONG_TAIL_STREAMS + [368] * 12
# Every stream here is long, and the requests application's run preempts: more than the
# harness' default per-call deadline.
STREAM_TIMEOUT_S = 300.0
PREEMPTION_RATE_THRESHOLD = 0.5
# The requests run is cancelled once its replica has preempted this often (or its smoothed
# rate passed the threshold): it preempted first. Whether the rate itself passes 0.5/s on
# this ramp depends on the machine's step time (0.62/s on a loaded machine, a peak of 0.47/s
# on a quieter one, one preemption every 1.5-2.5 s either way).
CONTRAST_PREEMPTIONS = 5
# What the contrast asserts, where the run was not cut short: a tail that meets the ramp late
# (a second replica slow to start: 21.7 s in one suite run, not ~17) leaves the requests run's
# one replica fewer preemptions before its streams end (4 in that run, none on ours).
CONTRAST_MIN_PREEMPTIONS = 3
# The demand's trend is off (replica_startup_s 0): the scale-up here is today's committed KV
# crossing the target (the trend's arithmetic: test_autoscaling.py; its effect:
# bench_autoscale_sim.py).
AUTOSCALING = {
    "min_replicas": 1, "max_replicas": 2, "target_utilization": 0.8, "scale_down_utilization": 0.6,
    "preemption_rate_threshold": PREEMPTION_RATE_THRESHOLD, "upscale_delay_s": 0, "downscale_delay_s": 1,
    "look_back_period_s": 1, "metrics_interval_s": 0.5, "replica_startup_s": 0,
}
HEADROOM, REQUESTS = "headroom-policy", "requests-policy"  # the applications, named after their policies
PROBE_PERIOD_S = 0.5
# One-token requests sent while a replica is being removed (STOPPING, its streams still
# running): the router must send every one of them elsewhere.
DRAIN_PROBES = 6


def autoscaled_config():
    document = small_config(28800, engine=ENGINE).model_dump(exclude_unset=True)
    template = document["applications"][0]
    applications = []
    for index, (name, policy) in enumerate(((HEADROOM, "headroom"), (REQUESTS, "requests"))):
        args = {**template["args"], "replicas": {"autoscaling": {**AUTOSCALING, "policy": policy}, "num_cpus": 1,
                                                 "drain_timeout_s": 120},
                # Each application's replicas and ingress count up from ports of their own.
                "ports": {**template["args"]["ports"], "metrics": 28810 + 30 * index,
                          "router_metrics": 28820 + 30 * index, "replica_grpc": 28830 + 30 * index}}
        applications.append({**template, "name": name, "route_prefix": f"/{name}", "args": args})
    document["applications"] = applications
    return load_config(document)


CONFIG = autoscaled_config()


@pytest.fixture(scope="module")
def cluster():
    # Two replicas of one application and one of the other at most at once (the shared Ray's 4
    # CPUs: a CPU to spare).
    with local_cluster(CONFIG) as config:
        yield config


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(grpc_target(cluster)) as channel:
        yield channel


@dataclass
class Probe:
    """What Serve and one application's replicas said, every PROBE_PERIOD_S, from a thread of
    its own (times from time.monotonic())."""

    application: str
    counts: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, target, running, draining)
    replica_states: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # replica id -> states seen
    preemption_rate_passed_at: dict[str, float] = field(default_factory=dict)  # replica id -> first time > threshold
    first_preemption_at: dict[str, float] = field(default_factory=dict)  # replica id -> first time its total > 0
    preemptions: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)  # id -> (t, total, rate)
    loads: dict[str, Any] = field(default_factory=dict)  # replica id -> its latest ReplicaLoad
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from ray.serve.context import _get_global_client

        while not self.stop.wait(PROBE_PERIOD_S):
            now = time.monotonic()
            count = replica_counts()[self.application]
            self.counts.append((now, count.target, count.running, count.draining))
            details = _get_global_client().get_serve_details()["applications"][self.application]
            for replica in details["deployments"]["LLMReplica"]["replicas"]:
                states = self.replica_states.setdefault(replica["replica_id"], [])
                if not states or states[-1][1] != replica["state"]:
                    states.append((now, replica["state"]))
            for status in replica_statuses():
                if status.application != self.application or status.load is None:
                    continue
                self.loads[status.replica_id] = status.load
                series = self.preemptions.setdefault(status.replica_id, [])
                point = (now, status.load.preemptions_total, round(status.load.preemption_rate, 2))
                if not series or series[-1][1:] != point[1:]:
                    series.append(point)
                if status.load.preemption_rate > PREEMPTION_RATE_THRESHOLD:
                    self.preemption_rate_passed_at.setdefault(status.replica_id, now)
                if status.load.preemptions_total > 0:
                    self.first_preemption_at.setdefault(status.replica_id, now)

    def preemptions_total(self) -> int:
        """The replicas' preemptions, as last probed."""
        return sum(series[-1][1] for series in list(self.preemptions.values()) if series)

    def stopping(self) -> Optional[str]:
        """The replica last probed STOPPING, if any."""
        return next((replica_id for replica_id, states in list(self.replica_states.items())  # the prober adds to it
                     if states[-1][1] == "STOPPING"), None)

    def first(self, predicate, since: float = -math.inf) -> Optional[float]:
        """The first probed time from `since` on when `predicate(target, running, draining)` held."""
        return next((t for t, target, running, draining in self.counts
                     if t >= since and predicate(target, running, draining)), None)

    def wait_for(self, predicate, timeout_s: float, what: str) -> float:
        """The first time from now on that `predicate(target, running, draining)` is probed to hold."""
        since = time.monotonic()
        deadline = since + timeout_s
        while (at := self.first(predicate, since)) is None:
            assert time.monotonic() < deadline, f"{self.application}: timed out waiting for {what}; {self.report()}"
            time.sleep(PROBE_PERIOD_S)
        return at

    def report(self) -> str:
        changed = [count for index, count in enumerate(self.counts)
                   if index == 0 or count[1:] != self.counts[index - 1][1:]]
        return (f"counts (t, target, running, draining) as they changed {changed}, preemptions {self.preemptions}, "
                f"first preemption at {self.first_preemption_at}, "
                f"rate passed {PREEMPTION_RATE_THRESHOLD}/s at {self.preemption_rate_passed_at}, "
                f"latest decision {latest_decision(self.application)}")


@dataclass
class TimedStream:
    result: StreamResult
    started_at: float
    ended_at: float
    max_tokens: int


@dataclass
class DrainProbe:
    """A one-token request sent while `removing` was probed STOPPING, and where it went."""

    sent_at: float
    removing: str
    result: StreamResult


@dataclass
class Run:
    """One application's run: its probe, its streams (the ramp's, then the tail's), when the
    ramp started, how long after it the tail was sent and how far the ramp had got by then,
    and the requests sent while a replica was being removed."""

    probe: Probe
    streams: list[TimedStream]
    started_at: float
    tail_offset_s: float
    tail_blocks_used: int  # the KV blocks the ramp's replica held when the tail was sent
    drain_probes: list[DrainProbe]

    @property
    def long_tail(self) -> list[TimedStream]:
        return self.streams[RAMP_STREAMS:RAMP_STREAMS + LONG_TAIL_STREAMS]


def await_router_routes_past(channel: grpc.Channel, application: str, full_replica: str) -> None:
    """Serve runs a new replica before the ingress' router has heard of it: one-token requests
    until one is routed away from `full_replica` (the router prefers any replica with room to
    it, so the new one is then in its ranking)."""
    deadline = time.monotonic() + 60
    def routed_to() -> Optional[str]:
        return stream_generate(channel, generate_request(1, prompt="probe"), application=application).replica_id

    while routed_to() == full_replica:
        assert time.monotonic() < deadline, f"the router never routed past {full_replica}"
        time.sleep(PROBE_PERIOD_S)


def blocks_used(load: Any) -> int:
    return load.kv_blocks_total - load.kv_blocks_free


def run_ramp(channel: grpc.Channel, application: str, tail_at: Optional[Run] = None,
             until_preempting: bool = False) -> Run:
    """The ramp to `application`: its streams RAMP_GAP_S apart, then the tail (without
    `tail_at`: as soon as a second replica runs and the router ranks it; with it, at the same
    point of the ramp as that run's: once the ramp's replica holds as many KV blocks as that
    run's did when it sent its tail, or as long after the ramp's start, whichever comes first.
    The ramp alone runs faster than beside a replica starting: at the same offset, one run's
    tail met a ramp that had ended, and nothing preempted).
    While a replica is being removed and the streams still run, up to DRAIN_PROBES one-token
    requests are sent, one per probe period. Returns once every stream has ended and the
    application is back to one replica; or, with until_preempting, as soon as the replicas
    have preempted CONTRAST_PREEMPTIONS times or a replica's preemption rate passed the
    threshold, once what was sent has been cancelled and the replicas hold none of it."""
    probe = Probe(application)
    prober = threading.Thread(target=probe.run, daemon=True)
    prober.start()
    calls: list[grpc.Call] = []
    drain_probes: list[DrainProbe] = []

    def timed_stream(max_tokens: int, prompt: str) -> TimedStream:
        started = time.monotonic()
        result = stream_generate(channel, generate_request(max_tokens, prompt=prompt), application=application,
                                 timeout_s=STREAM_TIMEOUT_S, on_call=calls.append)
        return TimedStream(result, started, time.monotonic(), max_tokens)

    def stopped() -> bool:
        return until_preempting and (bool(probe.preemption_rate_passed_at)
                                     or probe.preemptions_total() >= CONTRAST_PREEMPTIONS)

    started_at = math.nan
    try:
        probe.wait_for(lambda target, running, draining: running == 1, 60, "one running replica")
        (first_replica,) = [replica_id for replica_id, states in probe.replica_states.items()
                            if states[-1][1] == "RUNNING"]
        with concurrent.futures.ThreadPoolExecutor(RAMP_STREAMS + len(TAIL_MAX_TOKENS)) as pool:
            started_at = time.monotonic()
            futures = []
            for index in range(RAMP_STREAMS):
                futures.append(pool.submit(timed_stream, RAMP_MAX_TOKENS, f"ramp {index}"))
                time.sleep(RAMP_GAP_S)
            if tail_at is None:
                probe.wait_for(lambda target, running, draining: running == 2, 240, "a second replica")
                await_router_routes_past(channel, application, first_replica)
            else:
                while (time.monotonic() < started_at + tail_at.tail_offset_s
                       and (first_replica not in probe.loads
                            or blocks_used(probe.loads[first_replica]) < tail_at.tail_blocks_used)):
                    time.sleep(PROBE_PERIOD_S / 5)
            tail_offset_s = time.monotonic() - started_at
            tail_blocks_used = blocks_used(probe.loads[first_replica]) if first_replica in probe.loads else 0
            futures += [pool.submit(timed_stream, max_tokens, f"tail {index}")
                        for index, max_tokens in enumerate(TAIL_MAX_TOKENS)]
            while not all(future.done() for future in futures) and not stopped():
                if len(drain_probes) < DRAIN_PROBES and (removing := probe.stopping()) is not None:
                    sent_at = time.monotonic()
                    result = stream_generate(channel, generate_request(1, prompt=f"drain {len(drain_probes)}"),
                                             application=application)
                    drain_probes.append(DrainProbe(sent_at, removing, result))
                time.sleep(PROBE_PERIOD_S)
            for call in calls:  # none is left running unless stopped
                call.cancel()
            streams = [future.result() for future in futures]
        if stopped():  # nothing left running, waiting or holding a block
            probe.loads.clear()
            deadline = time.monotonic() + 60
            while not probe.loads or any((load.num_running, load.num_waiting, load.kv_blocks_free)
                                         != (0, 0, load.kv_blocks_total) for load in probe.loads.values()):
                assert time.monotonic() < deadline, f"cancelled streams still held: {probe.loads}"
                time.sleep(PROBE_PERIOD_S)
        else:
            probe.wait_for(lambda target, running, draining: (target, running, draining) == (1, 1, 0), 120,
                           "one replica again")
    finally:
        probe.stop.set()
        prober.join(timeout=30)
    return Run(probe, streams, started_at, tail_offset_s, tail_blocks_used, drain_probes)


def test_the_ramp_adds_a_replica_before_preemptions_where_the_request_count_preempts_first(
        cluster, channel, capsys):
    ours = run_ramp(channel, HEADROOM)
    changes = decision_changes(HEADROOM)
    assert cli.main(["status"]) == 0
    status_text = capsys.readouterr().out
    router_metrics_port = cluster.applications[0].args.ports.router_metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{router_metrics_port}/metrics", timeout=10) as response:
        exposition = response.read().decode()
    # The same arrivals to the application Serve's request count scales, the tail at the
    # same point of the ramp.
    assert ours.tail_blocks_used > 0, ours.probe.report()  # the ramp was running when ours' tail went
    theirs = run_ramp(channel, REQUESTS, tail_at=ours, until_preempting=True)
    for name, run in ((HEADROOM, ours), (REQUESTS, theirs)):  # shown if the test fails
        ends = [f"{stream.ended_at - run.started_at:.1f}" for stream in run.streams]
        drains = [(f"{drain.sent_at - run.started_at:.1f}", drain.result.replica_id) for drain in run.drain_probes]
        print(f"{name}: ramp from {run.started_at:.1f}, tail {run.tail_offset_s:.1f} s after "
              f"({run.tail_blocks_used} KV blocks held), streams ended after "
              f"{ends}; sent while a replica was STOPPING (after, to) {drains}; {run.probe.report()}")

    # headroom: Serve's target went to 2 on the KV demand before any replica preempted (so
    # before any preemption rate passed the threshold).
    scaled_up_at = ours.probe.first(lambda target, running, draining: target == 2)
    assert scaled_up_at is not None, ours.probe.report()
    first_preemption = min(ours.probe.first_preemption_at.values(), default=None)
    assert first_preemption is None or scaled_up_at < first_preemption, ours.probe.report()
    # The board may open with the policy's start-up record (1, low_demand) before the ramp.
    up_index = next((index for index, change in enumerate(changes) if change["desired_replicas"] == 2), None)
    assert up_index is not None and all(change["desired_replicas"] == 1 for change in changes[:up_index]), changes
    first_up, last_down = changes[up_index], changes[-1]
    assert (first_up["desired_replicas"], first_up["reason"], first_up["policy"]) == (2, "kv_demand", "headroom"), changes
    assert (last_down["desired_replicas"], last_down["reason"]) == (1, "low_demand"), changes

    # requests, same arrivals (until the contrast shows; then the run is cancelled): its one
    # replica preempted, again and again, and Serve's target stayed 1 on the requests policy's
    # decisions (28 streams in flight are under its 32 per replica).
    assert theirs.probe.first_preemption_at, theirs.probe.report()
    assert (theirs.probe.preemptions_total() >= CONTRAST_MIN_PREEMPTIONS
            or theirs.probe.preemption_rate_passed_at), theirs.probe.report()
    assert theirs.probe.first(lambda target, running, draining: target >= 2) is None, theirs.probe.report()
    assert (latest_decision(REQUESTS) or {}).get("policy") == "requests", latest_decision(REQUESTS)

    # Every stream of the headroom run ended OK with all its tokens; the requests run's streams
    # got the same tokens, as far as each went before it was cancelled: its preemptions cost
    # time, not output (greedy).
    for stream in ours.streams:
        assert stream.result.code == grpc.StatusCode.OK, stream.result.details
        assert stream.result.num_tokens == stream.max_tokens
    for stream, reference in zip(theirs.streams, ours.streams):
        assert stream.result.code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED), stream.result.details
        assert stream.result.token_ids == reference.result.token_ids[:stream.result.num_tokens]
        assert stream.result.code == grpc.StatusCode.CANCELLED or stream.result.num_tokens == stream.max_tokens

    # headroom's scale-in: the newer replica went from RUNNING to STOPPING while the tail's
    # long streams, which it served, were still streaming, and they finished (above).
    stopped = [replica_id for replica_id, states in ours.probe.replica_states.items()
               if "STOPPING" in [state for _, state in states]]
    assert len(stopped) == 1, ours.probe.replica_states
    (removed,) = stopped
    stopping_at = next(t for t, state in ours.probe.replica_states[removed] if state == "STOPPING")
    for stream in ours.long_tail:
        assert stream.result.replica_id == removed, [(s.result.replica_id, s.started_at, s.ended_at)
                                                     for s in ours.streams]
        assert stream.started_at < stopping_at < stream.ended_at, (stream.started_at, stopping_at, stream.ended_at)
    # Drain: requests sent while it was STOPPING and its long streams still ran (so it was
    # still there to be chosen) all went to the replica that stays.
    still_streaming_until = max(stream.ended_at for stream in ours.long_tail)
    drained = [(drain.sent_at, drain.result.code, drain.result.replica_id) for drain in ours.drain_probes]
    assert drained and all(drain.removing == removed for drain in ours.drain_probes), (removed, drained)
    for drain in ours.drain_probes:
        assert stopping_at <= drain.sent_at < still_streaming_until, (stopping_at, still_streaming_until, drained)
        assert drain.result.code == grpc.StatusCode.OK and drain.result.num_tokens == 1, drained
        assert drain.result.replica_id != removed, (removed, drained)

    # Observability: the status command and the ingress' metrics say what the policy wanted.
    assert f"{HEADROOM}: 1 replica running, desired 1 (headroom policy:" in status_text, status_text
    assert f'headroom_autoscaler_desired_replicas{{application="{HEADROOM}",policy="headroom",reason=' in exposition
    assert f'headroom_autoscaler_running_replicas{{application="{HEADROOM}"}} 1.0' in exposition
