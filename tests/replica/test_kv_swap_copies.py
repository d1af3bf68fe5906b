"""The executor's block copies between the device KV cache and the host tier (KVSwapper):
batched through a staging buffer, one copy per run of consecutive host blocks, they must move
exactly the bytes that copying each block on its own moves, in BlockCopies' order."""

from __future__ import annotations

import random

import pytest
import torch

from replica.attention.base import allocate_kv_cache
from replica.core.host_pool import BlockCopies
from replica.executor.kv_swap import STAGING_BLOCKS, KVSwapper, plan_rounds

NUM_LAYERS, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS = 3, 80, 120
BLOCK_SHAPE = (4, 2, 8)  # block_size, kv heads, head_dim


def _swapper(seed: int, dtype=torch.float32) -> KVSwapper:
    generator = torch.Generator().manual_seed(seed)
    caches = allocate_kv_cache(NUM_LAYERS, NUM_DEVICE_BLOCKS, *BLOCK_SHAPE, dtype, "cpu")
    caches.stacked.copy_(torch.randn(caches.stacked.shape, generator=generator).to(dtype))
    swapper = KVSwapper(caches, NUM_HOST_BLOCKS, torch.device("cpu"))
    swapper.host_cache.copy_(torch.randn(swapper.host_cache.shape, generator=generator).to(dtype))
    return swapper


def _copy_block_by_block(swapper: KVSwapper, copies: BlockCopies) -> None:
    """The reference: every block on its own, layer by layer, in BlockCopies' order."""
    host = swapper.host_cache

    def out(pairs):
        for device_id, host_id in pairs:
            for layer, (key_cache, value_cache) in enumerate(swapper.kv_caches):
                host[host_id, layer, 0].copy_(key_cache[device_id])
                host[host_id, layer, 1].copy_(value_cache[device_id])

    def in_(pairs):
        for host_id, device_id in pairs:
            for layer, (key_cache, value_cache) in enumerate(swapper.kv_caches):
                key_cache[device_id].copy_(host[host_id, layer, 0])
                value_cache[device_id].copy_(host[host_id, layer, 1])

    out(copies.swap_out)
    in_(copies.swap_in)
    out(copies.write_through)
    in_(copies.prefetch)


def _random_copies(rng: random.Random) -> BlockCopies:
    """A step's copies as the scheduler makes them: swap-outs into fresh host blocks (mostly a
    run, as the host pool hands them out), swap-ins from other host blocks, possibly into the
    device blocks the swap-outs freed, write-throughs of other device blocks, prefetches."""
    device_ids = rng.sample(range(1, NUM_DEVICE_BLOCKS), 70)
    first = rng.randrange(1, NUM_HOST_BLOCKS - 40)
    fresh_host = list(range(first, first + rng.randrange(0, 40)))
    if rng.random() < 0.5:
        rng.shuffle(fresh_host)
    other_host = rng.sample([h for h in range(1, NUM_HOST_BLOCKS + 1) if h not in fresh_host], 30)
    num_out = rng.randrange(0, min(20, len(fresh_host)) + 1)
    swap_out = list(zip(device_ids[:num_out], fresh_host[:num_out]))
    num_in = rng.randrange(0, 15)
    # Into the blocks the swap-outs just freed first, then others.
    swap_in = list(zip(other_host[:num_in], (device_ids[:num_out] + device_ids[20:])[:num_in]))
    write_through = list(zip(device_ids[40:40 + rng.randrange(0, 15)], fresh_host[num_out:]))
    if write_through and rng.random() < 0.3:  # a small host tier reuses a host block within the step
        write_through.append((device_ids[69], write_through[0][1]))
    num_prefetch = rng.randrange(0, 15)
    prefetch = list(zip(other_host[15:15 + num_prefetch], device_ids[55:55 + num_prefetch]))
    return BlockCopies(tuple(swap_out), tuple(swap_in), tuple(write_through), tuple(prefetch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_copies_move_exactly_the_bytes_block_by_block_copies_move(dtype):
    rng = random.Random(0)
    batched, reference = _swapper(1, dtype), _swapper(1, dtype)
    for _ in range(30):
        copies = _random_copies(rng)
        batched.copy(copies)
        _copy_block_by_block(reference, copies)
        assert torch.equal(batched.host_cache.view(torch.uint8), reference.host_cache.view(torch.uint8))
        for (key, value), (ref_key, ref_value) in zip(batched.kv_caches, reference.kv_caches):
            assert torch.equal(key.view(torch.uint8), ref_key.view(torch.uint8))
            assert torch.equal(value.view(torch.uint8), ref_value.view(torch.uint8))
    assert batched.swapped_out_blocks > 0 and batched.prefetched_blocks > 0


def test_consecutive_host_blocks_are_one_copy_however_the_pairs_are_ordered():
    swapper = _swapper(2)
    host_ids = list(range(10, 10 + 12))
    random.Random(3).shuffle(host_ids)
    swapper.copy(BlockCopies(tuple(zip(range(1, 13), host_ids)), ()))
    assert swapper.runs == 1
    swapper.copy(BlockCopies((), tuple(zip(host_ids, range(30, 42)))))
    assert swapper.runs == 2
    # Two gaps make three runs; more blocks than the staging buffer holds take more rounds.
    assert [len(r.runs) for r in plan_rounds([(h, 1) for h in (1, 2, 4, 5, 9)])] == [3]
    rounds = plan_rounds([(h, h) for h in range(1, 2 * STAGING_BLOCKS + 2)])
    assert [len(r.runs) for r in rounds] == [1, 1, 1] and sum(len(r.device_ids) for r in rounds) == 2 * STAGING_BLOCKS + 1
    # Each block lands in its own host block, not its neighbour's.
    for device_id, host_id in zip(range(1, 13), host_ids):
        assert torch.equal(swapper.host_cache[host_id, 1, 0], swapper.kv_caches[1][0][device_id])


def test_a_round_of_copies_costs_the_same_ops_whatever_the_number_of_layers():
    # Each op is a launch on CUDA: four per layer per round had put ~0.5 ms on every H200 step
    # that wrote a block through. Counted at the dispatcher, so the CPU shows what a GPU launches.
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    views = {"slice", "view", "movedim", "detach_", "lift_fresh", "alias"}
    counts = {}
    for num_layers in (1, 8):
        caches = allocate_kv_cache(num_layers, NUM_DEVICE_BLOCKS, *BLOCK_SHAPE, torch.float32, "cpu")
        swapper = KVSwapper(caches, NUM_HOST_BLOCKS, torch.device("cpu"))
        copies = BlockCopies(((1, 5), (2, 9)), ((20, 3),), ((4, 30), (6, 31)), ((40, 7),))
        with CountOps() as counter:
            swapper.copy(copies)
        counts[num_layers] = [op for op in map(str, counter.ops) if op.split(".")[1] not in views]
    # Four rounds (one per kind of copy), five runs: one gather or scatter a round and one copy a
    # run; the gather writes into the staging buffer itself (a temporary and a copy had followed it).
    assert counts[1] == counts[8] and len(counts[8]) == 9, counts


class _RecordingCudart:
    """CUDA's runtime as pinned_host_zeros calls it (torch.cuda.cudart()), recording each call: a
    CPU cannot page-lock through CUDA, and what matters here is the range asked for and the release."""

    def __init__(self, register_error: int = 0):
        self.calls: list[tuple] = []
        self.register_error = register_error

    def cudaHostRegister(self, pointer, num_bytes, flags):  # noqa: N802 - CUDA's name
        self.calls.append(("register", pointer, num_bytes))
        return self.register_error

    def cudaHostUnregister(self, pointer):  # noqa: N802
        self.calls.append(("unregister", pointer))
        return 0


def test_the_host_tier_is_page_locked_at_exactly_its_size_on_pages_of_its_own_and_unlocked_when_collected(
        monkeypatch):
    """torch's pin_memory=True rounds up to a power of two: 1,025 blocks of 1 MiB pinned 2 GiB."""
    import gc
    import mmap

    from replica.config import ConfigError
    from replica.executor.kv_swap import pinned_host_zeros

    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    shape = (1025, 3, 2, 4, 2, 8)  # blocks + the null block, layers, key/value, block shape
    host_cache = pinned_host_zeros(shape, torch.bfloat16)
    num_bytes = 1025 * 3 * 2 * 4 * 2 * 8 * 2
    pages = -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    pointer = host_cache.data_ptr()
    assert host_cache.shape == shape and host_cache.dtype == torch.bfloat16 and not host_cache.any()
    assert pointer % mmap.PAGESIZE == 0 and cudart.calls == [("register", pointer, pages)]
    host_cache[-1] = 1.5  # writable to its last element
    del host_cache
    gc.collect()
    assert cudart.calls[-1] == ("unregister", pointer)

    refusing = _RecordingCudart(register_error=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: refusing)
    with pytest.raises(ConfigError, match=r"^host_kv_bytes / num_host_kv_blocks: .* 1024 bytes could not be page-locked"):
        pinned_host_zeros((256,), torch.float32)


def test_the_copy_stream_drains_before_the_host_tier_is_unlocked_even_if_draining_fails(monkeypatch):
    """A copy still queued on the swap stream must not land in pages already unmapped; and the
    pages are unregistered whatever the drain did (a later registration at the same address
    would fail over pages unmapped while registered)."""
    import gc

    from replica.executor import kv_swap

    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host_cache = kv_swap.pinned_host_zeros((64,), torch.float32, before_unpin=lambda: cudart.calls.append(("drain",)))
    pointer = host_cache.data_ptr()
    del host_cache
    gc.collect()
    assert cudart.calls[1:] == [("drain",), ("unregister", pointer)]

    def failing_drain():
        raise RuntimeError("CUDA gone")

    host_cache = kv_swap.pinned_host_zeros((64,), torch.float32, before_unpin=failing_drain)
    pointer = host_cache.data_ptr()
    del host_cache
    gc.collect()
    assert cudart.calls[-1] == ("unregister", pointer)
