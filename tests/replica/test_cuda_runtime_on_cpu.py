"""The replica's CUDA-only host branches, run on a CPU under an emulated CUDA runtime.

Every GPU run so far found a host-side defect no CPU test reached: a second
enable_decode_padding reallocated the tensors captured graphs write (every replayed token 0,
run B), a capture invalidated by a collector's CUDA call (run C), a set_device that refused the
default device (found by a desk review). These engines take the branches a GPU takes
(`cuda_runtime.on_cuda` says yes: cuda_emulation.py): decode steps padded to the ladder
and replayed from CUDA graphs recorded op by op, async scheduling by default, events on every
copy a step's reader waits for, the SLO abort's per-layer pacing, the host KV tier's copy
stream and registered host memory, the preemption costs measured at start, the KV pool sized
by a profiling run under gpu_memory_utilization (where run C's first call died). Each must
give the plain CPU engine's tokens, and each is paired with a probe that the branch ran.
"""

from __future__ import annotations

import attention_harness  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import random

import pytest
import torch

from cuda_emulation import emulate_cuda_runtime
from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.core.structured_output import StructuredOutput
from replica.executor.memory_profile import kv_cache_bytes_per_block

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DEVICE_MEMORY_BYTES = 16 * 2**20


def _jobs() -> list[tuple[list[int], SamplingParams]]:
    """Queued past max_num_seqs; three share a 12-token prefix; one prefills in two chunks;
    greedy, seeded, penalised, biased, with logprobs and prompt logprobs, and under a constraint."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 250) for _ in range(12)]
    prompts = [prefix + [rng.randrange(3, 250) for _ in range(n)] for n in (3, 5, 2)]
    prompts += [[rng.randrange(3, 250) for _ in range(n)] for n in (30, 4, 9)]
    params = [GREEDY,
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, frequency_penalty=0.5,
                             repetition_penalty=1.3, logit_bias=((prompts[1][-1], 4.0),)),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.0, structured_output=StructuredOutput(
                  "choice", ("yes", "no", "maybe so"))),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)]
    return list(zip(prompts, params))


def _run(engine: LLMEngine, jobs) -> list[tuple[list[int], list[float]]]:
    """Each job's output tokens, and its prompt's and its tokens' log-probabilities where asked."""
    requests = [engine.make_request(f"job-{index}", prompt, params) for index, (prompt, params) in enumerate(jobs)]
    for request in requests:
        engine.add_request(request, detokenize=False)
    logprobs: dict[str, list[float]] = {request.request_id: [] for request in requests}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.prompt_logprobs is not None:
                logprobs[output.request_id] += output.prompt_logprobs.logprobs
            logprobs[output.request_id] += output.logprobs or []
            cached[output.request_id] = output.num_cached_tokens
    engine.scheduler.check_invariants()
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked device blocks"
    assert sum(cached.values()) > 0, "the shared prefix must really be served from the cache"
    return [(list(request.output_token_ids), logprobs[request.request_id]) for request in requests]


def _config(**overrides):
    return make_engine_config(**{**dict(block_size=4, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
                                        num_kv_blocks=64), **overrides})


@pytest.fixture(scope="module")
def cpu_outputs():
    engine = LLMEngine(_config(), "builtin", device="cpu", dtype="float32")
    assert engine.runner.graphs is None and not engine.async_scheduling
    return _run(engine, _jobs())


def _assert_same(outputs, expected) -> None:
    assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, expected_logprobs) in zip(outputs, expected):
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_the_gpu_s_engine_replays_captured_graphs_and_gives_the_cpu_s_tokens(monkeypatch, cpu_outputs):
    runtime = emulate_cuda_runtime(monkeypatch, device_memory_bytes=DEVICE_MEMORY_BYTES)
    engine = LLMEngine(_config(fused_ops="triton", scheduling_policy="slo", gpu_memory_utilization=0.5), "builtin",
                       device="cpu", dtype="float32", attention_backend="triton")
    # The GPU's defaults, each taken because the runtime says CUDA; the pool sized by profiling:
    # half of the device (its allocator reports nothing allocated, the profiling run's scratch
    # KV then lending a few blocks more), not num_kv_blocks' 64.
    assert engine.async_scheduling and engine.runner.paces_layers
    per_block = kv_cache_bytes_per_block(engine.model_config, 4, torch.float32)
    assert runtime.memory_profiles == 1 and 64 < DEVICE_MEMORY_BYTES // 2 // per_block <= engine.config.num_kv_blocks
    assert engine.runner.graphs.captured == [4, 2, 1] and len(runtime.captures) == 3
    assert min(runtime.captures) > 50, "a capture records the decode pass's device work"
    replays_before = runtime.replays
    _assert_same(_run(engine, _jobs()), cpu_outputs)
    assert runtime.replays > replays_before, "decode steps must replay the captured graphs"
    assert runtime.events_recorded > 0 and runtime.events_synchronized > 0
    # Prefills (abortable under the SLO policy) launched paced: the host waited on layer events.
    assert sum(event.synchronized for event in engine.runner._layer_events) > 0
    engine.shutdown()


def test_the_host_tier_swaps_through_the_copy_stream_into_registered_host_memory(monkeypatch):
    # The roomy CPU engine's greedy tokens; then a cramped pool on the GPU's path: 10 usable
    # blocks of 4 tokens for five requests growing to 20-33 tokens, the host tier 64 blocks.
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    jobs = [(prompt, params) for prompt, _ in _jobs() if len(prompt) < 20]
    expected = _run(LLMEngine(_config(), "builtin", device="cpu", dtype="float32"), jobs)
    runtime = emulate_cuda_runtime(monkeypatch)
    engine = LLMEngine(_config(num_kv_blocks=11, max_model_len=40, num_host_kv_blocks=64, preemption_mode="swap",
                               max_num_batched_tokens=64), "builtin", device="cpu", dtype="float32")
    # Costs measured at start on the GPU's path; the tier's memory registered with the runtime;
    # swap-ins prefetched beside the step before (a copy stream overlaps them on CUDA).
    assert engine.scheduler.prefetch_swap_ins and runtime.host_registrations >= 1
    streams_waited = runtime.stream_waits
    assert _run(engine, jobs) == expected
    counters, kv_cache = engine.scheduler.counters, engine.scheduler.kv_cache
    assert counters.swap_preemptions == counters.preemptions > 0, "the cramped pool must really swap"
    assert engine.runner.kv_swap.prefetched_blocks > 0 and runtime.stream_waits > streams_waited
    assert kv_cache.num_free_host_blocks == kv_cache.num_host_blocks, "leaked host blocks"
    engine.shutdown()


@pytest.mark.timeout(300)
def test_tp2_captures_collectives_in_its_graphs_and_replays_them_on_both_ranks_in_lockstep(monkeypatch):
    """test_tp_graphs.py's GPU test, which no machine with two GPUs has run, on two gloo ranks:
    each rank captures its ladder with its collectives inside the graphs (an all-reduce after
    the embedding and after each layer's o-proj and down-proj, the logits' all-gather), and a
    replay runs them again, meeting the other rank's replay of the same size. Rank 0's tokens
    depend on every one of rank 1's replayed collectives."""
    import cuda_emulation
    from replica.executor.cuda_graphs import capture_order, capture_sizes
    from replica.parallel import executor

    config = dict(block_size=4, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64)
    jobs = [(prompt, GREEDY) for prompt, _ in _jobs()[:4]]
    expected = _run(LLMEngine(make_engine_config(**config), "builtin", device="cpu", dtype="float32"), jobs)
    emulate_cuda_runtime(monkeypatch)
    monkeypatch.setattr(executor, "worker_main", cuda_emulation.emulated_worker_main)  # rank 1 emulates too
    engine = LLMEngine(make_engine_config(**config, tensor_parallel_size=2), "builtin", device="cpu",
                       dtype="float32", attention_backend="triton")
    try:
        (before,) = engine.tp_workers.call("stats")
        assert engine.runner.graphs is not None and before["cuda_graphs"], "a rank did not capture"
        assert before["capture_order"] == engine.runner.graphs.captured == capture_order(capture_sizes(4, 16))
        layers = engine.model_config.num_hidden_layers
        for graph in engine.runner.graphs._graphs.values():
            assert sum(op.kind == "collective" for op in graph.ops) == 2 * layers + 2
        replayed = []
        original_step = engine.step

        def step():
            outputs = original_step()
            if engine.last_step.graph_batch_size is not None:
                replayed.append(engine.last_step.graph_batch_size)
            return outputs

        engine.step = step
        assert _run(engine, jobs) == expected
        (after,) = engine.tp_workers.call("stats")
        assert len(replayed) > 3, "no decode graph was replayed"
        assert after["graph_sizes"][-len(replayed):] == replayed, "the worker replayed other sizes than rank 0"
    finally:
        engine.shutdown()
