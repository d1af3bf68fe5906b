"""KV event subscriptions: one WatchKVEvents stream per replica per router, feeding the
router's PrefixCacheIndex. A gap in the batch numbers, or the stream ending, drops that
replica's cache from the index; the next stream starts with a snapshot that rebuilds it.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import grpc

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from router.cache_index import PrefixCacheIndex
from router.stream_subscription import Backoff, Resync, StreamSubscription, SubscriptionSet


class KVEventGap(Resync):
    """A live batch did not follow the previous one: reconnect for a fresh snapshot (an
    expected resync, counted by headroom_router_kv_event_resyncs_total when it arrives)."""


class KVEventSubscription(StreamSubscription):
    kind = "watch-kv-events"

    def __init__(self, replica_id: str, endpoint: str, index: PrefixCacheIndex,
                 on_resync: Optional[Callable[[str], None]] = None, **kwargs):
        super().__init__(replica_id, endpoint, **kwargs)
        self.index = index
        self.on_resync = on_resync
        self.snapshots = 0  # snapshots received: the first, then one per resync

    async def _stream_once(self, channel: grpc.aio.Channel) -> None:
        call = pb_grpc.LoadReporterStub(channel).WatchKVEvents(pb.WatchKVEventsRequest(), metadata=self.metadata)
        first = True
        previous_seq = None
        async for batch in call:
            if first:  # a stream answers for one replica: its first message says which
                self._check_identity(batch.replica_id)
                self._delivered()
                first = False
            after_seq = previous_seq
            if batch.snapshot and batch.seq != previous_seq:
                self.snapshots += 1  # the first part of a new snapshot
                if self.snapshots > 1 and self.on_resync is not None:
                    self.on_resync(self.replica_id)
            previous_seq = batch.seq
            if self.stopped:  # unsubscribed: its index entry is gone and stays gone
                return
            if not self.index.apply(self.replica_id, batch):
                raise KVEventGap(f"KV event batch {batch.seq} came after {after_seq}: batches missed, "
                                 "reconnecting for a fresh snapshot")

    def _disconnected(self) -> None:
        self.index.drop(self.replica_id)


class KVEventSubscriber(SubscriptionSet[KVEventSubscription]):
    """All of one router's KV event subscriptions, writing into one index."""

    def __init__(self, index: PrefixCacheIndex, *, backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.monotonic, on_resync: Optional[Callable[[str], None]] = None,
                 metadata: Sequence[tuple[str, str]] = ()):
        self.index = index
        super().__init__(lambda replica_id, endpoint: KVEventSubscription(
            replica_id, endpoint, index, on_resync, backoff=backoff, clock=clock, metadata=metadata))

    def unsubscribe(self, replica_id: str) -> None:
        super().unsubscribe(replica_id)
        self.index.drop(replica_id)
