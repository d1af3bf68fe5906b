"""The engine's eager steps through the kernels CUDA runs, on a CPU under Triton's interpreter.

A chunked prefill beside decodes, whose last decoder layer runs past its K/V write for the
sampling rows alone (their queries gathered out of the fused QKV projection, attended as
one-token queries with the decode plan), through the Triton attention kernel, gives the tokens
the torch path gives, and only the sampling rows reach the last layer's MLP. The CPU's own
defaults (the torch attention backend, the in-place torch ops) are what every other engine test
runs; the GPU's whole combination (the Triton fused ops too, the eager steps beside graph-replayed
decodes) runs in test_cuda_runtime_on_cpu.py. And launching steps through these kernels reads
nothing back from the device (test_step_host_reads' probe, with the Triton backend in).
"""

import attention_harness  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import random

from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams


def _generate(attention_backend: str, fused_ops: str, prompts, params) -> tuple[list, int]:
    """Output tokens, and the rows the last layer's MLP saw."""
    engine = LLMEngine(make_engine_config(block_size=4, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=8,
                                          num_kv_blocks=64, fused_ops=fused_ops), "builtin", device="cpu",
                       dtype="float32", attention_backend=attention_backend)
    rows = [0]
    engine.model.model.layers[-1].mlp.register_forward_hook(
        lambda module, inputs, output: rows.__setitem__(0, rows[0] + len(inputs[0])))
    return engine.generate(prompts, params), rows[0]


def test_pruned_last_layer_through_the_triton_kernels_equals_the_torch_path():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(length)] for length in (3, 19, 30, 9)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected, _ = _generate("torch", "torch", prompts, params)
    tokens, last_layer_rows = _generate("triton", "inplace", prompts, params)
    assert tokens == expected
    # Budget 16: the 19- and 30-token prompts prefill in chunks; only sampled rows reach the MLP.
    assert last_layer_rows == len(prompts) * params.max_tokens


def test_launching_steps_through_the_triton_kernels_reads_nothing_back():
    # test_step_host_reads leaves the CPU's torch attention out; here the kernels CUDA runs are in.
    from test_step_host_reads import _assert_no_reads, _mixed_params, _probe_launches, _run

    engine = LLMEngine(make_engine_config(block_size=4, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8,
                                          num_kv_blocks=64, async_scheduling=True, fused_ops="triton"), "builtin",
                       device="cpu", attention_backend="triton")
    engine.runner.enable_decode_padding()
    probe = _probe_launches(engine)
    params = _mixed_params(5)
    _run(engine, params, [5 + 3 * index for index in range(len(params))], shared_prefix=12)
    assert probe.calls["launch"] > 0 and probe.calls["_decode_pass"] > 0
    _assert_no_reads(probe)
