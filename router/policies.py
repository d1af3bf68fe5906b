"""Replica scoring policies behind one interface: `rank(request, replicas)` returns replica
ids, best first. `headroom` is ours; `round_robin`, `pow2` and `least_loaded` are faithful
load-only baselines (the prefix-cache-aware ones are in router/prefix_baselines.py). Stale or
missing stats fall back to queue length, never to an error.
"""

from __future__ import annotations

import collections
import itertools
import math
import random
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

from router.policy_base import (  # noqa: F401  (re-exported: callers import the views from here)
    DEFAULT_STALENESS_S,
    LiveBlocks,
    ReplicaView,
    RoutingPolicy,
    RoutingRequest,
    load_scores,
    merge_stale_by_queue_len,
    rank_by_queue_len,
    split_by_freshness,
)
from router.prefix_baselines import ApproxPrefixPolicy, DynamoPolicy, PrecisePrefixPolicy


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next replica in id order, whatever the load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        ids = sorted(view.replica_id for view in replicas)
        if not ids:
            return []
        start = self._next % len(ids)
        self._next += 1
        return ids[start:] + ids[:start]


class PowerOfTwoPolicy(RoutingPolicy):
    """Ray Serve's default (PowerOfTwoChoicesRequestRouter, 2.60): sample two replicas
    uniformly, take the one with the strictly shorter queue, else the first sampled.
    The rest follow in random order, for the caller's retries."""

    name = "pow2"

    def __init__(self, rng: Optional[random.Random] = None) -> None:
        self.rng = rng or random.Random()

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        order = list(replicas)
        self.rng.shuffle(order)
        if len(order) >= 2 and order[1].queue_len < order[0].queue_len:
            order[0], order[1] = order[1], order[0]
        return [view.replica_id for view in order]


class LeastLoadedPolicy(RoutingPolicy):
    """The Gateway API inference extension's default scorers (as llm-d configures them):
    queue scorer weight 2 plus KV-cache-utilization scorer weight 2, highest total wins,
    exact ties at random (its max-score picker shuffles first).

    Followed: gateway-api-inference-extension pkg/epp/scheduling/framework/plugins/scorer/
    queue.go (score = (max_waiting - waiting) / (max_waiting - min_waiting) over the
    candidates, 1.0 when all are equal) and kvcache_utilization.go (score = 1 - KV usage),
    both from the scraped metrics (vllm:num_requests_waiting, vllm:kv_cache_usage_perc),
    here ReplicaLoad.num_waiting and kv_usage. GIE itself has no queue-length fallback;
    replicas with stale stats get ours, like every policy here.
    """

    name = "least_loaded"

    def __init__(
        self,
        queue_weight: float = 2.0,
        kv_cache_weight: float = 2.0,
        staleness_s: float = DEFAULT_STALENESS_S,
        rng: Optional[random.Random] = None,
    ) -> None:
        self.queue_weight = queue_weight
        self.kv_cache_weight = kv_cache_weight
        self.staleness_s = staleness_s
        self.rng = rng or random.Random()

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        fresh, stale = split_by_freshness(replicas, self.staleness_s)
        scores = load_scores(fresh, self.queue_weight, self.kv_cache_weight)
        self.rng.shuffle(fresh)
        fresh.sort(key=lambda view: scores[view.replica_id], reverse=True)
        return merge_stale_by_queue_len(fresh, stale, self.rng)


# Pinning's defaults (HeadroomPolicy; cluster.config reads them from its constructor).
PIN_PREFIX_FRACTION = 0.3  # a holder of this much of the prompt keeps it (approx_prefix's cache_threshold)
PIN_SHARE_WINDOW = 256  # requests over which a tenant's share of the traffic is counted
TENANT_KEY_TOKENS = 16  # a tenant is its prompts' first this many tokens (one block at the usual size)


def tenant_key(request: RoutingRequest) -> Optional[tuple[int, ...]]:
    """The request's tenant for pinning: its prompt's first TENANT_KEY_TOKENS token ids, or None
    for a prompt no longer than that (or without token ids): no cacheable block to pin."""
    ids = request.prompt_token_ids
    return tuple(ids[:TENANT_KEY_TOKENS]) if len(ids) > TENANT_KEY_TOKENS else None


class RecentRoutes:
    """The last `window` requests a router routed that name a tenant: per request key its tenant,
    replica and prompt blocks, and from them each tenant's count, each tenant's count per replica
    and each replica's distinct prompt blocks (a block routed there by several of them counted
    once). A retry replaces the request's earlier route, counted once."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._routes: collections.OrderedDict[str, tuple[tuple[int, ...], str, tuple[bytes, ...]]] = collections.OrderedDict()
        self.tenant_counts: collections.Counter = collections.Counter()
        self._tenant_replicas: dict[tuple[int, ...], collections.Counter] = {}
        self._replica_blocks: dict[str, collections.Counter] = {}

    def __len__(self) -> int:
        return len(self._routes)

    def add(self, request_key: str, tenant: tuple[int, ...], replica_id: str, block_hashes: tuple[bytes, ...]) -> None:
        if not self.window:
            return
        self._drop(request_key)
        self._routes[request_key] = (tenant, replica_id, block_hashes)
        self.tenant_counts[tenant] += 1
        self._tenant_replicas.setdefault(tenant, collections.Counter())[replica_id] += 1
        self._replica_blocks.setdefault(replica_id, collections.Counter()).update(block_hashes)
        while len(self._routes) > self.window:
            self._drop(next(iter(self._routes)))

    def _drop(self, request_key: str) -> None:
        route = self._routes.pop(request_key, None)
        if route is None:
            return
        tenant, replica_id, block_hashes = route
        _decrement(self.tenant_counts, tenant)
        _decrement(self._tenant_replicas[tenant], replica_id)
        if not self._tenant_replicas[tenant]:
            del self._tenant_replicas[tenant]
        blocks = self._replica_blocks[replica_id]
        for block_hash in block_hashes:
            _decrement(blocks, block_hash)

    def home(self, tenant: tuple[int, ...]) -> Optional[str]:
        """The replica that received most of the tenant's requests in the window (None: none did)."""
        replicas = self._tenant_replicas.get(tenant)
        return replicas.most_common(1)[0][0] if replicas else None

    def other_blocks(self, replica_id: str, block_hashes: Sequence[bytes]) -> int:
        """Distinct prompt blocks routed to the replica in the window, less those of `block_hashes`."""
        blocks = self._replica_blocks.get(replica_id)
        if not blocks:
            return 0
        return len(blocks) - sum(1 for block_hash in block_hashes if block_hash in blocks)

    def block_count(self, block_hash: bytes) -> int:
        """Requests in the window whose prompt holds this block, on whichever replica."""
        return sum(blocks.get(block_hash, 0) for blocks in self._replica_blocks.values())

    def forget_replica(self, replica_id: str) -> None:
        for key in [key for key, (_, owner, _) in self._routes.items() if owner == replica_id]:
            self._drop(key)
        self._replica_blocks.pop(replica_id, None)


def _decrement(counter: collections.Counter, key) -> None:
    """Counts `key` one less, deleting it at zero."""
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


@dataclass(frozen=True)
class HeadroomScore:
    """Why a replica ranks where it does, in fractions of that replica's KV pool."""

    replica_id: str
    fits: bool  # the request's full sequence fits in the room nobody has been promised yet
    headroom_after: float  # pool fraction still unpromised once this request is admitted too
    backlog: float  # pool fraction of prefill queued ahead of this request
    own_prefill: float  # pool fraction of its own prompt the replica must prefill
    preemption_risk: float  # chance this request is preempted at least once, at the recent rate
    score: float
    inflight_requests: int
    cached_tokens: int = 0  # prompt tokens the replica's prefix cache would save


class HeadroomPolicy(RoutingPolicy):
    """Ours: send the request where its whole sequence fits and it is least likely to be
    preempted or to queue, counting the prefill its prompt's cached prefix saves there.

    Every term is a fraction of the replica's KV pool (tokens / pool tokens), so replicas of
    different sizes compare fairly and the weights are dimensionless:

    - fit (hard filter): the room nobody has been promised yet must hold this request. That
      room is free tokens (beyond the admission watermark), minus the growth the replica's
      live requests are already owed (`kv_committed_tokens`: to max_tokens, or to expected
      lengths under reserve_expected admission), minus what this router sent since the
      snapshot (each send's expected size less the cached prefix it shares there); the
      request needs its prompt plus min(max_tokens, the replica's
      `expected_output_tokens`), less the prefix the replica caches (those blocks are
      shared, not allocated again). Free blocks alone make a replica that has just admitted
      long-output requests look roomy until they grow into each other. A replica without
      the room is ranked after every one with it, whatever its cache holds: affinity never
      sends a request where it would preempt. One exception, where no preemption can
      follow: a replica that admits by expected growth (it reports `expected_output_tokens`)
      holds a request that does not fit until memory frees, and where it caches the
      request's prefix it fits while it is short by no more than that prefix, which any
      other replica would have to allocate again (and evict some other tenant's prefix
      for). Without that, a transient shortfall at the holder copied prefixes around the
      cluster under an even multi-tenant load (docs/benchmarks.md). If none fits, the least
      bad still gets it, never an error.
    - headroom_after (reward, `headroom_weight` = 0.25): that room, left after the request.
      Small, because the filter already keeps replicas out of trouble: past it, memory to
      spare is worth less than the prefill a cached prefix saves.
    - backlog (penalty, `backlog_weight` = 1): the prefill queued ahead of this request's
      first token: the waiting queue's (net of the prefix each waiting request found
      cached) and the prompts this router sent since the snapshot (less their cached
      prefix), as time rather than memory: TTFT is what users wait on.
    - own prefill (penalty, `prefill_weight` = 4): the request's prompt less the prefix the
      replica caches (from its KV events). Heavier than the queue ahead because it delays
      this request and every one queued behind it there, and on a replica without the
      prefix it also duplicates a cached prefix (memory, and evictions of others'). This
      is where a cached prefix pays and where it stops paying: a hot prefix spreads to a
      second (third...) replica once its holder's queue outweighs 4x the prefill saved.
    - preemption_risk (penalty, `preemption_weight` = 1): 1 - exp(-rate * lifetime), with
      rate the replica's smoothed preemptions per running request per second and lifetime
      this request's decode time there (max_tokens x the replica's step time): the chance
      it is preempted at least once if the replica keeps thrashing as it has. Weight 1 puts
      a certain preemption on a par with a replica whose whole pool is queued work: either
      way the request waits for a pool's worth of work to drain (and after a preemption
      also recomputes what it had).

    Under pressure (fewer than half of the fresh replicas fit), the fit filter yields to the
    score, with the own-prefill penalty at `saturated_prefill_weight` = 16: the few
    replicas with room keep it only until their next admissions, and a request sent there
    for it copies its prefix, memory and prefill the saturated cluster pays for. The cached
    prefix a replica is credited with is the larger of its KV events' and the prompts this
    router sent there to requests still live (`live_blocks`), so a tenant's burst that
    arrives before any KV event stays together.

    Pinning (`pin_prefix_fraction` = 0.3, gated by `pin_share_window` = 256): a replica that
    caches at least that fraction of the prompt and holds rather than preempts (it reports
    expected output lengths) counts as fitting whatever its room, so a tenant stays on its
    replica as approx_prefix keeps it, but only while the tenant fits one replica: its share
    of the last `pin_share_window` requests this router routed (a tenant is the prompt's
    first `TENANT_KEY_TOKENS` tokens) is at most 1 / replicas. A pinned request's own prefill
    weighs `saturated_prefill_weight` on every replica: leaving its holder copies a prefix the
    cluster already holds. Under overload that keeps the excess on the replicas whose tenants
    brought it, where spreading a tenant re-prefills its prefix on another replica and drags
    every replica past its SLO; a hot tenant, more than a replica's share, still spreads, since
    pinning it costs more than its prefill saves (docs/benchmarks.md, issue 27: ungated pinning
    delivered 0.69x of hot_tenant's goodput at capacity). Since pinning keeps a tenant where it
    first lands, a pinned tenant that no replica holds is placed (`placement`): on its home, the
    replica that received most of its requests in the window, if it has one (its prefix was
    evicted there), else on the replica that received the fewest distinct prompt blocks in the
    window, as approx_prefix places a new prefix on its smallest tree. The placement chooses
    only among the replicas with room scoring within `placement_margin` (0.1 of a pool) of the
    best, so a replica whose queue or memory the score counts against it by more is not
    chosen for its few blocks; the score breaks ties, and a replica without room is still
    ranked after every one with it. A prompt of its own (no other request shares its first
    block) is such a tenant too, so near-equal replicas take unique prompts by the prompt
    blocks (prefill and prefix memory) each was recently sent. Placing by the score's load of
    the moment had put five of sixteen tenants on one replica and three on another, and
    pinning kept them there; placing without the margin balanced prompt blocks but not the
    queues, which the score sees and the blocks do not, and with stats 500 ms late it sent
    one replica 1.6x the others' requests (docs/benchmarks.md, issue 27). `pin_prefix_fraction`
    0 turns pinning and placement off; `pin_share_window` 0 pins every tenant (no gate, no
    window: no placement).

    Hot prefixes (`replicate_hot`, on by default): where the request's tenant has more than one
    replica's share of the window (pinning leaves it unpinned) and so does the longest prefix
    of the prompt some replica caches (its deepest cached block was in more than one replica's
    share of the window's prompts; a window of at least `hot_min_window` = 32 requests), that
    prefix is replicated on every replica (a conversation's own earlier turns, cached on one
    replica, are not hot: they keep the score's affinity): its requests go, among the replicas
    where they fit (then the rest), where the fewest requests queue (waiting there, or sent
    since its snapshot), then where the most room is left unpromised, whatever the replicas
    cache; near-ties at random. It counts in pinning's window, so pinning off
    (`pin_prefix_fraction` 0, or `pin_share_window` 0) turns it off too; and it counts a block
    in the block size of the replica caching most, so across replicas of different block
    sizes a prefix is hot only by the requests routed to replicas of that size. Its traffic
    amortizes a prefix copy per replica, and its requests become the load that evens out the
    pinned tenants' bursts. Ranking it by the score kept it on the two or three replicas that
    first cached it, where replicas memory-bound by the cold tenants' prefixes queued (issue 27,
    hot_tenant: P90 TTFT at 12.77 req/s 0.570 -> 0.228 s before the latest-start holds; with
    them, at 12.65 req/s, goodput 11.31 -> 11.47 req/s; docs/benchmarks.md).

    The weights were chosen on the router simulation (docs/benchmarks.md), not derived.

    Near-ties (scores within `tie_epsilon` = 0.02 of a pool, about one chat request)
    go to the replica this router sent the fewest requests since its snapshot, then at
    random, so a burst spreads out and many routers reading the same snapshots do not
    all pick the same replica.
    """

    name = "headroom"
    uses_prefix_cache = True

    def __init__(
        self,
        headroom_weight: float = 0.25,
        backlog_weight: float = 1.0,
        prefill_weight: float = 4.0,
        saturated_prefill_weight: float = 16.0,
        preemption_weight: float = 1.0,
        pin_prefix_fraction: Optional[float] = PIN_PREFIX_FRACTION,
        pin_share_window: int = PIN_SHARE_WINDOW,
        tie_epsilon: float = 0.02,
        placement_margin: float = 0.1,
        replicate_hot: bool = True,
        hot_min_window: int = 32,
        staleness_s: float = DEFAULT_STALENESS_S,
        rng: Optional[random.Random] = None,
    ) -> None:
        self.replicate_hot = replicate_hot
        if hot_min_window < 0 or hot_min_window != int(hot_min_window):
            raise ValueError(f"hot_min_window: must be a whole number of requests >= 0, got {hot_min_window}")
        self.hot_min_window = int(hot_min_window)
        if placement_margin < 0:
            raise ValueError(f"placement_margin: must be >= 0 (a fraction of a replica's pool), got {placement_margin}")
        self.placement_margin = placement_margin
        self.headroom_weight = headroom_weight
        self.backlog_weight = backlog_weight
        self.prefill_weight = prefill_weight
        self.saturated_prefill_weight = saturated_prefill_weight
        self.preemption_weight = preemption_weight
        if pin_prefix_fraction is not None and not 0 <= pin_prefix_fraction <= 1:
            raise ValueError(f"pin_prefix_fraction: must be in [0, 1] (0 or None: off), got {pin_prefix_fraction}")
        self.pin_prefix_fraction = pin_prefix_fraction or None
        if pin_share_window < 0 or pin_share_window != int(pin_share_window):
            raise ValueError(f"pin_share_window: must be a whole number of requests >= 0 (0: no gate), got {pin_share_window}")
        self.pin_share_window = int(pin_share_window)
        if replicate_hot and 0 < self.pin_share_window < self.hot_min_window:
            raise ValueError(f"hot_min_window: {self.hot_min_window} is more than pin_share_window ({self.pin_share_window}), "
                             "the window hot prefixes are counted in: nothing would ever be hot")
        # The last `pin_share_window` requests routed that name a tenant: the tenants' shares,
        # where each tenant went, and the prompt blocks each replica received.
        self._recent = RecentRoutes(self.pin_share_window)
        self.tie_epsilon = tie_epsilon
        self.staleness_s = staleness_s
        self.rng = rng or random.Random()
        self._live = LiveBlocks()  # the prompt blocks of the requests this router sent, still live
        self._block_sizes: dict[str, int] = {}  # per replica, as its KV events (else its loads) give it

    def live_blocks(self, request: RoutingRequest, view: ReplicaView) -> int:
        """Leading blocks of the request's prompt that requests this router sent to the
        replica, still live there, share (in the replica's cache block size)."""
        block_size = view.cache_block_size or (view.load.block_size if view.load is not None else 0)
        if block_size:
            self._block_sizes[view.replica_id] = block_size
        blocks = self._live.of(view.replica_id)
        if not blocks or not block_size:
            return 0
        count = 0
        for block_hash in request.prefix_hashes(block_size):
            if block_hash not in blocks:
                break
            count += 1
        return count

    def tenant_share(self, request: RoutingRequest) -> float:
        """The request's tenant's share of the recent requests, this one counted in (1.0 when its
        prompt is too short to name a tenant, or nothing was routed yet)."""
        tenant = tenant_key(request)
        if tenant is None:
            return 1.0
        return (self._recent.tenant_counts[tenant] + 1) / (len(self._recent) + 1)

    def pins(self, request: RoutingRequest, num_replicas: int) -> bool:
        """Whether this request's tenant is pinned: pinning is on and the tenant's share of the
        recent requests is at most one replica's (or the share is not gated)."""
        if self.pin_prefix_fraction is None:
            return False
        return not self.pin_share_window or self.tenant_share(request) * max(num_replicas, 1) <= 1.0

    def is_hot(self, request: RoutingRequest, views: Sequence[ReplicaView]) -> bool:
        """Replication is on and the longest prefix of the prompt that some replica caches is hot:
        more than one replica's share of the last `pin_share_window` requests routed carried it
        (its deepest cached block), in a window of at least `hot_min_window` requests. A hot
        tenant's system prompt is; a conversation's earlier turns, cached on one replica, are not
        (they keep the score's affinity), nor are the first few requests of a run."""
        if not (self.replicate_hot and self.pin_prefix_fraction is not None and self.pin_share_window
                and len(self._recent) >= self.hot_min_window):
            return False
        best = max(views, key=lambda view: view.cached_blocks)
        block_size = self._block_sizes.get(best.replica_id, 0)
        if not best.cached_blocks or not block_size:
            return False
        hashes = request.prefix_hashes(block_size)
        deepest = min(best.cached_blocks, len(hashes)) - 1
        if deepest < 0:
            return False
        share = (self._recent.block_count(hashes[deepest]) + 1) / (len(self._recent) + 1)
        return share * len(views) > 1.0

    def holds_enough(self, request: RoutingRequest, view: ReplicaView) -> bool:
        """The replica caches at least `pin_prefix_fraction` of the prompt and holds rather than
        preempts (it reports expected output lengths): where a pinned request stays."""
        return (self.pin_prefix_fraction is not None and view.load.expected_output_tokens > 0
                and request.prompt_tokens > 0  # an unsized request holds nothing anywhere
                and min(view.cached_tokens, request.prompt_tokens) >= self.pin_prefix_fraction * request.prompt_tokens)

    def _with_live_blocks(self, request: RoutingRequest, view: ReplicaView) -> ReplicaView:
        """`view` counting the blocks requests this router sent there share (on its device,
        before its KV events say so)."""
        live = self.live_blocks(request, view)
        device = view.cached_blocks if view.device_blocks is None else view.device_blocks
        if live <= device:
            return view
        return replace(view, cached_blocks=max(view.cached_blocks, live),
                       device_blocks=None if view.device_blocks is None else live,
                       cache_block_size=view.cache_block_size or view.load.block_size)

    def on_routed(self, request: RoutingRequest, replica_id: str, request_key: str, cached_blocks: int) -> None:
        tenant = tenant_key(request)
        block_size = self._block_sizes.get(replica_id, 0)
        hashes = tuple(request.prefix_hashes(block_size)) if block_size else ()
        if tenant is not None:
            self._recent.add(request_key, tenant, replica_id, hashes)
        if not block_size:
            self._live.remove(request_key)  # a retry replaces the earlier send
            return
        self._live.add(request_key, replica_id, hashes)

    def on_finished(self, request_key: str) -> None:
        self._live.remove(request_key)

    def forget_replica(self, replica_id: str) -> None:
        self._live.forget_replica(replica_id)
        self._recent.forget_replica(replica_id)
        self._block_sizes.pop(replica_id, None)

    def placement(self, request: RoutingRequest, views: Sequence[ReplicaView]) -> dict[str, int]:
        """Where a pinned tenant that no replica holds lands, as a key per replica, lowest first:
        the tenant's home (the replica that received most of its recent requests: its prefix was
        evicted there, and approx_prefix's tree would send it back too) first, then the fewest
        distinct prompt blocks routed there over the window (not counting this prompt's own), the
        prefix memory and prefill each replica was recently given, as approx_prefix places a new
        prefix on its smallest tree."""
        home = self._recent.home(tenant_key(request))
        keys = {}
        for view in views:
            block_size = self._block_sizes.get(view.replica_id, 0)
            hashes = request.prefix_hashes(block_size) if block_size else ()
            keys[view.replica_id] = -1 if view.replica_id == home else self._recent.other_blocks(view.replica_id, hashes)
        return keys

    def score(self, request: RoutingRequest, view: ReplicaView, saturated: bool = False,
              pin: bool = False) -> HeadroomScore:
        """The replica's score for this request; `view` must carry a snapshot. `saturated`:
        no replica has room for it (the own-prefill penalty is then `saturated_prefill_weight`).
        `pin`: the request is pinned (`pins`, and some replica `holds_enough`): a holder fits
        whatever its room, and the own-prefill penalty is `saturated_prefill_weight`."""
        load = view.load
        block_size = load.block_size
        pool_tokens = max(load.kv_blocks_total * block_size, 1)
        inflight = view.inflight_since_snapshot
        # full sequences, like kv_committed_tokens, less the KV of requests that ended since the
        # snapshot (never more room than the pool)
        inflight_tokens = max(inflight.blocks * block_size,
                              load.headroom_tokens - load.kv_committed_tokens - pool_tokens)
        cached_tokens = min(view.cached_tokens, request.prompt_tokens)  # prefill saved
        shared_tokens = min(view.shared_tokens, request.prompt_tokens)  # memory not allocated again
        own_tokens = request.expected_blocks(load) * block_size - shared_tokens
        free_after_tokens = load.headroom_tokens - load.kv_committed_tokens - inflight_tokens - own_tokens
        headroom_after = free_after_tokens / pool_tokens
        # Where the replica holds what does not fit instead of preempting for it (it admits by
        # expected growth: it reports expected output lengths), a cached prefix lends its size
        # to the fit: any other replica would have to allocate that prefix again, so waiting
        # there for at most that much memory to free costs the cluster no more memory, and
        # evicts no other tenant's prefix to make room for a copy.
        lent_tokens = shared_tokens if load.expected_output_tokens > 0 else 0
        # Pinned: a holder of enough of the prompt keeps the request of a tenant that fits one
        # replica whatever its room, as approx_prefix keeps a tenant on one replica.
        pinned = pin and self.holds_enough(request, view)
        backlog = (load.waiting_prefill_tokens + inflight.prefill_tokens) / pool_tokens
        own_prefill = (request.prompt_tokens - cached_tokens) / pool_tokens
        lifetime_s = request.max_tokens * load.step_time_ms / 1000.0
        exposure = load.preemption_rate_per_running * lifetime_s
        # A degenerate load (NaN or inf times, a negative rate) is the riskiest, not a NaN score
        # (which fell out of every group of the ranking) or an overflow.
        preemption_risk = -math.expm1(-exposure) if 0.0 <= exposure < math.inf else 1.0
        score = (self.headroom_weight * headroom_after - self.backlog_weight * backlog
                 - (self.saturated_prefill_weight if saturated or pin else self.prefill_weight) * own_prefill
                 - self.preemption_weight * preemption_risk)
        return HeadroomScore(
            view.replica_id, pinned or free_after_tokens + lent_tokens >= 0, headroom_after, backlog,
            own_prefill, preemption_risk, score, inflight.requests, cached_tokens,
        )

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> list[str]:
        fresh, stale = split_by_freshness(replicas, self.staleness_s)
        # Blocks this router sent there count before the replica's KV events say so, in the
        # block size live_blocks counted them in (its load's, while the replica has no index:
        # a size of 0 made them worth no tokens).
        fresh = [self._with_live_blocks(request, view) for view in fresh]
        pins = self.pins(request, len(replicas))
        if fresh and not pins and self.is_hot(request, fresh):
            # A hot tenant: its prefix is worth a copy on every replica (its traffic amortizes
            # each copy over more than a replica's share of requests), so its requests go where
            # the fewest requests queue ahead of them, then the most unpromised room.
            return merge_stale_by_queue_len(self._hot_ranked(request, fresh), stale, self.rng)
        pin = pins and any(self.holds_enough(request, view) for view in fresh)
        # A pinned tenant nobody holds yet: where it lands now is where pinning keeps it.
        placement = self.placement(request, fresh) if pins and not pin and self.pin_share_window else None
        scores = {view.replica_id: self.score(request, view, pin=pin) for view in fresh}
        fitting = [view for view in fresh if scores[view.replica_id].fits]
        if len(fitting) * 2 < len(fresh):
            # Most of the cluster has no room for it: the few replicas that do hold it only
            # until their next admissions, and a request sent there for its room copies its
            # prefix (memory and prefill the saturated cluster pays for) and waits as long
            # anyway. Under that pressure the score alone ranks, with the own-prefill
            # penalty at `saturated_prefill_weight`.
            scores = {view.replica_id: self.score(request, view, saturated=True, pin=pin) for view in fresh}
            ranked = self._placed(list(fresh), scores, placement)
        else:
            not_fitting = [view for view in fresh if not scores[view.replica_id].fits]
            ranked = self._placed(fitting, scores, placement) + self._rank_with_ties(not_fitting, scores)
        return merge_stale_by_queue_len(ranked, stale, self.rng)

    def _hot_ranked(self, request: RoutingRequest, fresh: list[ReplicaView]) -> list[ReplicaView]:
        """A hot tenant's request: the replicas where it fits first (the fit filter holds here
        too: a replica without room, whose queue may look short because it admits everything
        and preempts, ranks after every one with it), each group by fewest requests queued
        (waiting there, or sent since its snapshot), then the most room left unpromised after
        it. Near-ties (the same queue, room within `tie_epsilon`) are ordered at random, so
        routers reading the same snapshots do not all pick the same replica."""
        scores = {view.replica_id: self.score(request, view) for view in fresh}

        def queued(view: ReplicaView) -> int:
            return view.load.num_waiting + view.inflight_since_snapshot.requests

        ranked = sorted(fresh, key=lambda view: (not scores[view.replica_id].fits, queued(view),
                                                 -scores[view.replica_id].headroom_after))
        first = scores[ranked[0].replica_id]
        # Sorted so, the near-ties are a leading run.
        ties = list(itertools.takewhile(
            lambda view: (scores[view.replica_id].fits == first.fits and queued(view) == queued(ranked[0])
                          and first.headroom_after - scores[view.replica_id].headroom_after <= self.tie_epsilon),
            ranked))
        self.rng.shuffle(ties)
        return ties + ranked[len(ties):]

    def _placed(self, views: list[ReplicaView], scores: dict[str, HeadroomScore],
                placement: Optional[dict[str, int]]) -> list[ReplicaView]:
        """By score alone without a placement; with one, the replicas scoring within
        `placement_margin` of the best by the placement key (`placement`), lowest first, each
        key's by score, then the rest by score."""
        if placement is None or not views:
            return self._rank_with_ties(views, scores)
        best = max(scores[view.replica_id].score for view in views)
        near = [view for view in views if best - scores[view.replica_id].score <= self.placement_margin]
        rest = [view for view in views if best - scores[view.replica_id].score > self.placement_margin]
        groups: dict[int, list[ReplicaView]] = collections.defaultdict(list)
        for view in near:
            groups[placement[view.replica_id]].append(view)
        placed = [ranked for key in sorted(groups) for ranked in self._rank_with_ties(groups[key], scores)]
        return placed + self._rank_with_ties(rest, scores)

    def _rank_with_ties(self, views: list[ReplicaView], scores: dict[str, HeadroomScore]) -> list[ReplicaView]:
        """Best score first; the near-tie group at the top is reordered by fewest requests
        sent since the snapshot, then at random."""
        remaining = sorted(views, key=lambda view: scores[view.replica_id].score, reverse=True)
        if not remaining:
            return []
        best = scores[remaining[0].replica_id].score
        ties = [view for view in remaining if best - scores[view.replica_id].score <= self.tie_epsilon]
        rest = remaining[len(ties) :]
        self.rng.shuffle(ties)
        ties.sort(key=lambda view: scores[view.replica_id].inflight_requests)
        return ties + rest


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    "headroom": lambda rng, **knobs: HeadroomPolicy(rng=rng, **knobs),
    "round_robin": lambda rng, **knobs: RoundRobinPolicy(**knobs),
    "pow2": lambda rng, **knobs: PowerOfTwoPolicy(rng=rng, **knobs),
    "least_loaded": lambda rng, **knobs: LeastLoadedPolicy(rng=rng, **knobs),
    "approx_prefix": lambda rng, **knobs: ApproxPrefixPolicy(rng=rng, **knobs),
    "precise_prefix": lambda rng, **knobs: PrecisePrefixPolicy(rng=rng, **knobs),
    "dynamo": lambda rng, **knobs: DynamoPolicy(rng=rng, **knobs),
}


# Policies that score ReplicaLoad snapshots and take staleness_s; with no fresh snapshot at all
# they have nothing to go on and the router falls back to Ray Serve's queue-length choice. The
# others (round_robin, pow2, approx_prefix, dynamo) never read loads and always rank.
LOAD_BASED_POLICIES = frozenset({"headroom", "least_loaded", "precise_prefix"})


def make_router_policy(name: str, staleness_s: float, knobs: Mapping[str, float],
                       rng: Optional[random.Random] = None) -> RoutingPolicy:
    """The policy as a router runs it: its knobs, and staleness_s where it takes one (the
    router's config and the config's load-time check build it alike)."""
    return make_policy(name, rng, **knobs, **({"staleness_s": staleness_s} if name in LOAD_BASED_POLICIES else {}))


def make_policy(name: str, rng: Optional[random.Random] = None, **knobs: float) -> RoutingPolicy:
    """The policy registered under `name`; `knobs` override its constructor's defaults
    (cluster.config.RouterConfig validates them against the constructor)."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name](rng or random.Random(), **knobs)
