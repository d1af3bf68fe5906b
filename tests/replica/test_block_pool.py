"""The block pool against a plain model of it: the free queue is least-recently-freed first
(popleft_n and extend splice it in bulk), a reused block's hash leaves the index with a
BLOCK_REMOVED event, and a full block takes its hash unless another block holds it."""

from __future__ import annotations

import random

import pytest

from replica.core.block_pool import BlockPool
from replica.core.kv_events import BLOCK_REMOVED, BLOCK_STORED


class PoolModel:
    """Lists and dicts: what BlockPool must do, slowly."""

    def __init__(self, num_blocks: int):
        self.free = list(range(1, num_blocks))  # head first
        self.refs = {block_id: 0 for block_id in range(1, num_blocks)}
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.events: list[tuple] = []

    def get_new(self, count: int) -> list[int]:
        taken, self.free = self.free[:count], self.free[count:]
        for block_id in taken:
            block_hash = self.hash_of.pop(block_id, None)
            if block_hash is not None and self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
                self.events.append((BLOCK_REMOVED, block_hash, None))
            self.refs[block_id] = 1
        return taken

    def touch(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.refs[block_id] == 0:
                self.free.remove(block_id)
            self.refs[block_id] += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                self.free.append(block_id)

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


@pytest.mark.parametrize("seed", range(20))
def test_the_pool_does_what_its_plain_model_does(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 9, 33])
    pool, model = BlockPool(num_blocks), PoolModel(num_blocks)
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
