"""The torch backend plans each forward pass once: layers share the plan, a new pass gets a new one,
and every pass gathers into the same buffers unless it needs bigger ones.

A pass is recognised by its metadata object; a layer seen again starts a new pass even when the
same metadata object was refilled in place (persistent buffers), so no layer reads a stale plan.
"""

from attention_harness import PagedBatch  # first: it sets TRITON_INTERPRET before any Triton import

import torch

from replica.attention import allocate_kv_cache
from replica.attention import torch_plan
from replica.attention.torch_plan import TorchAttentionPlan
from replica.attention.torch_ref import TorchAttentionBackend

DECODES = [(12, 1), (3, 1), (0, 1), (17, 1)]
# Same row count and block-table width as DECODES (block size 4), other lengths and blocks.
OTHER_DECODES = [(14, 1), (2, 1), (5, 1), (16, 1)]
MIXED = [(0, 7), (9, 6), (12, 1), (3, 1), (5, 1)]


def layer_caches(batch: PagedBatch, num_layers: int):
    """num_layers caches, each a copy of the batch's: every layer must attend to the same answer."""
    caches = allocate_kv_cache(num_layers, *batch.key_cache.shape[:2], *batch.key_cache.shape[2:],
                               batch.key_cache.dtype, "cpu")
    for key_cache, value_cache in caches:
        key_cache.copy_(batch.key_cache)
        value_cache.copy_(batch.value_cache)
    return caches


def count_builds(monkeypatch) -> list:
    builds = []
    build = TorchAttentionPlan.build.__func__

    def counting_build(cls, *args):
        builds.append(args)
        return build(cls, *args)

    monkeypatch.setattr(TorchAttentionPlan, "build", classmethod(counting_build))
    return builds


def test_every_layer_of_a_pass_attends_with_the_plan_its_first_layer_built(monkeypatch):
    builds = count_builds(monkeypatch)
    batch = PagedBatch(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    expected = batch.dense_causal_attention()
    backend = TorchAttentionBackend()
    for key_cache, value_cache in layer_caches(batch, num_layers=3):
        output = backend.forward(batch.query, key_cache, value_cache, batch.meta, batch.scale)
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    assert len(builds) == 1


def test_metadata_refilled_in_place_for_the_next_pass_is_planned_anew(monkeypatch):
    builds = count_builds(monkeypatch)
    first = PagedBatch(DECODES, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    second = PagedBatch(OTHER_DECODES, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=5)
    backend = TorchAttentionBackend()
    backend.forward(first.query, first.key_cache, first.value_cache, first.meta, first.scale)

    # The next step reuses the same metadata object and cache, refilled in place.
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        getattr(first.meta, name).copy_(getattr(second.meta, name))
    first.meta.max_seq_len = second.meta.max_seq_len
    first.key_cache.copy_(second.key_cache)
    first.value_cache.copy_(second.value_cache)
    output = backend.forward(second.query, first.key_cache, first.value_cache, first.meta, second.scale)

    assert len(builds) == 2
    torch.testing.assert_close(output.double(), second.dense_causal_attention(), atol=1e-5, rtol=1e-5)


def test_write_kv_finds_padding_slots_again_when_a_pass_refills_the_slot_mapping():
    [(key_cache, value_cache)] = allocate_kv_cache(1, 4, 4, 1, 2, torch.float32, "cpu")
    slot_mapping = torch.tensor([3, 5], dtype=torch.int64)
    backend = TorchAttentionBackend()
    backend.write_kv(torch.ones(2, 1, 2), torch.ones(2, 1, 2), key_cache, value_cache, slot_mapping)

    slot_mapping.copy_(torch.tensor([9, -1]))  # the next pass: its second token is padding
    backend.write_kv(torch.full((2, 1, 2), 2.0), torch.full((2, 1, 2), 2.0), key_cache, value_cache, slot_mapping)

    written = key_cache.view(-1, 2)[:, 0]
    assert written.tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0]


def test_passes_gather_into_the_backends_buffers_which_grow_only_when_a_pass_needs_more():
    # DECODES gathers 4 rows x 5 blocks; MIXED at most 9 blocks (a 3-row decode group).
    large = PagedBatch(DECODES, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    small = PagedBatch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=3)
    backend = TorchAttentionBackend()
    plans = []
    for batch in (large, small, large):
        output = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
        torch.testing.assert_close(output.double(), batch.dense_causal_attention(), atol=1e-5, rtol=1e-5)
        plans.append(backend._plan._value)
    assert len({id(plan) for plan in plans}) == 3  # a plan per pass...
    buffers = {(plan.key_blocks.data_ptr(), plan.value_blocks.data_ptr()) for plan in plans}
    assert len(buffers) == 1  # ...and one pair of buffers: the smaller pass fits in the larger's


def test_decode_groups_gather_no_more_than_the_byte_budget_and_attend_as_the_reference(monkeypatch):
    # 20 decodes of 1-40 tokens (block size 4): one block's K+V is 2 x 4 x 2 x 16 x 4 = 1 KiB.
    decodes = [(cached, 1) for cached in (0, 39, 3, 20, 7, 11, 30, 2, 15, 25, 5, 9, 33, 1, 18, 27, 6, 13, 36, 22)]
    batch = PagedBatch(decodes, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    block_bytes = 2 * batch.key_cache[0].numel() * batch.key_cache.element_size()
    budget = 24 * block_bytes
    monkeypatch.setattr(torch_plan, "DECODE_GROUP_BYTES", budget)
    backend = TorchAttentionBackend()

    output = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)

    torch.testing.assert_close(output.double(), batch.dense_causal_attention(), atol=1e-5, rtol=1e-5)
    groups = backend._plan._value.decode_groups
    rows = sorted(row for group in groups for row in group.token_index.tolist())
    assert rows == list(range(len(decodes)))  # every decode in exactly one group
    for group in groups:
        assert group.num_rows <= torch_plan.DECODE_GROUP_SIZE
        assert group.num_rows == 1 or group.block_index.numel() * block_bytes <= budget
    assert 1 < len(groups) < len(decodes)  # the budget split the batch, yet rows still share calls
