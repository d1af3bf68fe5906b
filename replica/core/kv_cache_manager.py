"""Per-request view of the block pools: which blocks a request holds, prefix-cache lookups
over a hash chain of full blocks, `allocate_slots`, which says no when memory is short, and
(with a host tier) the blocks a swapped-out request holds in host memory and the copies
between the tiers each step needs.

The spilling prefix cache writes through: a full block registered in the prefix cache in one
step (and written by that step's forward pass) is copied to the host tier in the next step,
in the background (BlockCopies.write_through: the copy overlaps that step's forward pass and
only the step after it waits for it), so that when the device pool later evicts the block its
KV is already on the host and the step that reuses the block copies nothing. A cached block
freed without a host copy (the host evicted it while the device held the block) is written
through again, the same way. A block the device evicts with no copy on the host (in the step
right after it was filled or freed) is forgotten, as without a host tier, rather than copied
in a step that would wait for the copy. A swap-out takes the host copies that are there
instead of copying those blocks again. A swapped-out request about to resume may be
prefetched: its device blocks taken a step early and its copy-in run beside that step's
forward pass (prefetch_swap_in); it holds both tiers' blocks until it resumes
(admit_prefetched), gives the device blocks back if it does not (cancel_prefetches), and an
abort frees both.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from protos.block_hash import extend_block_hashes
from replica.core.block_pool import BlockPool, KVBlock
from replica.core.host_pool import BlockCopies, HostBlockPool
from replica.core.kv_events import ALL_BLOCKS_CLEARED, KVEvent
from replica.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SwappedOut(NamedTuple):
    """A swapped-out request's KV in the host tier."""

    host_blocks: list[KVBlock]
    num_tokens: int  # the computed tokens those blocks hold


class Prefetched(NamedTuple):
    """A swapped-out request whose KV is being copied back beside a step's forward pass, into
    device blocks it holds while it waits to resume the step after (its host blocks too)."""

    step_id: int  # the step whose copies carry the prefetch
    num_start: int  # tokens its device blocks hold once the copies are done
    num_hit_tokens: int  # of those, found in the device's prefix cache rather than copied
    num_copies: int  # blocks copied back
    request: Request  # it holds device blocks while it waits: admission reserves its growth too


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0,
                 protected_share: float = 0.0):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, protected_share if enable_caching else 0.0)
        self.host_pool: Optional[HostBlockPool] = HostBlockPool(num_host_blocks) if num_host_blocks else None
        # Swapped-out requests: the host blocks holding their KV, and how many tokens that is.
        self.swapped: dict[str, SwappedOut] = {}
        # This step's copies, taken by the scheduler into its output (take_block_copies).
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._prefetch: list[tuple[int, int]] = []
        # Swapped-out requests prefetched a step ahead of resuming (prefetch_swap_in).
        self.prefetched: dict[str, Prefetched] = {}
        self.prefetched_blocks = 0  # swap-in copies that overlapped the step before the resuming one
        self.prefetches_cancelled = 0  # prefetches whose device blocks were taken back unused
        self.prefetch_cancelled_blocks = 0  # their copies: the blocks swapped in twice when prefetched again
        # Host blocks this step's swap-ins read: held until the step's copies are taken, so no
        # swap-out of the same step (copied first) can overwrite them.
        self._host_blocks_read: list[KVBlock] = []
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        # Steps whose forward pass waited for copies planned in the step itself (swap-outs,
        # swap-ins not prefetched, host prefix hits: BlockCopies.swap_out and swap_in), and
        # those blocks; what the prefetch and the write-through take off the step's path.
        self.copy_wait_steps = 0
        self.copy_wait_blocks = 0
        # The spilling prefix cache: every full cached block is written through to the host
        # tier (keeping its hash) the step after it was filled, and again when it is freed
        # without one; a prefix hit there is copied back. spilled_blocks counts those copies;
        # evicted_without_host_copy_blocks the cached blocks the device evicted before the host
        # had (or while it no longer had) a copy: forgotten.
        self.spilled_blocks = 0
        self.evicted_without_host_copy_blocks = 0
        self.host_hit_blocks = 0
        # Blocks of swap-outs whose copy the host tier already held (written through): taken
        # there, not copied again (not counted in swapped_out_blocks, which counts copies).
        self.swap_out_blocks_on_host = 0
        self.writes_through = self.host_pool is not None and enable_caching
        # (block, hash) registered this step, and those registered the step before: its forward
        # pass has written them, so this step's copies may read them.
        self._filled: list[tuple[KVBlock, bytes]] = []
        self._filled_before: list[tuple[KVBlock, bytes]] = []
        # Cached blocks freed since the last plan without a host copy (theirs was evicted from
        # the host while the device held them): written through again before the device
        # evicts them, where it does not in the very step they were freed.
        self._freed: list[tuple[KVBlock, bytes]] = []
        self._write_through: list[tuple[int, int]] = []
        # The previous step's copies had write-throughs or prefetches: this step's copies must be
        # issued (if empty) so that its forward pass waits for them (it may overwrite the blocks
        # they read, or read the blocks they write).
        self._copies_beside_in_flight = False
        if self.writes_through:
            self.pool.on_evict = self._on_evict
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading full blocks of each request are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Sum of len(req_to_blocks[r]) over requests: a block shared by k requests counts k
        # times, because each of them would need it again on its own. Kept incrementally so
        # the scheduler's committed-KV figure is O(1) to report.
        self.num_request_blocks = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up, on each admission
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # ---- cheap reads -------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def headroom_tokens(self, reserved_blocks: int = 0) -> int:
        """Room for new work in tokens: free blocks beyond `reserved_blocks` (the admission
        watermark in force). Negative when running requests have grown into the reserve."""
        return (self.pool.num_free_blocks - reserved_blocks) * self.block_size

    def num_held_blocks(self, request: Request) -> int:
        return len(self.req_to_blocks.get(request.request_id, ()))

    def num_private_blocks(self, request: Request) -> int:
        """Blocks only this request holds: what its end would free. Shared blocks form a
        leading prefix (others share them through prefix-cache hits), so a binary search
        over reference counts finds where they stop."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        low, high = 0, len(blocks)  # first block with ref_cnt < 2 lies in [low, high]
        while low < high:
            middle = (low + high) // 2
            if blocks[middle].ref_cnt >= 2:
                low = middle + 1
            else:
                high = middle
        return len(blocks) - low

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    # ---- prefix caching ----------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> list[bytes]:
        # Stable chain hashes (protos/block_hash.py): the keys KV events publish and the
        # router recomputes from prompts. Each one names its whole prefix, and a dict lookup
        # by it is exact up to a 128-bit blake2b collision.
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, as blocks and tokens. At least one token is
        always left to compute, because the model must run to produce the next logits."""
        if not self.enable_caching:
            return [], 0
        hit_blocks = self.pool.get_cached_prefix(self._hit_hashes(request))
        return hit_blocks, len(hit_blocks) * self.block_size

    def _hit_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's blocks a prefix hit may cover: its full blocks, short of
        its last token (whose logits the model must still compute); none while it gathers its
        prompt's log-probabilities, which need every prompt position's logits (as vLLM, it
        still stores its blocks for others)."""
        if request.gathers_prompt_logprobs:
            return []
        return self._update_block_hashes(request)[:(request.num_tokens - 1) // self.block_size]

    def record_prefix_cache_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def get_host_hits(self, request: Request, num_device_hit_blocks: int) -> list[KVBlock]:
        """The host tier's blocks that continue the request's device prefix hit: spilled
        prefix blocks it can copy back instead of computing (at least one token is still
        left to compute, as for device hits)."""
        if self.host_pool is None or not self.enable_caching:
            return []
        return self.host_pool.get_cached_prefix(self._hit_hashes(request)[num_device_hit_blocks:])

    def hold_host_hits(self, host_hits: Sequence[KVBlock]) -> None:
        """Keep host hits from being reused while an allocation may spill into the host tier;
        release_host_hits undoes it when the allocation fails."""
        self.host_pool.touch(host_hits)

    def release_host_hits(self, host_hits: Sequence[KVBlock]) -> None:
        self.host_pool.free_blocks(host_hits)

    def copy_in_host_hits(self, request: Request, num_device_hit_blocks: int, host_hits: Sequence[KVBlock]) -> None:
        """Plan the copies of held host hits into the device blocks allocate_slots gave the
        request after its device hits; the holds end once the step's copies are taken."""
        device_blocks = self.req_to_blocks[request.request_id][num_device_hit_blocks:]
        self._swap_in.extend((host.block_id, device.block_id) for host, device in zip(host_hits, device_blocks))
        self._host_blocks_read.extend(host_hits)
        self.host_hit_blocks += len(host_hits)

    def _on_evict(self, block: KVBlock) -> None:
        """The device pool is about to reuse a cached block. Its host copy (written through),
        if the host tier still has one, becomes the host's most recently used: the host's LRU
        order is the order blocks left the device, so copies of blocks still on the device go
        first. A block without one is forgotten, as without a host tier: copying it now would
        be a copy this step's forward pass (which overwrites the block) waits for."""
        host_block = self.host_pool.get_cached_block(block.block_hash)
        if host_block is None:
            self.evicted_without_host_copy_blocks += 1
            return
        self.host_pool.touch((host_block,))
        self.host_pool.free_blocks((host_block,))

    def _plan_write_through(self) -> None:
        """Write through the blocks registered the step before (its forward pass wrote them),
        and the cached blocks freed since the last plan, that the device still caches under
        that hash and the host tier lacks, each into the host's least recently used free block,
        which takes its hash (held by nobody: found by its hash until reused). Blocks registered
        this step wait for the next one (their KV is written by this step's forward pass)."""
        filled_before, self._filled_before, self._filled = self._filled_before, self._filled, []
        if self._freed:
            filled_before += self._freed
            self._freed = []
        if not filled_before:
            return
        host_pool = self.host_pool
        cached, host_cached = self.pool.cached_blocks, host_pool.cached_blocks
        filled_now = {id(block) for block, _ in self._filled_before}
        for block, block_hash in filled_before:
            if (cached.get(block_hash) is block and block_hash not in host_cached
                    and id(block) not in filled_now):
                if not host_pool.num_free_blocks:
                    break
                (host_block,) = host_pool.get_new_blocks(1)  # its old hash evicted
                self._write_through.append((block.block_id, host_block.block_id))
                host_pool.cache_block(host_block, block_hash, block.parent_hash)
                host_pool.free_blocks((host_block,))
                self.spilled_blocks += 1

    def clear_prefix_cache(self) -> None:
        """Forget every cached block on both tiers and the write-throughs planned for them (the
        engine's recovery from a failed step, once no request holds a block)."""
        self.pool.clear_cache()
        if self.host_pool is not None:
            self.host_pool.clear_cache()
        self._filled, self._filled_before, self._freed = [], [], []

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache blocks stored and removed since the previous call, in order within
        each medium; after a pool compacted its backlog, a snapshot of both."""
        events = self.pool.take_events()
        if self.host_pool is None:
            return events
        host_events = self.host_pool.take_events()
        if (events and events[0] == ALL_BLOCKS_CLEARED) or (host_events and host_events[0] == ALL_BLOCKS_CLEARED):
            return self.kv_snapshot_events()
        return events + host_events

    def kv_snapshot_events(self) -> list[KVEvent]:
        """Events that rebuild the prefix cache's current index from scratch, both media."""
        events = self.pool.snapshot_events()
        if self.host_pool is not None:
            events += self.host_pool.stored_events()
        return events

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_new_computed_tokens: int = 0,
        reserved_blocks: int = 0,
        num_tokens_to_fit: Optional[int] = None,
    ) -> Optional[list[KVBlock]]:
        """Give the request blocks for `num_new_tokens` more tokens, or return None (and change
        nothing) when memory is short.

        new_computed_blocks / num_new_computed_tokens: prefix-cache hits taken on admission.
        reserved_blocks: free blocks this allocation must leave untouched (the watermark, and
            under the reserve admission modes the growth running requests are owed).
        num_tokens_to_fit: the allocation succeeds only if this many tokens in total would fit
            (the full-sequence admission check, or a request's whole final size); only the
            scheduled tokens are allocated.
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if req_blocks and not new_computed_blocks and num_tokens_to_fit is None:
            block_size = self.block_size
            if num_total_tokens <= len(req_blocks) * block_size:
                # The common decode step: the tokens fit in blocks the request already holds
                # (and, most steps, fill no block that is not registered yet).
                if self.enable_caching:
                    num_known_tokens = min(num_total_tokens, len(request.all_token_ids))
                    if num_known_tokens // block_size > self.num_cached_blocks[request.request_id]:
                        self._cache_full_blocks(request, req_blocks, num_known_tokens)
                return []
        num_new_blocks, num_blocks_needed = self._blocks_needed(
            request, num_new_tokens, new_computed_blocks, num_new_computed_tokens, num_tokens_to_fit
        )
        if num_blocks_needed + reserved_blocks > self.pool.num_free_blocks:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        self.num_request_blocks += len(new_computed_blocks) + num_new_blocks
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, min(num_total_tokens, request.num_tokens))
        return new_blocks

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_new_computed_tokens: int = 0,
        reserved_blocks: int = 0,
        num_tokens_to_fit: Optional[int] = None,
    ) -> bool:
        """Whether allocate_slots with these arguments would succeed; changes nothing."""
        _, num_blocks_needed = self._blocks_needed(
            request, num_new_tokens, new_computed_blocks, num_new_computed_tokens, num_tokens_to_fit
        )
        return num_blocks_needed + reserved_blocks <= self.pool.num_free_blocks

    def _blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock],
        num_new_computed_tokens: int,
        num_tokens_to_fit: Optional[int],
    ) -> tuple[int, int]:
        """(blocks to allocate now, free blocks the allocation needs to succeed)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_held = (len(req_blocks) if req_blocks else 0) + len(new_computed_blocks)
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(num_total_tokens, self.block_size) - num_held)
        num_blocks_to_fit = num_new_blocks
        if num_tokens_to_fit is not None:
            num_blocks_to_fit = max(num_new_blocks, cdiv(num_tokens_to_fit, self.block_size) - num_held)
        # Hits sitting in the free queue stop being free once taken.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_new_blocks, num_blocks_to_fit + num_revived

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVBlock], num_known_tokens: int) -> None:
        # Registered now, before this step's forward pass writes them: a request that hits
        # them in the same step runs in the same forward pass, which writes every new K/V
        # before any attention reads the cache.
        num_full = num_known_tokens // self.block_size
        start = self.num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = self._update_block_hashes(request)
        self.pool.cache_full_blocks(req_blocks, hashes, start, num_full, self._filled if self.writes_through else None)
        self.num_cached_blocks[request.request_id] = num_full

    def forget_unwritten_blocks(self, requests: Sequence[Request]) -> list[Request]:
        """Undo the prefix-cache side of an aborted forward pass, once each request's
        num_computed_tokens is rolled back to what the pass started from.

        allocate_slots registered the pass's full blocks before it ran; their KV was never
        written, so their cache entries are forgotten. Returns the requests admitted in the
        same pass on a hit on one of them: their computed tokens count KV that does not
        exist, in a block another request holds and will write. They must not write it
        themselves (two holders writing one block, one of them maybe beside its host
        write-through): the caller sends them back to wait, to be admitted afresh."""
        block_size = self.block_size
        unwritten_ids = set()
        for request in requests:
            request_id = request.request_id
            blocks = self.req_to_blocks.get(request_id, [])
            num_written_blocks = request.num_computed_tokens // block_size
            num_registered = self.num_cached_blocks.get(request_id, 0)
            for block in blocks[num_written_blocks:num_registered]:
                self.pool.uncache_block(block)
                unwritten_ids.add(block.block_id)
            if num_registered > num_written_blocks:
                self.num_cached_blocks[request_id] = num_written_blocks
        if not unwritten_ids:
            return []
        if self.writes_through:  # never written, so never to be written through
            self._filled = [entry for entry in self._filled if entry[0].block_id not in unwritten_ids]
            self._filled_before = [entry for entry in self._filled_before
                                   if entry[0].block_id not in unwritten_ids]
            self._freed = [entry for entry in self._freed if entry[0].block_id not in unwritten_ids]
        return [request for request in requests
                if any(block.block_id in unwritten_ids
                       for block in self.req_to_blocks.get(request.request_id, [])[:request.num_computed_tokens // block_size])]

    def free(self, request: Request) -> None:
        """Return every block the request holds, on the device and (swapped out) on the host."""
        self.prefetched.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.num_request_blocks -= len(blocks)
            self.pool.free_blocks(reversed(blocks))
            if self.writes_through:
                host_cached = self.host_pool.cached_blocks
                # Tail first, as they joined the free queue: the prefix is written last, so the
                # host's LRU keeps it longest.
                self._freed.extend((block, block.block_hash) for block in reversed(blocks)
                                   if block.ref_cnt == 0 and block.block_hash is not None
                                   and block.block_hash not in host_cached)
        swapped = self.swapped.pop(request.request_id, None)
        if swapped is not None:
            self.host_pool.free_blocks(reversed(swapped.host_blocks))

    # ---- the host tier -----------------------------------------------------------------
    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_usable_blocks if self.host_pool is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool is not None else 0

    def num_swapped_tokens(self, request: Request) -> int:
        """Computed tokens the request holds in the host tier (swapped out), else 0."""
        swapped = self.swapped.get(request.request_id)
        return swapped.num_tokens if swapped is not None else 0

    def num_swappable_tokens(self, request: Request) -> int:
        """Computed tokens a swap would keep: all but the request's last known token, whose
        logits its next step must produce (with async scheduling a token still being sampled
        is dropped by preemption, as under recompute, and sampled again)."""
        return max(0, min(request.num_computed_tokens, len(request.all_token_ids) - 1))

    def num_swap_blocks(self, request: Request) -> int:
        return cdiv(self.num_swappable_tokens(request), self.block_size)

    def num_swap_out_copies(self, request: Request) -> int:
        """Blocks a swap-out of the request would copy now: its swap blocks the host tier has no
        copy of (the write-through copies of full cached blocks are taken, not copied again)."""
        host_cached = self.host_pool.cached_blocks if self.host_pool is not None else {}
        blocks = self.req_to_blocks.get(request.request_id, ())[:self.num_swap_blocks(request)]
        return sum(1 for block in blocks if block.block_hash is None or block.block_hash not in host_cached)

    def can_swap_out(self, request: Request) -> bool:
        """Whether the host tier has the free blocks a swap-out takes: one per copy, and each
        host copy it reuses that sits free (held by nobody, so in the free queue). A copy
        another swapped-out request holds takes none."""
        host_pool = self.host_pool
        num_blocks = self.num_swap_blocks(request)
        if host_pool is None or num_blocks == 0:
            return False
        blocks = self.req_to_blocks.get(request.request_id, ())[:num_blocks]
        num_needed = 0
        for block in blocks:
            host = host_pool.get_cached_block(block.block_hash) if block.block_hash is not None else None
            num_needed += host is None or host.ref_cnt == 0
        return num_needed <= host_pool.num_free_blocks

    def swap_out(self, request: Request) -> int:
        """Copy the request's computed KV into host blocks it then holds and free its device
        blocks (shared prefix blocks stay with their other holders); returns the tokens kept.
        The copies run at the start of this step, before anything overwrites the freed blocks.
        A full cached block whose copy the host tier already has (written through) is not
        copied again: the request holds that host block; a copied one takes the block's hash
        there, so the block's eviction from the device later copies nothing."""
        host_pool = self.host_pool
        num_tokens = self.num_swappable_tokens(request)
        device_blocks = self.req_to_blocks[request.request_id][:cdiv(num_tokens, self.block_size)]
        # Hold the host copies first, so that the new host blocks cannot evict them.
        on_host = [host_pool.get_cached_block(device.block_hash) if device.block_hash is not None else None
                   for device in device_blocks]
        host_pool.touch([host for host in on_host if host is not None])
        num_copies = sum(host is None for host in on_host)
        new_blocks = iter(host_pool.get_new_blocks(num_copies))
        host_blocks = []
        for device, host in zip(device_blocks, on_host):
            if host is None:
                host = next(new_blocks)
                self._swap_out.append((device.block_id, host.block_id))
                if device.block_hash is not None:
                    host_pool.cache_block(host, device.block_hash, device.parent_hash)
            host_blocks.append(host)
        self.free(request)
        self.swapped[request.request_id] = SwappedOut(host_blocks, num_tokens)
        self.swapped_out_blocks += num_copies
        self.swap_out_blocks_on_host += len(host_blocks) - num_copies
        return num_tokens

    def swap_in(self, request: Request, num_hit_blocks: int) -> int:
        """Plan the copies that bring a swapped-out request's KV back into the device blocks
        allocate_slots just gave it, past the `num_hit_blocks` leading blocks the device's
        prefix cache already had; its host blocks are freed once the copies are taken.
        Returns the number of blocks copied."""
        request_id = request.request_id
        host_blocks = self.swapped.pop(request_id).host_blocks
        device_blocks = self.req_to_blocks[request_id]
        copies = [(host.block_id, device.block_id)
                  for host, device in zip(host_blocks[num_hit_blocks:], device_blocks[num_hit_blocks:])]
        self._swap_in.extend(copies)
        self._host_blocks_read.extend(host_blocks)
        self.swapped_in_blocks += len(copies)
        return len(copies)

    def num_swap_in_copies(self, request: Request, num_hit_blocks: int) -> int:
        """Blocks a swapped-out request's resumption would copy back past its device hits."""
        return max(0, len(self.swapped[request.request_id].host_blocks) - num_hit_blocks)

    def prefetch_swap_in(self, request: Request, num_hit_blocks: int, num_start: int, num_hit_tokens: int,
                         step_id: int) -> int:
        """Plan the copies that bring a swapped-out request's KV back into the device blocks
        allocate_slots just gave it (past its `num_hit_blocks` device hits) beside this step's
        forward pass: it stays waiting, holding both tiers' blocks, and resumes next step
        (admit_prefetched) on a copy already done or under way. Returns the blocks copied."""
        host_blocks = self.swapped[request.request_id].host_blocks
        device_blocks = self.req_to_blocks[request.request_id]
        copies = [(host.block_id, device.block_id)
                  for host, device in zip(host_blocks[num_hit_blocks:], device_blocks[num_hit_blocks:])]
        self._prefetch.extend(copies)
        self.prefetched[request.request_id] = Prefetched(step_id, num_start, num_hit_tokens, len(copies), request)
        self.swapped_in_blocks += len(copies)
        self.prefetched_blocks += len(copies)
        return len(copies)

    def admit_prefetched(self, request: Request) -> None:
        """The prefetched request resumes: its host blocks, read by the step before's copies,
        become free once this step's copies are taken."""
        del self.prefetched[request.request_id]
        self._host_blocks_read.extend(self.swapped.pop(request.request_id).host_blocks)

    def cancel_prefetches(self, made_before_step: Optional[int] = None, most: Optional[int] = None) -> bool:
        """Give back the device blocks of prefetched requests that did not resume (all, or
        those prefetched before step `made_before_step`; at most `most` of them, the latest
        made first); they keep their host blocks. Their prefix blocks stay cached: the KV is
        there once the prefetch's step is. Returns whether any was cancelled."""
        cancelled = [request_id for request_id, prefetched in reversed(self.prefetched.items())
                     if made_before_step is None or prefetched.step_id < made_before_step][:most]
        for request_id in cancelled:
            self.prefetch_cancelled_blocks += self.prefetched.pop(request_id).num_copies  # copied again if prefetched again
            blocks = self.req_to_blocks.pop(request_id)
            del self.num_cached_blocks[request_id]
            self.num_request_blocks -= len(blocks)
            self.pool.free_blocks(reversed(blocks))
        self.prefetches_cancelled += len(cancelled)
        return bool(cancelled)

    def take_block_copies(self) -> Optional[BlockCopies]:
        """The copies planned since the previous call (once per step, with the step's output,
        after its allocations), with the write-throughs of the blocks the previous step filled;
        None when there are none and none of the previous step's are in flight. The host
        blocks this step's swap-ins read become free now: later steps' copies are issued after
        this step's, in order."""
        if self.writes_through:
            self._plan_write_through()  # before the held host blocks are freed: none is reused
        if self._host_blocks_read:
            self.host_pool.free_blocks(reversed(self._host_blocks_read))
            self._host_blocks_read = []
        if not self._swap_out and not self._swap_in and not self._write_through and not self._prefetch:
            if not self._copies_beside_in_flight:
                return None
            self._copies_beside_in_flight = False
            return BlockCopies((), ())  # this step's forward pass waits for the previous one's
        copies = BlockCopies(tuple(self._swap_out), tuple(self._swap_in), tuple(self._write_through),
                             tuple(self._prefetch))
        if copies.swap_out or copies.swap_in:
            self.copy_wait_steps += 1
            self.copy_wait_blocks += len(copies.swap_out) + len(copies.swap_in)
        self._copies_beside_in_flight = copies.beside_forward
        self._swap_out, self._swap_in, self._write_through, self._prefetch = [], [], [], []
        return copies

    # ---- preemption cost ---------------------------------------------------------------
    def num_shared_prefix_blocks(self, request: Request) -> int:
        """The request's leading cached blocks other live requests also hold: a preemption
        leaves them on the device, where its resumption finds them (no recompute, no copy)."""
        num_blocks = 0
        for block in self.req_to_blocks.get(request.request_id, ()):
            if block.ref_cnt < 2 or block.block_hash is None:
                break
            num_blocks += 1
        return num_blocks

    def rebuild_cost(self, request: Request) -> int:
        """Computed tokens the request would have to recompute if preempted now: all of them
        except its shared prefix blocks. Those stay cached for sure; the request's private
        blocks are the ones the preemption hands to someone else."""
        return max(0, request.num_computed_tokens - self.num_shared_prefix_blocks(request) * self.block_size)
