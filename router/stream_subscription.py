"""A router's subscriptions to replica streams (WatchLoad, WatchKVEvents): each kept open until
closed, reconnecting with exponential backoff and jitter while its replica is unreachable,
and the set of them keyed by replica id, whose streams end when it is closed or discarded.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import random
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Generic, Optional, Sequence, TypeVar

import grpc

from protos.keepalive import CLIENT_KEEPALIVE_OPTIONS

logger = logging.getLogger(__name__)


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


class Resync(Exception):
    """The stream must start over (a KV event batch missed: the next stream's snapshot repairs
    it). Expected, not a failure: logged as one warning line, without a traceback."""


class WrongReplica(Exception):
    """The endpoint answered as another replica: the one subscribed to is gone and its port was
    taken by a new one (which the router learns of under its own id). Nothing it sends is
    applied; the subscription keeps backing off until its replica is unsubscribed."""


class StreamSubscription(abc.ABC):
    """One replica's server stream, kept open until close(): after a stream error or a clean
    end (the replica restarting its server) it reconnects, backing off while the replica
    stays unreachable. Subclasses read one stream in `_stream_once`."""

    kind = "stream"  # for logs

    def __init__(
        self,
        replica_id: str,
        endpoint: str,
        *,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
        rng: Optional[random.Random] = None,
        metadata: Sequence[tuple[str, str]] = (),
    ):
        """metadata: sent with every stream (the cluster token's `authorization`)."""
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.metadata = tuple(metadata)
        self.backoff = backoff
        self.clock = clock
        self.rng = rng or random.Random()
        self.connects = 0  # streams that delivered at least one message
        self.failed_attempts = 0  # consecutive attempts without a message; sets the backoff
        self.stopped = False
        self.wrong_replica: Optional[str] = None  # the id the endpoint last answered as, if not ours
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start streaming on the running event loop (grpc.aio channels belong to one loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"{self.kind}-{self.replica_id}")

    def stop(self) -> None:
        """Deliver nothing more, from now: a message the stream's task was already woken with
        would otherwise still be applied when it runs, after the subscription was dropped."""
        self.stopped = True
        if self._task is not None:
            self._task.cancel()

    def stop_soon(self) -> None:
        """stop(), from any thread and at any moment (a garbage collection's finalizer): the
        task is cancelled by its own event loop, on its next turn."""
        task = self._task
        if task is None:
            return
        self.stopped = True
        try:
            task.get_loop().call_soon_threadsafe(self.stop)
        except RuntimeError:  # its loop is closed, and the task ended with it
            pass

    async def close(self) -> None:
        self.stop()
        if self._task is not None:
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                async with grpc.aio.insecure_channel(self.endpoint, options=CLIENT_KEEPALIVE_OPTIONS) as channel:
                    await self._stream_once(channel)
            except grpc.aio.AioRpcError as error:
                logger.debug("%s %s at %s: %s", self.kind, self.replica_id, self.endpoint, error.code())
            except Resync as error:
                logger.warning("%s %s at %s: %s", self.kind, self.replica_id, self.endpoint, error)
            except WrongReplica as error:
                if self.wrong_replica != str(error):
                    logger.warning("%s %s: %s answers as replica %s; ignoring it until %s is removed",
                                   self.kind, self.replica_id, self.endpoint, error, self.replica_id)
                self.wrong_replica = str(error)
            except Exception:  # never let one replica's stream die silently: keep retrying
                logger.exception("%s %s at %s failed", self.kind, self.replica_id, self.endpoint)
            self._disconnected()
            delay_s = self.backoff.delay_s(self.failed_attempts, self.rng)
            self.failed_attempts += 1
            await asyncio.sleep(delay_s)

    def _check_identity(self, replica_id: str) -> None:
        """Raise WrongReplica unless a message's `replica_id` is this subscription's (empty:
        a replica that does not say, trusted)."""
        if replica_id and replica_id != self.replica_id:
            raise WrongReplica(replica_id)

    def _delivered(self) -> None:
        """Call on a stream's first message: only a stream that delivers resets the backoff,
        so a replica that accepts connections and then fails at once is not hammered."""
        self.connects += 1
        self.failed_attempts = 0
        self.wrong_replica = None

    def _disconnected(self) -> None:
        """The stream ended or failed; subclasses drop what no longer holds."""

    @abc.abstractmethod
    async def _stream_once(self, channel: grpc.aio.Channel) -> None: ...


S = TypeVar("S", bound=StreamSubscription)


class SubscriptionSet(Generic[S]):
    """One router's subscriptions of one kind, keyed by replica id. Not thread-safe: call it
    from the event loop the router runs on. Dropped without close(), it still ends its streams
    (Ray Serve 2.60 discards a request router with no hook to close it: a proxy drops the
    handle of a deleted application, a handle is garbage collected), or each would keep its
    task, its channel and its replica's stream for the life of the process."""

    def __init__(self, make: Callable[[str, str], S]):
        self._make = make
        self._subscriptions: dict[str, S] = {}
        self._closing: set[asyncio.Task] = set()
        weakref.finalize(self, _stop_soon, self._subscriptions)

    def subscribe(self, replica_id: str, endpoint: str) -> None:
        """Watch `replica_id` at `endpoint`; a changed endpoint replaces the old stream."""
        current = self._subscriptions.get(replica_id)
        if current is not None and current.endpoint == endpoint:
            return
        if current is not None:
            self.unsubscribe(replica_id)
        subscription = self._make(replica_id, endpoint)
        subscription.start()
        self._subscriptions[replica_id] = subscription

    def unsubscribe(self, replica_id: str) -> None:
        """Stop watching a dead or removed replica (closes its stream in the background)."""
        subscription = self._subscriptions.pop(replica_id, None)
        if subscription is not None:
            subscription.stop()
            task = asyncio.get_running_loop().create_task(subscription.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def get(self, replica_id: str) -> Optional[S]:
        return self._subscriptions.get(replica_id)

    @property
    def replica_ids(self) -> set[str]:
        return set(self._subscriptions)

    async def close(self) -> None:
        for replica_id in list(self._subscriptions):
            self.unsubscribe(replica_id)
        if self._closing:
            await asyncio.gather(*self._closing)


def _stop_soon(subscriptions: dict[str, StreamSubscription]) -> None:
    """A discarded SubscriptionSet's finalizer: holds no reference to the set itself."""
    for subscription in list(subscriptions.values()):
        subscription.stop_soon()
