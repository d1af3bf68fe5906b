"""HeadroomRouter: the Ray-free core of the Ray Serve request router. It keeps one load
subscription per replica (and one KV event subscription, for policies that read caches),
turns snapshots and the cache index into ReplicaViews, asks the routing policy for a
ranking and counts what it sends between snapshots (herd avoidance).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from replica.server.auth import authorization_metadata
from router.cache_index import PrefixCacheIndex
from router.inflight import InflightCounts, InflightTracker
from router.kv_event_subscriber import KVEventSubscriber
from router.load_subscriber import Backoff, LoadSubscriber
from router.metrics import RouterMetrics
from router.policies import (
    DEFAULT_STALENESS_S, LOAD_BASED_POLICIES, ReplicaView, RoutingRequest, make_router_policy,
)

# The convention by which a request's size reaches the router: callers of the LLMReplica
# deployment pass `routing=RoutingRequest(prompt_tokens, max_tokens, priority)` as a keyword
# argument (Ray Serve hands the router the call's args and kwargs, not the request's tokens).
ROUTING_KWARG = "routing"
# A call without the hint is routed as a short chat turn: size unknown, so load decides;
# 16 is the engine's (and OpenAI completions') default max_tokens.
UNSIZED_REQUEST = RoutingRequest(prompt_tokens=0, max_tokens=16)
# A choice the router made but Ray Serve has not confirmed (the replica may still reject
# it, or the caller cancel) counts against its replica for at most this long.
TENTATIVE_SEND_TTL_S = 5.0
# How long a request's end, reported before its routing (a caller whose two reports cross: a
# request refused at once, or a very short one, may end first), is remembered so that the late
# routing records nothing live.
ENDED_BEFORE_ROUTED_TTL_S = 60.0


def routing_request_of(kwargs: Mapping[str, Any]) -> RoutingRequest:
    """The request's size as its caller declared it under ROUTING_KWARG, else UNSIZED_REQUEST."""
    hint = kwargs.get(ROUTING_KWARG)
    return hint if isinstance(hint, RoutingRequest) else UNSIZED_REQUEST


@dataclass(frozen=True)
class TentativeSend:
    replica_id: str
    send: InflightCounts
    chosen_at: float  # on the router's monotonic clock


class HeadroomRouter:
    """One router instance's state. Call it from one event loop (the subscriptions run there)."""

    def __init__(
        self,
        policy: str = "headroom",
        *,
        staleness_s: float = DEFAULT_STALENESS_S,
        knobs: Optional[Mapping[str, float]] = None,
        rng: Optional[random.Random] = None,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        cluster_token: Optional[str] = None,
    ):
        """cluster_token: presented on every replica stream (router/cluster_token.py); None
        for replicas that ask for none."""
        self.policy = make_router_policy(policy, staleness_s, knobs or {}, rng)
        self.staleness_s = staleness_s
        self.clock = clock
        self.wall_clock = wall_clock
        metadata = authorization_metadata(cluster_token)
        self.loads = LoadSubscriber(backoff=backoff, clock=clock, metadata=metadata)
        self.inflight = InflightTracker()
        self.metrics = RouterMetrics(self.policy.name)
        # The cached-blocks gauge follows the index as its batches arrive (an idle router's too).
        self.cache_index = PrefixCacheIndex(on_change=self.metrics.set_cached_blocks)
        self.kv_events: Optional[KVEventSubscriber] = None
        if self.policy.uses_prefix_cache:
            self.kv_events = KVEventSubscriber(self.cache_index, backoff=backoff, clock=clock,
                                               on_resync=self.metrics.kv_event_resynced, metadata=metadata)
        self._tentative: dict[str, TentativeSend] = {}  # request key -> the router's first choice
        self._replica_ids: set[str] = set()  # what Serve routes to now (sync_replicas)
        self._live: dict[str, str] = {}  # request key -> the replica it was routed to, until it ends
        self._ended_before_routed: dict[str, tuple[str, float]] = {}  # request key -> (replica, when)

    # ---- the replica set -------------------------------------------------------------
    def sync_replicas(self, endpoints: Mapping[str, Optional[str]]) -> None:
        """The replicas Ray Serve routes to now, each with the load endpoint it announced
        (None until it has): subscribe to new ones, drop the ones that are gone."""
        for replica_id, endpoint in endpoints.items():
            if endpoint:
                self.loads.subscribe(replica_id, endpoint)
                if self.kv_events is not None:
                    self.kv_events.subscribe(replica_id, endpoint)
        # Every replica that left, subscribed or not (one routed to by queue length before it
        # announced an endpoint has bookkeeping and metric series too).
        for replica_id in (self._replica_ids | self.loads.replica_ids) - set(endpoints):
            self.remove_replica(replica_id)
        self._replica_ids = set(endpoints)

    def remove_replica(self, replica_id: str) -> None:
        """Forget a dead or removed replica: its stream, its bookkeeping, its metric series."""
        self.loads.unsubscribe(replica_id)
        if self.kv_events is not None:
            self.kv_events.unsubscribe(replica_id)
        self.inflight.remove_replica(replica_id)
        self.metrics.remove_replica(replica_id)
        self.policy.forget_replica(replica_id)
        for key in [key for key, send in self._tentative.items() if send.replica_id == replica_id]:
            del self._tentative[key]
        for key in [key for key, owner in self._live.items() if owner == replica_id]:
            del self._live[key]
        self._replica_ids.discard(replica_id)

    # ---- routing -----------------------------------------------------------------------
    def rank(self, request: RoutingRequest, queue_lens: Mapping[str, int], request_key: str) -> Optional[list[str]]:
        """Replica ids for `request`, best first, among those in `queue_lens` (Ray Serve's
        count of requests in flight to each) that are `serving`. None when the policy reads
        loads and no replica has a fresh one: the caller then uses Ray Serve's own
        queue-length choice among the `serving` ones.

        The first choice counts against its replica at once (until `routed` confirms or
        replaces it), so concurrent choices made before any confirmation spread out.
        """
        # A retry re-ranks from scratch: its own earlier choice must not count against it.
        self._tentative.pop(request_key, None)
        self._expire_tentative()
        serving = set(self.serving(queue_lens))
        views = [self._view(request, replica_id, queue_len) for replica_id, queue_len in queue_lens.items()
                 if replica_id in serving]
        for view in views:
            if view.load is not None:
                self.metrics.observe_load_age(view.replica_id, view.load_age_s)
        if self.policy.name in LOAD_BASED_POLICIES and not any(
            view.has_fresh_load(self.staleness_s) for view in views
        ):
            return None
        ranked = self.policy.rank(request, views)
        if ranked:
            self._tentative[request_key] = TentativeSend(ranked[0], self._send_of(request, ranked[0]), self.clock())
        return ranked

    def serving(self, replica_ids) -> list[str]:
        """The replicas among `replica_ids` that have not said they serve nothing more (a
        dead engine core, a shutdown: protos/not_serving.py) and whose endpoint does not answer
        as another replica (the replica is gone and a new one took its port), or all of them if
        none is left: a dead core fails requests fast, and a gone replica's queue is unknown
        (counted 0), so either would otherwise draw traffic until Serve's health check or probe
        drops it."""
        serving = []
        for replica_id in replica_ids:
            subscription = self.loads.get(replica_id)
            if subscription is None or (subscription.not_serving is None and subscription.wrong_replica is None):
                serving.append(replica_id)
        return serving or list(replica_ids)

    def routed(self, request: RoutingRequest, request_key: str, replica_id: str) -> None:
        """Ray Serve sent the request to `replica_id` and the replica accepted it."""
        self._tentative.pop(request_key, None)
        if self._replica_ids and replica_id not in self._replica_ids:
            return  # removed meanwhile (a scale-down during the accept round trip): nothing to recreate
        send = self._send_of(request, replica_id)
        self.inflight.record_sent(replica_id, send.blocks, self.wall_clock(), send.prefill_tokens, request_key)
        cached = {other: self._cached_blocks(request, other) for other in self.cache_index.replica_ids()}
        cached_blocks, _, block_size = cached.get(replica_id, (0, 0, 0))
        spilled = any(blocks > cached_blocks for blocks, _, _ in cached.values())
        self.metrics.decided(replica_id, cached_blocks * block_size, spilled)
        ended = self._ended_before_routed.pop(request_key, None)
        if ended is not None and ended[0] == replica_id:
            self.inflight.record_ended(request_key, self.wall_clock())
            return  # it ended before this call came: its prompt is live nowhere
        self._live[request_key] = replica_id
        self.policy.on_routed(request, replica_id, request_key, cached_blocks)

    def abandoned(self, request_key: str, replica_id: Optional[str] = None) -> None:
        """The request will not be sent after all (cancelled), or its accepted attempt ended on
        `replica_id` (None: wherever it was routed). Never report a rejected attempt's end here:
        Ray Serve reports it under the same key, and a retry may be accepted by the replica that
        rejected it (serve_router watches the accepted attempt's own result instead). An end
        reported for another replica than the one it is live on leaves the live one be; one
        reported before its routing is remembered for it."""
        self._tentative.pop(request_key, None)
        live_on = self._live.get(request_key)
        if live_on is not None and (replica_id is None or live_on == replica_id):
            del self._live[request_key]
            self.inflight.record_ended(request_key, self.wall_clock())  # the loads taken before now still hold its KV
            self.policy.on_finished(request_key)
        elif live_on is None and replica_id is not None:
            now = self.clock()
            self._ended_before_routed[request_key] = (replica_id, now)
            if len(self._ended_before_routed) > 1024:  # bounded: most are read within a loop turn
                expired_before = now - ENDED_BEFORE_ROUTED_TTL_S
                for key in [key for key, (_, at) in self._ended_before_routed.items() if at < expired_before]:
                    del self._ended_before_routed[key]

    def _cached_blocks(self, request: RoutingRequest, replica_id: str) -> tuple[int, int, int]:
        """(leading prompt blocks the replica caches, as a score (ReplicaCache.hit_blocks); of
        them, those on its device; its block size); zeros when unknown."""
        cache = self.cache_index.get(replica_id)
        if cache is None or not cache.block_size or not request.prompt_token_ids:
            return 0, 0, 0
        subscription = self.loads.get(replica_id)
        num_blocks, num_device_blocks = cache.hits(request.prefix_hashes(cache.block_size),
                                                   subscription.load if subscription else None)
        return num_blocks, num_device_blocks, cache.block_size

    def _view(self, request: RoutingRequest, replica_id: str, queue_len: int) -> ReplicaView:
        subscription = self.loads.get(replica_id)
        load = subscription.load if subscription is not None else None
        if load is not None:
            # Sends made before the core took the snapshot stop counting; a repeat does nothing.
            self.inflight.observe_snapshot(replica_id, load.seq, load.timestamp)
        cached_blocks, device_blocks, block_size = self._cached_blocks(request, replica_id)
        return ReplicaView(
            replica_id=replica_id,
            load=load,
            load_age_s=subscription.age_s() if load is not None else 0.0,
            queue_len=queue_len,
            inflight_since_snapshot=self._inflight_counts(replica_id),
            cached_blocks=cached_blocks,
            cache_block_size=block_size,
            device_blocks=device_blocks,
        )

    def _inflight_counts(self, replica_id: str) -> InflightCounts:
        confirmed = self.inflight.counts(replica_id)
        tentative = [send for send in self._tentative.values() if send.replica_id == replica_id]
        return InflightCounts(
            requests=confirmed.requests + len(tentative),
            blocks=confirmed.blocks + sum(tentative_send.send.blocks for tentative_send in tentative),
            prefill_tokens=confirmed.prefill_tokens + sum(t.send.prefill_tokens for t in tentative),
        )

    def _expire_tentative(self) -> None:
        expired_before = self.clock() - TENTATIVE_SEND_TTL_S
        for key in [key for key, send in self._tentative.items() if send.chosen_at < expired_before]:
            del self._tentative[key]

    def _send_of(self, request: RoutingRequest, replica_id: str) -> InflightCounts:
        """What sending `request` to the replica adds before its next snapshot shows it."""
        subscription = self.loads.get(replica_id)
        if subscription is None or subscription.load is None or not subscription.load.block_size:
            # No block size known: the request still counts, and so does its prefill.
            return InflightCounts(1, 0, request.prompt_tokens)
        load = subscription.load
        cached_blocks, device_blocks, _ = self._cached_blocks(request, replica_id)
        return InflightCounts.one_send(request.expected_blocks(load), request.prompt_tokens, cached_blocks,
                                       load.block_size, device_blocks)

    async def close(self) -> None:
        await self.loads.close()
        if self.kv_events is not None:
            await self.kv_events.close()
