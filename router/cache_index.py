"""The router's view of every replica's prefix cache, built from its KV events: per replica
the set of cached block hashes (bounded) in each medium, and for a prompt the number of its
leading blocks each replica holds (a device hit, then the host tier's continuation of it). A replica's set is dropped when its stream breaks and rebuilt from the
snapshot that starts the next one.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from protos import headroom_pb2 as pb

# A replica caches at most its pool's blocks (tens of thousands); a set past this bound means
# a misbehaving stream, and the oldest hashes go first so memory stays bounded.
MAX_BLOCKS_PER_REPLICA = 1 << 19


class ReplicaCache:
    """One replica's cached block hashes, in insertion order (for the bound), and the
    sequence number of the latest batch applied."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_REPLICA):
        self.max_blocks = max_blocks
        self.hashes: dict[bytes, None] = {}
        self.host_hashes: dict[bytes, None] = {}  # blocks in the replica's host KV tier
        self.seq: Optional[int] = None  # None until a snapshot arrives
        self.block_size: Optional[int] = None
        self._live = False  # the latest message applied was a step's (not a snapshot's)

    def apply(self, batch: pb.KVEventBatch) -> bool:
        """Apply one message; False (nothing applied) when a live batch does not follow the
        previous one: events were missed and only a new snapshot can repair the set. A step's
        events past one message's share come in several parts with its seq, as a snapshot's do
        (a part after the first was taken for a gap, and the index dropped)."""
        if not batch.snapshot and not (self.seq is not None and (batch.seq == self.seq + 1
                                                                 or (batch.seq == self.seq and self._live))):
            return False
        self.seq = batch.seq
        self._live = not batch.snapshot
        self.block_size = batch.block_size
        self.apply_events((event.kind, event.block_hash, event.medium) for event in batch.events)
        return True

    def apply_events(self, events: Iterable[tuple]) -> None:
        """(kind, block hash[, medium]) in order; kinds and media are the proto's values (the
        router simulation feeds the engine's own events through here); no medium: the device."""
        for event in events:
            kind, block_hash = event[0], event[1]
            hashes = self.host_hashes if len(event) > 2 and event[2] == pb.KV_MEDIUM_HOST else self.hashes
            if kind == pb.KV_EVENT_BLOCK_STORED:
                hashes[block_hash] = None
            elif kind == pb.KV_EVENT_BLOCK_REMOVED:
                hashes.pop(block_hash, None)
            elif kind == pb.KV_EVENT_ALL_BLOCKS_CLEARED:
                self.hashes.clear()
                self.host_hashes.clear()
        for hashes in (self.hashes, self.host_hashes):
            while len(hashes) > self.max_blocks:
                del hashes[next(iter(hashes))]

    def leading_blocks(self, prefix_hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks this replica holds on the device."""
        return _leading(self.hashes, prefix_hashes, 0)

    def leading_host_blocks(self, prefix_hashes: Sequence[bytes], num_device_blocks: int) -> int:
        """How many blocks past its device hit the replica's host tier holds: a hit there is
        copied back instead of prefilled."""
        return _leading(self.host_hashes, prefix_hashes, num_device_blocks) - num_device_blocks

    def hit_blocks(self, prefix_hashes: Sequence[bytes], load: Optional[pb.ReplicaLoad]) -> int:
        """The prompt's leading blocks this replica would serve from cache, as a routing score:
        its device hit, and the host tier's continuation of it counted at what those blocks
        save after their copy back (host_hit_worth of the replica's latest load report)."""
        return self.hits(prefix_hashes, load)[0]

    def hits(self, prefix_hashes: Sequence[bytes], load: Optional[pb.ReplicaLoad]) -> tuple[int, int]:
        """(hit_blocks, of them the device's): only a device hit is memory the request shares;
        a host hit is copied back into blocks allocated for it."""
        num_device_blocks = self.leading_blocks(prefix_hashes)
        num_host_blocks = self.leading_host_blocks(prefix_hashes, num_device_blocks)
        worth = host_hit_worth(load) if num_host_blocks else 0.0
        return num_device_blocks + int(num_host_blocks * worth), num_device_blocks


def _leading(hashes: dict[bytes, None], prefix_hashes: Sequence[bytes], start: int) -> int:
    for count in range(start, len(prefix_hashes)):
        if prefix_hashes[count] not in hashes:
            return count
    return len(prefix_hashes)


def host_hit_worth(load: Optional[pb.ReplicaLoad]) -> float:
    """What a host-tier block hit saves, as a fraction of a device hit: the prefill it avoids
    less the copy back (the replica's measured host_hit_cost_ratio); 0 where the replica
    reports none."""
    if load is None or not load.host_kv_blocks_total:
        return 0.0
    return min(1.0, max(0.0, 1.0 - load.host_hit_cost_ratio))


class PrefixCacheIndex:
    """Every replica's ReplicaCache. Replicas without one (no stream yet) hold nothing.
    `on_change(replica_id, num_blocks)` follows every change: after a message is applied, with
    the device blocks the replica's set now holds (`num_blocks`); after its set is dropped,
    with None (the router's cached-blocks gauge, kept current without a request to rank)."""

    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA,
                 on_change: Optional[Callable[[str, Optional[int]], None]] = None):
        self.max_blocks_per_replica = max_blocks_per_replica
        self.on_change = on_change
        self._caches: dict[str, ReplicaCache] = {}

    def apply(self, replica_id: str, batch: pb.KVEventBatch) -> bool:
        cache = self._caches.get(replica_id)
        if cache is None:
            cache = self._caches[replica_id] = ReplicaCache(self.max_blocks_per_replica)
        applied = cache.apply(batch)
        if applied and self.on_change is not None:
            self.on_change(replica_id, len(cache.hashes))
        return applied

    def drop(self, replica_id: str) -> None:
        """Forget a replica's cache (its stream broke, or it is gone): stale hashes would
        send requests where their prefix may no longer be."""
        if self._caches.pop(replica_id, None) is not None and self.on_change is not None:
            self.on_change(replica_id, None)

    def get(self, replica_id: str) -> Optional[ReplicaCache]:
        cache = self._caches.get(replica_id)
        return cache if cache is not None and cache.seq is not None else None

    def num_blocks(self, replica_id: str) -> int:
        cache = self._caches.get(replica_id)
        return len(cache.hashes) if cache is not None else 0

    def replica_ids(self) -> Iterable[str]:
        return self._caches.keys()
