"""Load subscriptions: one WatchLoad stream per replica per router, reconnecting with
exponential backoff and jitter, keeping each replica's latest ReplicaLoad and when it arrived
(its age is what tells a policy whether to trust it).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import grpc

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Replicas push a snapshot at least this often; asking for the same keeps one contract.
WATCH_INTERVAL_MS = 100


@dataclass(frozen=True)
class Backoff:
    """Delay before reconnect attempt `attempt` (0-based): exponential, capped, with "equal
    jitter" (half fixed, half random) so routers that lost a replica together do not all
    reconnect in the same instant, yet none retries sooner than half the nominal delay."""

    initial_s: float = 0.05
    multiplier: float = 2.0
    max_s: float = 2.0

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        nominal = min(self.initial_s * self.multiplier ** min(attempt, 64), self.max_s)
        return nominal / 2 + rng.uniform(0.0, nominal / 2)


class LoadSubscription:
    """One replica's WatchLoad stream, kept open until close(): after a stream error or a
    clean end (the replica restarting its server) it reconnects, backing off while the
    replica stays unreachable. The last snapshot is kept while disconnected, so its age
    keeps growing and policies stop trusting it."""

    def __init__(
        self,
        replica_id: str,
        endpoint: str,
        *,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
        rng: Optional[random.Random] = None,
    ):
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.backoff = backoff
        self.clock = clock
        self.rng = rng or random.Random()
        self.load: Optional[pb.ReplicaLoad] = None
        self.received_at: Optional[float] = None  # on `clock`, when `load` arrived
        self.connects = 0  # streams that delivered at least one snapshot
        self.failed_attempts = 0  # consecutive attempts without a snapshot; sets the backoff
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start streaming on the running event loop (grpc.aio channels belong to one loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"watch-load-{self.replica_id}"
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def age_s(self) -> Optional[float]:
        """Seconds since the latest snapshot arrived; None before the first one."""
        if self.received_at is None:
            return None
        return self.clock() - self.received_at

    async def _run(self) -> None:
        while True:
            try:
                await self._stream_once()
            except grpc.aio.AioRpcError as error:
                logger.debug("WatchLoad %s at %s: %s", self.replica_id, self.endpoint, error.code())
            except Exception:  # never let one replica's stream die silently: keep retrying
                logger.exception("WatchLoad %s at %s failed", self.replica_id, self.endpoint)
            delay_s = self.backoff.delay_s(self.failed_attempts, self.rng)
            self.failed_attempts += 1
            await asyncio.sleep(delay_s)

    async def _stream_once(self) -> None:
        async with grpc.aio.insecure_channel(self.endpoint) as channel:
            stub = pb_grpc.LoadReporterStub(channel)
            call = stub.WatchLoad(pb.WatchLoadRequest(max_interval_ms=WATCH_INTERVAL_MS))
            first = True
            async for load in call:
                self.load = load
                self.received_at = self.clock()
                if first:
                    # Only a stream that delivers resets the backoff: a replica that accepts
                    # connections and then fails at once must not be hammered.
                    self.connects += 1
                    self.failed_attempts = 0
                    first = False


class LoadSubscriber:
    """All of one router's subscriptions, keyed by replica id. Not thread-safe: call it from
    the event loop the router runs on."""

    def __init__(self, *, backoff: Backoff = Backoff(), clock: Callable[[], float] = time.monotonic):
        self.backoff = backoff
        self.clock = clock
        self._subscriptions: dict[str, LoadSubscription] = {}
        self._closing: set[asyncio.Task] = set()

    def subscribe(self, replica_id: str, endpoint: str) -> None:
        """Watch `replica_id` at `endpoint`; a changed endpoint replaces the old stream."""
        current = self._subscriptions.get(replica_id)
        if current is not None and current.endpoint == endpoint:
            return
        if current is not None:
            self.unsubscribe(replica_id)
        subscription = LoadSubscription(replica_id, endpoint, backoff=self.backoff, clock=self.clock)
        subscription.start()
        self._subscriptions[replica_id] = subscription

    def unsubscribe(self, replica_id: str) -> None:
        """Stop watching a dead or removed replica (closes its stream in the background)."""
        subscription = self._subscriptions.pop(replica_id, None)
        if subscription is not None:
            task = asyncio.get_running_loop().create_task(subscription.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def get(self, replica_id: str) -> Optional[LoadSubscription]:
        return self._subscriptions.get(replica_id)

    @property
    def replica_ids(self) -> set[str]:
        return set(self._subscriptions)

    async def close(self) -> None:
        for replica_id in list(self._subscriptions):
            self.unsubscribe(replica_id)
        if self._closing:
            await asyncio.gather(*self._closing)
