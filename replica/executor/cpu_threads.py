"""How many torch intra-op threads a CPU step runs on: large steps borrow the cores nothing
else is using at that moment.

Under Ray Serve each replica reserves one CPU (`replicas.num_cpus`), so Ray starts it with
OMP_NUM_THREADS=1 and its engine core inherits one intra-op thread. Two replicas on a 2-core
machine then prefill a lone long prompt on one core while the other idles: `headroom serve`'s
TTFT of a 1,250-token prompt was ~2.8 s, the in-process prefill on both cores ~1.6 s, and
everything outside the engine's step ~25 ms (issue 24, docs/benchmarks.md). Giving every
step all cores is no answer: extra threads pay off only where there is idle silicon and work
coarse enough to split (a passive OpenMP worker is woken at each parallel region, hundreds per
step, and a busy neighbour makes each wake-up wait for a core): on the same VM under load two
threads made decode and short prefill steps slower, not faster.

So a step of at least `EngineConfig.borrow_idle_cpus_min_tokens` tokens runs on its base
threads plus the cores that no other thread on the machine was running on over a few reads
of the kernel's count of runnable threads (`/proc/loadavg`), up to the CPUs this process may
use (affinity, physical cores, the cgroup's quota); every other step, and every step where
that count is unreadable, runs on the base (torch's count at engine start: Ray's reservation,
OMP_NUM_THREADS or torch's default). A lone replica's long prefill gets both cores; two busy
replicas stay on one core each, as reserved. /proc/loadavg counts every thread of the kernel
it reads, in a container the whole host's: on a shared host a step borrows only while the host
has idle cores, never less than its base.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional

from replica.config import container_cpu_quota

# Reads of the runnable-thread count per decision, and the pause between them: a busy engine
# core (a thread that computes) is runnable at every read, a front or proxy handling a message
# at few of them; the fewest runnable threads seen is what really competes for the cores.
RUNNABLE_READS = 5
RUNNABLE_READ_PAUSE_S = 0.001


def spin(seconds: float) -> None:
    """Wait without sleeping: a core deciding is itself runnable throughout, so another core
    deciding at the same moment (a burst fanned out to both replicas) sees it and stays on its
    base, instead of both borrowing the same idle core."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def runnable_threads(path: str = "/proc/loadavg") -> Optional[int]:
    """Threads runnable on the machine right now, the reader included (the fourth field of
    /proc/loadavg, "runnable/total"); None where there is no such file."""
    try:
        with open(path) as file:
            return int(file.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def physical_cores(cpus: set[int], topology: str = "/sys/devices/system/cpu") -> int:
    """How many physical cores `cpus` (logical CPU ids) span: hyperthread siblings count once,
    as torch's own default thread count does. len(cpus) where the topology is unreadable."""
    cores = set()
    for cpu in cpus:
        try:
            with open(f"{topology}/cpu{cpu}/topology/core_id") as core, \
                    open(f"{topology}/cpu{cpu}/topology/physical_package_id") as package:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def usable_cpus() -> int:
    """The cores this process may compute on: its affinity, hyperthreads counted once, within its
    cgroup's CPU quota."""
    try:
        cpus = set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = set(range(os.cpu_count() or 1))
    count = physical_cores(cpus)
    quota = container_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


class StepThreads:
    """Sets torch's intra-op thread count before each step (only when it changes: with passive
    OpenMP waits a change costs nothing measurable)."""

    def __init__(self, min_tokens: int, base: int, limit: int,
                 runnable: Optional[Callable[[], Optional[int]]] = None,
                 set_threads: Optional[Callable[[int], None]] = None,
                 reads: int = RUNNABLE_READS, pause_s: float = RUNNABLE_READ_PAUSE_S,
                 sleep: Callable[[float], None] = spin):
        self.min_tokens = min_tokens
        self.base = base
        self.limit = limit
        self._runnable = runnable or runnable_threads
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._reads = reads
        self._pause_s = pause_s
        self._sleep = sleep
        self.current = base
        self.borrowed_steps = 0  # steps that ran on more than the base (tests, logs)

    @classmethod
    def for_this_process(cls, min_tokens: Optional[int]) -> Optional["StepThreads"]:
        """None when nothing can be borrowed: the feature off, or torch already on every usable core."""
        if min_tokens is None:
            return None
        import torch

        base = torch.get_num_threads()
        limit = usable_cpus()
        if limit <= base:
            return None
        return cls(min_tokens, base, limit)

    def idle_cores(self) -> Optional[int]:
        """Cores no other thread used at any of a few reads (this thread, running, is not counted)."""
        fewest = None
        for index in range(self._reads):
            if index:
                self._sleep(self._pause_s)
            running = self._runnable()
            if running is None:
                return None
            fewest = running if fewest is None else min(fewest, running)
        return max(0, self.limit - (fewest - 1))

    def threads_for(self, num_tokens: int) -> int:
        if num_tokens < self.min_tokens:
            return self.base
        idle = self.idle_cores()
        if idle is None:
            return self.base
        return min(self.limit, max(self.base, idle))

    def before_step(self, num_tokens: int) -> int:
        """Set the thread count for a step of `num_tokens` scheduled tokens; returns it."""
        threads = self.threads_for(num_tokens)
        if threads != self.current:
            self._set_threads(threads)
            self.current = threads
        if threads > self.base:
            self.borrowed_steps += 1
        return threads
