"""CUDA graphs of the decode forward pass: captured at start-up for a ladder of batch sizes,
replayed with the batch padded up to the next captured size.

A decode-only step launches hundreds of small kernels whose launch cost, not their work,
sets the step time; one graph replay launches them all at once. The captured pass (the
model, the logits and the greedy pick of every row) reads its inputs from the runner's
persistent device buffers and writes persistent outputs, so a replay needs only those
buffers refilled. Padding rows are harmless by construction (see ModelRunner).

Under tensor parallelism every rank captures the same ladder in the same order (capture_order),
its collectives inside its graphs; replica/parallel/graphs.py says what keeps the ranks in step.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from typing import Callable, Optional, Sequence

import torch

from replica.executor import cuda_runtime

logger = logging.getLogger(__name__)

# Past this many sequences a decode step is compute-bound enough that launches no longer
# dominate, and each captured size costs memory and start-up time (vLLM's default cap).
MAX_CAPTURE_SIZE = 512


def use_cuda_graphs(device: torch.device, enforce_eager: bool, supports_cuda_graphs: bool) -> bool:
    """Whether decode steps replay CUDA graphs: on CUDA, unless `enforce_eager`, with an
    attention backend whose forward pass never waits for the host (the Triton one; the torch
    reference reads sequence lengths on the host). Never on a CPU, so never with gloo. Each
    tensor-parallel rank decides with this, and the ranks then agree (parallel/graphs.py)."""
    return cuda_runtime.on_cuda(device) and not enforce_eager and supports_cuda_graphs


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, largest: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch-size ladder: 1, 2, 4, then every multiple of 8, up to the largest decode
    batch the scheduler can form (one token per sequence), which is always included."""
    top = min(max_num_seqs, max_num_batched_tokens, largest)
    sizes = [size for size in (1, 2, 4) if size < top] + list(range(8, top, 8))
    return sizes + [top]


def capture_order(sizes: Sequence[int]) -> list[int]:
    """The order sizes are captured in: largest first, so the smaller graphs fit in the memory
    the largest one pooled. Every tensor-parallel rank captures in this order, so each size's
    warm-up pass (collectives included) meets the other ranks' warm-up of the same size."""
    return sorted(sizes, reverse=True)


def padded_batch_size(sizes: Sequence[int], num_seqs: int) -> Optional[int]:
    """The smallest captured size that holds num_seqs sequences; None past the largest."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


class DecodeGraphs:
    def __init__(self, decode_pass: Callable[[int], None], sizes: Sequence[int]):
        """decode_pass(size) runs one decode step's device work on the first `size` rows of
        the runner's persistent inputs and writes its results to the runner's persistent
        outputs (fixed addresses, read after every replay)."""
        self.sizes = list(sizes)
        self._decode_pass = decode_pass
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured: list[int] = []  # the sizes in the order they were captured

    def capture(self) -> None:
        start = time.perf_counter()
        # A finaliser run during capture (an earlier engine's pinned buffers, its events) would
        # issue CUDA calls that invalidate it: collect now and let no collection run until done.
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all()
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
                    len(self._graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def _capture_all(self) -> None:
        pool = None
        for size in capture_order(self.sizes):
            # Warm-up outside the graph: compiles Triton kernels for this shape and runs any
            # lazy initialisation, neither of which may happen during capture. Under tensor
            # parallelism its collectives run for real, meeting the other ranks' warm-up of
            # the same size (the capture that follows records them without communicating).
            self._decode_pass(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (a front's copies, a finishing engine's
            # threads) must not invalidate this capture; this thread's unsafe calls still fail it.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._decode_pass(size)
            if pool is None:
                pool = graph.pool()
            self._graphs[size] = graph
            self.captured.append(size)

    def replay(self, size: int) -> None:
        self._graphs[size].replay()
