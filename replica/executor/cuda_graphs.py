"""CUDA graphs of the decode forward pass: captured at start-up for a ladder of batch sizes,
replayed with the batch padded up to the next captured size.

A decode-only step launches hundreds of small kernels whose launch cost, not their work,
sets the step time; one graph replay launches them all at once. The captured pass (the
model, the logits and the greedy pick of every row) reads its inputs from the runner's
persistent device buffers and writes persistent outputs, so a replay needs only those
buffers refilled. Padding rows are harmless by construction (see ModelRunner).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

# Past this many sequences a decode step is compute-bound enough that launches no longer
# dominate, and each captured size costs memory and start-up time (vLLM's default cap).
MAX_CAPTURE_SIZE = 512


def use_cuda_graphs(device: torch.device, enforce_eager: bool, supports_cuda_graphs: bool) -> bool:
    """Whether decode steps replay CUDA graphs: on CUDA, unless `enforce_eager`, with an
    attention backend whose forward pass never waits for the host (the Triton one; the torch
    reference reads sequence lengths on the host)."""
    return device.type == "cuda" and not enforce_eager and supports_cuda_graphs


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, largest: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch-size ladder: 1, 2, 4, then every multiple of 8, up to the largest decode
    batch the scheduler can form (one token per sequence), which is always included."""
    top = min(max_num_seqs, max_num_batched_tokens, largest)
    sizes = [size for size in (1, 2, 4) if size < top] + list(range(8, top, 8))
    return sizes + [top]


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

    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        # Largest first: the smaller graphs then fit in the memory the largest one pooled.
        for size in sorted(self.sizes, reverse=True):
            # Warm-up outside the graph: compiles Triton kernels for this shape and runs any
            # lazy initialisation, neither of which may happen during capture.
            self._decode_pass(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._decode_pass(size)
            if pool is None:
                pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
                    len(self._graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def replay(self, size: int) -> None:
        self._graphs[size].replay()
