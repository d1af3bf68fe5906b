"""Load subscriptions: one WatchLoad stream per replica per router, keeping each replica's
latest ReplicaLoad and when it arrived (its age is what tells a policy whether to trust it:
the time since it arrived plus the age its replica sent it at, `load_age`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import grpc

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from protos.not_serving import not_serving_reason
from router.stream_subscription import Backoff, StreamSubscription, SubscriptionSet

__all__ = ["Backoff", "LoadSubscriber", "LoadSubscription", "WATCH_INTERVAL_MS", "load_age"]

logger = logging.getLogger(__name__)

# Replicas push a snapshot at least this often; asking for the same keeps one contract.
WATCH_INTERVAL_MS = 100


def load_age(load: pb.ReplicaLoad, since_arrival_s: float) -> float:
    """How old `load` is, in seconds, `since_arrival_s` after it reached the router: that plus
    the age its replica sent it at (ReplicaLoad.load_age_ms, on the replica's own monotonic
    clock: a core that hangs with work has its load age though the stream goes on; an idle
    core's stays fresh). No wall clocks compared across hosts."""
    return since_arrival_s + load.load_age_ms / 1000.0


class LoadSubscription(StreamSubscription):
    """One replica's WatchLoad stream. The last snapshot is kept while disconnected, so its
    age keeps growing and policies stop trusting it. A replica that ends the stream saying
    it can serve nothing more (protos/not_serving.py) is `not_serving` until a stream
    delivers a snapshot again."""

    kind = "watch-load"

    def __init__(self, replica_id: str, endpoint: str, **kwargs):
        super().__init__(replica_id, endpoint, **kwargs)
        self.load: Optional[pb.ReplicaLoad] = None
        self.received_at: Optional[float] = None  # on `clock`, when `load` arrived
        self.not_serving: Optional[str] = None  # why the replica said it serves nothing more

    def age_s(self) -> Optional[float]:
        """How old the latest snapshot is (load_age: since it arrived, plus its age when its
        replica sent it); None before the first one."""
        if self.received_at is None or self.load is None:
            return None
        return load_age(self.load, self.clock() - self.received_at)

    async def _stream_once(self, channel: grpc.aio.Channel) -> None:
        call = pb_grpc.LoadReporterStub(channel).WatchLoad(pb.WatchLoadRequest(max_interval_ms=WATCH_INTERVAL_MS),
                                                          metadata=self.metadata)
        first = True
        try:
            async for load in call:
                if first:  # a stream answers for one replica: its first message says which
                    self._check_identity(load.replica_id)
                    self._delivered()
                    self.not_serving = None
                    first = False
                self.load = load
                self.received_at = self.clock()
        except grpc.aio.AioRpcError as error:
            reason = not_serving_reason(error.trailing_metadata())
            if reason is not None and self.not_serving is None:
                logger.warning("replica %s serves nothing more (%s): routing around it", self.replica_id, reason)
            self.not_serving = reason or self.not_serving
            raise


class LoadSubscriber(SubscriptionSet[LoadSubscription]):
    """All of one router's load subscriptions, keyed by replica id."""

    def __init__(self, *, backoff: Backoff = Backoff(), clock: Callable[[], float] = time.monotonic,
                 metadata: Sequence[tuple[str, str]] = ()):
        super().__init__(lambda replica_id, endpoint: LoadSubscription(
            replica_id, endpoint, backoff=backoff, clock=clock, metadata=metadata))
