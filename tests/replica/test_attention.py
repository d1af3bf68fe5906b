"""Paged attention: the torch reference against dense causal attention, the Triton kernels against the reference.

Triton runs under TRITON_INTERPRET=1 here (set before the kernels are decorated), so shapes stay tiny.
"""

from attention_harness import BLOCK_SIZE, TOLERANCE, PagedBatch  # sets TRITON_INTERPRET first

import pytest
import torch

from replica.attention import allocate_kv_cache, get_attention_backend
from replica.attention.torch_ref import TorchAttentionBackend
from replica.attention.triton_backend import TritonAttentionBackend

# (cached tokens, new tokens) per sequence: a fresh prefill, a chunk continuing on a cached
# prefix, and decodes at a block boundary and mid-block.
MIXED_BATCH = [(0, 7), (9, 6), (12, 1), (3, 1)]
DECODE_BATCH = [(12, 1), (3, 1), (0, 1), (17, 1)]


def test_torch_reference_matches_dense_causal_attention_on_mixed_gqa_batch():
    batch = PagedBatch(MIXED_BATCH, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    output = TorchAttentionBackend().forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    torch.testing.assert_close(output.double(), batch.dense_causal_attention(), atol=1e-5, rtol=1e-5)


def test_torch_reference_batches_decodes_of_different_lengths_exactly():
    # All four are single-token queries, so they share one padded call; padding must not leak in.
    batch = PagedBatch(DECODE_BATCH, num_q_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    output = TorchAttentionBackend().forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    torch.testing.assert_close(output.double(), batch.dense_causal_attention(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_attention_matches_reference_on_mixed_gqa_batch(dtype):
    batch = PagedBatch(MIXED_BATCH, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    expected = TorchAttentionBackend().forward(*args)
    output = TritonAttentionBackend().forward(*args)
    torch.testing.assert_close(output, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_attention_matches_reference_on_decode_only_batch(dtype):
    batch = PagedBatch(DECODE_BATCH, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype, seed=1)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    expected = TorchAttentionBackend().forward(*args)
    torch.testing.assert_close(TritonAttentionBackend().forward(*args), expected,
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_triton_attention_handles_head_dim_not_a_power_of_two_without_gqa():
    batch = PagedBatch(MIXED_BATCH, num_q_heads=2, num_kv_heads=2, head_dim=24, dtype=torch.float32, seed=2)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    torch.testing.assert_close(TritonAttentionBackend().forward(*args), batch.dense_causal_attention().float(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [TorchAttentionBackend(), TritonAttentionBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_stores_each_token_at_its_slot_and_skips_padding(backend, dtype):
    num_tokens, num_kv_heads, head_dim = 5, 2, 16
    # K and V as strided views of a fused projection, the way the model produces them.
    fused = torch.randn(num_tokens, 2 * num_kv_heads * head_dim).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([13, 4, -1, 30, 7], dtype=torch.int64)
    [(key_cache, value_cache)] = allocate_kv_cache(1, 10, BLOCK_SIZE, num_kv_heads, head_dim, dtype, "cpu")

    backend.write_kv(key, value, key_cache, value_cache, slot_mapping)

    flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
    flat_values = value_cache.view(-1, num_kv_heads, head_dim)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat_keys[slot], key[token])
            assert torch.equal(flat_values[slot], value[token])
    written_slots = [slot for slot in slot_mapping.tolist() if slot >= 0]
    untouched = torch.ones(flat_keys.shape[0], dtype=torch.bool)
    untouched[written_slots] = False
    assert not flat_keys[untouched].any() and not flat_values[untouched].any()


def test_write_then_attend_equals_attention_over_the_prefilled_cache():
    """The two kernels compose: writing a step's K/V and attending gives what a pre-filled cache gives."""
    batch = PagedBatch(MIXED_BATCH, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=3)
    expected = batch.dense_causal_attention().float()
    new_keys = torch.cat([keys[cached:] for (cached, _), keys in zip(MIXED_BATCH, batch.keys)])
    new_values = torch.cat([values[cached:] for (cached, _), values in zip(MIXED_BATCH, batch.values)])
    batch.key_cache.view(-1, 2, 16)[batch.meta.slot_mapping] = 0.0  # forget this step's K/V
    batch.value_cache.view(-1, 2, 16)[batch.meta.slot_mapping] = 0.0

    backend = TritonAttentionBackend()
    backend.write_kv(new_keys, new_values, batch.key_cache, batch.value_cache, batch.meta.slot_mapping)
    output = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_auto_backend_is_torch_on_cpu_and_unknown_names_are_rejected():
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"
    with pytest.raises(ValueError, match="flash"):
        get_attention_backend("flash", torch.device("cpu"))
