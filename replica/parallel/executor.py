"""Tensor-parallel execution: rank 0 in the engine core's own process, ranks 1..N-1 as worker
processes (spawned, one device each), all in one torch.distributed group.

The scheduler stays single, on rank 0. Its runner (TensorParallelRunner) prepares each step's
inputs as the one-device runner does, then ships what it copied to its device (the staged input
words that changed since that host buffer was last shipped, and the host-side step plan) to
every worker over a pipe; each worker patches its mirror of rank 0's buffer, puts the same
bytes on its own device and runs the same forward pass on its shard, meeting the others
in the row-parallel all-reduces, the logits all-gather and (steps that may be aborted) the
vote at every layer boundary; a padded decode step replays the rank's own CUDA graph of the
size rank 0 padded to, those collectives captured inside (parallel/graphs.py). Rank 0
samples; one broadcast gives every rank the sampled ids that the next step's inputs read on
the device.

A dead or silent worker never hangs the replica: rank 0 checks the workers before each step,
every write to a worker's pipe gives up after the collective timeout (a stopped worker stops
reading it), a collective with a dead peer fails at once (gloo: connection closed; NCCL: rank 0
waiting for the step's tokens checks its workers meanwhile, wait_watching_workers) and every
eager collective has a timeout (a replayed graph's have none, but the broadcast after it has);
TensorParallelDead then takes the engine core down, and the front reports the replica dead
(EngineDeadError). A worker exits when rank 0 goes away.
"""

from __future__ import annotations

import collections
import gc
import logging
import multiprocessing
import os
import select
import socket
import struct
import threading
import time
import weakref
from pathlib import Path
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

import numpy as np
import torch

from replica.config import ConfigError, EngineConfig
from replica.core.host_pool import BlockCopies
from replica.core.process import freeze_startup_heap
from replica.executor.cuda_graphs import capture_sizes, use_cuda_graphs
from replica.executor.model_runner import ModelRunner, StepInFlight, _StepPlan
from replica.executor.preemption_profile import preemption_costs
from replica.executor.rank_config import resolve_rank_config
from replica.executor.staging import StagedChanges
from replica.executor.step_abort import StepAborted
from replica.model import ModelConfig, load_model
from replica.parallel.group import (
    RENDEZVOUS_TIMEOUT_S, TensorParallel, TensorParallelDead, join_group, remove_rendezvous, rendezvous_path,
    rendezvous_store,
)
from replica.parallel.graphs import agree_on_decode_graphs
from replica.parallel.vote import WorkerVote

logger = logging.getLogger(__name__)

# How often an idle worker checks that rank 0 is still there.
PARENT_WATCH_INTERVAL_S = 1.0
# The store key a worker sets as it is about to join the group (rank 0 joins once all are set),
# and how often rank 0 looks for them, watching the workers in between.
ARRIVED_KEY = "arrived/{rank}"
ARRIVAL_POLL_S = 0.05
# How many of its latest padded decode steps' sizes a worker keeps for its stats.
RECENT_GRAPH_SIZES = 4096
# Rank 0 writes to a worker's pipe without ever blocking in the write (a stopped worker stops
# reading, and a message past the socket's buffer would block it for good); it polls for room
# until the collective timeout instead.
_SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
# Rank 0 waiting on NCCL for a step's tokens polls the step's event, and checks its workers
# every STEP_WORKER_CHECK_S: NCCL's wait never raises, so a worker that died mid-step would
# otherwise hold it until NCCL's watchdog fires (max(120 s, tensor_parallel_timeout_s)), where
# gloo fails the collective at once. It polls without sleeping, giving up the core between asks
# (os.sched_yield: the process's other threads, the channel's sender or a grammar compile, run
# meanwhile): a sleep of even 0.1 ms took ~0.15-0.2 ms on Linux (timer slack and the wake-up),
# so a step that ended was seen up to that late, every step under async scheduling (~5% of a
# 3 ms decode step). The core that polls stays busy while rank 0 waits, as NCCL's own waits do.
STEP_WORKER_CHECK_S = 0.05


@dataclass
class StepMessage:
    """One step for the worker ranks: what rank 0's runner put on its device, and the plan for it."""

    step_id: int
    abortable: bool  # the ranks vote at each layer boundary
    plan: _StepPlan
    staged: StagedChanges  # the staged input words that changed since their host buffer last shipped
    # Block-table changes past the staged buffer's capacity (rare), applied before the staged ones.
    overflow_changes: list[tuple[np.ndarray, np.ndarray]]


@dataclass
class WorkerSpec:
    rank: int
    size: int
    rendezvous: str  # the group's store (group.rendezvous_path)
    model_dir: str
    config: EngineConfig
    device: str
    dtype: Optional[str]
    attention_backend: str
    num_threads: int
    parent_pid: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from rank 0's (cuda:r under Serve, which reserved the
    replica's GPUs; from cuda:N given one), else the CPU."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


class TensorParallelWorkers:
    """Rank 0's handle on the worker processes and the SLO order board they read."""

    def __init__(self, size: int, model_dir: str, config: EngineConfig, device: torch.device,
                 dtype: Optional[str], attention_backend: str):
        context = multiprocessing.get_context("spawn")
        self.size = size
        self.board = context.RawValue("q", -1)  # the step id the latest SLO order names
        self._rendezvous = path = rendezvous_path()
        store = rendezvous_store(size, path)
        self.timeout_s = config.tensor_parallel_timeout_s
        self._connections = []
        # Each connection's socket (its own descriptor), written to without blocking (_write_within).
        self._sockets: list[socket.socket] = []
        # Per worker: a write to it gave up part way, so its pipe holds a partial message.
        self._broken: list[bool] = []
        self._processes = []
        for rank in range(1, size):
            spec = WorkerSpec(rank, size, path, str(model_dir), config, str(rank_device(device, rank)), dtype,
                              attention_backend, torch.get_num_threads(), os.getpid())
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, theirs, self.board),
                                      name=f"tp-rank-{rank}", daemon=True)
            process.start()
            theirs.close()
            self._connections.append(ours)
            self._sockets.append(socket.fromfd(ours.fileno(), socket.AF_UNIX, socket.SOCK_STREAM))
            self._broken.append(False)
            self._processes.append(process)
        self._store = store  # the workers' rendezvous; kept for the group's lifetime
        # Stops the workers when this handle goes away without shutdown() (an engine whose own
        # start failed after spawning them), as shutdown() does.
        self._stop = weakref.finalize(self, _stop_workers, self._sockets, self._broken, self._processes, path,
                                      self.timeout_s)
        # The control group (the SLO vote's) only where the policy votes, as the workers decide.
        self.tp = self._join(store, device, config.tensor_parallel_timeout_s,
                             votes=config.scheduling_policy == "slo")

    def _join(self, store, device: torch.device, timeout_s: float, votes: bool) -> TensorParallel:
        """Rank 0 joins the group, watching the workers meanwhile: one that exits before it
        joins (killed, or its device refused it) fails the start at once, naming its rank,
        instead of after the rendezvous timeout.

        Rank 0 joins only once every worker has said it is about to (ARRIVED_KEY): joining
        blocks in torch until every rank has joined or the rendezvous times out, so a join
        begun beside a worker killed as it started was left blocked in its thread for 120 s
        after the start had failed, and returning into a finalizing interpreter it aborted the
        process (SIGABRT, after a test run had passed)."""
        self._await_arrivals(store)
        joined: dict[str, Any] = {}
        # A thread starts on cuda:0, whatever device its process made current.
        index = (device.index if device.index is not None else torch.cuda.current_device()
                 ) if device.type == "cuda" else None

        def join() -> None:
            try:
                if index is not None:
                    torch.cuda.set_device(index)
                joined["group"] = join_group(store, 0, self.size, device, timeout_s,
                                             control="auto" if votes else "none")
            except BaseException as error:  # noqa: BLE001 - re-raised on the starting thread
                joined["error"] = error

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            try:
                self.check_alive()
            except TensorParallelDead:
                if thread.is_alive():
                    self._stop()
                    raise
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    def _await_arrivals(self, store) -> None:
        keys = [ARRIVED_KEY.format(rank=rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while not store.check(keys):
            try:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TensorParallelDead(f"tensor-parallel workers did not reach the rendezvous within "
                                             f"{RENDEZVOUS_TIMEOUT_S:.0f} s")
            except TensorParallelDead:
                self._stop()
                raise
            time.sleep(ARRIVAL_POLL_S)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def check_alive(self) -> None:
        check_workers_alive(self._processes)

    def send(self, message: Any) -> None:
        """`message` to every worker (a step, a step's block copies, a question), as
        Connection.send frames it; TensorParallelDead naming the rank when a worker is gone or
        has not taken it within the collective timeout (hung, or stopped: its pipe full)."""
        self.check_alive()
        frame = _frame(message)
        deadline = time.monotonic() + self.timeout_s
        for index, sock in enumerate(self._sockets):
            rank = index + 1
            if self._broken[index]:
                raise TensorParallelDead(f"tensor-parallel rank {rank}: its pipe holds a message cut short")
            try:
                sent = _write_within(sock, frame, deadline)
            except OSError as error:  # BrokenPipeError, ConnectionResetError: it is gone
                raise TensorParallelDead(f"tensor-parallel rank {rank}: cannot send it a step: {error}") from error
            if not sent:
                self._broken[index] = True
                raise TensorParallelDead(
                    f"tensor-parallel rank {rank} (pid {self._processes[index].pid}) took no message for "
                    f"{self.timeout_s:g} s (tensor_parallel_timeout_s): hung or stopped")

    def wait_ready(self) -> None:
        """Until every worker has loaded its shard and built its runner (rank 0's first step
        would otherwise spend the collective timeout waiting for a rank still loading); a
        worker that failed to start raises here, with its error."""
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        for rank, (connection, process) in enumerate(zip(self._connections, self._processes), start=1):
            while not connection.poll(0.1):
                if process.exitcode is not None or time.monotonic() > deadline:
                    raise TensorParallelDead(f"tensor-parallel rank {rank} did not start (exit code {process.exitcode})")
            status, detail = connection.recv()
            if status != "ready":
                raise TensorParallelDead(f"tensor-parallel rank {rank} failed to start: {detail}")

    def call(self, request: str) -> list[Any]:
        """Ask every worker a question between steps (tests and tools): their answers in rank order."""
        self.send(request)
        answers = []
        for rank, connection in enumerate(self._connections, start=1):
            if not connection.poll(RENDEZVOUS_TIMEOUT_S):
                raise TensorParallelDead(f"tensor-parallel rank {rank} did not answer {request!r}")
            answers.append(connection.recv())
        return answers

    def abandon(self) -> None:
        """The workers wait in a collective no later step can meet: shutdown kills them at once
        rather than waiting for them to take its stop message (they never would)."""
        self._broken[:] = [True] * len(self._broken)

    def shutdown(self) -> None:
        self._stop()


def check_workers_alive(processes) -> None:
    """TensorParallelDead naming the first of `processes` (ranks 1..N-1, in order) that exited."""
    for rank, process in enumerate(processes, start=1):
        if process.exitcode is not None:
            raise TensorParallelDead(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                                     f"{process.exitcode}")


def wait_watching_workers(done: Callable[[], bool], check_workers: Callable[[], None],
                          check_every_s: float = STEP_WORKER_CHECK_S) -> None:
    """Return once `done()`, asked again after each os.sched_yield() (never a sleep); meanwhile
    `check_workers()` every `check_every_s`, which raises (TensorParallelDead) for a dead
    worker: a wait on the device that a dead peer would otherwise stretch to NCCL's watchdog
    timeout."""
    next_check = time.monotonic()
    while not done():
        now = time.monotonic()
        if now >= next_check:
            check_workers()
            next_check = now + check_every_s
        os.sched_yield()


class _WatchedEvent:
    """A step's CUDA event (StepInFlight.done) whose synchronize() watches the workers."""

    def __init__(self, event: torch.cuda.Event, check_workers: Callable[[], None]):
        self.event, self.check_workers = event, check_workers

    def synchronize(self) -> None:
        wait_watching_workers(self.event.query, self.check_workers)


def _frame(message: Any) -> tuple[bytes, memoryview]:
    """`message` as Connection.send frames it, for the worker's Connection.recv: its pickle's
    length (4 bytes, big-endian; past 2 GiB -1 then 8 bytes), then the pickle."""
    payload = ForkingPickler.dumps(message)
    size = len(payload)
    return (struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)), payload


def _write_within(sock: socket.socket, buffers, deadline: float) -> bool:
    """Write `buffers` in order without blocking, waiting for room in the socket until
    `deadline` (time.monotonic()); False when it came first, part of them perhaps written.
    One sendmsg when they fit, as a step's message does unless the worker is behind."""
    views = [memoryview(buffer) for buffer in buffers]
    poller = None
    while True:
        try:
            sent = sock.sendmsg(views, (), _SEND_FLAGS)
        except BlockingIOError:
            sent = 0
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if not views:
            return True
        views[0] = views[0][sent:]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if poller is None:
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
        poller.poll(max(1, int(remaining * 1000)))


def _stop_workers(sockets: list[socket.socket], broken: list[bool], processes, rendezvous: str,
                  timeout_s: float) -> None:
    """Each worker reads None and returns; one that does not take it within the collective
    timeout (hung, stopped), whose pipe holds a message cut short, or that waits in a collective
    no step can meet (TensorParallelWorkers.abandon), is killed at once."""
    remove_rendezvous(rendezvous)
    frame = _frame(None)
    deadline = time.monotonic() + timeout_s
    unreachable = set()
    for index, sock in enumerate(sockets):
        try:
            if broken[index] or not _write_within(sock, frame, deadline):
                unreachable.add(index)
        except OSError:
            pass  # it is gone
    for index, process in enumerate(processes):
        if index in unreachable:
            process.kill()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    for sock in sockets:
        sock.close()


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: the one-device runner, plus shipping each step to the workers
    and broadcasting the sampled ids. With CUDA graphs every rank captures the same decode
    ladder at start, each its own collectives inside (parallel/graphs.py), and replays the
    size rank 0's plan names."""

    def __init__(self, model, model_config: ModelConfig, config: EngineConfig, device: torch.device,
                 workers: TensorParallelWorkers, *, cuda_graphs: bool = False):
        """cuda_graphs: this rank's use_cuda_graphs; the ranks capture only if all would."""
        self.workers: Optional[TensorParallelWorkers] = None  # set once every rank has its runner
        try:
            cuda_graphs = agree_on_decode_graphs(workers.tp, cuda_graphs, capture_sizes(
                config.max_num_seqs, config.max_num_batched_tokens), device)
            # With graphs, every rank captures now, the workers as they build their runners.
            super().__init__(model, model_config, config, device, cuda_graphs=cuda_graphs)
        except TensorParallelDead:
            workers.wait_ready()  # a worker that failed to start says why
            raise
        workers.wait_ready()
        self.workers = workers
        self.tp = workers.tp
        self._step_id = -1  # of the step being launched
        # This step's block-table changes past the staged buffer, sent to the workers with it.
        self._overflow: list[tuple[np.ndarray, np.ndarray]] = []
        # A step shipped to the workers that rank 0 has not carried through its collectives
        # (the forward's all-reduces, the sampled ids' broadcast): a failure then leaves them
        # waiting in one, and the next step would meet it out of step.
        self.workers_mid_step = False

    def check_recoverable(self) -> None:
        """After a failed step, before the engine serves on: TensorParallelDead when the
        workers are stuck mid-step, since no later step could meet them (they would wait out
        the collective timeout, then fail it anyway)."""
        if self.workers_mid_step:
            self.workers.abandon()  # stuck in the step's broadcast: stopping them waits for nothing
            raise TensorParallelDead("a step failed on rank 0 while the other ranks were in it: the ranks are out "
                                     "of step")

    def enable_decode_padding(self) -> None:
        """Pad decode-only steps to the graph ladder on every rank: each runs the padded pass
        (what a captured decode graph replays, collectives included) on the same rows. Graph
        capture turns it on at start on every rank; on its own it runs the pass eagerly (CPU tests)."""
        super().enable_decode_padding()
        if self.workers is not None:  # after start: the workers pad too (during it, each rank pads itself)
            self.workers.call("enable_decode_padding")

    def launch(self, scheduler_output) -> StepInFlight:
        self._step_id = scheduler_output.step_id
        if scheduler_output.block_copies is not None:  # every rank swaps its shard (even in a step that runs nothing)
            self.workers.send(scheduler_output.block_copies)
        try:
            in_flight = super().launch(scheduler_output)
        except StepAborted:  # every rank unwound at the same layer
            self.workers_mid_step = False
            raise
        if self.workers_mid_step and not any(entry.samples for entry in scheduler_output.scheduled):
            self.workers_mid_step = False  # no ids to broadcast: the workers are done with the forward
        return in_flight

    def _prepare(self, scheduled, graphable: bool) -> _StepPlan:
        self._overflow = []
        plan = super()._prepare(scheduled, graphable)
        # A step is graphable exactly when it may not be aborted (launch): the workers vote
        # on the same steps rank 0 does, and never on one padded for a graph.
        self.workers.send(StepMessage(self._step_id, not graphable, plan, self.staged.last_sent(), self._overflow))
        self.workers_mid_step = True
        return plan

    def _apply_unstaged_changes(self, flat_index: np.ndarray, block_ids: np.ndarray) -> None:
        # The host's own arrays for the workers (reading the device copies back would wait for
        # the step in flight).
        self._overflow.append((np.array(flat_index), np.array(block_ids)))
        super()._apply_unstaged_changes(flat_index, block_ids)

    def _send_sampled(self, step, token_ids, logprobs, top_token_ids, top_logprobs) -> StepInFlight:
        self.tp.broadcast(token_ids.contiguous(), src=0)
        self.workers_mid_step = False
        in_flight = super()._send_sampled(step, token_ids, logprobs, top_token_ids, top_logprobs)
        if in_flight.done is not None:  # NCCL: the step's event completes only once every rank met its collectives
            in_flight.done = _WatchedEvent(in_flight.done, self.workers.check_alive)
        return in_flight

    def _wait_for_device(self, event: torch.cuda.Event) -> None:
        # The pacing of an abortable step (ModelRunner._layer_check). The layers it waits for
        # hold NCCL all-reduces a killed worker never finishes: watch the workers, as the wait
        # for a step's tokens does. (A hung worker's device still runs what it launched, which
        # covers those layers, since it cast the vote before the layer before; the next vote
        # then fails after the collective timeout.)
        wait_watching_workers(event.query, self.workers.check_alive)

    def _send_prompt_logprobs(self, rows, hidden):
        # Their logits are gathers (and a prefill chunk that samples nothing waits on this event
        # alone): a dead worker must not hold rank 0 until NCCL's watchdog either.
        in_flight = super()._send_prompt_logprobs(rows, hidden)
        if in_flight.done is not None:
            in_flight.done = _WatchedEvent(in_flight.done, self.workers.check_alive)
        return in_flight


# ---- the worker process -------------------------------------------------------------------

def worker_main(spec: WorkerSpec, connection, board) -> None:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp-rank-{spec.rank} %(name)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and every default allocation on this rank's GPU
    store = rendezvous_store(spec.size, spec.rendezvous)
    store.set(ARRIVED_KEY.format(rank=spec.rank), b"1")  # rank 0 joins once every worker is here
    tp = join_group(store, spec.rank, spec.size, device, spec.config.tensor_parallel_timeout_s,
                    control="auto" if spec.config.scheduling_policy == "slo" else "none")
    try:
        runner, vote, model_config, config = _build_rank(spec, tp, device, board)
    except Exception as error:
        logger.exception("failed to start")
        connection.send(("failed", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ready", None))
    worker = _Worker(runner, tp, vote)
    if config.num_host_kv_blocks:  # rank 0's engine measures them now, with every rank
        try:
            preemption_costs(runner.model, model_config, config, device, runner.kv_swap, tp)
        except TensorParallelDead:
            logger.exception("a peer died; exiting")
            os._exit(1)
    # As rank 0's engine-core process does once built: a rank's full collection scanned the
    # model's modules and everything imported (~310k objects, ~210 ms on a 2-core VM), and in
    # the next collective every other rank waits for it.
    freeze_startup_heap()
    with torch.inference_mode():
        while True:
            while not connection.poll(PARENT_WATCH_INTERVAL_S):
                if os.getppid() != spec.parent_pid:
                    _exit_now()  # rank 0 is gone
            try:
                message = connection.recv()
            except EOFError:
                _exit_now()
            if message is None:
                return
            if isinstance(message, str):
                connection.send(worker.answer(message))
                continue
            try:
                worker.run(message)
            except TensorParallelDead:
                logger.exception("a peer died; exiting")
                os._exit(1)


def _exit_now() -> None:
    """Rank 0 is gone: exit at once, freeing the device, without the interpreter's teardown of
    torch (seconds on a busy host; nothing there needs flushing)."""
    logger.info("rank 0 is gone; exiting")
    os._exit(0)


def _build_rank(spec: WorkerSpec, tp: TensorParallel, device: torch.device, board
                ) -> tuple[ModelRunner, WorkerVote, ModelConfig, EngineConfig]:
    model, model_config = load_model(spec.model_dir, dtype=spec.dtype, device=device,
                                     attention_backend=spec.attention_backend, fused_ops=spec.config.fused_ops, tp=tp)
    # Decided as rank 0's engine decides it, from the same config and model (agreeing with the
    # other ranks on a profiled pool): the same pool shape.
    config = resolve_rank_config(spec.config, model, model_config, device, tp)
    # As rank 0's TensorParallelRunner decides, at the same point of the start (one collective).
    cuda_graphs = agree_on_decode_graphs(
        tp, use_cuda_graphs(device, config.enforce_eager, model.attn_backend.supports_cuda_graphs),
        capture_sizes(config.max_num_seqs, config.max_num_batched_tokens), device)
    runner = ModelRunner(model, model_config, config, device, cuda_graphs=cuda_graphs)  # captures with rank 0's
    max_abort_layer = int(config.slo_abort_max_layer_fraction * model_config.num_hidden_layers)
    vote = WorkerVote(tp, board, max_abort_layer)
    runner.step_abort = vote
    # No pacing here: a worker reaches layer L's launches only through vote L, which waits for
    # rank 0's host at that check, its device already past layer L - 2 (and the collectives
    # keep the devices in step). A worker waiting on its device for an all-reduce a dead rank 0
    # never joins would hold its GPU until NCCL's watchdog; in the gloo vote it fails at once.
    runner.paces_layers = False
    return runner, vote, model_config, config


class _Worker:
    def __init__(self, runner: ModelRunner, tp: TensorParallel, vote: WorkerVote):
        self.runner, self.tp, self.vote = runner, tp, vote
        self.num_steps = 0
        self.num_padded_decode_steps = 0
        # The padded size of each of the latest padded decode steps, in order (tests and tools
        # check the ranks replayed the same sizes; num_padded_decode_steps counts them all).
        self.graph_sizes: collections.deque[int] = collections.deque(maxlen=RECENT_GRAPH_SIZES)

    def answer(self, question: str) -> Any:
        if question == "enable_decode_padding":
            self.runner.enable_decode_padding()
            return None
        if question == "stats":
            kv_swap = self.runner.kv_swap
            runner = self.runner
            return {"steps": self.num_steps, "aborts": list(self.vote.aborts), "votes": self.vote.ballot.num_votes,
                    "padded_decode_steps": self.num_padded_decode_steps, "graph_sizes": list(self.graph_sizes),
                    "cuda_graphs": runner.graphs is not None, "decode_sizes": list(runner.decode_sizes),
                    "capture_order": list(runner.graphs.captured) if runner.graphs is not None else [],
                    "num_kv_blocks": self.runner.kv_caches[0][0].shape[0],
                    "gc_frozen_objects": gc.get_freeze_count(), "gc_young_threshold": gc.get_threshold()[0],
                    "swapped_out_blocks": kv_swap.swapped_out_blocks if kv_swap is not None else 0,
                    "swapped_in_blocks": kv_swap.swapped_in_blocks if kv_swap is not None else 0}
        raise ValueError(f"unknown question {question!r}")

    def run(self, message: StepMessage | BlockCopies) -> None:
        runner = self.runner
        if isinstance(message, BlockCopies):  # this rank's shard of the blocks, before the step that reads them
            runner.kv_swap.copy(message)
            return
        runner.staged.receive(message.staged)
        for flat_index, block_ids in message.overflow_changes:
            runner.rows.block_tables.apply_on_device(torch.from_numpy(flat_index).to(runner.device),
                                                     torch.from_numpy(block_ids).to(runner.device))
        plan = message.plan
        self.num_steps += 1
        try:
            hidden = runner._forward(plan, runner._layer_check(message.step_id) if message.abortable else None)
        except StepAborted:
            return  # every rank unwound at this layer; rank 0 rolls the step back
        if plan.prompt_logprobs is not None:  # this rank's vocabulary blocks, for rank 0's gathers
            for _ in runner.prompt_logprob_logits(plan.prompt_logprobs, hidden):
                pass  # rank 0 alone takes their logprobs
        num_samples = len(plan.sampling_seqs)
        if not num_samples:
            return
        if hidden is None:  # a padded decode pass (a graph replayed, or run eagerly): it gathered every row's logits
            self.num_padded_decode_steps += 1
            self.graph_sizes.append(plan.graph_size)
        else:
            runner.logits_of(plan, hidden)  # this rank's vocabulary block, for rank 0's gather
        token_ids = torch.empty(num_samples, dtype=torch.int64, device=runner.device)
        self.tp.broadcast(token_ids, src=0)
        runner.keep_sampled(token_ids)


def start_tensor_parallel(config: EngineConfig, model_dir, device: torch.device, dtype: Optional[str],
                          attention_backend: str) -> Optional[TensorParallelWorkers]:
    """The workers of a tensor-parallel engine (None at size 1), after checking at start, in one
    line naming tensor_parallel_size, that the model divides among the ranks."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    from replica.model.registry import check_tensor_parallel

    check_tensor_parallel(Path(model_dir), size)
    if device.type == "cuda" and (last := rank_device(device, size - 1).index) >= torch.cuda.device_count():
        raise ConfigError(f"tensor_parallel_size: {size} ranks from {device} need up to cuda:{last}; this host "
                          f"shows {torch.cuda.device_count()} CUDA devices")
    return TensorParallelWorkers(size, model_dir, config, device, dtype, attention_backend)
