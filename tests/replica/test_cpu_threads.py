"""Large CPU steps borrow idle cores (replica/executor/cpu_threads.py): the decision from the
kernel's runnable-thread count, the CPUs a process may use, and the engine-core process's
wiring: under Serve its base is the one thread Ray's reservation gives it, and a long prefill
ran on that one core while the other idled (issue 24)."""

from __future__ import annotations

import asyncio
import os
import random

import torch

from replica.config import EngineConfig, make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.executor import cpu_threads
from replica.config import container_cpu_quota
from replica.executor.cpu_threads import StepThreads, physical_cores, runnable_threads
from replica.front.async_engine import AsyncEngine


class Reads:
    """A runnable-thread count that replays `values` (the last one repeats)."""

    def __init__(self, *values):
        self.values = list(values)
        self.calls = 0

    def __call__(self):
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value


def threads(runnable, base=1, limit=2, min_tokens=256, **options) -> tuple[StepThreads, list[int]]:
    applied: list[int] = []
    return StepThreads(min_tokens, base, limit, runnable=runnable, set_threads=applied.append,
                       sleep=lambda s: None, **options), applied


def test_a_small_step_keeps_the_base_without_reading_the_machine():
    reads = Reads(1)
    step_threads, applied = threads(reads)
    assert step_threads.before_step(255) == 1
    assert reads.calls == 0 and applied == []


def test_a_large_step_takes_every_core_nothing_else_runs_on_and_gives_them_back_after():
    step_threads, applied = threads(Reads(1))  # only the reader itself is runnable
    assert step_threads.before_step(1250) == 2
    assert step_threads.before_step(1) == 1  # the decode step after the prefill
    assert step_threads.before_step(1) == 1
    assert applied == [2, 1]  # set only when it changes
    assert step_threads.borrowed_steps == 1


def test_a_busy_neighbour_keeps_a_large_step_on_the_base():
    # The other replica's engine core computes: runnable at every read.
    step_threads, applied = threads(Reads(2))
    assert step_threads.before_step(2048) == 1 and applied == []


def test_a_thread_that_runs_only_for_a_moment_does_not_count():
    # A front or a proxy handling one message is runnable at one read of five, not at all of them.
    step_threads, _ = threads(Reads(2, 3, 1, 2, 2))
    assert step_threads.threads_for(1250) == 2


def test_borrowing_stops_at_the_usable_cores_and_never_goes_below_the_base():
    assert threads(Reads(1), base=2, limit=8)[0].threads_for(4096) == 8
    assert threads(Reads(4), base=2, limit=8)[0].threads_for(4096) == 5  # three others busy
    assert threads(Reads(20), base=2, limit=8)[0].threads_for(4096) == 2


def test_where_the_machine_cannot_be_read_every_step_keeps_the_base():
    assert threads(Reads(None))[0].threads_for(4096) == 1


def test_nothing_to_borrow_when_torch_already_has_every_usable_core(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: torch.get_num_threads())
    assert StepThreads.for_this_process(256) is None
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: torch.get_num_threads() + 1)
    assert StepThreads.for_this_process(None) is None  # switched off
    borrowing = StepThreads.for_this_process(256)
    assert (borrowing.base, borrowing.limit, borrowing.min_tokens) == (torch.get_num_threads(),
                                                                        torch.get_num_threads() + 1, 256)


def test_the_machine_readers(tmp_path):
    (tmp_path / "loadavg").write_text("5.36 5.08 3.21 5/113 14195\n")
    assert runnable_threads(str(tmp_path / "loadavg")) == 5
    assert runnable_threads(str(tmp_path / "absent")) is None
    (tmp_path / "self_cgroup").write_text("0::/\n")
    (tmp_path / "fs").mkdir()
    (tmp_path / "fs" / "cpu.max").write_text("150000 100000\n")
    assert container_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "self_cgroup")) == 1.5
    (tmp_path / "fs" / "cpu.max").write_text("max 100000\n")
    assert container_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "self_cgroup")) is None
    # A nested cgroup: the lowest quota of it and its ancestors.
    (tmp_path / "self_cgroup").write_text("0::/slice/replica\n")
    (tmp_path / "fs" / "slice" / "replica").mkdir(parents=True)
    (tmp_path / "fs" / "slice" / "cpu.max").write_text("100000 100000\n")
    (tmp_path / "fs" / "slice" / "replica" / "cpu.max").write_text("300000 100000\n")
    assert container_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "self_cgroup")) == 1.0
    # Four logical CPUs, two hyperthreads on each of two cores.
    for cpu, core in enumerate((0, 0, 1, 1)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_id").write_text(f"{core}\n")
        (topology / "physical_package_id").write_text("0\n")
    assert physical_cores({0, 1, 2, 3}, str(tmp_path)) == 2
    assert physical_cores({0, 2}, str(tmp_path)) == 2
    assert physical_cores({0, 1, 7}, str(tmp_path)) == 3  # cpu7 unreadable: logical CPUs counted


def test_the_default_and_off():
    assert EngineConfig().borrow_idle_cpus_min_tokens == 256
    assert make_engine_config(borrow_idle_cpus_min_tokens=0).borrow_idle_cpus_min_tokens == 0


def test_greedy_output_does_not_depend_on_the_threads_a_step_borrowed():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(length)] for length in (5, 40, 70, 130)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    config = make_engine_config(max_num_batched_tokens=64, borrow_idle_cpus_min_tokens=32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = LLMEngine(config, "builtin", device="cpu").generate(prompts, params)
        engine = LLMEngine(config, "builtin", device="cpu")
        engine.step_threads, applied = threads(Reads(1), min_tokens=32)
        applied_threads = engine.step_threads._set_threads
        engine.step_threads._set_threads = lambda count: (applied_threads(count), torch.set_num_threads(count))
        assert engine.generate(prompts, params) == expected
        assert engine.step_threads.borrowed_steps >= 2 and applied[-1] == 1  # prefill chunks borrowed, decode gave back
    finally:
        torch.set_num_threads(previous)


THREADS_LOG_ENV = "HEADROOM_TEST_THREADS_LOG"


class ThreadsProbeEngine(LLMEngine):
    """Engine factory for the engine-core process: a machine where nothing else runs and two
    cores are usable; appends "tokens threads" for every step it launches."""

    def __init__(self, *args, **kwargs):
        cpu_threads.runnable_threads = lambda: 1
        cpu_threads.usable_cpus = lambda: 2
        super().__init__(*args, **kwargs)

    def _launch(self, scheduler_output):
        launched = super()._launch(scheduler_output)
        if not scheduler_output.is_empty:
            with open(os.environ[THREADS_LOG_ENV], "a") as log:
                log.write(f"{scheduler_output.num_scheduled_tokens} {torch.get_num_threads()}\n")
        return launched


def test_the_engine_core_process_with_one_reserved_thread_borrows_an_idle_core_for_a_long_prefill(
        tmp_path, monkeypatch):
    threads_log = tmp_path / "threads.log"
    monkeypatch.setenv(THREADS_LOG_ENV, str(threads_log))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray starts a replica that reserved one CPU
    config = make_engine_config(max_model_len=512, borrow_idle_cpus_min_tokens=128)

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu",
                                         engine_factory=f"{__name__}:ThreadsProbeEngine")
        try:
            stream = front.add_request(list(range(3, 303)), SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True))
            return [output async for output in stream]
        finally:
            await front.shutdown(grace_period_s=0)

    outputs = asyncio.run(scenario())
    assert sum(len(output.new_token_ids) for output in outputs) == 3
    steps = [tuple(map(int, line.split())) for line in threads_log.read_text().splitlines()]
    assert steps == [(300, 2), (1, 1), (1, 1)]  # the prefill on both cores, the decodes on the reserved one
