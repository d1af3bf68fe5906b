"""Split-KV (flash-decoding) under TRITON_INTERPRET=1: segments, the merge, graph-style batches.

Tiny shapes with a shrunk tuning (16-key tiles and segments) so a few dozen keys span many segments.
"""

from attention_harness import TOLERANCE, PagedBatch  # sets TRITON_INTERPRET first

import pytest
import torch

from replica.attention.launch_plan import AttentionPlan, AttentionTuning, KernelConfig
from replica.attention.torch_ref import TorchAttentionBackend
from replica.attention.triton_backend import SegmentPartials, TritonAttentionBackend, merge_segments, paged_attention

TINY_CONFIG = KernelConfig(key_tile=16, num_warps=4, num_stages=2)
TINY_TUNING = AttentionTuning(decode_configs={16: TINY_CONFIG, 32: TINY_CONFIG},
                              split_configs={16: TINY_CONFIG, 32: TINY_CONFIG},
                              prefill_configs={16: TINY_CONFIG, 32: TINY_CONFIG}, segment_min_keys=16)


def split_plan(num_segments, queries_per_kv, tile_rows=16) -> AttentionPlan:
    return AttentionPlan(num_segments=num_segments, tile_rows=tile_rows, tile_tokens=tile_rows // queries_per_kv,
                         config=TINY_CONFIG, segment_min_keys=16)


def nan_partials(num_tokens, num_q_heads, num_segments, head_dim) -> SegmentPartials:
    """Scratch full of NaN: a segment the kernel writes becomes finite, one it skips stays NaN."""
    partials = SegmentPartials.empty(num_tokens, num_q_heads, num_segments, head_dim, "cpu")
    for tensor in (partials.out, partials.max, partials.sum):
        tensor.fill_(float("nan"))
    return partials


def run_split(batch: PagedBatch, plan: AttentionPlan, partials: SegmentPartials | None = None) -> torch.Tensor:
    output = torch.empty_like(batch.query)
    paged_attention(*batch.args, plan, output, partials)
    return output


# Decodes over 8 segments of at least 16 keys: seq_len 13 fits one segment (16 keys), 29 spans
# two (16 each), 37 three (16 each), 150 five (cdiv(150, 8) = 19 -> 32 keys each). None of the
# lengths is a multiple of the block size (4) or of a segment.
DECODES_OVER_SEGMENTS = [(12, 1), (28, 1), (36, 1), (149, 1)]
SEGMENTS_USED = [1, 2, 3, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_split_kv_equals_reference_for_one_two_and_many_segments(dtype, num_q_heads, num_kv_heads):
    batch = PagedBatch(DECODES_OVER_SEGMENTS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=16,
                       dtype=dtype)
    plan = split_plan(8, num_q_heads // num_kv_heads)
    partials = nan_partials(len(DECODES_OVER_SEGMENTS), num_q_heads, 8, 16)

    output = run_split(batch, plan, partials)

    expected = TorchAttentionBackend().forward(*batch.args)
    torch.testing.assert_close(output, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # Probe: each sequence really was cut into the segments its length calls for, and the rest
    # of the grid (sized for 8) wrote nothing that the merge could have read.
    written_segments = partials.max.isfinite().all(dim=1).sum(dim=1).tolist()
    assert written_segments == SEGMENTS_USED
    assert partials.max.isnan().any(dim=1).sum(dim=1).tolist() == [8 - used for used in SEGMENTS_USED]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kv_equals_reference_for_short_query_segments_with_causal_masking(dtype):
    # A 4-token segment at positions 46-49 whose last segment starts at key 48: its first two
    # rows see no key there and must weigh nothing in the merge. Plus a 3-token segment and a decode.
    batch = PagedBatch([(46, 4), (40, 3), (12, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype, seed=1)
    plan = split_plan(8, queries_per_kv=2)

    output = run_split(batch, plan)

    torch.testing.assert_close(output.double(), batch.dense_causal_attention(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_split_kv_single_pass_and_reference_agree_on_head_dim_not_a_power_of_two():
    batch = PagedBatch(DECODES_OVER_SEGMENTS, num_q_heads=4, num_kv_heads=1, head_dim=24, dtype=torch.float32, seed=2)
    expected = batch.dense_causal_attention().float()
    torch.testing.assert_close(run_split(batch, split_plan(4, queries_per_kv=4)), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run_split(batch, split_plan(1, queries_per_kv=4)), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graph_style_batch_with_padding_rows_and_max_model_len_bound_matches_reference(dtype):
    """What a captured decode graph sees: max_seq_len is max_model_len, padding rows sit on the null block."""
    batch = PagedBatch([(30, 1), (5, 1), (61, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype, seed=3,
                       padding_rows=3, max_seq_len=4096)
    backend = TritonAttentionBackend(TINY_TUNING, num_sms=8)
    plan = backend.plan(batch.query, batch.key_cache, batch.meta)
    # 6 seqs x 2 kv heads busy; 8 SMs x 4 programs -> 2 segments (4096 keys would allow 64).
    assert (plan.num_segments, plan.tile_rows) == (2, 16)

    output = backend.forward(*batch.args)

    real = batch.num_real_tokens
    torch.testing.assert_close(output[:real].double(), batch.dense_causal_attention(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # A padding row attends to the null block's one (zeroed) slot: finite, exactly its value.
    assert torch.equal(output[real:], torch.zeros_like(output[real:]))


def test_many_segments_under_a_loose_bound_leave_short_sequences_to_their_first_segments():
    batch = PagedBatch([(30, 1), (5, 1), (61, 1)], num_q_heads=2, num_kv_heads=1, head_dim=16,
                       dtype=torch.float32, seed=4, padding_rows=1, max_seq_len=2048)
    backend = TritonAttentionBackend(TINY_TUNING, num_sms=64)
    plan = backend.plan(batch.query, batch.key_cache, batch.meta)
    assert plan.num_segments == 64  # capped by max_segments; the real contexts use at most 4

    output = backend.forward(*batch.args)

    torch.testing.assert_close(output[:3].double(), batch.dense_causal_attention(), atol=1e-5, rtol=1e-5)
    assert output[3:].isfinite().all()


def test_backend_takes_the_single_pass_for_mixed_batches_and_matches_reference():
    batch = PagedBatch([(0, 9), (40, 1), (70, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16,
                       dtype=torch.float32, seed=5)
    backend = TritonAttentionBackend(TINY_TUNING, num_sms=64)
    assert not backend.plan(batch.query, batch.key_cache, batch.meta).is_split  # a 9-token chunk is a prefill
    torch.testing.assert_close(backend.forward(*batch.args).double(), batch.dense_causal_attention(),
                               atol=1e-5, rtol=1e-5)


def partial_softmax(query, keys, values, scale):
    """(unnormalised output, log2-domain max, exp2 sum) of one query row over some keys, in float64."""
    if keys.shape[0] == 0:
        return torch.zeros(query.shape[-1], dtype=torch.float64), -1.0e30, 0.0
    scores = (keys @ query) * scale * 1.4426950408889634
    row_max = scores.max()
    probs = torch.exp2(scores - row_max)
    return probs @ values, row_max.item(), probs.sum().item()


def test_merge_kernel_alone_equals_softmax_over_the_union_of_segments():
    # Three decode sequences over 4 segments of >= 16 keys: 10 keys use 1 segment, 40 use 3, 64 use 4.
    seq_lens, num_q_heads, head_dim, num_segments = [10, 40, 64], 2, 16, 4
    keys_per_segment = [16, 16, 16]
    plan = split_plan(num_segments, queries_per_kv=1)
    generator = torch.Generator().manual_seed(6)
    partials = nan_partials(len(seq_lens), num_q_heads, num_segments, head_dim)
    expected = torch.empty(len(seq_lens), num_q_heads, head_dim, dtype=torch.float64)
    for token, (seq_len, seg_keys) in enumerate(zip(seq_lens, keys_per_segment)):
        for head in range(num_q_heads):
            query = torch.randn(head_dim, generator=generator, dtype=torch.float64)
            keys = torch.randn(seq_len, head_dim, generator=generator, dtype=torch.float64) * 2
            values = torch.randn(seq_len, head_dim, generator=generator, dtype=torch.float64)
            visible = torch.ones(seq_len, dtype=torch.bool)
            if (token, head) == (1, 0):
                visible[16:32] = False  # one segment this row sees no key of: (floor, 0, 0)
            for segment in range(-(-seq_len // seg_keys)):
                span = slice(segment * seg_keys, min((segment + 1) * seg_keys, seq_len))
                mask = visible[span]
                out, row_max, row_sum = partial_softmax(query, keys[span][mask], values[span][mask], 0.25)
                partials.out[token, head, segment] = out.float()
                partials.max[token, head, segment] = row_max
                partials.sum[token, head, segment] = row_sum
            probs = ((keys[visible] @ query) * 0.25).softmax(0)
            expected[token, head] = probs @ values[visible]
    meta = PagedBatch([(seq_len - 1, 1) for seq_len in seq_lens], num_q_heads, 1, head_dim, torch.float32).meta
    output = torch.empty(len(seq_lens), num_q_heads, head_dim)

    merge_segments(output, partials, meta, plan)

    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
