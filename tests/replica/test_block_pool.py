"""The block pool against a plain model of it: the free queue is least-recently-freed first
(popleft_n and extend splice it in bulk), a reused block's hash leaves the index with a
BLOCK_REMOVED event, and a full block takes its hash unless another block holds it. With a
protected share, freed blocks that were shared (a prefix-cache hit while another request held
them) are handed out after every other free block, up to their cap (segmented LRU)."""

from __future__ import annotations

import random

import pytest

from replica.core.block_pool import BlockPool
from replica.core.kv_events import BLOCK_REMOVED, BLOCK_STORED


class PoolModel:
    """Lists and dicts: what BlockPool must do, slowly."""

    def __init__(self, num_blocks: int, protected_cap: int = 0):
        self.probation = list(range(1, num_blocks))  # head first
        self.protected: list[int] = []  # freed hits, head first
        self.protected_cap = protected_cap
        self.hit: set[int] = set()  # blocks shared since they were last handed out
        self.refs = {block_id: 0 for block_id in range(1, num_blocks)}
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.events: list[tuple] = []

    @property
    def free(self) -> list[int]:
        return self.probation + self.protected

    def get_new(self, count: int) -> list[int]:
        free = self.free
        taken = free[:count]
        self.probation, self.protected = [b for b in self.probation if b not in taken], [
            b for b in self.protected if b not in taken]
        for block_id in taken:
            self.hit.discard(block_id)
            block_hash = self.hash_of.pop(block_id, None)
            if block_hash is not None and self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
                self.events.append((BLOCK_REMOVED, block_hash, None))
            self.refs[block_id] = 1
        return taken

    def touch(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.refs[block_id] == 0:
                (self.protected if block_id in self.protected else self.probation).remove(block_id)
            elif self.protected_cap:  # shared: another request holds it
                self.hit.add(block_id)
            self.refs[block_id] += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                (self.protected if block_id in self.hit else self.probation).append(block_id)
        while len(self.protected) > self.protected_cap:  # the oldest protected drop back
            dropped = self.protected.pop(0)
            self.hit.discard(dropped)
            self.probation.append(dropped)

    def cache(self, block_ids: list[int], hashes: list[bytes], start: int, end: int) -> list[int]:
        took = []
        for index in range(start, end):
            block_id, block_hash = block_ids[index], hashes[index]
            if block_id not in self.hash_of and block_hash not in self.cached:
                self.hash_of[block_id] = block_hash
                self.cached[block_hash] = block_id
                self.events.append((BLOCK_STORED, block_hash, hashes[index - 1] if index else None))
                took.append(block_id)
        return took


@pytest.mark.parametrize("protected_share", [0.0, 0.5])
@pytest.mark.parametrize("seed", range(20))
def test_the_pool_does_what_its_plain_model_does(seed, protected_share):
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 9, 33])
    pool = BlockPool(num_blocks, protected_share)
    model = PoolModel(num_blocks, pool.free_queue.protected_cap if pool.protects_hits else 0)
    held: list[list[int]] = []  # each sequence's blocks, as BlockPool ids
    for _ in range(300):
        op = rng.random()
        if op < 0.4 and model.free:
            count = rng.randint(1, len(model.free))
            blocks = pool.get_new_blocks(count)
            assert [block.block_id for block in blocks] == model.get_new(count)
            # A sequence's full blocks, named from a small alphabet so that hashes repeat.
            hashes = [bytes([rng.randrange(4), index]) for index in range(count)]
            start, end = sorted(rng.sample(range(count + 1), 2))
            filled: list = []
            pool.cache_full_blocks(blocks, hashes, start, end, filled)
            took = model.cache([block.block_id for block in blocks], hashes, start, end)
            assert [block.block_id for block, _ in filled] == took
            held.append([block.block_id for block in blocks])
        elif op < 0.5 and held:  # registered again under other hashes: a block keeps its first
            block_ids = rng.choice(held)
            hashes = [bytes([rng.randrange(4), index]) for index in range(len(block_ids))]
            filled = []
            pool.cache_full_blocks([pool.blocks[block_id] for block_id in block_ids], hashes, 0, len(block_ids), filled)
            assert [block.block_id for block, _ in filled] == model.cache(block_ids, hashes, 0, len(block_ids))
        elif op < 0.6 and model.cached:
            hits = [model.cached[block_hash] for block_hash in rng.sample(sorted(model.cached), 1)]
            pool.touch([pool.blocks[block_id] for block_id in hits])
            model.touch(hits)
            held.append(hits)
        elif held:
            blocks = held.pop(rng.randrange(len(held)))
            order = list(reversed(blocks)) if rng.random() < 0.5 else blocks
            pool.free_blocks([pool.blocks[block_id] for block_id in order])
            model.free_blocks(order)
        assert [block.block_id for block in pool.free_queue] == model.free
        assert pool.num_free_blocks == len(model.free)
        assert {block_hash: block.block_id for block_hash, block in pool.cached_blocks.items()} == model.cached
        assert pool.take_events() == model.events
        model.events = []
    with pytest.raises(ValueError):
        pool.get_new_blocks(pool.num_free_blocks + 1)


def test_a_freed_shared_prefix_outlives_blocks_freed_after_it():
    """A tenant's system prompt, shared by two of its requests at once, is evicted after a
    burst's one-off blocks freed later, where plain LRU evicts it first (it was freed longest
    ago)."""
    for share, prompt_survives in ((0.0, False), (0.5, True)):
        pool = BlockPool(9, share)
        prompt = pool.get_new_blocks(2)
        pool.cache_full_blocks(prompt, [b"p0", b"p1"], 0, 2)
        pool.touch(pool.get_cached_prefix([b"p0", b"p1"]))  # the tenant's next request, while the first runs
        pool.free_blocks(prompt)
        pool.free_blocks(prompt)
        burst = pool.get_new_blocks(6)  # another tenant's request: the other six free blocks
        pool.cache_full_blocks(burst, [bytes([i]) for i in range(6)], 0, 6)
        pool.free_blocks(burst)
        pool.get_new_blocks(6)  # the next request needs six blocks
        assert (len(pool.get_cached_prefix([b"p0", b"p1"])) == 2) is prompt_survives


def test_a_conversations_history_hit_after_it_was_freed_is_not_protected():
    """A turn's blocks, hit by the next turn once the turn has finished, are no shared prefix:
    freed again, they are evicted by recency, before a burst freed after them is."""
    pool = BlockPool(9, 0.5)
    turn = pool.get_new_blocks(2)
    pool.cache_full_blocks(turn, [b"t0", b"t1"], 0, 2)
    pool.free_blocks(turn)
    pool.touch(pool.get_cached_prefix([b"t0", b"t1"]))  # the next turn
    pool.free_blocks(turn)
    burst = pool.get_new_blocks(6)
    pool.free_blocks(burst)
    assert [block.protected for block in pool.free_queue] == [False] * 8
    assert [block.block_id for block in pool.free_queue][:2] == [block.block_id for block in turn]


def test_past_its_share_the_protected_segment_drops_its_oldest_back():
    pool = BlockPool(5, 0.5)  # 4 usable blocks, 2 protected at most
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [bytes([i]) for i in range(4)], 0, 4)
    pool.touch(blocks)  # shared by a second request
    pool.free_blocks(blocks)
    pool.free_blocks(blocks)  # all four were shared: the two freed first drop back, unprotected
    assert [block.block_id for block in pool.free_queue] == [1, 2, 3, 4]
    assert [block.protected for block in pool.free_queue] == [False, False, True, True]
    with pytest.raises(ValueError, match="protected_share"):
        BlockPool(5, 1.5)


def test_a_cleared_cache_protects_nothing():
    """After a failed step's clear_cache no block holds what its hash named: a block that was
    protected is handed out before cached KV filled since (and the cap counts exactly)."""
    pool = BlockPool(7, 0.5)
    prompt = pool.get_new_blocks(3)
    pool.cache_full_blocks(prompt, [b"a", b"b", b"c"], 0, 3)
    pool.touch(prompt)
    pool.free_blocks(prompt)
    pool.free_blocks(prompt)
    pool.clear_cache()
    assert not any(block.protected for block in pool.blocks)
    fresh = pool.get_new_blocks(3)
    pool.cache_full_blocks(fresh, [b"x", b"y", b"z"], 0, 3)
    pool.free_blocks(fresh)
    pool.get_new_blocks(3)
    assert len(pool.get_cached_prefix([b"x", b"y", b"z"])) == 3
    assert BlockPool(101, 0.29).free_queue.protected_cap == 29
