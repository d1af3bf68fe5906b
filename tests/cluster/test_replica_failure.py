"""A replica killed under load: requests it had queued but not started are retried on the
other replica and complete; streams it had started end with UNAVAILABLE; every call ends
within its bound and the survivor keeps serving. The same when only a replica's engine-core
process dies (and Serve replaces the replica); clients that leave free their blocks at once.
Plus the SSE framing of a cut HTTP stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from typing import Callable

import grpc
import pytest
import requests

ray = pytest.importorskip("ray")

from cluster import status_command  # noqa: E402
from cluster.deployment import DEPLOYMENT_NAME  # noqa: E402
from replica.core.outputs import RequestOutput  # noqa: E402
from cluster.ingress import _sse_stream  # noqa: E402
from replica.errors import ReplicaLostError
from cluster.openai_api import Choice  # noqa: E402
from cluster.openai_responses import CompletionBodies, TokenText  # noqa: E402
from protos import headroom_pb2 as pb  # noqa: E402
from protos import headroom_pb2_grpc as pb_grpc  # noqa: E402
from replica.core.request import SamplingParams  # noqa: E402
from tests.cluster.serve_harness import (  # noqa: E402
    local_cluster,
    APP_NAME, GRPC_TIMEOUT_S, StreamResult, generate_request, grpc_target, http_base, small_config,
    stream_generate,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

# Two requests run per replica and the rest queue: a kill then finds both kinds on its victim.
CONFIG = small_config(28600, engine={"max_num_seqs": 2})
NUM_STREAMS = 8
# Long enough (seconds on a CPU) that no stream finishes before the kill lands.
LONG_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(CONFIG) as config:
        yield config


def replica_with_running_and_waiting(deadline_s: float) -> status_command.ReplicaStatus:
    """A replica that streams some requests while others wait in its queue."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for status in status_command.replica_statuses():
            if status.load is not None and status.load.num_running >= 1 and status.load.num_waiting >= 1:
                return status
        time.sleep(0.05)
    raise AssertionError("no replica had running and waiting requests at once")


def kill_under_load(cluster, kill: Callable[[status_command.ReplicaStatus], None]) -> tuple[
        status_command.ReplicaStatus, list[StreamResult]]:
    """Start NUM_STREAMS long streams, `kill` a replica that runs some and queues others once
    its running streams have reached the client, and return it with every stream's result."""
    with grpc.insecure_channel(grpc_target(cluster)) as channel, \
            concurrent.futures.ThreadPoolExecutor(max_workers=NUM_STREAMS) as pool:
        started: dict[int, StreamResult] = {}  # streams with a response so far, live

        def on_response(result: StreamResult) -> None:
            started[id(result)] = result

        streams = [pool.submit(stream_generate, channel, generate_request(LONG_MAX_TOKENS), on_response)
                   for _ in range(NUM_STREAMS)]
        victim = replica_with_running_and_waiting(deadline_s=60)
        # Its running requests have sampled (the load is published after a step); wait until
        # their first tokens reached the client, so "had produced a token" is what the client saw.
        deadline = time.monotonic() + 10
        while sum(result.replica_id == victim.replica_id for result in list(started.values())) < victim.load.num_running:
            assert time.monotonic() < deadline, "the victim's running streams never reached the client"
            time.sleep(0.01)
        kill(victim)
        done, not_done = concurrent.futures.wait(streams, timeout=GRPC_TIMEOUT_S + 30)
        assert not not_done, f"{len(not_done)} requests hung"
        return victim, [stream.result() for stream in streams]


def assert_started_streams_cut_and_queued_ones_retried(victim: status_command.ReplicaStatus,
                                                       results: list[StreamResult], lost: str = "") -> None:
    cut = [result for result in results if any(r.replica_id == victim.replica_id for r in result.responses)]
    untouched = [result for result in results if result not in cut]
    # The victim's running requests had streamed tokens: they cannot be replayed elsewhere.
    assert len(cut) >= victim.load.num_running
    for result in cut:
        assert result.code == grpc.StatusCode.UNAVAILABLE, (result.code, result.details)
        assert "lost" in result.details and lost in result.details and 0 < result.num_tokens < LONG_MAX_TOKENS
    # Everything else completed, the victim's queued requests included (retried elsewhere).
    assert len(untouched) == NUM_STREAMS - len(cut) >= victim.load.num_waiting
    for result in untouched:
        assert result.code == grpc.StatusCode.OK, (result.code, result.details)
        assert result.num_tokens == LONG_MAX_TOKENS and result.replica_id != victim.replica_id


def test_killed_replica_retries_unstarted_requests_and_cuts_started_streams_with_unavailable(cluster):
    def kill_actor(victim: status_command.ReplicaStatus) -> None:
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim.replica_id}",
                               namespace="serve"), no_restart=True)

    victim, results = kill_under_load(cluster, kill_actor)
    assert_started_streams_cut_and_queued_ones_retried(victim, results)
    with grpc.insecure_channel(grpc_target(cluster)) as channel:
        survivor_result = stream_generate(channel, generate_request(8))
    assert survivor_result.code == grpc.StatusCode.OK and survivor_result.replica_id != victim.replica_id


def test_sse_stream_cut_by_a_lost_replica_ends_with_an_error_event_then_done():
    choice = Choice(0, 0, [1, 2, 3], SamplingParams())

    async def chunks():
        yield choice, RequestOutput("r1", [5], "a", None, 3, 1, 0)
        raise ReplicaLostError("the replica serving this request was lost mid-stream")

    async def collect() -> list[str]:
        bodies = CompletionBodies("completion", "cmpl-1", APP_NAME, TokenText(lambda ids: "a"), None, [""])
        return [event async for event in _sse_stream(chunks(), bodies, [choice], False, {})]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "a"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_unavailable" and "lost" in error["message"]


# ---- the engine core behind a Serve replica ------------------------------------------------
def live_replicas(count: int, deadline_s: float = 120) -> list[status_command.ReplicaStatus]:
    """Wait until `count` replicas serve a load (Serve may still be replacing a killed one)."""
    deadline = time.monotonic() + deadline_s
    while True:
        statuses = [status for status in status_command.replica_statuses() if status.load is not None]
        if len(statuses) == count:
            return statuses
        assert time.monotonic() < deadline, f"{len(statuses)} live replicas, not {count}"
        time.sleep(0.2)


def engine_core_pid(status: status_command.ReplicaStatus) -> int:
    """The engine-core process of the replica whose front listens on its load endpoint (this
    machine runs the whole local cluster)."""
    front_pid = _pid_listening_on(int(status.load_endpoint.rsplit(":", 1)[1]))
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline, open(f"/proc/{pid}/status") as proc_status:
                if b"replica.core.process" in cmdline.read() and f"PPid:\t{front_pid}\n" in proc_status.read():
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no engine core under the front {front_pid}")


def _pid_listening_on(port: int) -> int:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as sockets:
            for line in sockets.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    raise AssertionError(f"nothing listens on port {port}")


def test_cancelled_disconnected_and_late_requests_through_serve_free_their_blocks_at_once(cluster):
    live_replicas(2)
    # Each stream still has ~199 tokens to go when it is cut: seconds of decoding on this CPU.
    long = generate_request(LONG_MAX_TOKENS)

    async def run():
        async with grpc.aio.insecure_channel(grpc_target(cluster)) as channel:
            stub = pb_grpc.GenerationStub(channel)
            # A prefill takes longer than 1 ms on this CPU: the deadline fires in the replica.
            late = stub.Generate(pb.GenerateRequest(text="late", ttft_deadline_ms=1.0, sampling=pb.SamplingParams(
                max_tokens=LONG_MAX_TOKENS, ignore_eos=True)), timeout=GRPC_TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as missed:
                await late.read()
            cancelled = stub.Generate(long, timeout=GRPC_TIMEOUT_S)
            sse = requests.post(f"{http_base(cluster)}/v1/completions", stream=True, timeout=GRPC_TIMEOUT_S, json={
                "model": APP_NAME, "prompt": "hello", "max_tokens": LONG_MAX_TOKENS, "stream": True,
                "ignore_eos": True})
            first_event = json.loads(next(line for line in sse.iter_lines() if line).removeprefix(b"data: "))
            first_response = await cancelled.read()
            cancelled.cancel()
            sse.close()
            return missed.value.code(), first_response, first_event, time.monotonic()

    missed_code, first_response, first_event, cut_at = asyncio.run(run())
    assert missed_code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The probe: both streams were live, with tokens to go, when their clients left.
    assert first_response.finish_reason == pb.FINISH_REASON_UNSPECIFIED and first_response.token_ids
    assert first_event["choices"][0]["finish_reason"] is None
    # A few steps, not the ~199 the streams had left: every front sent its abort.
    loads = [status.load for status in live_replicas(2)]
    natural_finish_s = (LONG_MAX_TOKENS - 1) * max(load.step_time_ms for load in loads) / 1000
    while any(load.num_running or load.num_waiting or load.kv_blocks_free != load.kv_blocks_total for load in loads):
        assert time.monotonic() - cut_at < natural_finish_s / 2, "a replica still holds requests its clients left"
        time.sleep(0.05)
        loads = [status.load for status in live_replicas(2)]


def test_a_killed_engine_core_cuts_its_started_streams_with_unavailable_and_serve_replaces_the_replica(cluster):
    live_replicas(2)
    killed = []

    def kill_engine_core(victim: status_command.ReplicaStatus) -> None:
        killed.append(engine_core_pid(victim))
        os.kill(killed[0], signal.SIGKILL)

    victim, results = kill_under_load(cluster, kill_engine_core)
    # The probe: the core really is gone (reaped by its front), not merely silent.
    assert not os.path.exists(f"/proc/{killed[0]}") or "State:\tZ" in open(f"/proc/{killed[0]}/status").read()
    assert_started_streams_cut_and_queued_ones_retried(victim, results, lost="EngineDeadError")
    # Serve's health check fails on the dead core and a new replica takes the victim's place.
    replicas = live_replicas(2)
    assert victim.replica_id not in {status.replica_id for status in replicas}
