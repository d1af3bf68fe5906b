"""The host-memory tier of the KV cache: a second, larger and slower pool of blocks beside
the device pool, with its own free list, LRU order and prefix-hash index.

A host block holds a copy of a device block's KV. It is referenced by a request swapped out
by preemption (until it is swapped back in or aborted), and its hash, when the block was a
full prefix-cache block, stays findable after it is freed, until the free list hands the
block out again, least recently freed first: the same lazy eviction as the device pool's.
The copies themselves are the executor's (replica/executor/kv_swap.py); this pool only
decides which host block receives or provides which KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.core.block_pool import BlockPool
from replica.core.kv_events import MEDIUM_HOST


class HostBlockPool(BlockPool):
    """`num_blocks` usable host blocks, ids 1..num_blocks (0 is the pool's unused null block,
    kept so block ids index the host KV tensor as device ids index the device cache)."""

    medium = MEDIUM_HOST

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        super().__init__(num_blocks + 1)



@dataclass(frozen=True)
class BlockCopies:
    """The whole-block copies between the tiers one step needs: every swap-out first (its device
    blocks may be handed to this very step's new KV), then every swap-in (its device blocks are
    read by this step's attention); the step's forward pass waits for those. Then the
    write-throughs of the spilling prefix cache (device blocks filled by an earlier step, free
    or held, that this step neither writes nor frees for reuse), then the prefetches (swap-ins
    of a request that resumes next step, into device blocks this step's forward pass neither
    reads nor writes): they overlap this step's forward pass, and the next step's forward pass
    waits for them (the scheduler sends a BlockCopies, empty if need be, with every step after
    one that had write-throughs or prefetches)."""

    swap_out: tuple[tuple[int, int], ...]  # (device block id, host block id)
    swap_in: tuple[tuple[int, int], ...]  # (host block id, device block id)
    write_through: tuple[tuple[int, int], ...] = ()  # (device block id, host block id)
    prefetch: tuple[tuple[int, int], ...] = ()  # (host block id, device block id)

    @property
    def beside_forward(self) -> bool:
        """Whether some copies overlap the step's forward pass (the next step must wait for them)."""
        return bool(self.write_through or self.prefetch)
