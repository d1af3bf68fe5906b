"""warm_up launches every kernel variant the launch planner can pick (issue 20 item 9).

A batch's shape picks the variant (tile, config, segment count), and Triton compiles a variant on
its first launch, so a new shape in a mixed step would compile inside it. Under TRITON_INTERPRET=1
here: this checks what warm_up launches; the compiles themselves happen on a GPU.
"""

import attention_harness  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

from collections import Counter

import torch

from replica.attention import block_table_width, triton_backend
from replica.attention.launch_plan import plan_attention, reachable_plans
from replica.attention.torch_ref import TorchAttentionBackend
from replica.attention.triton_backend import TritonAttentionBackend


def test_warm_up_launches_every_reachable_plan_in_both_query_layouts(monkeypatch):
    launched = []
    real_paged_attention = triton_backend.paged_attention

    def recording(query, key_cache, value_cache, meta, scale, plan, output, partials=None):
        launched.append((plan, query.stride()))
        real_paged_attention(query, key_cache, value_cache, meta, scale, plan, output, partials)

    monkeypatch.setattr(triton_backend, "paged_attention", recording)
    backend = TritonAttentionBackend(num_sms=4)  # 16 programs: one sequence splits up to 8 ways over 2,048 keys

    plans = backend.warm_up(2, 1, 16, torch.float32, block_size=4, max_model_len=2048, device="cpu")

    assert plans == reachable_plans(2, 1, 16, num_sms=4, max_model_len=2048)
    assert sorted((plan.tile_rows, plan.num_segments) for plan in plans) == [(16, 1), (16, 2), (16, 4), (16, 8),
                                                                            (64, 1)]
    # Each plan in the fused-QKV view layout (row stride 2 + 1 + 1 heads of 16) and the contiguous one.
    assert Counter(launched) == Counter([(plan, (64, 16, 1)) for plan in plans] + [(plan, (32, 16, 1)) for plan in plans])
    # Any batch afterwards picks a plan warm_up launched.
    for num_seqs, max_query_len, max_seq_len in [(1, 1, 2048), (3, 1, 700), (2, 5, 40), (4, 300, 2000)]:
        assert plan_attention(num_seqs, max_query_len, max_seq_len, 2, 1, 16, num_sms=4) in plans


def test_torch_backend_warm_up_has_nothing_to_compile():
    assert TorchAttentionBackend().warm_up(2, 1, 16, torch.float32, 4, 2048, "cpu") is None


def test_the_block_tables_row_stride_is_a_multiple_of_16_whatever_max_model_len_profiling_leaves(monkeypatch):
    """Triton specializes an integer argument on its divisibility by 16. warm_up compiles with the
    model's max_model_len; a pool sized by profiling may cut it after (to 1,000 tokens, say) and
    the runner's block table follows the cut: its row stride must land in the same variant."""
    strides = []
    real_paged_attention = triton_backend.paged_attention

    def recording(query, key_cache, value_cache, meta, scale, plan, output, partials=None):
        strides.append(meta.block_tables.stride(0))
        real_paged_attention(query, key_cache, value_cache, meta, scale, plan, output, partials)

    monkeypatch.setattr(triton_backend, "paged_attention", recording)
    TritonAttentionBackend(num_sms=4).warm_up(2, 1, 16, torch.float32, block_size=16, max_model_len=1000, device="cpu")

    assert strides and set(strides) == {block_table_width(1000, 16)} == {64}  # 63 blocks' worth, rounded up
    for max_model_len, block_size in [(1000, 16), (1001, 16), (2048, 16), (4097, 16), (130_000, 16), (5, 4)]:
        width = block_table_width(max_model_len, block_size)
        assert width % 16 == 0 and width * block_size >= max_model_len > (width - 16) * block_size
