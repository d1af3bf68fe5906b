"""The host KV tier's memory and the whole-block copies between it and the device cache.

The host cache is one tensor, block-major: [host blocks, layers, key/value, block_size,
kv heads, head_dim], so a host block is contiguous (one copy moves it on CUDA). On CUDA it is
pinned and the copies run on a stream of their own: they start once the compute stream has
queued everything before them (the steps that wrote the blocks swapped out, or still read
the blocks swapped into), and the compute stream waits on an event after the step's swap-outs
and swap-ins, so the step that reads swapped-in blocks, or overwrites swapped-out ones, runs
only once they are done, while the host goes on preparing the step. The step's
write-throughs (the spilling prefix cache's copies of blocks filled earlier) are queued after
that event: they overlap the step's forward pass, and the next step's event, recorded after
them on the same stream, makes its forward pass (which may overwrite their blocks) wait for
them. On CPU the copies are plain tensor ops, done when `copy` returns.

Order within a step: every swap-out, then every swap-in, then every write-through
(BlockCopies' contract): a device block a swap-out frees may be the destination of a swap-in
of the same step.
"""

from __future__ import annotations

from typing import Optional

import torch

from replica.core.host_pool import BlockCopies

# Blocks gathered on the device per round of a CUDA copy: bounds the staging buffer.
CUDA_STAGING_BLOCKS = 32


class KVSwapper:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_host_blocks: int,
                 device: torch.device):
        """num_host_blocks: usable host blocks; ids run 1..num_host_blocks (HostBlockPool's)."""
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        key_cache = kv_caches[0][0]
        self.block_shape = tuple(key_cache.shape[1:])  # block_size, kv heads, head_dim
        self.num_layers = len(kv_caches)
        shape = (num_host_blocks + 1, self.num_layers, 2) + self.block_shape
        # Zeroed lazily by the OS on CPU; pinned (page-locked) on CUDA for asynchronous copies.
        self.host_cache = torch.zeros(shape, dtype=key_cache.dtype, pin_memory=self.on_cuda)
        self.bytes_per_block = self.host_cache[0].numel() * self.host_cache.element_size()
        # Blocks this rank copied each way (under tensor parallelism every rank copies its shard).
        self.swapped_out_blocks = self.swapped_in_blocks = self.written_through_blocks = 0
        self.stream: Optional[torch.cuda.Stream] = None
        self.staging: Optional[torch.Tensor] = None
        if self.on_cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.staging = torch.empty((CUDA_STAGING_BLOCKS,) + shape[1:], dtype=key_cache.dtype, device=self.device)

    @torch.inference_mode()
    def copy(self, copies: BlockCopies) -> None:
        """Run a step's copies: swap-outs, then swap-ins, then write-throughs. On CUDA the
        step's kernels queued after this call wait for the swaps and for every earlier step's
        write-throughs, not for this step's."""
        self.swapped_out_blocks += len(copies.swap_out)
        self.swapped_in_blocks += len(copies.swap_in)
        self.written_through_blocks += len(copies.write_through)
        if self.on_cuda:
            self._copy_cuda(copies)
            return
        self._copy_out_cpu(copies.swap_out)
        if copies.swap_in:
            host_ids, device_ids = _id_tensors(copies.swap_in, self.device)
            for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
                key_cache.index_copy_(0, device_ids, self.host_cache[:, layer, 0].index_select(0, host_ids))
                value_cache.index_copy_(0, device_ids, self.host_cache[:, layer, 1].index_select(0, host_ids))
        self._copy_out_cpu(copies.write_through)

    def _copy_out_cpu(self, pairs) -> None:
        if not pairs:
            return
        device_ids, host_ids = _id_tensors(pairs, self.device)
        for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
            self.host_cache[:, layer, 0].index_copy_(0, host_ids, key_cache.index_select(0, device_ids))
            self.host_cache[:, layer, 1].index_copy_(0, host_ids, value_cache.index_select(0, device_ids))

    def _copy_cuda(self, copies: BlockCopies) -> None:
        compute = torch.cuda.current_stream(self.device)
        queued = torch.cuda.Event()
        queued.record(compute)
        stream = self.stream
        with torch.cuda.stream(stream):
            stream.wait_event(queued)  # the steps before this one have written / read the blocks
            self._copy_out_cuda(copies.swap_out)
            for start in range(0, len(copies.swap_in), CUDA_STAGING_BLOCKS):
                chunk = copies.swap_in[start:start + CUDA_STAGING_BLOCKS]
                _, device_ids = _id_tensors(chunk, self.device)
                staging = self.staging[:len(chunk)]
                for index, (host_id, _) in enumerate(chunk):
                    staging[index].copy_(self.host_cache[host_id], non_blocking=True)
                for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
                    key_cache.index_copy_(0, device_ids, staging[:, layer, 0])
                    value_cache.index_copy_(0, device_ids, staging[:, layer, 1])
            # After this step's swaps and the previous steps' write-throughs (one stream, in order).
            done = torch.cuda.Event()
            done.record(stream)
            # Blocks filled by earlier steps, which this step's forward pass neither writes nor
            # reuses: overlapped with it; the next step's `done` follows them.
            self._copy_out_cuda(copies.write_through)
        compute.wait_event(done)  # the step's forward pass reads / overwrites these blocks

    def _copy_out_cuda(self, pairs) -> None:
        """Device -> host on the copy stream (the caller's), in rounds through the staging buffer."""
        for start in range(0, len(pairs), CUDA_STAGING_BLOCKS):
            chunk = pairs[start:start + CUDA_STAGING_BLOCKS]
            device_ids, _ = _id_tensors(chunk, self.device)
            staging = self.staging[:len(chunk)]
            for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
                staging[:, layer, 0].copy_(key_cache.index_select(0, device_ids))
                staging[:, layer, 1].copy_(value_cache.index_select(0, device_ids))
            for index, (_, host_id) in enumerate(chunk):
                self.host_cache[host_id].copy_(staging[index], non_blocking=True)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def _id_tensors(pairs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two columns of (id, id) pairs as int64 index tensors on `device`."""
    ids = torch.tensor(pairs, dtype=torch.int64).t()
    if device.type != "cpu":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return ids[0], ids[1]
