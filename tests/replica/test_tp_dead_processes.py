"""What a tensor-parallel process that dies outright (SIGKILL: the OOM killer, Ray ending the
actor) leaves behind, with real processes killed: a dead rank 0's rendezvous directory is
removed by the next group's creation, a live one's never; rank 0 waiting on the device for a
step notices a dead worker within its check interval (NCCL's wait never raises, so without
the watch it waited for NCCL's watchdog). The CUDA event the wait polls in production is
stood in for by a "done?" callable here: this runs on the CPU."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from replica.parallel.executor import check_workers_alive, wait_watching_workers
from replica.parallel.group import (
    RENDEZVOUS_PREFIX, TensorParallelDead, remove_rendezvous, remove_stale_rendezvous, rendezvous_path,
)

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Makes a rendezvous as rank 0 does, says where, and waits to be killed.
OWNER = ("import sys, time\n"
         "from replica.parallel.group import rendezvous_path\n"
         "print(rendezvous_path(), flush=True)\n"
         "time.sleep(600)\n")


def start_owner() -> tuple[subprocess.Popen, str]:
    """A process holding a rendezvous, and its directory."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env)
    return owner, os.path.dirname(owner.stdout.readline().strip())


def test_a_killed_rank_0s_rendezvous_is_removed_by_the_next_group_and_a_live_ones_is_not():
    """It was removed only on a clean shutdown: every SIGKILLed rank 0 left one in /tmp for good."""
    killed, killed_dir = start_owner()
    live, live_dir = start_owner()
    older = tempfile.mkdtemp(prefix=RENDEZVOUS_PREFIX)  # no owner's lock file: cannot tell, so kept
    ours = None
    try:
        assert os.path.isdir(killed_dir) and os.path.isdir(live_dir)
        assert os.path.basename(killed_dir).startswith(f"{RENDEZVOUS_PREFIX}{killed.pid}-")
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        ours = rendezvous_path()
        assert not os.path.exists(killed_dir), "the killed owner's rendezvous outlived it"
        assert os.path.isdir(live_dir) and os.path.isdir(older)
        remove_stale_rendezvous()  # our own, held by this process, is live too
        assert os.path.isdir(os.path.dirname(ours))
        live.send_signal(signal.SIGKILL)
        live.wait(timeout=30)
        remove_stale_rendezvous()
        assert not os.path.exists(live_dir)
    finally:
        for owner in (killed, live):
            owner.kill()
            owner.wait()
            owner.stdout.close()
        shutil.rmtree(older, ignore_errors=True)
        shutil.rmtree(live_dir, ignore_errors=True)
        if ours is not None:
            remove_rendezvous(ours)
    assert not os.path.exists(os.path.dirname(ours))


def _worker() -> None:
    time.sleep(600)


def test_rank_0s_wait_on_the_device_fails_within_the_check_interval_once_a_worker_is_killed():
    """The step never completes (a collective waiting on the dead peer); the wait raises what a
    step on gloo raises for a worker gone, naming its rank, pid and exit code."""
    worker = multiprocessing.get_context("spawn").Process(target=_worker, daemon=True)
    worker.start()
    never_done = threading.Event()
    killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
    try:
        killer.start()
        started = time.monotonic()
        with pytest.raises(TensorParallelDead, match=rf"^tensor-parallel rank 1 \(pid {worker.pid}\) exited with "
                                                     r"code -9$"):
            wait_watching_workers(never_done.is_set, lambda: check_workers_alive([worker]))
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 5, f"rank 0 noticed after {elapsed:.2f} s"
    finally:
        killer.cancel()
        worker.kill()
        worker.join()


def test_rank_0s_wait_yields_the_core_between_asks_and_never_sleeps(monkeypatch):
    """After a 0.5 ms spin every ask was followed by a 0.1 ms sleep, which takes ~0.15-0.2 ms on
    Linux: a step done just after rank 0 asked was seen that late, every step under async
    scheduling. The wait yields the core between asks (os.sched_yield), and sleeps never."""
    from types import SimpleNamespace

    from replica.parallel import executor

    slept, asked, yielded = [], [], []
    monkeypatch.setattr(executor, "time", SimpleNamespace(monotonic=time.monotonic, sleep=slept.append))
    monkeypatch.setattr(executor.os, "sched_yield", lambda: yielded.append(len(asked)))
    done = lambda: asked.append(None) or len(asked) == 20  # noqa: E731
    wait_watching_workers(done, lambda: None)
    assert len(asked) == 20 and slept == [] and yielded == list(range(1, 20))


def test_a_steps_prompt_logprobs_wait_watches_the_workers_and_counts_as_waiting(monkeypatch):
    """A prefill chunk that samples nothing waits on its prompt logprobs' event alone: a plain
    CUDA event under NCCL, so a dead worker held rank 0 until NCCL's watchdog; and that wait
    counted as the step's update time, not as waiting for the device. (Stand-in events: CPU.)"""
    from types import SimpleNamespace

    import torch

    from replica.executor import model_runner
    from replica.parallel.executor import TensorParallelRunner, _WatchedEvent

    class Event:  # done at its third query; synchronize() takes 20 ms
        queries = 0

        def query(self):
            self.queries += 1
            return self.queries >= 3

        def synchronize(self):
            time.sleep(0.02)

    empty = torch.zeros(0)

    def in_flight(event):
        return model_runner._PromptLogprobsInFlight([], empty, empty, None, None, event)

    monkeypatch.setattr(model_runner.ModelRunner, "_send_prompt_logprobs", lambda self, rows, hidden: in_flight(event))
    event, checks = Event(), []
    runner = object.__new__(TensorParallelRunner)  # rank 0's runner, as far as this override needs
    runner.workers = SimpleNamespace(check_alive=lambda: checks.append(None))
    watched = runner._send_prompt_logprobs(None, None)
    assert isinstance(watched.done, _WatchedEvent)
    step = model_runner.StepInFlight([], [], prompt_logprobs=watched)
    assert step.result().prompt_logprobs == {} and event.queries == 3 and checks
    step = model_runner.StepInFlight([], [], prompt_logprobs=in_flight(Event()))
    step.result()
    assert step.wait_s >= 0.02


def test_rank_0s_wait_returns_once_the_step_is_done_while_its_workers_live():
    worker = multiprocessing.get_context("spawn").Process(target=_worker, daemon=True)
    worker.start()
    done = threading.Event()
    try:
        threading.Timer(0.3, done.set).start()
        started = time.monotonic()
        wait_watching_workers(done.is_set, lambda: check_workers_alive([worker]))
        assert 0.3 <= time.monotonic() - started < 5
        assert worker.exitcode is None
    finally:
        worker.kill()
        worker.join()
