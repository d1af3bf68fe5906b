"""The launch plan: which batch shapes split the KV, into how many segments, with which tile and config.

A pure function of shape numbers, so a CUDA graph captured for one batch always takes the same path.
"""

import attention_harness  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import pytest
import torch

from replica.attention import AttentionMetadata
from replica.attention.launch_plan import (
    DECODE_CONFIGS,
    PREFILL_CONFIGS,
    config_for,
    plan_attention,
)
from replica.attention.triton_backend import TritonAttentionBackend

H100_SMS = 132

# (num_seqs, max_query_len, max_seq_len, q heads, kv heads, head dim) -> (segments, tile rows).
# Default tuning: 4 programs per SM (528 on an H100), segments of >= 256 keys, at most 64.
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
    ((4, 8, 4096, 32, 8, 128), (16, 32)),
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
    prefill = plan_attention(16, 512, 4096, 32, 8, 128, num_sms=H100_SMS)
    assert decode.config == DECODE_CONFIGS[64]
    assert prefill.config == PREFILL_CONFIGS[128]
    assert config_for(DECODE_CONFIGS, 80) == DECODE_CONFIGS[128]  # padded to 128
    assert config_for(DECODE_CONFIGS, 512) == DECODE_CONFIGS[256]  # beyond the table: its largest entry


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
