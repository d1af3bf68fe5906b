"""The one place a replica asks whether its device runs CUDA's runtime.

"The runtime" is everything the host does around the kernels: pinned host buffers, events a
step's readers wait on, the host KV tier's copy stream, CUDA-graph capture and replay, the SLO
abort's per-layer pacing, the caching allocator's profile, async scheduling's default. Every
such branch asks `on_cuda` here (as `cuda_runtime.on_cuda(device)`, a module attribute), so
tests/replica/test_cuda_runtime_on_cpu.py can run all of them on a CPU with stand-ins for
torch.cuda's runtime calls, and a branch that would crash on the first GPU (a set_device
refusing an unindexed device, a reallocated graph output) fails in CI instead.

Which kernels run is not asked here: the attention backend and the fused ops follow the
tensors' own device (`device.type`), as do tensor parallelism's process groups (NCCL or gloo).
"""

from __future__ import annotations

import torch


def on_cuda(device: torch.device | str) -> bool:
    """Whether `device`'s host-side work goes through CUDA's runtime."""
    return torch.device(device).type == "cuda"


def pins_host_memory(device: torch.device | str) -> bool:
    """Whether host buffers copied to or from `device` are page-locked (asynchronous copies)."""
    return on_cuda(device)
