"""The torch backend's attention forms against the dense float64 reference.

A prefill without a cached prefix attends causally to its own K/V; a chunk after a cached prefix
merges its attention over the prefix with its causal attention over itself; a lone decode reads its
whole context. Each reads its context in place when the sequence's blocks are consecutive and
gathers it otherwise, and takes the new tokens' K/V from the model (key=, value=) or, when they
are not handed in, back from the cache: every combination must equal dense causal attention.
"""

from attention_harness import PagedBatch  # first: it sets TRITON_INTERPRET before any Triton import

import pytest
import torch

from replica.attention import torch_ref
from replica.attention.torch_plan import TorchAttentionPlan
from replica.attention.torch_ref import TorchAttentionBackend

# (cached tokens, new tokens): fresh prefills of one block, several blocks and a partial block;
# chunks after prefixes ending on a block boundary (8), mid-block (9, 13) and longer than the
# chunk (37); a single new token after a prefix that is not a decode group (a lone decode).
FRESH_PREFILLS = [(0, 4), (0, 29), (0, 7)]
CHUNKS_AFTER_PREFIX = [(8, 6), (9, 5), (13, 16), (37, 3)]
LONE_DECODE = [(22, 1)]
FORMS = {"fresh": FRESH_PREFILLS, "after_prefix": CHUNKS_AFTER_PREFIX, "lone_decode": LONE_DECODE,
         "mixed": [(0, 9), (11, 4), (5, 1), (17, 1), (30, 2)]}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def attend(batch: PagedBatch, hand_in_new_kv: bool) -> torch.Tensor:
    kwargs = batch.new_kv if hand_in_new_kv else {}
    return TorchAttentionBackend().forward(batch.query, batch.key_cache, batch.value_cache, batch.meta,
                                           batch.scale, **kwargs)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shuffle_blocks", [True, False], ids=["gathered", "in_place"])
@pytest.mark.parametrize("hand_in_new_kv", [True, False], ids=["new_kv_given", "new_kv_from_cache"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_every_attention_form_equals_dense_causal_attention(form, shuffle_blocks, hand_in_new_kv, num_q_heads,
                                                             num_kv_heads):
    batch = PagedBatch(FORMS[form], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=16,
                       dtype=torch.float32, shuffle_blocks=shuffle_blocks)
    output = attend(batch, hand_in_new_kv)
    torch.testing.assert_close(output.double(), batch.dense_causal_attention(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_chunk_after_a_long_prefix_equals_dense_attention_with_the_fused_kernels_blocking(dtype):
    # Past the CPU flash kernel's query and key tiles (32-256 rows, 512 keys), so its blocking
    # and the log-sum-exp merge across the prefix / chunk boundary are exercised for real.
    batch = PagedBatch([(700, 300), (0, 600)], num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                       block_size=16)
    output = attend(batch, hand_in_new_kv=True)
    torch.testing.assert_close(output.double(), batch.dense_causal_attention(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_a_chunk_after_a_prefix_gives_the_same_answer_as_the_whole_prompt_at_once():
    """What chunked prefill relies on: the last rows of a whole prompt's attention are the chunk's."""
    whole = PagedBatch([(0, 40)], num_q_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=4)
    chunk = PagedBatch([(25, 15)], num_q_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=4)
    chunk.query = whole.query[25:].clone()  # the same tokens: seed 4 draws the same K/V for both
    assert torch.equal(chunk.keys[0], whole.keys[0])
    torch.testing.assert_close(attend(chunk, True), attend(whole, True)[25:], atol=1e-6, rtol=1e-6)


def test_off_the_cpu_kernel_a_chunk_after_a_prefix_falls_back_to_one_masked_call(monkeypatch):
    # The torch backend on another device has no log-sum-exp kernel to merge with.
    batch = PagedBatch(CHUNKS_AFTER_PREFIX, num_q_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    monkeypatch.setattr(torch_ref, "_cpu_flash_attention", None)
    torch.testing.assert_close(attend(batch, True).double(), batch.dense_causal_attention(), atol=1e-5, rtol=1e-5)


def test_the_plan_reads_consecutive_blocks_in_place_and_sizes_its_buffers_for_the_gathers_only():
    in_place = PagedBatch([(13, 16), (0, 7)], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                          shuffle_blocks=False)
    plan = TorchAttentionPlan.build(in_place.meta, in_place.key_cache, torch.float32,
                                    lambda size: (torch.empty(size), torch.empty(size)))
    first_blocks = [sequence.first_block for sequence in plan.sequences]
    assert first_blocks == in_place.meta.block_tables[:, 0].tolist()  # 8 and 2 blocks, each a run
    assert plan.key_blocks.numel() == 0  # nothing to gather

    gathered = PagedBatch([(13, 16), (0, 7)], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    plan = TorchAttentionPlan.build(gathered.meta, gathered.key_cache, torch.float32,
                                    lambda size: (torch.empty(size), torch.empty(size)))
    assert [sequence.first_block for sequence in plan.sequences] == [None, None]
    assert plan.key_blocks.numel() == 8 * gathered.key_cache[0].numel()  # the longer sequence's 8 blocks


def test_prefill_attention_runs_the_fused_kernel_not_the_math_path():
    """The math path materialises [heads, query_len, seq_len] scores: the cost that grew quadratically."""
    batch = PagedBatch([(0, 64), (40, 24), (30, 1)], num_q_heads=6, num_kv_heads=2, head_dim=16,
                       dtype=torch.float32, block_size=16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        attend(batch, hand_in_new_kv=True)
    ops = {event.key for event in profile.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
