"""The engine core in its own process, specified through the front that serves it: an abort
frees a request's blocks within one step, a core that cannot build its engine raises the
engine's own error, a core whose front disappears exits, and a core killed under load fails
every open stream with UNAVAILABLE at once while the server reports NOT_SERVING; the KV
events crossing to the front rebuild exactly the core's prefix cache, the admission mode
acts in the core while its load fields (held admissions, committed KV) reach the front, and
with async scheduling the core's loop overlaps the next step's scheduling with the pass in
flight and streams the same tokens."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.front.async_engine import AsyncEngine
from replica.front.core_client import OPENMP_SHORT_WAIT, OPENMP_WAIT_SETTINGS, child_environment
from replica.errors import EngineDeadError, EngineStepError
from replica.config import ConfigError, make_engine_config
from replica.core.kv_events import KVEventKind
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.core.structured_output import StructuredOutput
from replica.model.builtin import ensure_builtin_model
from replica_harness import RunningReplica, sampling

CONFIG = make_engine_config(max_model_len=256, block_size=16, num_kv_blocks=129)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


async def state_and_load_when(front: AsyncEngine, request_id: str, reflects):
    """The core's view of request_id once it has applied everything the front sent before
    this call (the channel is ordered: queued aborts leave before a utility call), and the
    first load reaching the front that reflects it. Counting load versions from the front's
    side raced: on a busy machine the front reads steps the core finished before the abort
    arrived several at a time, and the first load after the reply may be read before this
    coroutine resumes."""
    state = await front.core.call_utility("request_state", request_id)
    deadline = time.monotonic() + 30
    while not reflects(front.load()) and time.monotonic() < deadline:
        await front.wait_for_load(front.load_version, timeout=deadline - time.monotonic())
    return state, front.load()


def test_an_abort_frees_the_requests_blocks_before_the_cores_next_step():
    async def scenario():
        front = await AsyncEngine.launch(CONFIG, "builtin", device="cpu")
        try:
            # Built before the core said it was ready, not by a first constrained request's step.
            assert await front.core.call_utility("grammar_compiler_ready")
            kept = front.add_request(list(range(3, 40)), LONG, request_id="kept")
            dropped = front.add_request(list(range(50, 90)), LONG, request_id="dropped")
            await dropped.__anext__()
            await kept.__anext__()
            running_before = front.load()
            front.abort("dropped")
            state, load_after = await state_and_load_when(front, "dropped", lambda load: load.num_running == 1)
            rest = [output async for output in dropped]
            return running_before, load_after, state, rest
        finally:
            await front.shutdown(grace_period_s=0)

    before, after, state, rest = asyncio.run(scenario())
    assert before.num_running == 2 and after.num_running == 1
    assert state is None, "the core still holds the aborted request"
    assert after.kv_blocks_free > before.kv_blocks_free + 1  # the dropped request's 3+ blocks came back
    assert rest[-1].finish_reason == "abort"  # the stream ended at once, on the front's side


def test_an_id_aborted_and_added_again_gets_only_its_new_requests_outputs():
    """A client's retry under the id it just cancelled. Added again in the same turn of the
    event loop, the add reached the core before the queued abort, as a duplicate: refused.
    Added a turn later, the steps the core ran before the abort reached it delivered the old
    request's tokens into the new stream (6 tokens of a 5-token request). The new request runs
    under an id of its own in the core; clients see theirs."""
    async def retry(front: AsyncEngine, request_id: str, same_turn: bool):
        first = front.add_request(list(range(3, 40)), LONG, request_id=request_id)
        await first.__anext__()
        front.abort(request_id)
        if not same_turn:
            await asyncio.sleep(0)
        again = front.add_request(list(range(3, 40)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                                  request_id=request_id)
        return [output async for output in first], [output async for output in again]

    async def scenario():
        front = await AsyncEngine.launch(CONFIG, "builtin", device="cpu")
        try:
            return [await retry(front, "same-turn", True), await retry(front, "next-turn", False)]
        finally:
            await front.shutdown(grace_period_s=0)

    for request_id, (first_rest, again) in zip(("same-turn", "next-turn"), asyncio.run(scenario())):
        assert first_rest[-1].finish_reason == "abort" and first_rest[-1].request_id == request_id
        assert again[-1].finish_reason == "length" and again[-1].num_output_tokens == 5, again
        assert sum(len(output.new_token_ids) for output in again) == 5
        assert {output.request_id for output in again} == {request_id}


def test_a_stop_string_matched_in_the_front_ends_the_stream_and_the_core_drops_the_request():
    async def scenario():
        front = await AsyncEngine.launch(CONFIG, "builtin", device="cpu")
        try:
            prompt = front.engine.tokenizer.encode("hello")
            full = [output async for output in front.generate(prompt, SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True))]
            text = "".join(output.text for output in full)
            # Three characters (three tokens of the byte-level vocabulary) first seen past the start.
            cut = next(start for start in range(2, len(text) - 3)
                       if text.index(text[start:start + 3]) == start and "\ufffd" not in text[start:start + 3])
            stopped = [output async for output in front.generate(prompt, SamplingParams(
                max_tokens=200, temperature=0.0, ignore_eos=True, stop=(text[cut:cut + 3],)), request_id="stopped")]
            state, load = await state_and_load_when(front, "stopped", lambda load: load.num_running == 0)
            return text, cut, stopped, state, load
        finally:
            await front.shutdown(grace_period_s=0)

    text, cut, stopped, state, load = asyncio.run(scenario())
    assert "".join(output.text for output in stopped) == text[:cut]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == text[cut:cut + 3]
    assert stopped[-1].num_output_tokens < 40
    # The probe: the core dropped it at once instead of generating on to max_tokens.
    assert state is None and load.num_running == 0


@pytest.mark.parametrize("chosen", [None, ("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000"),
                                    ("KMP_BLOCKTIME", "1")])
def test_the_cores_openmp_threads_spin_briefly_unless_the_environment_chose_a_wait(monkeypatch, chosen):
    # A long-spinning intra-op worker holds a core the front needs, one that sleeps at once is
    # woken through the kernel at every op (docs/benchmarks.md, served vs offline).
    for name in OPENMP_WAIT_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    if chosen is not None:
        monkeypatch.setenv(*chosen)
    environment = child_environment()
    if chosen is None:
        assert OPENMP_SHORT_WAIT == {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}
        assert {name: environment.get(name) for name in OPENMP_WAIT_SETTINGS} == {
            "OMP_WAIT_POLICY": None, **OPENMP_SHORT_WAIT}
    else:
        assert {name: environment.get(name) for name in OPENMP_WAIT_SETTINGS} == {
            name: (chosen[1] if name == chosen[0] else None) for name in OPENMP_WAIT_SETTINGS}


def test_a_core_that_cannot_build_its_engine_raises_the_engines_error_naming_the_field(capfd):
    config = make_engine_config(max_model_len=1 << 20, num_kv_blocks=(1 << 16) + 1)  # past the model's context

    async def scenario():
        launches = [AsyncEngine.launch(config, "builtin", device="cpu")]
        if not torch.cuda.is_available():  # a device the host lacks: torch's traceback at the first tensor
            launches.append(AsyncEngine.launch(CONFIG, "builtin", device="cuda"))
        # Side by side: each core process imports and fails on its own (two cores, half the wait).
        outcomes = await asyncio.gather(*launches, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, AsyncEngine):  # started after all: the test fails below, leaving no core behind
                await outcome.shutdown(grace_period_s=0)
        return outcomes

    errors = asyncio.run(scenario())
    assert isinstance(errors[0], ConfigError) and str(errors[0]).startswith("max_model_len: "), repr(errors[0])
    if len(errors) > 1:
        assert isinstance(errors[1], ConfigError), repr(errors[1])
        assert str(errors[1]).startswith("device: cuda asked for, but this host has no CUDA device"), repr(errors[1])
    assert "Traceback" not in capfd.readouterr().err


def test_a_checkpoint_the_core_cannot_load_is_raised_in_the_front_without_a_traceback(tmp_path, capfd):
    """A model directory the engine cannot load (a config.json of no supported architecture)
    comes back as the loader's error, which the CLI says in one line; the core logged a full
    traceback above that line."""
    for source in ensure_builtin_model().iterdir():  # the built-in model's tokenizer, so the front loads it
        if source.is_file() and source.name != "config.json":
            shutil.copy(source, tmp_path / source.name)
    (tmp_path / "config.json").write_text('{"architectures": ["NotALlama"], "model_type": "not-a-llama"}')

    async def scenario():
        with pytest.raises(ValueError) as raised:
            await AsyncEngine.launch(CONFIG, str(tmp_path), device="cpu")
        return raised.value

    error = asyncio.run(scenario())
    assert type(error).__name__ in ("ModelConfigError", "ModelLoadError", "TokenizerLoadError"), repr(error)
    assert "Traceback" not in capfd.readouterr().err


def test_the_core_exits_when_its_front_goes_away_without_a_word():
    async def scenario():
        front = await AsyncEngine.launch(CONFIG, "builtin", device="cpu")
        front.add_request(list(range(3, 40)), LONG)  # busy: the core notices between steps
        await front.core._channel.close()  # as if the front process had died
        return await asyncio.get_running_loop().run_in_executor(None, front.core.process.wait, 30)

    assert asyncio.run(scenario()) == 0


OVERLAP_LOG_ENV = "HEADROOM_TEST_OVERLAP_LOG"


class OverlapProbeEngine(LLMEngine):
    """Engine factory for the engine-core process: appends a line to $HEADROOM_TEST_OVERLAP_LOG
    for every forward pass it launches while the previous one is still in flight."""

    def _launch(self, scheduler_output):
        overlapped = self._in_flight is not None
        launched = super()._launch(scheduler_output)
        if overlapped and launched is not None:
            with open(os.environ[OVERLAP_LOG_ENV], "a") as log:
                log.write("overlapped\n")
        return launched


async def _collect(stream) -> list:
    return [output async for output in stream]


async def _tokens(stream) -> list[int]:
    return [token for output in [output async for output in stream] for token in output.new_token_ids]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_after_a_failed_step_the_core_serves_as_a_fresh_core_would(tmp_path, monkeypatch, async_scheduling):
    """A failed step fails the requests then live and the core serves on (engine_core.py). It
    kept the blocks the failed prefill had registered in the prefix cache, so the same prompt
    next was served from KV never written (other tokens); and under async scheduling the
    step launched before the failure stayed in flight, so the next request, unrelated, failed
    too (helper-46's fuzzing). Each is checked against what the core gave before the failure."""
    from faulty_engine import FAIL_ONCE_ENV

    fail = tmp_path / "fail"
    monkeypatch.setenv(FAIL_ONCE_ENV, str(fail))
    prompt = [(7 * index + 3) % 256 for index in range(64)]  # 4 full blocks
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=40, temperature=0.0,
                                 structured_output=StructuredOutput.of("regex", "[a-z]{60}", "regex"))

    async def scenario():
        config = CONFIG.model_copy(update={"async_scheduling": async_scheduling})
        front = await AsyncEngine.launch(config, "builtin", device="cpu", engine_factory="faulty_engine:FailsOnce")
        try:
            expected = await _tokens(front.add_request(prompt, greedy, cache_salt="before"))  # its own cache keys
            fail.write_text("forward")  # the prompt's prefill fails, its blocks registered
            with pytest.raises(EngineStepError, match="the forward pass failed"):
                await _tokens(front.add_request(prompt, greedy))
            assert not fail.exists()
            outputs = [output async for output in front.add_request(prompt, greedy)]
            assert outputs[-1].num_cached_tokens == 0
            assert [token for output in outputs for token in output.new_token_ids] == expected
            running = front.add_request(list(range(65, 90)), constrained)
            await running.__anext__()  # it runs: its steps are sampled after the previous step's tokens
            fail.write_text("complete")
            with pytest.raises(EngineStepError, match="waiting for the step's tokens failed"):
                async for _ in running:
                    pass
            assert await _tokens(front.add_request(prompt, greedy, cache_salt="after")) == expected
            assert await front.core.call_utility("check_invariants")
        finally:
            await front.shutdown(grace_period_s=0)

    asyncio.run(scenario())


def test_the_core_process_exits_0_after_a_clean_shutdown():
    """Its receive threads held the last reference to the engine once run() returned; one that
    woke after the interpreter had begun to exit freed the model's tensors on a daemon thread,
    and torch's teardown there aborted the process (SIGABRT, exit -6) in most shutdowns."""
    async def once(seed: int) -> int:
        front = await AsyncEngine.launch(CONFIG, "builtin", device="cpu", torch_threads=1)
        try:
            streams = [front.add_request([(seed + index * 7) % 256 for index in range(5 + index)],
                                         SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                       for index in range(12)]
            for stream in streams:
                async for _ in stream:
                    pass
        finally:
            await front.shutdown(grace_period_s=0)
        return front.core.process.returncode

    async def three() -> list[int]:  # three shutdowns side by side: each core exits on its own
        return list(await asyncio.gather(*(once(seed) for seed in range(3))))

    assert asyncio.run(three()) == [0, 0, 0]


def test_with_async_scheduling_the_core_overlaps_steps_and_streams_the_unoverlapped_tokens(tmp_path, monkeypatch):
    overlap_log = tmp_path / "overlap.log"
    monkeypatch.setenv(OVERLAP_LOG_ENV, str(overlap_log))
    prompts = [list(range(3, 3 + length)) for length in (5, 19, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(CONFIG, "builtin", device="cpu").generate(prompts, params)  # async off on the CPU

    async def scenario():
        front = await AsyncEngine.launch(CONFIG.model_copy(update={"async_scheduling": True}), "builtin",
                                         device="cpu", engine_factory=f"{__name__}:OverlapProbeEngine")
        try:
            dropped = front.add_request(list(range(50, 90)), LONG, request_id="dropped")
            streams = [front.add_request(prompt, params) for prompt in prompts]
            await dropped.__anext__()
            front.abort("dropped")  # lands while the core has a step of it in flight
            outputs = await asyncio.gather(*(_collect(stream) for stream in streams))
            await front.core.call_utility("check_invariants")
            state = await front.core.call_utility("request_state", "dropped")
            return outputs, state, front.load()
        finally:
            await front.shutdown(grace_period_s=0)

    outputs, state, load = asyncio.run(scenario())
    assert [[token for output in stream for token in output.new_token_ids] for stream in outputs] == expected
    assert state is None and load.kv_blocks_free == load.kv_blocks_total  # nothing leaked by the abort
    assert len(overlap_log.read_text().splitlines()) >= 10  # the probe: passes really launched overlapped


@pytest.fixture
def replica():
    running = RunningReplica(max_model_len=256, block_size=16, num_kv_blocks=129)
    yield running
    running.close()


def test_a_core_killed_under_load_fails_every_stream_with_unavailable_at_once_and_the_server_is_not_serving(replica):
    num_streams = 8
    request = pb.GenerateRequest(text="long", sampling=sampling(max_tokens=200, ignore_eos=True))
    core_process = replica.async_engine.core.process

    async def stream_until_cut(stub, started: asyncio.Event, counter: list[int]):
        call = stub.Generate(request)
        tokens = 0
        try:
            async for response in call:
                tokens += len(response.token_ids)
                if tokens == len(response.token_ids):
                    counter[0] += 1
                    if counter[0] == num_streams:
                        started.set()
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details(), tokens, time.monotonic()
        return grpc.StatusCode.OK, "", tokens, time.monotonic()

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            started, counter = asyncio.Event(), [0]
            streams = [asyncio.ensure_future(stream_until_cut(stub, started, counter)) for _ in range(num_streams)]
            await asyncio.wait_for(started.wait(), 60)  # every stream has streamed tokens
            os.kill(core_process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(pb.GenerateRequest(text="late", sampling=sampling(max_tokens=2))).read()
            with pytest.raises(grpc.aio.AioRpcError) as no_load:
                await pb_grpc.LoadReporterStub(channel).GetLoad(pb.LoadRequest())
            return killed_at, results, refused.value, no_load.value

    killed_at, results, refused, no_load = asyncio.run(run())
    assert core_process.wait(timeout=10) == -signal.SIGKILL  # the probe: the core really died of the kill
    for code, details, tokens, ended_at in results:
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        assert "engine core" in details and 0 < tokens < 200
        assert ended_at - killed_at < 2.0  # at once, not at some timeout
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and no_load.code() == grpc.StatusCode.UNAVAILABLE
    for service in ("", "headroom.v1.Generation", "headroom.v1.LoadReporter"):
        assert replica.health_status(service) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert isinstance(replica.async_engine.dead, EngineDeadError)
    assert replica.on_loop(lambda: len(replica.async_engine._processor)) == 0  # no stream left behind


def test_the_fronts_kv_event_mirror_equals_the_cores_prefix_cache_after_eviction_and_aborts():
    # 9 usable blocks of 16 tokens; each 64-token prompt holds 5 with its output and caches 4,
    # so the second request already evicts (the probe below checks that it did).
    config = make_engine_config(max_model_len=128, block_size=16, num_kv_blocks=10, max_num_seqs=2)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu")
        kinds = []
        front.on_kv_events(lambda events: kinds.extend(kind for kind, _, _ in events))
        try:
            for index in range(3):
                stream = front.add_request([3 + index] * 64, short, request_id=f"r{index}")
                if index == 1:
                    await stream.__anext__()
                    front.abort("r1")
                rest = [output async for output in stream]
                assert rest[-1].finish_reason == ("abort" if index == 1 else "length")
            held = set(await front.core.call_utility("cached_block_hashes"))
            mirror = {block_hash for _, block_hash, _ in front.kv_events.snapshot().events[1:]}
            return held, mirror, kinds
        finally:
            await front.shutdown(grace_period_s=0)

    held, mirror, kinds = asyncio.run(scenario())
    assert kinds.count(KVEventKind.BLOCK_REMOVED) > 0, "nothing was evicted: the probe proves nothing"
    assert held and mirror == held


def test_the_admission_mode_runs_in_the_core_and_its_load_fields_reach_the_front():
    # 4 usable blocks of 16 tokens: two 16-token prompts fit today, but not both grown to
    # 16 + 32 tokens (3 blocks each), so reserve_max_tokens holds the second back.
    config = make_engine_config(max_model_len=48, block_size=16, num_kv_blocks=5,
                                admission_mode="reserve_max_tokens", admission_max_hold_ms=None)
    grow = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu")
        try:
            streams = [front.add_request(list(range(3 + 20 * i, 19 + 20 * i)), grow) for i in range(2)]
            await streams[0].__anext__()
            version = front.load_version
            await front.wait_for_load(version, timeout=30)
            while_held = front.load()
            for stream in streams:
                assert [output async for output in stream][-1].finish_reason == "length"
            return front.engine.config.admission_mode, while_held, front.load()
        finally:
            await front.shutdown(grace_period_s=0)

    mode, while_held, after = asyncio.run(scenario())
    assert mode == "reserve_max_tokens"
    assert while_held.num_running == 1 and while_held.num_waiting == 1
    assert while_held.kv_committed_tokens >= 3 * 16  # growth to max_tokens: 1 block running, 3 waiting
    assert after.admissions_held_total == 1 and after.preemptions_total == 0
