"""The launch plan: which batch shapes split the KV, into how many segments, with which tile and config.

A pure function of shape numbers, so a CUDA graph captured for one batch always takes the same path.
"""

import attention_harness  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import pytest
import torch

from replica.attention import AttentionMetadata
from replica.attention.launch_plan import (
    DEFAULT_TUNING,
    DECODE_CONFIGS,
    PREFILL_CONFIGS,
    SPLIT_CONFIGS,
    config_for,
    plan_attention,
    reachable_plans,
    split_programs_per_sm,
)
from replica.attention.triton_backend import TritonAttentionBackend

H100_SMS = 132

# (num_seqs, max_query_len, max_seq_len, q heads, kv heads, head dim) -> (segments, tile rows).
# Default tuning: 16 warps per SM (4-warp configs: 528 programs on an H100), segments of >= 256 keys,
# at most 64, a power of two.
PLANS = [
    # Issue 10's decode shapes: few sequences split, many keep the single pass.
    ((1, 1, 16384, 32, 8, 128), (64, 16)),  # 8 busy programs -> 66 wanted, capped at 64
    ((8, 1, 4096, 32, 8, 128), (8, 16)),  # 64 busy -> 8
    ((32, 1, 2048, 32, 8, 128), (2, 16)),  # 256 busy -> 2
    ((64, 1, 4096, 32, 8, 128), (1, 16)),  # 512 busy already fill 528
    ((256, 1, 4096, 32, 8, 128), (1, 16)),
    ((1, 1, 16384, 32, 8, 64), (64, 16)),
    # A mixed batch (prefill chunk + decodes) keeps the single pass and 64-row tiles.
    ((128, 2048, 3072, 32, 8, 128), (1, 64)),
    # Short query segments (speculative decoding) split too, in tiles sized to them.
    ((1, 4, 16384, 32, 8, 128), (64, 16)),
    ((4, 8, 4096, 32, 8, 128), (8, 32)),  # 32-row tiles run 8 warps at head dim 128: 2 programs per SM
    # Short contexts: no segment under 256 keys.
    ((1, 1, 300, 32, 8, 128), (2, 16)),
    ((1, 1, 256, 32, 8, 128), (1, 16)),
    # A captured graph's bound (max_model_len) caps segments only; occupancy decides.
    ((4, 1, 131072, 32, 8, 128), (16, 16)),
    # MQA: a tile holds all 32 query heads of one token.
    ((1, 1, 4096, 32, 1, 128), (16, 32)),
]


@pytest.mark.parametrize("shape,expected", PLANS, ids=[str(shape) for shape, _ in PLANS])
def test_plan_splits_only_batches_that_under_fill_the_gpu(shape, expected):
    plan = plan_attention(*shape, num_sms=H100_SMS)
    assert (plan.num_segments, plan.tile_rows) == expected
    assert plan.is_split == (expected[0] > 1)
    num_q_heads, num_kv_heads = shape[3], shape[4]
    assert plan.tile_tokens * (num_q_heads // num_kv_heads) == plan.tile_rows


def test_plan_takes_its_kernel_config_from_the_table_for_its_tile_and_head_size():
    decode = plan_attention(1, 1, 16384, 32, 8, 64, num_sms=H100_SMS)
    short_query = plan_attention(1, 8, 16384, 32, 8, 64, num_sms=H100_SMS)  # 8 tokens x 4 heads: 32 rows
    prefill = plan_attention(16, 512, 4096, 32, 8, 128, num_sms=H100_SMS)
    assert (decode.tile_rows, decode.config) == (16, DECODE_CONFIGS[64])
    assert (short_query.tile_rows, short_query.config) == (32, SPLIT_CONFIGS[64])
    assert (prefill.tile_rows, prefill.config) == (64, PREFILL_CONFIGS[128])
    assert config_for(DECODE_CONFIGS, 80) == DECODE_CONFIGS[128]  # padded to 128
    assert config_for(DECODE_CONFIGS, 512) == DECODE_CONFIGS[256]  # beyond the table: its largest entry


def test_split_grids_are_sized_in_warps_so_wider_configs_get_fewer_programs():
    """16 warps per SM: 4 programs of the 4-warp decode config, 2 of the 8-warp split config at head dim
    128 (an H100 holds no more of either without spilling: test_attention_compile.py)."""
    assert (split_programs_per_sm(DECODE_CONFIGS[128], DEFAULT_TUNING),
            split_programs_per_sm(SPLIT_CONFIGS[128], DEFAULT_TUNING)) == (4, 2)
    # The same 8 sequences of 4 kv heads: 16-row tiles (1 token x 4 heads) vs 32 rows (8 tokens).
    assert plan_attention(8, 1, 32768, 16, 4, 128, num_sms=H100_SMS).num_segments == 16  # 528 // 32
    assert plan_attention(8, 8, 32768, 16, 4, 128, num_sms=H100_SMS).num_segments == 8  # 264 // 32


def test_more_sms_split_the_same_batch_into_more_segments():
    h100 = plan_attention(8, 1, 32768, 32, 8, 128, num_sms=H100_SMS)
    smaller_gpu = plan_attention(8, 1, 32768, 32, 8, 128, num_sms=46)
    assert (h100.num_segments, smaller_gpu.num_segments) == (8, 2)


def test_backend_plans_from_shapes_without_reading_any_tensor():
    """Tensors on the meta device have no values: a plan that synced or read one would raise."""
    def meta_tensor(*shape, dtype=torch.int32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    meta = AttentionMetadata(query_start_loc=meta_tensor(9), seq_lens=meta_tensor(8), block_tables=meta_tensor(8, 256),
                             slot_mapping=meta_tensor(8, dtype=torch.int64), max_query_len=1, max_seq_len=4096)
    query = meta_tensor(8, 32, 128, dtype=torch.bfloat16)
    key_cache = meta_tensor(1024, 16, 8, 128, dtype=torch.bfloat16)
    plan = TritonAttentionBackend(num_sms=H100_SMS).plan(query, key_cache, meta)
    assert plan == plan_attention(8, 1, 4096, 32, 8, 128, num_sms=H100_SMS)


# (q heads, kv heads, head dim, max_model_len, SMs): GQA 4 and 8, SmolLM2's 3, MHA, MQA, a short model.
MODELS = [(32, 8, 128, 8192, H100_SMS), (64, 8, 128, 32768, H100_SMS), (9, 3, 64, 8192, H100_SMS),
          (32, 32, 128, 4096, H100_SMS), (32, 1, 128, 131072, H100_SMS), (32, 8, 64, 600, 46), (2, 1, 16, 5, 1)]


def _grid_plans(num_q_heads, num_kv_heads, head_dim, max_model_len, num_sms):
    """plan_attention over a grid of batch shapes that reaches every segment count and tile."""
    plans = set()
    seq_lens = sorted({*range(1, 40), *(256 * s + d for s in range(1, 130) for d in (-1, 0, 1)), max_model_len})
    for num_seqs in (1, 2, 3, 5, 8, 13, 32, 100, 256):
        for max_query_len in (*range(1, 13), 16, 100, 2048):
            for max_seq_len in seq_lens:
                if max_query_len <= max_seq_len <= max_model_len:
                    plans.add(plan_attention(num_seqs, max_query_len, max_seq_len, num_q_heads, num_kv_heads,
                                             head_dim, num_sms))
    return plans


@pytest.mark.parametrize("model", MODELS, ids=[str(model) for model in MODELS])
def test_reachable_plans_are_exactly_the_plans_batch_shapes_reach_and_few(model):
    """warm_up compiles reachable_plans; a batch shape picking anything else would compile mid-step."""
    num_q_heads, num_kv_heads, head_dim, max_model_len, num_sms = model
    reachable = reachable_plans(num_q_heads, num_kv_heads, head_dim, num_sms=num_sms, max_model_len=max_model_len)
    assert set(reachable) == _grid_plans(*model)
    assert len(reachable) == len(set(reachable)) <= 22  # 3 split tiles x 7 segment counts + the prefill tile


def test_segment_counts_are_powers_of_two_rounded_down():
    """Each distinct count is a compile; rounding down keeps segments >= segment_min_keys and the grid
    within the occupancy target."""
    counts = {plan_attention(num_seqs, 1, max_seq_len, 32, 8, 128, num_sms=H100_SMS).num_segments
              for num_seqs in range(1, 70) for max_seq_len in range(1, 20000, 97)}
    assert counts == {1, 2, 4, 8, 16, 32, 64}
    assert plan_attention(3, 1, 16384, 32, 8, 128, num_sms=H100_SMS).num_segments == 16  # 528 // 24 = 22 -> 16
    assert plan_attention(1, 1, 256 * 5, 32, 8, 128, num_sms=H100_SMS).num_segments == 4  # 5 segments' worth -> 4
