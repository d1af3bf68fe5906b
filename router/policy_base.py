"""The routing interface every policy implements, and what policies share: the request and
replica views they rank, the stale-stats fallback to queue length, and the inference
extension's load scorers (llm-d and the Gateway API inference extension use them).
"""

from __future__ import annotations

import abc
import collections
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

from protos.block_hash import block_hashes
from protos.headroom_pb2 import ReplicaLoad
from router.inflight import InflightCounts

# Snapshots arrive every <= 100 ms; one older than a second means the stream is broken or
# the replica is stuck, and its numbers no longer describe it.
DEFAULT_STALENESS_S = 1.0


@dataclass(frozen=True)
class RoutingRequest:
    """What the router knows of a request before it runs: its token counts and priority, and
    (when the caller passes them) its prompt's token ids, to match against replica caches."""

    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    prompt_token_ids: tuple[int, ...] = ()
    _prefix_hashes: dict[int, list[bytes]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        """The full sequence the replica must eventually hold: prompt plus every output token."""
        return self.prompt_tokens + self.max_tokens

    def num_blocks(self, block_size: int) -> int:
        return -(-self.num_tokens // block_size)

    def expected_output_tokens(self, load: Optional[ReplicaLoad]) -> int:
        """Output the replica expects of this request: max_tokens, or less where the replica
        admits by expected length and has learned it (ReplicaLoad.expected_output_tokens)."""
        if load is None or not load.expected_output_tokens:
            return self.max_tokens
        return min(self.max_tokens, load.expected_output_tokens)

    def expected_blocks(self, load: ReplicaLoad) -> int:
        """KV blocks the request is expected to hold at its end on the replica reporting `load`."""
        return -(-(self.prompt_tokens + self.expected_output_tokens(load)) // load.block_size)

    def prefix_hashes(self, block_size: int) -> list[bytes]:
        """Chain hashes of the prompt blocks a replica's prefix cache could serve: full blocks,
        leaving at least one token to compute (as the replica does). Computed once per block
        size; empty without token ids, or with ids no replica would accept."""
        hashes = self._prefix_hashes.get(block_size)
        if hashes is None:
            num_cacheable = (len(self.prompt_token_ids) - 1) // block_size * block_size
            try:
                hashes = block_hashes(self.prompt_token_ids[:num_cacheable], block_size)
            except OverflowError:  # an id outside uint32: the replica will reject the request
                hashes = []
            self._prefix_hashes[block_size] = hashes
        return hashes


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it when a request arrives."""

    replica_id: str
    load: Optional[ReplicaLoad]  # the latest snapshot; None until the first one arrives
    load_age_s: float  # how old `load` is (ignored when it is None)
    queue_len: int  # Ray Serve's own count of requests in flight to this replica
    inflight_since_snapshot: InflightCounts = field(default_factory=InflightCounts)
    # Leading blocks of the request's prompt this replica's prefix cache holds, from its KV
    # events (0 when unknown); in blocks of `cache_block_size` tokens. A host-tier hit counts
    # at what it saves after its copy back (router/cache_index.py's host_hit_worth).
    cached_blocks: int = 0
    cache_block_size: int = 0
    # Of those, the blocks on the replica's device: memory the request shares rather than
    # allocates (a host hit is copied into blocks allocated for it). None: all of them.
    device_blocks: Optional[int] = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the replica's cache saves prefilling."""
        return self.cached_blocks * self.cache_block_size

    @property
    def shared_tokens(self) -> int:
        """Prompt tokens whose KV the replica already holds on its device."""
        blocks = self.cached_blocks if self.device_blocks is None else min(self.device_blocks, self.cached_blocks)
        return blocks * self.cache_block_size

    def has_fresh_load(self, staleness_s: float) -> bool:
        # A load without a block size (no replica of ours sends one) is no measure of anything:
        # ranked as a stale one is, not divided by.
        return self.load is not None and self.load.block_size > 0 and self.load_age_s <= staleness_s


def split_by_freshness(replicas: Sequence[ReplicaView], staleness_s: float) -> tuple[list[ReplicaView], list[ReplicaView]]:
    """(replicas with a snapshot no older than staleness_s, the rest), in one pass."""
    fresh, stale = [], []
    for view in replicas:
        (fresh if view.has_fresh_load(staleness_s) else stale).append(view)
    return fresh, stale


class RoutingPolicy(abc.ABC):
    """Ranks replicas for one request; the caller sends it to the first that accepts.

    A policy that reads `ReplicaView.cached_blocks` sets `uses_prefix_cache`, so the router
    subscribes to KV events for it. Policies that track their own sends (an approximate
    prefix tree, active sequences) override the lifecycle hooks; the caller reports each
    request's key when it is routed, when its first token arrives (where the caller can see
    it) and when it finishes.
    """

    name: str
    uses_prefix_cache = False

    @abc.abstractmethod
    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]: ...

    def on_routed(self, request: RoutingRequest, replica_id: str, request_key: str, cached_blocks: int) -> None:
        """The request went to `replica_id`, whose cache held `cached_blocks` of its prompt."""

    def on_first_token(self, request_key: str) -> None:
        """The request's prefill is done."""

    def on_finished(self, request_key: str) -> None:
        """The request ended (or was abandoned)."""

    def forget_replica(self, replica_id: str) -> None:
        """The replica is gone."""


class LiveBlocks:
    """The prompt blocks of the requests a router sent that have not finished, per replica (a
    block shared by several live requests counted once per request): a live request holds its
    prefix there, or will once admitted, before any KV event can say so. Ours reads it as
    cache the replica is about to have; Dynamo's router as the replica's active blocks."""

    def __init__(self) -> None:
        self._per_replica: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._sent: dict[str, tuple[str, tuple[bytes, ...]]] = {}  # request key -> (replica, its prompt blocks)

    def of(self, replica_id: str) -> collections.Counter:
        """The replica's live blocks, each with the number of live requests holding it."""
        return self._per_replica.get(replica_id) or collections.Counter()

    def add(self, request_key: str, replica_id: str, block_hashes: tuple[bytes, ...]) -> None:
        self.remove(request_key)  # a retry replaces the earlier send
        self._sent[request_key] = (replica_id, block_hashes)
        self._per_replica[replica_id].update(block_hashes)

    def remove(self, request_key: str) -> None:
        sent = self._sent.pop(request_key, None)
        if sent is None:
            return
        replica_id, block_hashes = sent
        blocks = self._per_replica[replica_id]
        blocks.subtract(block_hashes)
        for block_hash in block_hashes:
            if blocks[block_hash] <= 0:
                del blocks[block_hash]

    def forget_replica(self, replica_id: str) -> None:
        self._per_replica.pop(replica_id, None)
        for key in [key for key, (owner, _) in self._sent.items() if owner == replica_id]:
            del self._sent[key]


def rank_by_queue_len(replicas: Sequence[ReplicaView], rng: random.Random) -> list[ReplicaView]:
    """Shortest queue first, equal queues in random order: Ray Serve's choice without stats."""
    shuffled = list(replicas)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=lambda view: view.queue_len)  # stable: the shuffle breaks ties


def merge_stale_by_queue_len(
    fresh_ranked: list[ReplicaView], stale: Sequence[ReplicaView], rng: random.Random
) -> list[str]:
    """Slots replicas without fresh stats into a ranking of fresh ones, on queue length alone.

    A stale replica goes ahead of the next fresh one only when its queue is shorter, so a
    replica whose stream broke keeps serving while it is visibly less busy, and never
    wins on numbers it no longer reports.
    """
    stale_ranked = rank_by_queue_len(stale, rng)
    merged: list[str] = []
    i = j = 0
    while i < len(fresh_ranked) or j < len(stale_ranked):
        take_stale = j < len(stale_ranked) and (
            i == len(fresh_ranked) or stale_ranked[j].queue_len < fresh_ranked[i].queue_len
        )
        if take_stale:
            merged.append(stale_ranked[j].replica_id)
            j += 1
        else:
            merged.append(fresh_ranked[i].replica_id)
            i += 1
    return merged


def min_max_normalized(values: dict[str, float]) -> dict[str, float]:
    """(value - min) / (max - min) per key; 1.0 for every key when all values are equal, as
    the inference extension's scorers normalize."""
    if not values:
        return {}
    low, high = min(values.values()), max(values.values())
    if high == low:
        return dict.fromkeys(values, 1.0)
    return {key: (value - low) / (high - low) for key, value in values.items()}


def load_scores(fresh: Sequence[ReplicaView], queue_weight: float, kv_cache_weight: float) -> dict[str, float]:
    """The inference extension's queue scorer (fewest waiting requests, min-max normalized)
    and KV-cache-utilization scorer (1 - usage), weighted and summed, per replica id."""
    fewest_waiting = min_max_normalized({view.replica_id: -view.load.num_waiting for view in fresh})
    return {
        view.replica_id: queue_weight * fewest_waiting[view.replica_id] + kv_cache_weight * (1.0 - view.load.kv_usage)
        for view in fresh
    }
