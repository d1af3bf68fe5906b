"""CUDA graphs of the decode pass under tensor parallelism.

Each rank captures its own graphs of the padded decode pass (executor/cuda_graphs.py), its
collectives inside them as NCCL kernels: the vocab-parallel embedding's and every o_proj /
down_proj all-reduce, the logits all-gather. Rank 0's plan names each decode step's padded
size and every rank replays that size's graph, so the captured collectives meet in the same
order eager ones do (replays are as much in lockstep as eager steps: the step message comes
first, the token broadcast after). What keeps the ranks in step:

- One decision and one ladder. Each rank decides with use_cuda_graphs (never on a CPU, so
  never with gloo) and derives the ladder from the config (capture_sizes);
  agree_on_decode_graphs compares both across the ranks with one collective at start: all
  capture or none, and a different ladder fails every rank's start at once instead of
  leaving a replay without its peer.
- One order. Every rank captures in capture_order, each size's eager warm-up pass just before
  its capture; the warm-ups' collectives meet the other ranks' warm-up of the same size, and
  capture itself records NCCL calls without communicating.
- NCCL set up for capture: the communicator exists before capture (the agreement's collective
  makes it), torch keeps captured work off its watchdog and flushes the watchdog's queue
  before a capture begins, and the group is built with TORCH_NCCL_AVOID_RECORD_STREAMS
  (parallel/group.py: join_group). No custom all-reduce exists here, so NCCL is the graphs'
  all-reduce, as in vLLM with its custom all-reduce off.
- No vote in a graph. A step that may be aborted (one with a prefill: StepAbort.begin) is
  never padded, so it runs eagerly on every rank and votes at every layer; a padded step,
  replayed or not, never votes (graphable = not abortable, decided once on rank 0 and shipped).

A captured collective has no timeout of its own (torch's watchdog does not see it), but each
replayed decode step is followed by the eager broadcast of its sampled ids, which is watched:
a peer that dies mid-replay fails that broadcast after tensor_parallel_timeout_s.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from replica.parallel.group import TensorParallel, TensorParallelConfigError


def ladder_fingerprint(cuda_graphs: bool, sizes: Sequence[int]) -> list[int]:
    """A fixed-length summary of a rank's graph decision and ladder (order included), the same
    length on every rank whatever the ladder, so one collective compares them."""
    return [int(cuda_graphs), len(sizes), sum(sizes), zlib.crc32(repr(list(sizes)).encode())]


def agree_on_decode_graphs(tp: TensorParallel, cuda_graphs: bool, sizes: Sequence[int],
                           device: torch.device) -> bool:
    """Whether this rank captures decode graphs: only if every rank would (each decided with
    use_cuda_graphs). Raises TensorParallelConfigError on every rank together when the ranks'
    ladders differ (they derive it from one config, so that is a rank started differently).
    Every rank of a group calls this once, at the same point of its start (before its runner)."""
    if tp.size == 1:
        return cuda_graphs
    lows, highs = tp.extremes_at_start(ladder_fingerprint(cuda_graphs, sizes), device)
    if lows[1:] != highs[1:]:
        raise TensorParallelConfigError(
            f"max_num_seqs / max_num_batched_tokens: the {tp.size} tensor-parallel ranks would pad decode steps "
            f"to different batch-size ladders (rank {tp.rank}'s: {list(sizes)}); every rank must start from the "
            f"same config")
    return bool(lows[0])
