"""The host KV tier's memory and the whole-block copies between it and the device cache.

The host cache is one tensor, block-major: [host blocks, layers, key/value, block_size,
kv heads, head_dim], so a run of consecutive host blocks is one contiguous range. A batch of
copies one way goes through a staging buffer on the device, [blocks, layers, key/value, ...]
like the host cache: device -> host gathers the device blocks of every layer into it (one
index_select over the stacked cache, KVCaches.stacked, seen as rows of one block of one
layer's keys or values, written straight into the staging buffer in the order of their host
blocks) and then copies it out in one copy per run of consecutive host block ids, straight
into the (pinned, on CUDA) host blocks; host -> device copies each run of host blocks into it
and scatters its rows into the device blocks (one index_copy_). A round costs the host a
handful of launches whatever the model's depth: it had been four per layer, which on an H200
put ~0.5 ms on every step that wrote a block through (2026-11-29). Row indices keep each
launch whole: indexing the stacked cache along its block dimension made CUDA's index_copy_
split into about one kernel per layer and key/value once the cache passes 2^31 bytes (an
H200's pool at 0.9 of its memory: ~115 GB), where a row index stays a 64-bit multiply inside
one kernel; and the gather needs no temporary the size of the staging buffer. One copy per
direction per step where the step's host blocks are consecutive; the host pool hands them
out in its LRU order, so in practice runs
average 2.5-4.5 blocks (`runs` counts the copies: the router simulation's mixed_long at 100%,
write-throughs 2.9 blocks a copy, swap-outs 4.1, prefetches 2.5; bench_swap's multi-turn run
4.5). No host-side bounce buffer, which would make every step one copy each way: a copy
through one costs the CPU a memcpy of every byte on top of the link's, where a run's copy is
the DMA engine's alone. The CPU path is the same code, its copies plain tensor ops done when
`copy` returns.

On CUDA the copies run on a stream of their own: they start once the compute stream has
queued everything before them (the steps that wrote the blocks swapped out, or still read
the blocks swapped into), and the compute stream waits on an event after the step's swap-outs
and swap-ins, so the step that reads swapped-in blocks, or overwrites swapped-out ones, runs
only once they are done, while the host goes on preparing the step. The step's
write-throughs (the spilling prefix cache's copies of blocks filled earlier) and prefetches
(swap-ins of a request that resumes next step) are queued after that event: they overlap the
step's forward pass, and the next step's event, recorded after them on the same stream, makes
its forward pass (which may overwrite or read their blocks) wait for them.

Order within a step: every swap-out, then every swap-in, then every write-through, then every
prefetch (BlockCopies' contract): a device block a swap-out frees may be the destination of a
swap-in of the same step.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from replica.attention.base import KVCaches
from replica.config import ConfigError
from replica.core.host_pool import BlockCopies
from replica.executor import cuda_runtime

# Blocks staged on the device per round of copies: bounds the staging buffer.
STAGING_BLOCKS = 32


class CopyRound(NamedTuple):
    """One round of copies one way, at most STAGING_BLOCKS blocks, in the order of their host
    blocks: staging row i holds device block device_ids[i]; runs are (first staging row,
    first host block id, blocks) of consecutive host block ids, one copy each."""

    device_ids: list[int]
    runs: list[tuple[int, int, int]]


def plan_rounds(host_device_pairs: Sequence[tuple[int, int]]) -> list[CopyRound]:
    """(host id, device id) pairs as rounds of runs over consecutive host ids. Pairs with the
    same host id keep their order (a small host tier's write-throughs may reuse a host block
    within a step: the later copy must land last)."""
    pairs = sorted(host_device_pairs, key=lambda pair: pair[0])
    rounds = []
    for start in range(0, len(pairs), STAGING_BLOCKS):
        chunk = pairs[start:start + STAGING_BLOCKS]
        runs: list[tuple[int, int, int]] = []
        for row, (host_id, _) in enumerate(chunk):
            if runs and runs[-1][1] + runs[-1][2] == host_id:
                first_row, first_host, length = runs[-1]
                runs[-1] = (first_row, first_host, length + 1)
            else:
                runs.append((row, host_id, 1))
        rounds.append(CopyRound([device_id for _, device_id in chunk], runs))
    return rounds


def pinned_host_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                      before_unpin: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Zeroed host memory page-locked at exactly its size (rounded to whole pages), until the
    tensor is collected: an anonymous mapping of its own registered with cudaHostRegister, as
    SGLang's host KV pools do. `pin_memory=True` goes through torch's caching host allocator,
    which rounds each allocation up to the next power of two (torch <= 2.13 by default): a host
    tier of 64 GiB and a block pinned 128 GiB, past the memory resolve_host_kv_blocks checked it
    against. A mapping of its own shares no page with another allocation, which a registration
    of heap memory could (a second one over a shared page fails). A host that cannot lock that
    much fails the start in one line naming the setting (no fallback to pin_memory: past its
    rounding, a refused registration leaves the runtime's last error set, and torch raises it at
    the next kernel launch, far from here). `before_unpin` runs before the pages are unlocked
    (the copy stream drained: a copy still in flight must not land in unmapped pages)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    length = -(-max(num_bytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: what a registration locks
    mapped = mmap.mmap(-1, length)  # page-aligned, zero-filled by the OS as it is touched
    tensor = torch.frombuffer(mapped, dtype=torch.uint8)[:num_bytes].view(dtype).view(shape)  # keeps `mapped`
    cudart = torch.cuda.cudart()
    pointer = tensor.data_ptr()
    error = int(cudart.cudaHostRegister(pointer, length, 0))  # as torch.cuda._pin_memory_utils
    if error:
        raise ConfigError(f"host_kv_bytes / num_host_kv_blocks: the host KV tier's {num_bytes} bytes could not be "
                          f"page-locked (cudaHostRegister: CUDA error {error})")
    # Before the mapping goes: the tensor's collection runs this, and its storage (holding the
    # mapping) is freed after.
    weakref.finalize(tensor, _unpin, cudart, pointer, before_unpin)
    return tensor


def _unpin(cudart, pointer: int, before_unpin: Optional[Callable[[], None]] = None) -> None:
    # Each step whatever the other did (at interpreter exit CUDA may be gone before this runs):
    # pages unmapped while still registered would fail a later registration at their address.
    with contextlib.suppress(Exception):
        if before_unpin is not None:
            before_unpin()
    with contextlib.suppress(Exception):
        cudart.cudaHostUnregister(pointer)


class KVSwapper:
    def __init__(self, kv_caches: KVCaches, num_host_blocks: int, device: torch.device):
        """num_host_blocks: usable host blocks; ids run 1..num_host_blocks (HostBlockPool's)."""
        self.kv_caches = kv_caches
        self.stacked = kv_caches.stacked  # [layers, key/value, device blocks, block_size, kv heads, head_dim]
        self.device = torch.device(device)
        self.on_cuda = cuda_runtime.on_cuda(self.device)
        key_cache = kv_caches[0][0]
        self.block_shape = tuple(key_cache.shape[1:])  # block_size, kv heads, head_dim
        self.num_layers = len(kv_caches)
        shape = (num_host_blocks + 1, self.num_layers, 2) + self.block_shape
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(self.device) if self.on_cuda else None
        # Zeroed lazily by the OS on CPU; page-locked on CUDA, at exactly its size, for
        # asynchronous copies (the copy stream drained before the pages are unlocked).
        self.host_cache = (pinned_host_zeros(shape, key_cache.dtype, before_unpin=self.stream.synchronize)
                           if self.on_cuda else torch.zeros(shape, dtype=key_cache.dtype))
        self.bytes_per_block = self.host_cache[0].numel() * self.host_cache.element_size()
        # Blocks this rank copied each way (under tensor parallelism every rank copies its shard).
        self.swapped_out_blocks = self.swapped_in_blocks = self.written_through_blocks = 0
        self.prefetched_blocks = 0  # of swapped_in_blocks, those copied beside the step before
        self.runs = 0  # copies over the link: one per run of consecutive host blocks
        self.staging = torch.empty((STAGING_BLOCKS,) + shape[1:], dtype=key_cache.dtype, device=self.device)
        # Both as rows of one block of one layer's keys or values: the stacked cache's row
        # (layer, key/value, block) is plane (layer x 2 + key/value) x blocks + block, and the
        # staging buffer's rows run block-major, each block's planes in order.
        self.row_numel = math.prod(self.block_shape)
        self.device_rows = self.stacked.view(-1, self.row_numel)
        self.plane_starts = np.arange(self.num_layers * 2, dtype=np.int64) * self.stacked.shape[2]

    @torch.inference_mode()
    def copy(self, copies: BlockCopies) -> None:
        """Run a step's copies: swap-outs, swap-ins, write-throughs, prefetches. On CUDA the
        step's kernels queued after this call wait for the swaps and for every earlier step's
        write-throughs and prefetches, not for this step's."""
        self.swapped_out_blocks += len(copies.swap_out)
        self.swapped_in_blocks += len(copies.swap_in) + len(copies.prefetch)
        self.prefetched_blocks += len(copies.prefetch)
        self.written_through_blocks += len(copies.write_through)
        if not self.on_cuda:
            self._to_host(copies.swap_out)
            self._from_host(copies.swap_in)
            self._to_host(copies.write_through)
            self._from_host(copies.prefetch)
            return
        compute = torch.cuda.current_stream(self.device)
        queued = torch.cuda.Event()
        queued.record(compute)
        stream = self.stream
        with torch.cuda.stream(stream):
            stream.wait_event(queued)  # the steps before this one have written / read the blocks
            self._to_host(copies.swap_out)
            self._from_host(copies.swap_in)
            # After this step's swaps and the previous steps' write-throughs and prefetches (one
            # stream, in order).
            done = torch.cuda.Event()
            done.record(stream)
            # Blocks this step's forward pass neither reads nor writes: overlapped with it; the
            # next step's `done` follows them.
            self._to_host(copies.write_through)
            self._from_host(copies.prefetch)
        compute.wait_event(done)  # the step's forward pass reads / overwrites these blocks

    def _to_host(self, device_host_pairs: Sequence[tuple[int, int]]) -> None:
        """Device -> host: each round gathered into the staging buffer, then one copy per run
        (on the copy stream, the caller's, on CUDA)."""
        if not device_host_pairs:
            return
        for round_ in plan_rounds([(host_id, device_id) for device_id, host_id in device_host_pairs]):
            staging = self.staging[:len(round_.device_ids)]
            torch.index_select(self.device_rows, 0, self._rows(round_.device_ids), out=staging.view(-1, self.row_numel))
            for row, host_id, length in round_.runs:
                self.host_cache[host_id:host_id + length].copy_(staging[row:row + length], non_blocking=self.on_cuda)
            self.runs += len(round_.runs)

    def _from_host(self, host_device_pairs: Sequence[tuple[int, int]]) -> None:
        """Host -> device: each round's runs copied into the staging buffer, one copy each, then
        scattered into the device blocks."""
        if not host_device_pairs:
            return
        for round_ in plan_rounds(host_device_pairs):
            staging = self.staging[:len(round_.device_ids)]
            for row, host_id, length in round_.runs:
                staging[row:row + length].copy_(self.host_cache[host_id:host_id + length], non_blocking=self.on_cuda)
            self.runs += len(round_.runs)
            self.device_rows.index_copy_(0, self._rows(round_.device_ids), staging.view(-1, self.row_numel))

    def _rows(self, block_ids: list[int]) -> torch.Tensor:
        """The stacked cache's rows of `block_ids`, in the staging buffer's row order, as an int64
        index tensor on the device (from pinned memory, asynchronously, on CUDA)."""
        rows = torch.from_numpy((np.asarray(block_ids, dtype=np.int64)[:, None] + self.plane_starts).ravel())
        if not self.on_cuda:
            return rows
        return (rows.pin_memory() if cuda_runtime.pins_host_memory(self.device) else rows).to(self.device,
                                                                                             non_blocking=True)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
