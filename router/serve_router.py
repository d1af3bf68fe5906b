"""HeadroomRequestRouter: the Ray Serve 2.60 RequestRouter that routes LLMReplica calls with
HeadroomRouter. Ray Serve builds one in every proxy and handle-holding process, so all its
state lives in the instance; replicas announce their WatchLoad endpoint in routing stats, and
the router presents the cluster token (router/cluster_token.py) on every stream to it.

Configure it on the deployment with
`RequestRouterConfig(request_router_class="router.serve_router:HeadroomRequestRouter",
request_router_kwargs={"policy": "headroom", "staleness_s": 1.0, "knobs": {...}})`;
Ray Serve passes the kwargs to `initialize_state`. Callers declare each request's size with
the `routing=RoutingRequest(...)` keyword argument (router.headroom_router.ROUTING_KWARG).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Callable, List, Mapping, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.cluster_token import cluster_token
from router.headroom_router import HeadroomRouter, routing_request_of
from router.policies import DEFAULT_STALENESS_S

logger = logging.getLogger(__name__)

# The routing-stats keys a replica announces (LLMReplica.record_routing_stats). They must
# never change while the replica lives: a changed dict is broadcast to every router.
LOAD_ENDPOINT_STAT = "load_endpoint"
REPLICA_ID_STAT = "replica_id"


class HeadroomRequestRouter(RequestRouter):
    """Ranks replicas with the configured policy (headroom by default; the baselines for
    benchmarks) and returns one replica per rank, so Ray Serve tries them in that order and
    still enforces max_ongoing_requests. Without fresh loads it returns every candidate as
    one rank, which is Ray Serve's own choice: the shortest queue among them."""

    def initialize_state(
        self,
        policy: str = "headroom",
        staleness_s: float = DEFAULT_STALENESS_S,
        knobs: Optional[Mapping[str, float]] = None,
    ) -> None:
        self.headroom = HeadroomRouter(policy, staleness_s=staleness_s, knobs=knobs, cluster_token=cluster_token())

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        try:
            by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
            queue_len_cache = self.replica_queue_len_cache
            # An unknown queue length counts as empty, as Ray Serve's own availability check has it.
            queue_lens = {
                replica_id: queue_len_cache.get(replica.replica_id) or 0 for replica_id, replica in by_id.items()
            }
            ranked = self.headroom.rank(
                routing_request_of(pending_request.kwargs), queue_lens, pending_request.metadata.internal_request_id
            )
            if ranked is None:  # no fresh loads: Ray Serve's choice, among replicas that still serve
                serving = set(self.headroom.serving(by_id))
                return [[replica for replica_id, replica in by_id.items() if replica_id in serving]]
        except Exception:  # a routing bug must cost the request its best replica, never its answer
            logger.exception("headroom routing failed; falling back to Ray Serve's queue-length choice")
            return [candidate_replicas]
        return [[by_id[replica_id]] for replica_id in ranked]

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.headroom.sync_replicas(
            {replica.replica_id.unique_id: replica.routing_stats.get(LOAD_ENDPOINT_STAT) for replica in replicas}
        )

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.headroom.remove_replica(replica_id.unique_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        # Called only once the replica accepted the request (Ray Serve's rejection protocol,
        # on everywhere but Ray Client); there the tentative choice expires on its own.
        key, replica = pending_request.metadata.internal_request_id, replica_id.unique_id
        self.headroom.routed(routing_request_of(pending_request.kwargs), key, replica)
        # The request ends with this accepted attempt's own result, not with
        # on_request_completed: Serve 2.60 reports every attempt's end there under the same
        # internal_request_id, a rejected one's too (its result is cancelled and completes), and
        # a retry may be accepted by the replica that rejected it. Serve registers its own
        # callback on the same result the same way (AsyncioRouter._register_completion_callback),
        # so this fires exactly when Serve's completion of the accepted attempt does, always
        # after routed() above (marshalled onto this loop, as Serve marshals its own).
        loop = asyncio.get_running_loop()
        try:
            result.add_done_callback(partial(_attempt_done, loop, self.headroom.abandoned, key, replica))
        except Exception:  # no end will ever be reported: count nothing live rather than forever
            logger.exception("cannot watch the end of request %s; not counting it as live on %s", key, replica)
            self.headroom.abandoned(key, replica)

    # on_request_completed stays Serve's no-op: it cannot tell a rejected attempt's end from
    # the accepted one's (on_request_routed watches the latter's result instead).


def _attempt_done(loop: asyncio.AbstractEventLoop, ended: Callable[[str, str], None], key: str, replica_id: str,
                  _result=None) -> None:
    """A ReplicaResult's done callback: Ray runs it on one of its own threads."""
    try:
        loop.call_soon_threadsafe(ended, key, replica_id)
    except RuntimeError:  # the loop is closed: the router, and its books, are gone with it
        pass
