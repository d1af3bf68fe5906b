"""Autoscaling on memory pressure, live: Ray Serve's autoscaler runs the headroom policy on the
replicas' reported KV demand. A ramp of long generations onto one replica makes it add a second
before the first's preemption rate passes the policy's threshold (the decision says kv_demand,
not preemptions); when the ramp ends, the demand fits one replica again and Serve removes the
newer one while it still streams, which finishes every stream it holds. Each event is probed
from Serve's own replica states over time, not inferred.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

ray = pytest.importorskip("ray")

from cluster import cli  # noqa: E402
from cluster.autoscaling import decision_changes  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.deployment import replica_counts  # noqa: E402
from cluster.status_command import replica_statuses  # noqa: E402
from tests.cluster.serve_harness import (  # noqa: E402
    APP_NAME, StreamResult, generate_request, local_cluster, small_config, stream_generate,
)
import grpc  # noqa: E402

pytestmark = pytest.mark.timeout(420)

# 512 usable blocks of 16 = 8,192 tokens per replica. A ramp stream commits ~900 tokens (its
# whole max_tokens: optimistic admission counts growth to it), so eight commit 7,296, above
# 0.8 x 8,192: the policy wants a second replica as they arrive, though their KV (which the
# eight together never exceed) could not yet fill the pool.
ENGINE = {"num_kv_blocks": 513, "max_model_len": 2048, "max_num_seqs": 16}
RAMP_STREAMS = 8
RAMP_MAX_TOKENS = 900
RAMP_GAP_S = 0.5
# Two tail streams (~4,000 tokens together) fit one replica at the scale-down utilisation
# (0.6 x 8,192 = 4,915): once the ramp is done the policy removes a replica while they stream.
# They go to the new replica (the most headroom) and run twice a ramp stream's length, so the
# ramp, started earlier, ends long before them.
TAIL_STREAMS = 2
TAIL_MAX_TOKENS = 2000
PREEMPTION_RATE_THRESHOLD = 0.5
AUTOSCALING = {
    "policy": "headroom", "min_replicas": 1, "max_replicas": 2, "target_utilization": 0.8,
    "scale_down_utilization": 0.6, "preemption_rate_threshold": PREEMPTION_RATE_THRESHOLD,
    "upscale_delay_s": 0, "downscale_delay_s": 1, "look_back_period_s": 1, "metrics_interval_s": 0.5,
}
PROBE_PERIOD_S = 0.5


def autoscaled_config():
    document = small_config(28800, engine=ENGINE).model_dump(exclude_unset=True)
    document["applications"][0]["args"]["replicas"] = {"autoscaling": AUTOSCALING, "num_cpus": 1,
                                                       "drain_timeout_s": 120}
    return load_config(document)


CONFIG = autoscaled_config()


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(CONFIG) as config:
        yield config


@dataclass
class Probe:
    """What Serve and the replicas said, every PROBE_PERIOD_S, from a thread of its own."""

    counts: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, target, running, draining)
    replica_states: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # replica id -> states seen
    preemption_rate_passed_at: dict[str, float] = field(default_factory=dict)  # replica id -> first time > threshold
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from ray.serve.context import _get_global_client

        while not self.stop.wait(PROBE_PERIOD_S):
            now = time.monotonic()
            count = replica_counts()[APP_NAME]
            self.counts.append((now, count.target, count.running, count.draining))
            deployment = _get_global_client().get_serve_details()["applications"][APP_NAME]["deployments"]["LLMReplica"]
            for replica in deployment["replicas"]:
                states = self.replica_states.setdefault(replica["replica_id"], [])
                if not states or states[-1][1] != replica["state"]:
                    states.append((now, replica["state"]))
            for status in replica_statuses():
                if status.load is not None and status.load.preemption_rate > PREEMPTION_RATE_THRESHOLD:
                    self.preemption_rate_passed_at.setdefault(status.replica_id, now)

    def first(self, predicate) -> float | None:
        return next((t for t, target, running, draining in self.counts if predicate(target, running, draining)), None)


@dataclass
class TimedStream:
    result: StreamResult
    started_at: float
    ended_at: float
    max_tokens: int


def timed_stream(channel: grpc.Channel, max_tokens: int, prompt: str) -> TimedStream:
    started = time.monotonic()
    result = stream_generate(channel, generate_request(max_tokens, prompt=prompt))
    return TimedStream(result, started, time.monotonic(), max_tokens)


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(PROBE_PERIOD_S)


def test_a_ramp_adds_a_replica_before_preemptions_and_the_quiet_removes_it_without_cutting_a_stream(
        cluster, channel, capsys):
    probe = Probe()
    prober = threading.Thread(target=probe.run, daemon=True)
    prober.start()
    try:
        wait_for(lambda: probe.first(lambda target, running, draining: running == 1), 60, "one running replica")
        with concurrent.futures.ThreadPoolExecutor(RAMP_STREAMS + TAIL_STREAMS) as pool:
            ramp = []
            for index in range(RAMP_STREAMS):
                ramp.append(pool.submit(timed_stream, channel, RAMP_MAX_TOKENS, f"ramp {index}"))
                time.sleep(RAMP_GAP_S)
            wait_for(lambda: probe.first(lambda target, running, draining: running == 2), 180, "a second replica")
            # The new replica has the most headroom: the router sends the tail there.
            tail = [pool.submit(timed_stream, channel, TAIL_MAX_TOKENS, f"tail {index}") for index in range(TAIL_STREAMS)]
            streams = [future.result() for future in ramp + tail]
            wait_for(lambda: probe.counts[-1][1:] == (1, 1, 0), 120, "the scale-in to finish")
        changes = decision_changes(APP_NAME)
        assert cli.main(["status"]) == 0
        status_text = capsys.readouterr().out
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.applications[0].args.ports.router_metrics}/metrics",
                                    timeout=10) as response:
            exposition = response.read().decode()
    finally:
        probe.stop.set()
        prober.join(timeout=30)

    # Scale-up: Serve's target went to 2 on the KV demand, before any replica's preemption rate
    # passed the threshold (if one ever did).
    scaled_up_at = probe.first(lambda target, running, draining: target == 2)
    assert scaled_up_at is not None, probe.counts
    passed = min(probe.preemption_rate_passed_at.values(), default=None)
    assert passed is None or scaled_up_at < passed, (scaled_up_at, probe.preemption_rate_passed_at)
    # The board may open with the policy's start-up record (1, low_demand) before the ramp.
    up_index = next((index for index, change in enumerate(changes) if change["desired_replicas"] == 2), None)
    assert up_index is not None and all(change["desired_replicas"] == 1 for change in changes[:up_index]), changes
    first_up, first_down = changes[up_index], changes[-1]
    assert (first_up["desired_replicas"], first_up["reason"], first_up["policy"]) == (2, "kv_demand", "headroom"), changes
    assert (first_down["desired_replicas"], first_down["reason"]) == (1, "low_demand"), changes

    # Scale-in: the newer replica went from RUNNING to STOPPING while a stream it served was
    # still running, and that stream (as every other) ended OK with all its tokens.
    stopped = [replica_id for replica_id, states in probe.replica_states.items()
               if "STOPPING" in [state for _, state in states]]
    assert len(stopped) == 1, probe.replica_states
    (removed,) = stopped
    stopping_at = next(t for t, state in probe.replica_states[removed] if state == "STOPPING")
    drained = [stream for stream in streams if stream.result.replica_id == removed and stream.ended_at > stopping_at]
    assert drained, [(s.result.replica_id, s.started_at, s.ended_at) for s in streams]
    for stream in streams:
        assert stream.result.code == grpc.StatusCode.OK, stream.result.details
        assert stream.result.num_tokens == stream.max_tokens
    assert all(stream.started_at < stopping_at for stream in drained)

    # Observability: the status command and the ingress' metrics say what the policy wanted.
    assert f"{APP_NAME}: 1 replicas running, desired 1 (headroom policy:" in status_text, status_text
    assert 'headroom_autoscaler_desired_replicas{application="builtin",policy="headroom",reason=' in exposition
    assert 'headroom_autoscaler_running_replicas{application="builtin"} 1.0' in exposition
