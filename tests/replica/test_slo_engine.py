"""SLO preemption with the built-in model: a real monitor thread aborts a running prefill's
forward pass at a layer boundary so an urgent request gets its first token first, and the
aborted work changes no output; stale orders and stubborn passes never abort.
HEADROOM_TEST_DEVICE=cuda runs the engines on a GPU."""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.front.async_engine import AsyncEngine
from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import RequestStatus, SamplingParams
from replica.core.slo import AbortOrder

_rng = random.Random(7)
LONG_PROMPT = [_rng.randrange(256) for _ in range(256)]  # four 64-token chunks
URGENT_PROMPT = [_rng.randrange(256) for _ in range(12)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
LONG_SLO_MS, URGENT_SLO_MS = 60_000.0, 2_000.0
MONITOR_PATIENCE_S = 5.0  # generous: the monitor polls every 2 ms, but the CPU is shared


def make_engine(policy: str, **overrides) -> LLMEngine:
    config = dict(scheduling_policy=policy, max_model_len=512, num_kv_blocks=96, max_num_batched_tokens=64)
    config.update(overrides)
    return LLMEngine(make_engine_config(**config), "builtin", device=os.environ.get("HEADROOM_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def reference_engine():
    """Runs each prompt alone, without a prefix cache that earlier runs could warm."""
    return make_engine("fcfs", enable_prefix_caching=False)


@pytest.fixture
def slo_engine():
    engine = make_engine("slo")
    yield engine
    engine.shutdown()


class HookedAbort:
    """The engine's step abort with a test's hook run at each layer boundary of an abortable
    step, after the real check said go on (where the engine asks, so the hook may post orders)."""

    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def begin(self, scheduler_output) -> bool:
        return self.inner.begin(scheduler_output)

    def abort_now(self, step_id: int, layer_index: int):
        victim = self.inner.abort_now(step_id, layer_index)
        if victim is None:
            self.hook(layer_index)
        return victim

    def end(self) -> None:
        self.inner.end()


def hooked(engine: LLMEngine, hook) -> LLMEngine:
    """`engine` with `hook` at its layer boundaries from now on (None: the plain engine)."""
    runner = engine.runner
    if isinstance(runner.step_abort, HookedAbort):
        runner.step_abort = runner.step_abort.inner
    if hook is not None:
        runner.step_abort = HookedAbort(runner.step_abort, hook)
    return engine


def hold_pass_for_the_monitor(engine: LLMEngine):
    """Layer hook that keeps layer 0 of a pass waiting, while the urgent request waits and
    no order exists yet, until the real monitor thread posts one: it makes the race with
    the monitor deterministic on a CPU where a whole pass takes milliseconds."""

    def hook(layer_index: int) -> None:
        urgent = engine.scheduler.requests.get("urgent")
        if layer_index != 0 or urgent is None or urgent.status != RequestStatus.WAITING:
            return
        give_up = time.monotonic() + MONITOR_PATIENCE_S
        while engine.slo_monitor.abort_order is None and time.monotonic() < give_up:
            time.sleep(0.001)

    return hook


def run_long_then_urgent(engine: LLMEngine, layer_hook=None):
    """The long prompt runs its first chunk; then the urgent request arrives. Returns both
    requests and the step at which each produced its first token."""
    hooked(engine, layer_hook)
    long = engine.make_request("long", LONG_PROMPT, GREEDY, ttft_slo_ms=LONG_SLO_MS)
    engine.add_request(long, detokenize=False)
    engine.step()
    urgent = engine.make_request("urgent", URGENT_PROMPT, GREEDY, ttft_slo_ms=URGENT_SLO_MS)
    engine.add_request(urgent, detokenize=False)
    first_token_step = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            first_token_step.setdefault(output.request_id, step)
        engine.scheduler.check_invariants()
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked KV blocks"
    return long, urgent, first_token_step


def run_alone(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    request = engine.make_request(request_id, prompt, GREEDY)
    engine.add_request(request, detokenize=False)
    logprobs = []
    while engine.has_unfinished_requests():
        logprobs += [output.logprobs[0] for output in engine.step()]
    return request.output_token_ids, logprobs


@pytest.fixture(scope="module")
def unpreempted(reference_engine):
    """Each prompt's tokens and logprobs when it runs alone."""
    return {name: run_alone(reference_engine, f"alone-{name}", prompt)
            for name, prompt in (("long", LONG_PROMPT), ("urgent", URGENT_PROMPT))}


def test_under_slo_the_urgent_request_aborts_the_long_prefill_and_gets_its_first_token_first(
        slo_engine, unpreempted):
    long, urgent, first_token_step = run_long_then_urgent(slo_engine, hold_pass_for_the_monitor(slo_engine))

    counters = slo_engine.scheduler.counters
    assert counters.slo_preemptions == 1, "the monitor must have aborted exactly one pass"
    # The order lands either before the pass reaches its first boundary or while the hook
    # holds layer 0: either way the pass unwinds at a boundary with at most one layer run.
    assert counters.slo_discarded_layers in (0, 1)
    assert long.num_slo_preemptions == 1 and counters.preemptions == 0
    assert first_token_step["urgent"] < first_token_step["long"]
    assert long.output_token_ids == unpreempted["long"][0]
    assert urgent.output_token_ids == unpreempted["urgent"][0]
    load = slo_engine.load()
    assert (load.slo_preemptions_total, load.slo_discarded_layers_total) == (1, counters.slo_discarded_layers)


def test_under_fcfs_the_long_prompt_gets_its_first_token_first(unpreempted):
    fcfs_engine = make_engine("fcfs")
    long, urgent, first_token_step = run_long_then_urgent(fcfs_engine)

    assert first_token_step["long"] < first_token_step["urgent"]
    assert fcfs_engine.scheduler.counters.slo_preemptions == 0
    assert long.output_token_ids == unpreempted["long"][0]
    assert urgent.output_token_ids == unpreempted["urgent"][0]


def test_a_stale_step_id_never_aborts_a_later_step(slo_engine):
    monitor = slo_engine.slo_monitor
    monitor.stop()  # this test plays the monitor, to hit the race window exactly
    layers_run = []

    def late_verdict(layer_index: int) -> None:
        step = monitor.step_in_flight
        layers_run.append((step.step_id, layer_index))
        if layer_index == 0:  # decided for the previous step, landing in this one
            monitor.abort_order = AbortOrder(step.step_id - 1, "long")

    long = slo_engine.make_request("long", LONG_PROMPT, GREEDY, ttft_slo_ms=LONG_SLO_MS)
    slo_engine.add_request(long, detokenize=False)
    slo_engine.step()
    hooked(slo_engine, late_verdict).step()
    assert [layer for _, layer in layers_run] == [0, 1, 2, 3], "every layer of the later step ran"
    assert slo_engine.scheduler.counters.slo_preemptions == 0
    assert long.status == RequestStatus.RUNNING and long.num_computed_tokens == 128

    def current_verdict(layer_index: int) -> None:
        if layer_index == 0:
            monitor.abort_order = AbortOrder(monitor.step_in_flight.step_id, "long")

    hooked(slo_engine, current_verdict).step()
    assert slo_engine.scheduler.counters.slo_preemptions == 1, "the same order for the step in flight aborts it"
    assert long.status == RequestStatus.PREEMPTED


def test_a_pass_past_its_stubbornness_limit_refuses_to_abort():
    engine = make_engine("slo", slo_abort_max_layer_fraction=0.5)  # 4 layers: aborts up to layer 2
    engine.slo_monitor.stop()
    monitor = engine.slo_monitor

    def order_at_layer_2(layer_index: int) -> None:
        if layer_index == 2:
            monitor.abort_order = AbortOrder(monitor.step_in_flight.step_id, "long")

    long = engine.make_request("long", LONG_PROMPT, GREEDY, ttft_slo_ms=LONG_SLO_MS)
    engine.add_request(long, detokenize=False)
    hooked(engine, order_at_layer_2).step()
    assert engine.scheduler.counters.slo_preemptions == 0
    assert long.num_computed_tokens == 64


PASS_STARTED_ENV = "HEADROOM_TEST_PASS_STARTED"


def make_held_engine(config, model, **options) -> LLMEngine:
    """Engine factory for the engine-core process: layer 0 of the first pass touches the file
    named by $HEADROOM_TEST_PASS_STARTED (the test's signal across the process boundary) and
    holds until the real monitor posts an order, so the race is deterministic."""
    engine = LLMEngine(config, model, **options)
    pass_started = pathlib.Path(os.environ[PASS_STARTED_ENV])

    def hook(layer_index: int) -> None:
        if layer_index == 0 and engine.scheduler.counters.slo_preemptions == 0:
            pass_started.touch()
            give_up = time.monotonic() + MONITOR_PATIENCE_S
            while engine.slo_monitor.abort_order is None and time.monotonic() < give_up:
                time.sleep(0.001)

    return hooked(engine, hook)


def test_an_urgent_arrival_at_the_engine_core_aborts_the_pass_in_flight(unpreempted, tmp_path, monkeypatch):
    pass_started = tmp_path / "pass-started"
    monkeypatch.setenv(PASS_STARTED_ENV, str(pass_started))
    config = make_engine_config(scheduling_policy="slo", max_model_len=512, num_kv_blocks=96, max_num_batched_tokens=64)
    first_tokens: list[str] = []

    async def consume(stream) -> list[int]:
        tokens = []
        async for output in stream:
            if not tokens and output.new_token_ids:
                first_tokens.append(stream.request_id)
            tokens += output.new_token_ids
        return tokens

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu",
                                         engine_factory=f"{__name__}:make_held_engine")
        try:
            long = front.add_request(LONG_PROMPT, GREEDY, request_id="long", ttft_slo_ms=LONG_SLO_MS)
            long_task = asyncio.create_task(consume(long))
            # The urgent request reaches the core's scheduler only after this pass: the
            # monitor sees it as an arrival, received by the core while the pass runs.
            deadline = time.monotonic() + 60
            while not pass_started.exists():
                assert time.monotonic() < deadline, "the core never started the long pass"
                await asyncio.sleep(0.002)
            urgent = front.add_request(URGENT_PROMPT, GREEDY, request_id="urgent", ttft_slo_ms=URGENT_SLO_MS)
            outputs = await asyncio.gather(long_task, consume(urgent))
            counters = await front.core.call_utility("counters")
            await front.core.call_utility("check_invariants")
            return outputs, counters, front.load()
        finally:
            await front.shutdown()

    (long_tokens, urgent_tokens), counters, load = asyncio.run(scenario())
    assert counters["slo_preemptions"] == 1
    assert first_tokens == ["urgent", "long"]
    assert [long_tokens, urgent_tokens] == [unpreempted["long"][0], unpreempted["urgent"][0]]
    assert load.kv_blocks_free == load.kv_blocks_total


# ---- repeated aborts with the real model: outputs and logprobs unchanged -----------------


@pytest.fixture(scope="module")
def forced_abort_engine():
    engine = make_engine("slo", num_kv_blocks=48, max_num_batched_tokens=48, max_model_len=256)
    engine.slo_monitor.stop()  # the test posts the orders itself, at random layers
    yield engine


PROMPT_POOL = [LONG_PROMPT[:n] for n in (40, 100)] + [URGENT_PROMPT, LONG_PROMPT[50:130], LONG_PROMPT[:16] + [3, 4]]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, len(PROMPT_POOL) - 1), st.integers(0, 6)), min_size=1, max_size=5),
    abort_layers=st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=12, max_size=12),
)
def test_repeated_aborts_with_the_model_change_no_token_and_no_logprob(forced_abort_engine, reference_engine,
                                                                        arrivals, abort_layers):
    run_with_aborts(forced_abort_engine, reference_engine, arrivals, abort_layers)


@pytest.fixture(scope="module")
def paced_async_engine():
    """Async scheduling with the layer pacing a GPU runner does (the runner's flag forced; on a
    CPU there is no device to pace, so only the engine's half runs: a step that may be aborted
    is launched with nothing in flight). Its launches are recorded: (the step holds a prefill,
    another step was in flight)."""
    engine = make_engine("slo", num_kv_blocks=48, max_num_batched_tokens=48, max_model_len=256,
                         async_scheduling=True)
    engine.slo_monitor.stop()
    engine.runner.paces_layers = True
    engine.launches = []
    launch = engine.runner.launch

    def recording_launch(scheduler_output):
        prefills = bool(engine.scheduler.slo_snapshot(scheduler_output).prefills)
        engine.launches.append((prefills, engine._in_flight is not None))
        return launch(scheduler_output)

    engine.runner.launch = recording_launch
    yield engine


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, len(PROMPT_POOL) - 1), st.integers(0, 6)), min_size=2, max_size=5),
    abort_layers=st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=12, max_size=12),
)
def test_under_async_scheduling_a_paced_step_launches_with_nothing_in_flight_and_aborts_change_nothing(
        paced_async_engine, reference_engine, arrivals, abort_layers):
    """A paced launch returns near the end of its pass: the step before it is taken in first,
    so its tokens are not held back a step, and the aborts still change no token."""
    engine = paced_async_engine
    engine.launches.clear()
    run_with_aborts(engine, reference_engine, arrivals, abort_layers)
    assert any(prefills for prefills, _ in engine.launches)
    assert not [launch for launch in engine.launches if launch == (True, True)]
    # Steps with no prefill still overlap (the engine is async): the decodes once every prompt is in.
    assert (False, True) in engine.launches


def run_with_aborts(engine: LLMEngine, reference_engine: LLMEngine, arrivals, abort_layers) -> None:
    monitor = engine.slo_monitor
    requests, logprobs = {}, {}
    expected = {index: run_alone(reference_engine, f"ref-{index}-{id(arrivals)}", PROMPT_POOL[prompt_index])
                for index, (prompt_index, _) in enumerate(arrivals)}

    step = 0
    while step < 200:
        for index, (prompt_index, arrival_step) in enumerate(arrivals):
            if arrival_step == step:
                request = engine.make_request(f"r{index}-{id(arrivals)}", PROMPT_POOL[prompt_index], GREEDY)
                engine.add_request(request, detokenize=False)
                requests[index] = request
                logprobs[request.request_id] = []
        if len(requests) == len(arrivals) and not engine.has_unfinished_requests():
            break
        abort_layer = abort_layers[step % len(abort_layers)]

        def post_order(layer_index: int) -> None:
            step_in_flight = monitor.step_in_flight
            victims = [view.request_id for view in step_in_flight.prefills if view.preemptible]
            if layer_index == abort_layer and victims:
                monitor.abort_order = AbortOrder(step_in_flight.step_id, victims[-1])

        for output in hooked(engine, post_order).step():
            logprobs[output.request_id] += output.logprobs
        engine.scheduler.check_invariants()
        step += 1
    else:
        raise AssertionError("a request is stuck")

    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked KV blocks"
    for index, request in requests.items():
        tokens, ref_logprobs = expected[index]
        assert request.output_token_ids == tokens
        assert logprobs[request.request_id] == pytest.approx(ref_logprobs, abs=1e-4)
