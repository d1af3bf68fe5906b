"""HeadroomRequestRouter under Ray Serve 2.60's own request path (AsyncioRouter: choose, send,
rejection protocol, retry, completion callbacks), in process: only the replicas are stand-ins,
answering each send with an accept or a rejection as a replica at max_ongoing_requests does.

Serve reports every attempt's end through on_request_completed under the request's one
internal_request_id, a rejected attempt's too (router.py: the completion callback is registered
before the rejection is known, and a rejected result is cancelled, which completes it). A
replica that rejected a request may accept its retry; the rejection's end, whenever it lands,
must not take the accepted request off the router's books.
"""

from __future__ import annotations

import asyncio
import threading
from unittest.mock import Mock

import pytest

ray_serve_router = pytest.importorskip("ray.serve._private.router")

from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource, DeploymentID, ReplicaID, ReplicaQueueLengthInfo, RequestMetadata, RunningReplicaInfo,
)
from ray.serve._private.replica_result import ReplicaResult  # noqa: E402
from ray.serve._private.request_router import RunningReplica  # noqa: E402

from router.headroom_router import ROUTING_KWARG  # noqa: E402
from router.policies import RoutingRequest  # noqa: E402
from router.serve_router import HeadroomRequestRouter  # noqa: E402
from router_harness import router_over  # noqa: E402
from test_policies import make_load  # noqa: E402

DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="llm")
PROMPT = tuple(range(3, 3 + 64))  # 4 blocks of 16: 3 full ones count as live prompt blocks
REQUEST = RoutingRequest(prompt_tokens=len(PROMPT), max_tokens=8, prompt_token_ids=PROMPT)


class Attempt(ReplicaResult):
    """One send's result as Serve sees it: its rejection response, then its end, reported on a
    thread of its own to the callbacks registered on it (as Ray reports an ObjectRef's)."""

    def __init__(self, accepted: bool, end_on_cancel: bool):
        self.info = ReplicaQueueLengthInfo(accepted=accepted, num_ongoing_requests=1)
        self.end_on_cancel = end_on_cancel
        self._callbacks: list = []
        self._done = False
        self._lock = threading.Lock()

    async def get_rejection_response(self):
        return self.info

    def add_done_callback(self, callback) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def end(self) -> None:
        def report() -> None:
            with self._lock:
                self._done, callbacks = True, list(self._callbacks)
            for callback in callbacks:
                callback(self)
        thread = threading.Thread(target=report)
        thread.start()
        thread.join()

    def cancel(self) -> None:  # Serve cancels a rejected attempt so that it completes
        if self.end_on_cancel:
            self.end()

    def get(self, timeout_s):
        raise NotImplementedError

    async def get_async(self):
        raise NotImplementedError

    def __next__(self):
        raise NotImplementedError

    async def __anext__(self):
        raise NotImplementedError

    def to_object_ref(self):
        raise NotImplementedError

    async def to_object_ref_async(self):
        raise NotImplementedError

    def to_object_ref_gen(self):
        raise NotImplementedError


class Replica(RunningReplica):
    """A replica with max_ongoing_requests 1 that answers its sends in the order given; its
    queue probe says it has room (an earlier request of it has just ended)."""

    actor_id = None

    def __init__(self, unique_id: str, answers: list[bool], rejection_ends_on_cancel: bool):
        self._replica_info = RunningReplicaInfo(
            replica_id=ReplicaID(unique_id, DEPLOYMENT), node_id="node", node_ip="127.0.0.1",
            availability_zone=None, actor_name=unique_id, max_ongoing_requests=1)
        self._multiplexed_model_ids = set()
        self.answers = list(answers)
        self.rejection_ends_on_cancel = rejection_ends_on_cancel
        self.attempts: list[Attempt] = []

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0

    def try_send_request(self, pending_request, with_rejection: bool) -> Attempt:
        assert with_rejection  # Serve's rejection protocol, on everywhere but Ray Client
        self.attempts.append(Attempt(self.answers.pop(0), self.rejection_ends_on_cancel))
        return self.attempts[-1]


async def settle() -> None:
    """Let the loop run what Serve's callbacks marshalled onto it."""
    for _ in range(5):
        await asyncio.sleep(0)


async def serve_router(monkeypatch) -> tuple[ray_serve_router.AsyncioRouter, HeadroomRequestRouter]:
    # The process-wide long-poll client is the one piece that wants a Ray cluster.
    monkeypatch.setattr(ray_serve_router.SharedRouterLongPollClient, "get_or_create", Mock())
    request_router = HeadroomRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                                           use_replica_queue_len_cache=True)
    request_router.headroom = router_over({"r0": make_load("r0")})  # initialize_state, less the streams
    router = ray_serve_router.AsyncioRouter(
        controller_handle=Mock(), deployment_id=DEPLOYMENT, handle_id="handle", self_actor_id="driver",
        handle_source=DeploymentHandleSource.UNKNOWN, event_loop=asyncio.get_running_loop(),
        enable_strict_max_ongoing_requests=True, node_id="node", availability_zone=None,
        prefer_local_node_routing=False, request_router=request_router,
        _request_router_initialized_event=asyncio.Event())
    return router, request_router


@pytest.mark.parametrize("rejection_ends", ["before the retry is accepted", "after the retry is accepted"])
def test_a_rejections_end_leaves_the_retry_the_same_replica_accepted_live_until_its_own_end(monkeypatch, rejection_ends):
    early = rejection_ends == "before the retry is accepted"

    async def scenario() -> None:
        router, request_router = await serve_router(monkeypatch)
        headroom = request_router.headroom
        replica = Replica("r0", [False, True], rejection_ends_on_cancel=early)
        request_router.update_replicas([replica])
        metadata = RequestMetadata(request_id="q", internal_request_id="k", is_streaming=True)
        result = await router.assign_request(metadata, **{ROUTING_KWARG: REQUEST})
        rejected, accepted = replica.attempts
        assert result is accepted
        if not early:
            rejected.end()
        await settle()
        assert headroom._live == {"k": "r0"} and sum(headroom.policy._live.of("r0").values()) == 3
        accepted.end()  # its stream ends
        await settle()
        assert not headroom._live and not headroom.policy._live.of("r0")

    asyncio.run(scenario())


def test_an_accepted_request_that_ended_before_serve_reported_its_routing_leaves_nothing_live(monkeypatch):
    # A request that fails at once may complete before Serve's routing coroutine resumes: its
    # completion is on the loop first, on_request_routed then finds a finished result.
    class EndsFirst(Attempt):
        async def get_rejection_response(self):
            self.end()
            await settle()
            return self.info

    async def scenario() -> None:
        router, request_router = await serve_router(monkeypatch)
        replica = Replica("r0", [True], rejection_ends_on_cancel=True)
        replica.try_send_request = lambda pending_request, with_rejection: replica.attempts.append(
            EndsFirst(True, True)) or replica.attempts[-1]
        request_router.update_replicas([replica])
        metadata = RequestMetadata(request_id="q", internal_request_id="k", is_streaming=True)
        await router.assign_request(metadata, **{ROUTING_KWARG: REQUEST})
        await settle()
        assert not request_router.headroom._live and not request_router.headroom.policy._live.of("r0")

    asyncio.run(scenario())
