"""A rank's view of its tensor-parallel group: the collectives the sharded model needs
(all-reduce of row-parallel outputs, all-gather of vocab-parallel logits) and how a model's
heads, MLP and vocabulary divide among the ranks.

Collectives run over torch.distributed (gloo on CPU, NCCL on CUDA) with a timeout, so a rank
whose peer died or hangs raises instead of waiting forever; the executor turns that into
a dead replica (TensorParallelDead). Control collectives, which carry the host's decisions
rather than the model's tensors (the SLO abort vote), run over gloo on CPU tensors (beside
NCCL a second group of the same ranks; on a CPU the model's own), so they never wait on the
device.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from replica.model.config import kv_heads_per_rank  # torch-free: the pre-Ray host-tier check uses it too

if TYPE_CHECKING:  # the model package imports this module
    from replica.model.config import ModelConfig

# How long a rank waits for the others to join the group at start (collectives inside a step
# wait EngineConfig.tensor_parallel_timeout_s).
RENDEZVOUS_TIMEOUT_S = 120.0


class TensorParallelDead(RuntimeError):
    """A rank died or stopped answering: the replica cannot run another step."""


class TensorParallelConfigError(ValueError):
    """A tensor_parallel_size the model cannot be divided by; the message names the field."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size`; `size == 1` is no parallelism (every collective a no-op).

    The group is a process group of its own (not torch.distributed's global default), so one
    process may hold several tensor-parallel engines, as tests do."""

    rank: int = 0
    size: int = 1
    group: Optional[object] = field(default=None, compare=False, repr=False)  # a gloo / NCCL ProcessGroup
    # How long one collective waits for the other ranks (EngineConfig.tensor_parallel_timeout_s;
    # None: the group's own bound).
    timeout: Optional[datetime.timedelta] = None
    # The same ranks' host-side group, gloo on CPU tensors, for control collectives
    # (all_reduce_on_host): beside an NCCL group, a collective on it never waits for the device.
    # On a CPU the model's gloo group itself (join_group's control "auto"); None where nothing
    # votes (control "none").
    control: Optional[object] = field(default=None, compare=False, repr=False)

    def _bound(self, options):
        if self.timeout is not None:
            options.timeout = self.timeout
        return options

    def _run(self, name: str, start) -> None:
        """One collective, as `start()` launches it. On gloo the wait is the host's, and a dead
        or hung peer raises TensorParallelDead here. On NCCL the wait only orders the compute
        stream after the collective and never raises: rank 0, waiting for a step's tokens (or
        pacing an abortable step), watches its workers meanwhile (executor.wait_watching_workers),
        so a dead one raises TensorParallelDead there; otherwise a rank whose peer stopped
        answering is ended by NCCL's watchdog once the collective passes the group's timeout
        (TORCH_NCCL_ASYNC_ERROR_HANDLING's default tears the process down), so the engine core
        dies and its front reports EngineDeadError, as for a killed core: down, not hung, but
        not through this exception."""
        try:
            start().wait()
        except RuntimeError as error:  # gloo: a peer closed its connection, or the timeout passed
            raise TensorParallelDead(f"tensor-parallel rank {self.rank}: {name} failed: {error}") from error

    @functools.cached_property
    def _all_reduce_options(self) -> dict:
        """The options of each reduction this group runs, built once (two per layer per step)."""
        options = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            options[op] = self._bound(dist.AllreduceOptions())
            options[op].reduceOp = op
        return options

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place on every rank; returns the tensor."""
        if self.size > 1:
            options = self._all_reduce_options[op]
            self._run("all_reduce", lambda: self.group.allreduce([tensor], options))
        return tensor

    def all_reduce_on_host(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place on every rank, over the control group: `tensor` is on the CPU, and the
        collective waits for the other ranks' hosts, never for a device. A dead or hung peer
        raises TensorParallelDead here, after the collective's timeout at most, on CUDA too."""
        if self.size > 1:
            if self.control is None:
                raise RuntimeError("no control group: join_group(control='none') (a replica whose policy never votes)")
            options = self._all_reduce_options[op]
            self._run("all_reduce on the host", lambda: self.control.allreduce([tensor], options))
        return tensor

    def min_at_start(self, value: float, device: torch.device) -> float:
        """The smallest of every rank's `value`, on every rank: how the ranks agree at start on
        what one scheduler plans for all of them (the KV pool the tightest device holds, the
        slowest rank's copy bandwidth). A rank may still be loading its shard when another
        arrives, so the wait is bounded as the joining is (RENDEZVOUS_TIMEOUT_S), not per step."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.float64, device=device)
        self._all_reduce_at_start(box, dist.ReduceOp.MIN, "all_reduce(MIN)")
        return box.item()

    def extremes_at_start(self, values: Sequence[int], device: torch.device) -> tuple[list[int], list[int]]:
        """The smallest and the largest of every rank's `values`, element by element, on every
        rank (one all_reduce(MAX) of the values and their negations): how the ranks check at start
        that they agree on something each decided alone. Bounded as min_at_start is."""
        count = len(values)
        if self.size == 1:
            return list(values), list(values)
        box = torch.tensor([*values, *(-value for value in values)], dtype=torch.int64, device=device)
        self._all_reduce_at_start(box, dist.ReduceOp.MAX, "all_reduce(MAX)")
        extremes = box.tolist()
        return [-value for value in extremes[count:]], extremes[:count]

    def _all_reduce_at_start(self, box: torch.Tensor, op, what: str) -> None:
        """`box` reduced in place over every rank, waiting as long as the joining may."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        options.timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        self._run(what, lambda: self.group.allreduce([box], options))

    def all_gather_last_dim(self, tensor: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last dimension, in rank order; with
        `width`, only that many leading columns (the rest, padding, is left out of the one copy).
        One collective into one tensor (all-gather into a tensor, as vLLM gathers): nothing the
        collective itself copies afterwards, so a CUDA graph captures it whole."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        gathered = torch.empty((self.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                               device=tensor.device)
        options = self._bound(distributed_c10d.AllgatherOptions())
        self._run("all_gather", lambda: self.group._allgather_base(gathered, tensor, options))
        parts = list(gathered.view(self.size, *tensor.shape).unbind(0))
        columns = tensor.shape[-1]
        if width is not None and width < columns * self.size:
            parts = [part[..., :max(0, min(columns, width - rank * columns))] for rank, part in enumerate(parts)]
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor = src, 0
            self._bound(options)
            self._run("broadcast", lambda: self.group.broadcast([tensor], options))
        return tensor


NO_TENSOR_PARALLEL = TensorParallel()


# The rendezvous directories: this prefix in the temp directory, each holding its owner's lock
# file (held with flock for the group's lifetime; the kernel releases it when the owner dies).
RENDEZVOUS_PREFIX = "headroom-tp-"
_OWNER_LOCK = "owner.lock"
# The lock on each directory this process made, held until remove_rendezvous (or its death).
_held_locks: dict[str, int] = {}


def rendezvous_path() -> str:
    """Where a new group's ranks meet: a file in a directory of its own only this user may
    enter (every rank is on one node). A TCPStore listened on every interface, whatever host
    it was given, with no authentication: anyone who reached the port could join the group.

    A rank 0 killed outright (the OOM killer, Ray ending the actor) never removes its
    directory, and replicas restart again and again: each new group first removes the
    directories whose owner is gone (remove_stale_rendezvous)."""
    remove_stale_rendezvous()
    directory = tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-")
    # Locked under a name the sweep ignores, then renamed into place: a sweep never sees the
    # lock file unlocked, so never takes a directory being made for a stale one.
    pending = os.path.join(directory, f"{_OWNER_LOCK}.pending")
    lock = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(pending, os.path.join(directory, _OWNER_LOCK))
    _held_locks[directory] = lock
    return os.path.join(directory, "store")


def remove_stale_rendezvous() -> None:
    """Remove each rendezvous directory whose owner's lock can be taken: its owner is dead
    (a lock, unlike a pid, cannot be mistaken for a later process's). One without the lock
    file is left alone (an older version's, or one being made)."""
    parent = tempfile.gettempdir()
    for name in os.listdir(parent):
        if not name.startswith(RENDEZVOUS_PREFIX):
            continue
        directory = os.path.join(parent, name)
        try:
            lock = os.open(os.path.join(directory, _OWNER_LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no lock file, another user's, or removed meanwhile
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner is alive
            os.close(lock)
            continue
        shutil.rmtree(directory, ignore_errors=True)  # holding the lock, so no other sweep races it
        os.close(lock)


def rendezvous_store(size: int, path: str, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> dist.FileStore:
    """A rank's handle on the group's store at `path` (rendezvous_path); the file goes with the
    last handle, the directory with remove_rendezvous."""
    store = dist.FileStore(path, size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def remove_rendezvous(path: str) -> None:
    """The directory of `path` gone, then its owner's lock released (by its owner, rank 0)."""
    directory = os.path.dirname(path)
    shutil.rmtree(directory, ignore_errors=True)
    lock = _held_locks.pop(directory, None)
    if lock is not None:
        os.close(lock)


def join_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
               control: str = "auto") -> TensorParallel:
    """Join the group of `size` ranks meeting at `store` (one node: Serve packs a tensor-parallel
    replica's GPUs on one node, STRICT_PACK), and its control group (every rank must pass the
    same `control`); returns when every rank has joined. Each collective then fails
    (TensorParallelDead) after timeout_s without its peers (on NCCL, see TensorParallel._run).

    The control group, for the SLO vote alone: "auto", a gloo group of its own beside an NCCL
    one, and the model's own group on a CPU (gloo already: a second group's worker threads,
    asleep between votes, made the vote 1-5x slower and noisy there, 0.41-0.48 ms against
    0.49-2.46 ms a layer on the 2-core VM); "separate", a group of its own whatever the device
    (tests: the CUDA path's group on a CPU); "none", none, for a replica that never votes
    (joining a gloo group waits for every rank, which NCCL's joining does not, so rank 0 would
    otherwise load its shard only once the workers had started)."""
    if torch.device(device).type == "cuda":
        # Collectives run inside captured decode graphs (parallel/graphs.py): without the
        # record_stream calls ProcessGroupNCCL otherwise makes on their tensors (graph-pool
        # memory), torch's NCCL all-reduce captures safely (vLLM's finding, vllm#2152). Read
        # when the group is built.
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
        # NCCL's watchdog times each collective by the group's timeout (10 minutes unless set),
        # not by the one a call passes: the start-up's bound (a peer may still be loading its
        # shard) rather than that, as torch's own init_process_group sets it.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=max(RENDEZVOUS_TIMEOUT_S, timeout_s))
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = _gloo_group(store, rank, size)
    # Its keys under a prefix of their own: the two groups meet on one store.
    if control not in ("auto", "separate", "none"):
        raise ValueError(f"control: 'auto', 'separate' or 'none', got {control!r}")
    separate = control == "separate" or (control == "auto" and not isinstance(group, dist.ProcessGroupGloo))
    if size == 1 or control == "none":
        control_group = None
    elif separate:  # its keys under a prefix of their own: the two groups meet on one store
        control_group = _gloo_group(dist.PrefixStore("control/", store), rank, size)
    else:
        control_group = group
    return TensorParallel(rank, size, group, datetime.timedelta(seconds=timeout_s), control=control_group)


def _gloo_group(store: dist.Store, rank: int, size: int) -> dist.ProcessGroupGloo:
    """A gloo group of `size` ranks at `store`. Its timeout bounds the joining; each collective
    passes its own."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    # Gloo's own sockets on loopback (its default device binds the hostname's address).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, options)


def check_divisible(cfg: "ModelConfig", size: int) -> None:
    """Raise TensorParallelConfigError (one line naming tensor_parallel_size) unless the model
    divides among `size` ranks: attention heads and MLP width evenly, and KV heads either evenly
    or (fewer KV heads than ranks) each replicated on size / num_kv_heads ranks. The vocabulary
    need not divide: it is padded (vocab_rows_per_rank)."""
    if size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size: must be >= 1, got {size}")
    problems = []
    if cfg.num_attention_heads % size:
        problems.append(f"{cfg.num_attention_heads} attention heads")
    kv = cfg.num_key_value_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (neither divisible by it nor dividing it)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size {cfg.intermediate_size}")
    if problems:
        raise TensorParallelConfigError(
            f"tensor_parallel_size: {size} does not divide the model's {', '.join(problems)}")


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    """Each rank's block of the vocab-parallel embedding and LM head: the vocabulary padded to a
    multiple of `size` (as vLLM pads it, there to a multiple of 64 first), so a vocabulary such
    as 32,001 (a pad token added to Llama's 32,000) still divides among 2 ranks. The padding
    rows are zero, lie past the last real id (on the last rank or ranks) and are never
    embedded (ids are checked against vocab_size) nor sampled (the logits gather leaves their
    columns out)."""
    return -(-vocab_size // size)


def kv_head_start(cfg: "ModelConfig", rank: int, size: int) -> int:
    """The first KV head rank `rank` holds: its block of heads, or the one it replicates."""
    kv = cfg.num_key_value_heads
    if kv >= size:
        return rank * (kv // size)
    return rank // (size // kv)


def shard_config(cfg: "ModelConfig", size: int) -> "ModelConfig":
    """The model as one rank of `size` builds it: its share of the attention heads, KV heads
    and MLP width; the vocabulary stays whole (embedding and LM head divide it themselves,
    and the logits are gathered whole before sampling)."""
    if size == 1:
        return cfg
    check_divisible(cfg, size)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=kv_heads_per_rank(cfg, size),
                               intermediate_size=cfg.intermediate_size // size)

