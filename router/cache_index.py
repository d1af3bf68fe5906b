"""The router's view of every replica's prefix cache, built from its KV events: per replica
the set of cached block hashes (bounded), and for a prompt the number of its leading blocks
each replica holds. A replica's set is dropped when its stream breaks and rebuilt from the
snapshot that starts the next one.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

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
        self.seq: Optional[int] = None  # None until a snapshot arrives
        self.block_size: Optional[int] = None

    def apply(self, batch: pb.KVEventBatch) -> bool:
        """Apply one message; False (nothing applied) when a live batch does not follow the
        previous one: events were missed and only a new snapshot can repair the set."""
        if not batch.snapshot and (self.seq is None or batch.seq != self.seq + 1):
            return False
        self.seq = batch.seq
        self.block_size = batch.block_size
        self.apply_events((event.kind, event.block_hash) for event in batch.events)
        return True

    def apply_events(self, events: Iterable[tuple[int, bytes]]) -> None:
        """(kind, block hash) pairs in order; kinds are the proto's KVEventKind values (the
        router simulation feeds the engine's own events through here)."""
        hashes = self.hashes
        for kind, block_hash in events:
            if kind == pb.KV_EVENT_BLOCK_STORED:
                hashes[block_hash] = None
            elif kind == pb.KV_EVENT_BLOCK_REMOVED:
                hashes.pop(block_hash, None)
            elif kind == pb.KV_EVENT_ALL_BLOCKS_CLEARED:
                hashes.clear()
        while len(hashes) > self.max_blocks:
            del hashes[next(iter(hashes))]

    def leading_blocks(self, prefix_hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks this replica holds."""
        hashes = self.hashes
        for count, block_hash in enumerate(prefix_hashes):
            if block_hash not in hashes:
                return count
        return len(prefix_hashes)


class PrefixCacheIndex:
    """Every replica's ReplicaCache. Replicas without one (no stream yet) hold nothing."""

    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA):
        self.max_blocks_per_replica = max_blocks_per_replica
        self._caches: dict[str, ReplicaCache] = {}

    def apply(self, replica_id: str, batch: pb.KVEventBatch) -> bool:
        cache = self._caches.get(replica_id)
        if cache is None:
            cache = self._caches[replica_id] = ReplicaCache(self.max_blocks_per_replica)
        return cache.apply(batch)

    def drop(self, replica_id: str) -> None:
        """Forget a replica's cache (its stream broke, or it is gone): stale hashes would
        send requests where their prefix may no longer be."""
        self._caches.pop(replica_id, None)

    def get(self, replica_id: str) -> Optional[ReplicaCache]:
        cache = self._caches.get(replica_id)
        return cache if cache is not None and cache.seq is not None else None

    def num_blocks(self, replica_id: str) -> int:
        cache = self._caches.get(replica_id)
        return len(cache.hashes) if cache is not None else 0

    def replica_ids(self) -> Iterable[str]:
        return self._caches.keys()
