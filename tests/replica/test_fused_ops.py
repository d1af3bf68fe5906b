"""The fused ops against their reference: each Triton kernel against FusedOps (the unfused torch ops)
on tiny fp32/fp16 shapes, the reference against HF transformers bit for bit, and the whole model with
Triton ops against the same model with the reference ops.

Triton runs under TRITON_INTERPRET=1 here (set before the kernels are decorated), so shapes stay tiny.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from model_harness import PagedRunner  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from replica.model import FusedOps, ModelConfig, get_fused_ops, load_model  # noqa: E402
from replica.model.fused_ops import CompiledFusedOps, InPlaceFusedOps  # noqa: E402
from replica.model.llama import rope_cos_sin_table  # noqa: E402
from replica.model.triton_ops import TritonFusedOps  # noqa: E402

EPS = 1e-6
# Non-power-of-two widths: every kernel must mask its padded lanes.
HIDDEN = 80
INTERMEDIATE = 1100  # > one SiLU-mul column block (1024)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 24
MAX_POSITIONS = 64
TOKEN_COUNTS = (1, 3, 17)
DTYPES = (torch.float32, torch.float16)
# fp16 results may differ from the reference by one rounding (fp32 summation order, exp/rsqrt ulps).
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}

REFERENCE = FusedOps()
TRITON = TritonFusedOps()


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rope_config(**rope) -> ModelConfig:
    return ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=NUM_Q_HEADS * HEAD_DIM, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=NUM_Q_HEADS, num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS, **rope,
    ))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_rms_norm_kernel_matches_reference_and_leaves_its_input(num_tokens, dtype):
    hidden = _randn(num_tokens, HIDDEN, dtype=dtype, seed=0)
    weight = _randn(HIDDEN, dtype=dtype, seed=1)
    original = hidden.clone()
    normed = TRITON.rms_norm(hidden, weight, EPS)
    torch.testing.assert_close(normed, REFERENCE.rms_norm(original, weight, EPS), **TOLERANCES[dtype])
    assert torch.equal(hidden, original)  # the un-normed input stays the residual stream


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_add_rms_norm_kernel_matches_reference_sum_and_norm(num_tokens, dtype):
    hidden = _randn(num_tokens, HIDDEN, dtype=dtype, seed=2)
    residual = _randn(num_tokens, HIDDEN, dtype=dtype, seed=3)
    weight = _randn(HIDDEN, dtype=dtype, seed=4)
    expected_normed, expected_residual = REFERENCE.add_rms_norm(hidden, residual, weight, EPS)
    normed, new_residual = TRITON.add_rms_norm(hidden.clone(), residual.clone(), weight, EPS)
    assert torch.equal(new_residual, expected_residual)  # one rounding of one add: exact
    torch.testing.assert_close(normed, expected_normed, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_rotary_kernel_rotates_query_and_key_inside_the_qkv_output_only(num_tokens, dtype):
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=5)
    # Strided views into one GEMM output, as the model passes them; positions out of order, incl. the last.
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
    key = key.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randperm(MAX_POSITIONS, generator=torch.Generator().manual_seed(6))[:num_tokens]
    positions[0] = MAX_POSITIONS - 1
    cache = rope_cos_sin_table(_rope_config()).to(dtype)
    expected_query, expected_key = REFERENCE.rotary(positions, query, key, cache)
    value_before = value.clone()

    rotated_query, rotated_key = TRITON.rotary(positions, query, key, cache)
    torch.testing.assert_close(rotated_query, expected_query, **TOLERANCES[dtype])
    torch.testing.assert_close(rotated_key, expected_key, **TOLERANCES[dtype])
    assert torch.equal(value, value_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_silu_and_mul_kernel_matches_reference(num_tokens, dtype):
    gate_up = _randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype, seed=7) * 3
    torch.testing.assert_close(TRITON.silu_and_mul(gate_up), REFERENCE.silu_and_mul(gate_up), **TOLERANCES[dtype])


def test_reference_add_and_norm_equals_hf_bit_for_bit_in_bfloat16():
    hidden = _randn(5, HIDDEN, dtype=torch.bfloat16, seed=8)
    residual = _randn(5, HIDDEN, dtype=torch.bfloat16, seed=9)
    hf_norm = modeling_llama.LlamaRMSNorm(HIDDEN, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        hf_norm.weight.copy_(_randn(HIDDEN, dtype=torch.bfloat16, seed=10))
        hf_sum = residual + hidden
        normed, new_residual = REFERENCE.add_rms_norm(hidden, residual, hf_norm.weight, EPS)
        assert torch.equal(new_residual, hf_sum)
        assert torch.equal(normed, hf_norm(hf_sum))


@pytest.mark.parametrize("rope", [{}, {"rope_theta": 5e5, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16}}], ids=["default", "llama3"])
def test_reference_rotary_from_the_cos_sin_cache_equals_hf_bit_for_bit_in_bfloat16(rope):
    cfg = _rope_config(**rope)
    hf_config = transformers.LlamaConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=NUM_Q_HEADS, num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS, **rope)
    query = _randn(7, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, seed=11)
    key = _randn(7, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, seed=12)
    positions = torch.tensor([0, 1, 5, 17, 40, 62, 63])
    cos, sin = modeling_llama.LlamaRotaryEmbedding(hf_config)(query, positions[None, :])
    # HF's layout is [batch, heads, tokens, head_dim].
    hf_query, hf_key = modeling_llama.apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                                           cos, sin)
    ours_query, ours_key = REFERENCE.rotary(positions, query, key, rope_cos_sin_table(cfg).to(torch.bfloat16))
    assert torch.equal(ours_query, hf_query[0].transpose(0, 1))
    assert torch.equal(ours_key, hf_key[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [*TOKEN_COUNTS, 300])  # 300 x 80: past one thread's grain
def test_in_place_ops_equal_the_reference_bit_for_bit_on_the_models_strided_views(num_tokens, dtype):
    in_place = InPlaceFusedOps()
    hidden = _randn(num_tokens, HIDDEN, dtype=dtype, seed=20)
    residual = _randn(num_tokens, HIDDEN, dtype=dtype, seed=21)
    weight = _randn(HIDDEN, dtype=dtype, seed=22)
    assert torch.equal(in_place.rms_norm(hidden, weight, EPS), REFERENCE.rms_norm(hidden, weight, EPS))
    expected = REFERENCE.add_rms_norm(hidden, residual, weight, EPS)
    for actual, wanted in zip(in_place.add_rms_norm(hidden.clone(), residual, weight, EPS), expected):
        assert torch.equal(actual, wanted)

    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    query, key, _ = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=23).split([q_size, kv_size, kv_size],
                                                                                         dim=-1)
    query, key = query.view(num_tokens, NUM_Q_HEADS, HEAD_DIM), key.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=torch.Generator().manual_seed(24))
    cache = rope_cos_sin_table(_rope_config()).to(dtype)
    for actual, wanted in zip(in_place.rotary(positions, query, key, cache), REFERENCE.rotary(positions, query, key,
                                                                                              cache)):
        assert torch.equal(actual, wanted)

    gate_up = _randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype, seed=25) * 3
    assert torch.equal(in_place.silu_and_mul(gate_up.clone()), REFERENCE.silu_and_mul(gate_up))


def test_reference_ops_never_read_tensor_values_on_the_host():
    """Meta tensors have no values: an .item(), a sync or a branch on data would raise. That is what a
    CUDA graph capture forbids, so the reference (and torch.compile of it) stays capturable."""
    with torch.device("meta"):
        hidden, residual, weight = torch.empty(4, HIDDEN), torch.empty(4, HIDDEN), torch.empty(HIDDEN)
        query, key = torch.empty(4, NUM_Q_HEADS, HEAD_DIM), torch.empty(4, NUM_KV_HEADS, HEAD_DIM)
        positions, cache = torch.empty(4, dtype=torch.int64), torch.empty(MAX_POSITIONS, HEAD_DIM)
        assert REFERENCE.rms_norm(hidden, weight, EPS).shape == (4, HIDDEN)
        assert [t.shape for t in REFERENCE.add_rms_norm(hidden, residual, weight, EPS)] == [(4, HIDDEN)] * 2
        assert REFERENCE.rotary(positions, query, key, cache)[1].shape == (4, NUM_KV_HEADS, HEAD_DIM)
        assert REFERENCE.silu_and_mul(torch.empty(4, 2 * INTERMEDIATE)).shape == (4, INTERMEDIATE)


def test_compiled_ops_match_reference_and_one_recompile_covers_every_token_count():
    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = CompiledFusedOps()
    for num_tokens in (1, 5, 9):
        hidden, residual = _randn(num_tokens, HIDDEN, dtype=torch.float32, seed=13), _randn(
            num_tokens, HIDDEN, dtype=torch.float32, seed=14)
        weight = _randn(HIDDEN, dtype=torch.float32, seed=15)
        torch.testing.assert_close(compiled.add_rms_norm(hidden, residual, weight, EPS),
                                   REFERENCE.add_rms_norm(hidden, residual, weight, EPS))
        gate_up = _randn(num_tokens, 2 * INTERMEDIATE, dtype=torch.float32, seed=16)
        torch.testing.assert_close(compiled.silu_and_mul(gate_up), REFERENCE.silu_and_mul(gate_up))
    # Per op: 1 is specialised, 5 recompiles with a symbolic token count, 9 reuses it.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 2 * 2


def test_unknown_fused_ops_name_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="'fast'.*auto, torch, inplace, triton, compile"):
        get_fused_ops("fast", "cpu")


def test_auto_picks_the_in_place_ops_on_cpu():
    assert get_fused_ops("auto", "cpu").name == "inplace"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """Qwen2: q/k/v biases exercise the merged bias; non-power-of-two hidden and intermediate sizes."""
    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                         max_position_embeddings=64)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn(param.shape) if "norm" in name else 0.1 * torch.randn(param.shape))
    model_dir = tmp_path_factory.mktemp("qwen2")
    hf_model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_with_in_place_ops_equals_model_with_reference_ops_bit_for_bit(qwen2_dir, dtype):
    reference, cfg = load_model(qwen2_dir, dtype=dtype, attention_backend="torch", fused_ops="torch")
    in_place, _ = load_model(qwen2_dir, dtype=dtype, attention_backend="torch", fused_ops="inplace")
    assert in_place.model.layers[0].mlp.ops.name == "inplace"
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(18)).tolist()
    reference_runner, in_place_runner = PagedRunner(reference, cfg), PagedRunner(in_place, cfg)
    steps = [{"a": tokens[:5]}, {"a": tokens[5:10], "b": tokens[:3]}, {"a": tokens[10:11], "b": tokens[3:4]}]
    for step in steps:
        expected, actual = reference_runner.step(step), in_place_runner.step(step)
        for seq_id in step:
            assert torch.equal(actual[seq_id], expected[seq_id])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_model_with_triton_ops_equals_model_with_reference_ops(qwen2_dir, dtype):
    reference, cfg = load_model(qwen2_dir, dtype=dtype, attention_backend="torch", fused_ops="torch")
    fused, _ = load_model(qwen2_dir, dtype=dtype, attention_backend="torch", fused_ops="triton")
    assert fused.model.layers[0].mlp.ops.name == "triton"
    tokens = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(17)).tolist()
    reference_runner, fused_runner = PagedRunner(reference, cfg), PagedRunner(fused, cfg)
    # A prefill chunk, a second chunk sharing the pass with another sequence's prefill, then a decode.
    steps = [{"a": tokens[:5]}, {"a": tokens[5:10], "b": tokens[:3]}, {"a": tokens[10:11], "b": tokens[3:4]}]
    tolerance = dict(atol=1e-4, rtol=0) if dtype == "float32" else dict(atol=3e-2, rtol=0)
    for step in steps:
        expected, actual = reference_runner.step(step), fused_runner.step(step)
        for seq_id in step:
            torch.testing.assert_close(actual[seq_id], expected[seq_id], **tolerance)
