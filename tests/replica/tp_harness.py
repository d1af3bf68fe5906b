"""Two real gloo ranks on this CPU: rank 0 in the test's process, rank 1 in a spawned one."""

from __future__ import annotations

import contextlib
import multiprocessing
from typing import Callable, Iterator

import torch

from replica.parallel.group import TensorParallel, join_group, remove_rendezvous, rendezvous_path, rendezvous_store


@contextlib.contextmanager
def beside_rank_1(rank_1_target: Callable[[int, "multiprocessing.Queue"], None], timeout_s: float = 30.0,
                  control: str = "auto") -> Iterator[tuple[TensorParallel, "multiprocessing.Queue"]]:
    """Starts rank 1 as `rank_1_target(rendezvous, results)` in a spawned process, joins rank 0
    to the group here (each collective bounded by `timeout_s`) and yields (rank 0's group, the
    queue rank 1 puts its answers on); rank 1 is joined on exit, and killed if it is still
    alive then."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    path = rendezvous_path()
    store = rendezvous_store(2, path)
    rank_1 = context.Process(target=rank_1_target, args=(path, results), daemon=True)
    rank_1.start()
    try:
        yield join_group(store, 0, 2, torch.device("cpu"), timeout_s, control=control), results
    finally:
        rank_1.join(timeout=30)
        if rank_1.is_alive():
            rank_1.kill()
        remove_rendezvous(path)
