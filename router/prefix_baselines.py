"""Prefix-cache-aware baselines, faithful to their published designs, so the benchmark
compares ours against what operators run today:

- `approx_prefix`: SGLang's cache-aware router (sgl-router policies/cache_aware.rs, CLI
  defaults) and, with other knobs, Ray Serve's PrefixCacheAffinityRouter: an approximate
  prefix tree of what the router itself sent where, with a load-imbalance fallback.
- `precise_prefix`: llm-d's precise prefix-cache-aware scheduling: the longest cached prefix
  per pod from vLLM KV events, scorers prefix 3 / queue 2 / KV utilization 2 (llm-d's v0.5 guide; its current 2 / 1 / 1 measured weaker).
- `dynamo`: NVIDIA Dynamo's KV router: cost = overlap_score_weight x prefill blocks +
  decode blocks, from KV events and the router's own active-sequence tracking.

All three match prompts at block granularity with the stable chain hashes of
protos/block_hash.py (SGLang and Ray match characters: within one block the same).
"""

from __future__ import annotations

import collections
import random
from typing import Optional, Sequence

from router.policy_base import (
    DEFAULT_STALENESS_S,
    LiveBlocks,
    ReplicaView,
    RoutingPolicy,
    RoutingRequest,
    load_scores,
    merge_stale_by_queue_len,
    min_max_normalized,
    rank_by_queue_len,
    split_by_freshness,
)

# Block size for routers that never hear from a replica's cache (the approximate tree), and
# for hashing when a replica's block size is not known yet.
DEFAULT_BLOCK_SIZE = 16


class RoutedPrefixTree:
    """What an approximate router believes each replica caches: the prompt blocks it sent
    there, least recently used evicted first past `max_blocks` per replica. It never hears
    of the replica's own evictions, which is what makes it approximate."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._blocks: dict[str, collections.OrderedDict[bytes, None]] = {}

    def insert(self, replica_id: str, prefix_hashes: Sequence[bytes]) -> None:
        blocks = self._blocks.setdefault(replica_id, collections.OrderedDict())
        for block_hash in prefix_hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def matched_blocks(self, replica_id: str, prefix_hashes: Sequence[bytes]) -> int:
        blocks = self._blocks.get(replica_id, {})
        for count, block_hash in enumerate(prefix_hashes):
            if block_hash not in blocks:
                return count
        return len(prefix_hashes)

    def size(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))

    def remove(self, replica_id: str) -> None:
        self._blocks.pop(replica_id, None)


class ApproxPrefixPolicy(RoutingPolicy):
    """SGLang's cache-aware policy. Load = requests in flight to each replica (Serve's queue
    length; SGLang counts its own). If the load is imbalanced (max - min >
    `balance_abs_threshold` and max > `balance_rel_threshold` x min), the shortest queue;
    otherwise the replica whose tree matches the most of the prompt when the match rate
    exceeds `cache_threshold`, else the replica with the smallest tree. Every routed
    prompt is inserted into its replica's tree.

    Defaults: sgl-router's command line (0.3, 64, 1.5, max tree 2^26 characters, here about
    2^20 blocks). Ray Serve's PrefixCacheAffinityRouter is the same design with
    match_rate_threshold 0.1 and imbalanced_threshold 10 (absolute only: rel 1.0).
    """

    name = "approx_prefix"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_blocks: int = 1 << 20,
        rng: Optional[random.Random] = None,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = RoutedPrefixTree(max_tree_blocks)
        self.rng = rng or random.Random()

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        by_queue = rank_by_queue_len(replicas, self.rng)
        if not by_queue:
            return []
        loads = [view.queue_len for view in replicas]
        max_load, min_load = max(loads), min(loads)
        imbalanced = max_load - min_load > self.balance_abs_threshold and max_load > self.balance_rel_threshold * min_load
        if imbalanced:
            return [view.replica_id for view in by_queue]
        first = self._cache_choice(request, by_queue)
        return [first] + [view.replica_id for view in by_queue if view.replica_id != first]

    def _cache_choice(self, request: RoutingRequest, replicas: list[ReplicaView]) -> str:
        hashes = request.prefix_hashes(DEFAULT_BLOCK_SIZE)
        matches = {view.replica_id: self.tree.matched_blocks(view.replica_id, hashes) for view in replicas}
        best = max(matches.values())
        match_rate = best * DEFAULT_BLOCK_SIZE / max(request.prompt_tokens, 1)
        if best > 0 and match_rate > self.cache_threshold:
            return self.rng.choice([replica_id for replica_id, blocks in matches.items() if blocks == best])
        sizes = {view.replica_id: self.tree.size(view.replica_id) for view in replicas}
        smallest = min(sizes.values())
        return self.rng.choice([replica_id for replica_id, size in sizes.items() if size == smallest])

    def on_routed(self, request: RoutingRequest, replica_id: str, request_key: str, cached_blocks: int) -> None:
        self.tree.insert(replica_id, request.prefix_hashes(DEFAULT_BLOCK_SIZE))

    def forget_replica(self, replica_id: str) -> None:
        self.tree.remove(replica_id)


class PrecisePrefixPolicy(RoutingPolicy):
    """llm-d's precise prefix-cache-aware scheduling (llm-d-inference-scheduler's
    precise-prefix-cache-scorer over llm-d-kv-cache-manager's index of vLLM KV events,
    beside the inference extension's queue and KV-cache-utilization scorers), weights
    prefix 3 / queue 2 / KV utilization 2 as llm-d's gaie-kv-events guide deployed them
    (scheduler v0.5), highest total wins, ties at random. Its current guide
    (guides/precise-prefix-cache-aware/scheduler/precise-prefix-cache-aware.values.yaml, v0.8.0-rc.1)
    weighs 2 / 1 / 1, which lost capacity in the router simulation (multi_tenant, seeds 0-4:
    11.26 req/s against 12.08), so the stronger setting is the one we compare with.

    The prefix scorer's raw score is the longest run of leading prompt blocks a pod caches;
    pods with a hit are min-max normalized (all equal: 1.0), pods without one score 0.
    """

    name = "precise_prefix"
    uses_prefix_cache = True

    def __init__(
        self,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_cache_weight: float = 2.0,
        staleness_s: float = DEFAULT_STALENESS_S,
        rng: Optional[random.Random] = None,
    ) -> None:
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_cache_weight = kv_cache_weight
        self.staleness_s = staleness_s
        self.rng = rng or random.Random()

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        fresh, stale = split_by_freshness(replicas, self.staleness_s)
        scores = load_scores(fresh, self.queue_weight, self.kv_cache_weight)
        prefix = min_max_normalized({view.replica_id: view.cached_blocks for view in fresh if view.cached_blocks > 0})
        self.rng.shuffle(fresh)
        fresh.sort(key=lambda view: scores[view.replica_id] + self.prefix_weight * prefix.get(view.replica_id, 0.0),
                   reverse=True)
        return merge_stale_by_queue_len(fresh, stale, self.rng)


class DynamoPolicy(RoutingPolicy):
    """NVIDIA Dynamo's KV router (lib/llm/src/kv_router: scheduler.rs DefaultWorkerSelector,
    sequence.rs ActiveSequences): for each worker,

        logit = overlap_score_weight x potential_prefill_blocks + potential_decode_blocks

    potential_prefill_blocks = (prefill tokens of its requests not past their first token +
    this prompt less the blocks the worker caches) / block_size; potential_decode_blocks =
    distinct blocks of its active requests plus this prompt's blocks it does not already
    track. Lowest logit wins (router_temperature 0), ties at random. Overlaps come from KV
    events; active sequences from the router's own sends. Under Ray Serve the router does
    not see first tokens, so a request's prefill tokens count until it completes.
    """

    name = "dynamo"
    uses_prefix_cache = True

    def __init__(self, overlap_score_weight: float = 1.0, rng: Optional[random.Random] = None) -> None:
        self.overlap_score_weight = overlap_score_weight
        self.rng = rng or random.Random()
        # Dynamo's per-worker slot tracking (ActiveSequences): the blocks of active requests
        # (shared prompt blocks counted once) and the prompt tokens still to prefill.
        self._active_blocks = LiveBlocks()
        self._prefill_tokens: collections.Counter = collections.Counter()  # per worker
        self._routed: dict[str, tuple[str, int]] = {}  # request key -> (worker, its prompt tokens still to prefill)
        self._block_sizes: dict[str, int] = {}  # as each worker's KV events announce it

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        logits = {}
        for view in replicas:
            block_size = self._block_sizes[view.replica_id] = view.cache_block_size or DEFAULT_BLOCK_SIZE
            active_blocks = self._active_blocks.of(view.replica_id)
            hashes = request.prefix_hashes(block_size)
            new_tokens = max(0, request.prompt_tokens - view.cached_blocks * block_size)
            prefill_blocks = (self._prefill_tokens[view.replica_id] + new_tokens) / block_size
            new_blocks = sum(1 for block_hash in hashes if block_hash not in active_blocks)
            decode_blocks = len(active_blocks) + new_blocks
            logits[view.replica_id] = self.overlap_score_weight * prefill_blocks + decode_blocks
        order = [view.replica_id for view in replicas]
        self.rng.shuffle(order)
        return sorted(order, key=logits.__getitem__)

    def on_routed(self, request: RoutingRequest, replica_id: str, request_key: str, cached_blocks: int) -> None:
        self.on_finished(request_key)  # a retry replaces the earlier send
        block_size = self._block_sizes.get(replica_id, DEFAULT_BLOCK_SIZE)
        self._active_blocks.add(request_key, replica_id, tuple(request.prefix_hashes(block_size)))
        prefill_tokens = max(0, request.prompt_tokens - cached_blocks * block_size)
        self._prefill_tokens[replica_id] += prefill_tokens
        self._routed[request_key] = (replica_id, prefill_tokens)

    def on_first_token(self, request_key: str) -> None:
        replica_id, prefill_tokens = self._routed.get(request_key, (None, 0))
        if prefill_tokens:
            self._prefill_tokens[replica_id] -= prefill_tokens
            self._routed[request_key] = (replica_id, 0)

    def on_finished(self, request_key: str) -> None:
        routed = self._routed.pop(request_key, None)
        if routed is None:
            return
        replica_id, prefill_tokens = routed
        self._prefill_tokens[replica_id] -= prefill_tokens
        self._active_blocks.remove(request_key)

    def forget_replica(self, replica_id: str) -> None:
        self._active_blocks.forget_replica(replica_id)
        self._prefill_tokens.pop(replica_id, None)
        self._block_sizes.pop(replica_id, None)
        for key in [key for key, (owner, _) in self._routed.items() if owner == replica_id]:
            del self._routed[key]
