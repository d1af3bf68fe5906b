"""An LLMEngine on an emulated device, to measure the host paths (the engine's, the served
replica's) on a CPU at a GPU's step rate. The model's forward pass returns zeros at once (the
small lm_head and sampler still run), decode steps are padded to the CUDA-graph ladder, and
each step's tokens become ready a modelled device time after its launch, steps queueing one
after another as on a GPU stream: with async scheduling the host's work overlaps that time as
it overlaps a GPU's, and the host waits on it sleeping, as it waits on a CUDA event.

Device time per step: DEVICE_MS_PER_STEP + DEVICE_MS_PER_TOKEN x the step's tokens, by default
1.5 + 0.008 ms (a decode step at batch 64: 2.0 ms, at 256: 3.5 ms, a 2,048-token prefill step:
18 ms), chosen so that bench_served's offline loop makes about what it made on an H100 with
the 1.1B Llama in bf16 (24.1k / 39.4k output tok/s at 64 / 256 streams on the CPU; 26.8k /
41.1k there: run A of 2026-11-25). HEADROOM_EMULATED_DEVICE_MS="A+B" sets both ("0+0": the
engine host-bound). "1.0+0.005" is the H100's later engine (run B: 31.1k / 57.9k there; 36.6k /
59.5k here), the rate a 256-stream front must keep up with now.

The served replica builds it through `headroom replica --engine-factory
bench.emulated_device:emulated_device_engine` (bench/bench_served.py --emulated-device): the
replica itself holds no benchmarking code.
"""

from __future__ import annotations

import os
import time

import torch

DEVICE_MS_PER_STEP = 1.5
DEVICE_MS_PER_TOKEN = 0.008
ENV = "HEADROOM_EMULATED_DEVICE_MS"


def device_model() -> tuple[float, float]:
    """(ms per step, ms per token) from HEADROOM_EMULATED_DEVICE_MS ("A+B"), else the defaults."""
    value = os.environ.get(ENV)
    if not value:
        return DEVICE_MS_PER_STEP, DEVICE_MS_PER_TOKEN
    per_step, _, per_token = value.partition("+")
    return float(per_step), float(per_token or 0.0)


class _ReadyAt:
    """Stands where StepInFlight.done holds a CUDA event: synchronize() sleeps (releasing the
    GIL, as a CUDA event's does) until the emulated device has finished the step."""

    def __init__(self, ready_at: float):
        self.ready_at = ready_at

    def synchronize(self) -> None:
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def emulate_device(engine, ms_per_step: float, ms_per_token: float) -> None:
    """Turn `engine` (an LLMEngine on the CPU) into one on the emulated device."""
    runner = engine.runner
    runner.enable_decode_padding()  # as graph replays pad every decode step
    largest = max(engine.config.max_num_batched_tokens, max(runner.decode_sizes))
    hidden = torch.zeros(largest, engine.model_config.hidden_size, dtype=runner.dtype)

    def forward(input_ids, positions, kv_caches, metadata, layer_hook=None, output_rows=None):
        # A pass pruned to its sampling rows returns those rows alone, as the model's does.
        return hidden[:input_ids.shape[0] if output_rows is None else output_rows.token_index.shape[0]]

    engine.model.forward = forward
    launch = runner.launch
    device_free_at = 0.0

    def launch_on_device(scheduler_output, *args, **kwargs):
        nonlocal device_free_at
        in_flight = launch(scheduler_output, *args, **kwargs)
        if in_flight.request_ids:
            start = max(time.perf_counter(), device_free_at)
            device_free_at = start + (ms_per_step + ms_per_token * scheduler_output.num_scheduled_tokens) / 1000
            in_flight.done = _ReadyAt(device_free_at)
        return in_flight

    runner.launch = launch_on_device
    sample_tokens = runner.sample_tokens

    def sample_on_device(in_flight):
        # A step with structured-output rows samples later: its tokens are ready no earlier
        # than the device time its launch was given, and no earlier than now.
        sampled = sample_tokens(in_flight)
        if in_flight.done is not None:
            sampled.done = _ReadyAt(max(in_flight.done.ready_at, time.perf_counter()))
        return sampled

    runner.sample_tokens = sample_on_device


def emulated_device_engine(config, model, **options):
    """LLMEngine's signature (CoreSpec.engine_factory); the device model from the environment."""
    from replica.core.engine import LLMEngine

    # A GPU's engine never borrows CPU threads for large steps (EngineConfig.borrow_idle_cpus_min_tokens
    # applies to CPU engines only): the emulated one must not either, or its reads and spinning
    # threads are charged to the served side as they never would be beside a GPU.
    engine = LLMEngine(config.model_copy(update={"borrow_idle_cpus_min_tokens": 0}), model, **options)
    emulate_device(engine, *device_model())
    return engine
