"""bench_engine.py's StepRecorder, which the cost-model fit reads: each step's tokens paired with
that step's time. Under async scheduling a step() call launches one step and waits for the one
before, so a call's time is the earlier step's; on the emulated device (a known step cost, on
this CPU) the fit must recover that cost.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench_engine imports cost_model as a script does

from bench.bench_engine import StepRecorder, workload  # bench/ is a namespace package under the repository root
from bench.emulated_device import emulate_device

MS_PER_STEP, MS_PER_TOKEN = 40.0, 0.5  # well above the tiny model's host time a step, even on a busy machine


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_fit_recovers_the_devices_step_cost_with_and_without_async_scheduling(async_scheduling):
    import cost_model
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.core.request import SamplingParams

    engine = LLMEngine(make_engine_config(num_kv_blocks=512, max_model_len=512, max_num_seqs=8,
                                          max_num_batched_tokens=256, async_scheduling=async_scheduling,
                                          borrow_idle_cpus_min_tokens=0), "builtin", device="cpu")
    emulate_device(engine, MS_PER_STEP, MS_PER_TOKEN)
    recorder = StepRecorder(engine)
    for index, (prompt, num_out) in enumerate(workload(8, 256, seed=3, max_prompt=160, max_output=24)):
        engine.add_request(engine.make_request(f"r{index}", prompt, SamplingParams(max_tokens=num_out,
                                                                                   temperature=0.0,
                                                                                   ignore_eos=True)),
                           detokenize=False)
    while engine.has_unfinished_requests():
        engine.step()
        recorder.on_step(engine)
    engine.shutdown()

    tokens = [sample[0] for sample in recorder.samples]
    assert max(tokens) == 256 and min(tokens) <= 8  # whole-budget prefills and small decodes were both seen
    model = cost_model.fit(recorder.samples, source="test")
    def predicted(num_tokens, kv_tokens_read):
        return model.fixed_ms + model.per_batched_token_ms * num_tokens + model.per_kv_token_read_ms * kv_tokens_read

    # A decode of 8 sequences at ~100 tokens each, and a whole-budget prefill. Without async
    # scheduling a step's time is the host's work and then the device's, so it only adds to them.
    decode, prefill = MS_PER_STEP + 8 * MS_PER_TOKEN, MS_PER_STEP + 256 * MS_PER_TOKEN
    assert model.per_batched_token_ms == pytest.approx(MS_PER_TOKEN, rel=0.25)
    if async_scheduling:
        assert predicted(8, 800) == pytest.approx(decode, rel=0.3)
        assert predicted(256, 256) == pytest.approx(prefill, rel=0.2)
    else:
        assert decode * 0.9 <= predicted(8, 800) <= decode * 2
        assert prefill * 0.9 <= predicted(256, 256) <= prefill * 2
