"""A replica killed under load: requests it had queued but not started are retried on the
other replica and complete; streams it had started end with UNAVAILABLE; every call ends
within its bound and the survivor keeps serving. Plus the SSE framing of a cut HTTP stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import grpc
import pytest

ray = pytest.importorskip("ray")

from cluster import status_command  # noqa: E402
from cluster.deployment import DEPLOYMENT_NAME, GenerationChunk  # noqa: E402
from cluster.ingress import ReplicaLostError, _sse_stream  # noqa: E402
from cluster.openai_api import Choice  # noqa: E402
from cluster.openai_responses import CompletionBodies, TokenText  # noqa: E402
from replica.request import SamplingParams  # noqa: E402
from tests.cluster.serve_harness import (  # noqa: E402
    local_cluster,
    APP_NAME, GRPC_TIMEOUT_S, StreamResult, generate_request, grpc_target, small_config,
    stream_generate,
)

pytestmark = pytest.mark.timeout(300)

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


def test_killed_replica_retries_unstarted_requests_and_cuts_started_streams_with_unavailable(cluster):
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
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim.replica_id}",
                               namespace="serve"), no_restart=True)
        done, not_done = concurrent.futures.wait(streams, timeout=GRPC_TIMEOUT_S + 30)
        assert not not_done, f"{len(not_done)} requests hung"
        results = [stream.result() for stream in streams]

        cut = [result for result in results if any(r.replica_id == victim.replica_id for r in result.responses)]
        untouched = [result for result in results if result not in cut]
        # The victim's running requests had streamed tokens: they cannot be replayed elsewhere.
        assert len(cut) >= victim.load.num_running
        for result in cut:
            assert result.code == grpc.StatusCode.UNAVAILABLE, (result.code, result.details)
            assert "lost" in result.details and 0 < result.num_tokens < LONG_MAX_TOKENS
        # Everything else completed, the victim's queued requests included (retried elsewhere).
        assert len(untouched) == NUM_STREAMS - len(cut) >= victim.load.num_waiting
        for result in untouched:
            assert result.code == grpc.StatusCode.OK, (result.code, result.details)
            assert result.num_tokens == LONG_MAX_TOKENS and result.replica_id != victim.replica_id

        survivor_result = stream_generate(channel, generate_request(8))
        assert survivor_result.code == grpc.StatusCode.OK and survivor_result.replica_id != victim.replica_id


def test_sse_stream_cut_by_a_lost_replica_ends_with_an_error_event_then_done():
    choice = Choice(0, 0, [1, 2, 3], SamplingParams())

    async def chunks():
        yield choice, GenerationChunk("r1", [5], "a", None, 3, 1, 0, replica_id="replica-a")
        raise ReplicaLostError("the replica serving this request was lost mid-stream")

    async def collect() -> list[str]:
        bodies = CompletionBodies("completion", "cmpl-1", APP_NAME, TokenText(lambda ids: "a"), None, [""])
        return [event async for event in _sse_stream(chunks(), bodies, [choice], False, {})]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "a"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_unavailable" and "lost" in error["message"]
