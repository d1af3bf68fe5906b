"""The fixed pool of KV cache blocks: reference counts, the free queue, the prefix-hash index,
and the KV events that describe every change of that index.

Freed blocks keep their hash (lazy eviction): a later request with the same prefix can
take them back until the free queue hands them out again, least recently freed first. Only
then is the hash removed, so a BLOCK_REMOVED event means the KV is really gone.

With a protected share (segmented LRU), a freed block that was shared, a prefix-cache hit
while another request held it, waits in a second, protected segment that is handed out only
once the first (the rest: outputs, one-off prompts, a conversation's history its next turn
took up after the turn had ended) is empty; past its share of the pool, the protected
segment's least recently freed blocks drop back into the first. A tenant's system prompt then
outlives the one-off KV of a busier tenant's burst, where plain LRU (vLLM's, the share 0)
evicts whatever was freed longest ago. Protecting every hit would also protect the histories
of conversations that have ended over those of conversations still going (the router
simulation's multi_turn lost 5-8% of its prefix hits so).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from replica.core.kv_events import (
    ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, MEDIUM_DEVICE, KVEvent, removed, stored,
)

NULL_BLOCK_ID = 0
# Events wait in the pool until the engine takes them (once per step). If nobody takes them
# (an offline engine, the router simulation), a backlog past this many per block is replaced
# by the state it leads to: ALL_BLOCKS_CLEARED and one BLOCK_STORED per cached block.
MAX_PENDING_EVENTS_PER_BLOCK = 4


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "prev_free", "next_free", "protected")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.parent_hash: Optional[bytes] = None  # the previous block's hash in its sequence
        # Links of the free queue; both None while the block is in use.
        self.prev_free: Optional[KVBlock] = None
        self.next_free: Optional[KVBlock] = None
        # Shared since it was last filled (a prefix-cache hit while another request held it):
        # freed, it joins the protected segment (SegmentedFreeQueue) until handed out or dropped back.
        self.protected = False

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append at the tail, and
    removal from the middle (a prefix-cache hit revives a freed block in place)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head = KVBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.extend(list(blocks))

    def popleft_n(self, num_blocks: int) -> list[KVBlock]:
        """The first `num_blocks` free blocks, in order, out of the queue: one walk and one
        splice (the prefill-heavy step takes hundreds at once)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        append = blocks.append
        block = self._head.next_free
        for _ in range(num_blocks):
            append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= num_blocks
        return blocks

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def extend(self, blocks: Sequence[KVBlock]) -> None:
        """append each of `blocks`, in order (a finished request frees dozens at once)."""
        if not blocks:
            return
        last = self._tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class SegmentedFreeQueue:
    """The free queue as two segments (segmented LRU): unprotected blocks, then protected
    ones (KVBlock.protected), each least recently freed first. popleft_n empties the first
    before it takes from the second; past `protected_cap` blocks, the protected segment's
    oldest drop back to the first segment's tail, no longer protected. Iteration is eviction
    order."""

    def __init__(self, blocks: Iterable[KVBlock], protected_cap: int):
        self.probation = FreeBlockQueue(blocks)
        self.protected = FreeBlockQueue(())
        self.protected_cap = protected_cap

    @property
    def num_free_blocks(self) -> int:
        return self.probation.num_free_blocks + self.protected.num_free_blocks

    def popleft_n(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        first = min(num_blocks, self.probation.num_free_blocks)
        blocks = self.probation.popleft_n(first)
        if num_blocks > first:
            blocks += self.protected.popleft_n(num_blocks - first)
        return blocks

    def remove(self, block: KVBlock) -> None:
        (self.protected if block.protected else self.probation).remove(block)

    def extend(self, blocks: Sequence[KVBlock]) -> None:
        kept, plain = [], []
        for block in blocks:
            (kept if block.protected else plain).append(block)
        self.probation.extend(plain)
        protected = self.protected
        protected.extend(kept)
        excess = protected.num_free_blocks - self.protected_cap
        if excess > 0:
            dropped = protected.popleft_n(excess)
            for block in dropped:
                block.protected = False
            self.probation.extend(dropped)

    def unprotect(self, blocks: Iterable[KVBlock]) -> None:
        """Clear `blocks`' flags, the protected segment's joining the first segment's tail."""
        emptied = self.protected.popleft_n(self.protected.num_free_blocks)
        for block in blocks:
            block.protected = False
        self.probation.extend(emptied)

    def __iter__(self):
        yield from self.probation
        yield from self.protected


class BlockPool:
    # The medium its KV events name (the host tier's pool says MEDIUM_HOST).
    medium = MEDIUM_DEVICE

    def __init__(self, num_blocks: int, protected_share: float = 0.0):
        """`protected_share`: the fraction of the usable blocks that freed shared blocks may
        hold in the free queue's protected segment (0: plain LRU)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        if not 0.0 <= protected_share <= 1.0:
            raise ValueError(f"protected_share must be in [0, 1], got {protected_share}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Block 0 is never handed out: block tables are padded with it.
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1
        protected_cap = int(round(protected_share * (num_blocks - 1), 6))  # 0.29 x 100 is 28.999...
        self.protects_hits = protected_cap > 0
        self.free_queue = (SegmentedFreeQueue(self.blocks[1:], protected_cap) if self.protects_hits
                           else FreeBlockQueue(self.blocks[1:]))
        self.cached_blocks: dict[bytes, KVBlock] = {}
        self._events: list[KVEvent] = []
        self._max_pending_events = MAX_PENDING_EVENTS_PER_BLOCK * num_blocks
        # Called with a cached block about to be reused, before its hash is dropped: the
        # spilling prefix cache copies it to the host tier (KVCacheManager).
        self.on_evict: Optional[Callable[[KVBlock], None]] = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> Optional[KVBlock]:
        return self.cached_blocks.get(block_hash)

    def get_cached_prefix(self, block_hashes: Sequence[bytes]) -> list[KVBlock]:
        """The cached blocks of the leading run of `block_hashes`, up to the first miss."""
        blocks = []
        for block_hash in block_hashes:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new_blocks = self.free_queue.popleft_n(num_blocks)
        # _evict, inlined: a prefill-heavy step reuses hundreds of cached blocks.
        cached, events, medium, on_evict = self.cached_blocks, self._events, self.medium, self.on_evict
        device = medium == MEDIUM_DEVICE
        for block in new_blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                holder = cached.pop(block_hash, None)  # one lookup: a step evicts hundreds
                if holder is block:
                    if on_evict is not None:
                        on_evict(block)
                    # kv_events.removed, inlined
                    events.append((BLOCK_REMOVED, block_hash, None) if device else removed(block_hash, medium))
                elif holder is not None:
                    cached[block_hash] = holder
                block.block_hash = block.parent_hash = None
            block.protected = False
            block.ref_cnt = 1
        if len(events) > self._max_pending_events:
            self._compact_events()
        return new_blocks

    def _evict(self, block: KVBlock) -> None:
        # Lazy eviction: the hash is dropped only now that the block is reused.
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                self._events.append(removed(block.block_hash, self.medium))
                if len(self._events) > self._max_pending_events:
                    self._compact_events()
            block.block_hash = block.parent_hash = None
        if block.ref_cnt:  # a free block's flag says which segment holds it
            block.protected = False

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving those that sat in the free queue;
        with a protected share, one another request holds is shared: protected once freed."""
        protect = self.protects_hits
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            elif protect:
                block.protected = True
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those reaching zero join the free queue's tail
        in the given order (callers pass a request's blocks tail-first so its prefix, the part
        most likely to be shared, is evicted last)."""
        unused = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                unused.append(block)
        self.free_queue.extend(unused)

    def cache_block(self, block: KVBlock, block_hash: bytes, parent_hash: Optional[bytes]) -> None:
        """Register a full block under its prefix hash; the first block with a hash keeps it."""
        self.cache_full_blocks((block,), (block_hash,), 0, 1, parent_hash=parent_hash)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[bytes], start: int, end: int,
                          filled: Optional[list] = None, parent_hash: Optional[bytes] = None) -> None:
        """Register blocks[start:end] under block_hashes[start:end], each one's parent the hash
        before it (`parent_hash` before the first when start is 0); the first block with a hash
        keeps it. `filled` gets (block, hash) for each block that took its hash."""
        cached, events, medium = self.cached_blocks, self._events, self.medium
        device = medium == MEDIUM_DEVICE
        if start:
            parent_hash = block_hashes[start - 1]
        for index in range(start, end):
            block, block_hash = blocks[index], block_hashes[index]
            # setdefault: one lookup to find the hash free and take it (a step registers hundreds)
            if block.block_hash is None and cached.setdefault(block_hash, block) is block:
                block.block_hash = block_hash
                block.parent_hash = parent_hash
                # kv_events.stored, inlined
                events.append((BLOCK_STORED, block_hash, parent_hash) if device
                              else stored(block_hash, parent_hash, medium))
                if filled is not None:
                    filled.append((block, block_hash))
            parent_hash = block_hash
        if len(events) > self._max_pending_events:
            self._compact_events()

    def clear_cache(self) -> None:
        """Forget every hash: what the blocks hold may not be what their hashes name (a failed
        step). The pending events become one ALL_BLOCKS_CLEARED."""
        for block in self.cached_blocks.values():
            block.block_hash = block.parent_hash = None
        self.cached_blocks.clear()
        self._events = [ALL_BLOCKS_CLEARED]
        if self.protects_hits:  # nothing is shared any more: the protected free blocks hold nothing
            self.free_queue.unprotect(self.blocks)

    def uncache_block(self, block: KVBlock) -> None:
        """Forget the block's prefix-cache entry, if it has one: its KV was never written."""
        self._evict(block)

    # ---- KV events ---------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """The events since the previous call, oldest first."""
        events, self._events = self._events, []
        return events

    def _compact_events(self) -> None:
        self._events = self.snapshot_events()

    def snapshot_events(self) -> list[KVEvent]:
        """Events that rebuild the index as it stands, from any state a consumer may hold."""
        return [ALL_BLOCKS_CLEARED] + self.stored_events()

    def stored_events(self) -> list[KVEvent]:
        """A BLOCK_STORED event for every cached block."""
        return [stored(h, block.parent_hash, self.medium) for h, block in self.cached_blocks.items()]
