"""Pure-torch paged attention: the reference the Triton kernels are tested against, and the CPU backend.

One scaled_dot_product_attention call per prefill sequence over its gathered cache blocks;
single-token decodes share padded calls in groups sorted by context length. What each call reads
is planned once per forward pass (torch_plan.py); `dense_causal_attention` is the float64 ground
truth both backends are measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica.attention.base import AttentionBackend, AttentionMetadata
from replica.attention.torch_plan import (
    DecodeGroup, PerPassCache, SequenceAttention, TorchAttentionPlan, causal_offset_mask,
)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self):
        self._real_tokens = PerPassCache()
        self._plan = PerPassCache()
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        real_tokens = self._real_tokens.get(slot_mapping, (), key_cache, lambda: _real_tokens(slot_mapping))
        if real_tokens is not None:
            key, value, slot_mapping = key[real_tokens], value[real_tokens], slot_mapping[real_tokens]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._plan.get(meta, (key_cache.shape, key_cache.dtype, query.dtype), key_cache,
                              lambda: TorchAttentionPlan.build(meta, key_cache, query.dtype,
                                                               lambda size: self._buffers(size, key_cache)))
        output = torch.empty_like(query)
        for group in plan.decode_groups:
            _attend_decode_group(query, key_cache, value_cache, plan, group, scale, output)
        for sequence in plan.sequences:
            _attend_sequence(query, key_cache, value_cache, plan, sequence, scale, output)
        return output

    def _buffers(self, size: int, key_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather buffers of at least `size` elements, grown (never shrunk) as steps need."""
        buffers = self._gather_buffers
        if (buffers is None or buffers[0].numel() < size or buffers[0].dtype != key_cache.dtype
                or buffers[0].device != key_cache.device):
            buffers = self._gather_buffers = (key_cache.new_empty(size), key_cache.new_empty(size))
        return buffers


def _real_tokens(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """Bool mask of the tokens that own a cache slot (negative slots mark padding); None when all do."""
    is_real_token = slot_mapping >= 0
    return None if bool(is_real_token.all()) else is_real_token


def _gather_blocks(cache: torch.Tensor, block_index: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """[len(block_index) * block_size, num_kv_heads, head_dim]: these cache blocks, copied into `buffer`."""
    num_blocks = cache.shape[0]
    gathered = buffer[:block_index.numel() * cache[0].numel()].view(block_index.numel(), -1)
    torch.index_select(cache.view(num_blocks, -1), 0, block_index, out=gathered)
    return gathered.view(-1, *cache.shape[2:])


def _attend_decode_group(query, key_cache, value_cache, plan: TorchAttentionPlan, group: DecodeGroup, scale: float,
                         output) -> None:
    num_kv_heads, head_dim = key_cache.shape[2:]
    rows, num_q_heads = group.num_rows, query.shape[1]
    keys = _gather_blocks(key_cache, group.block_index, plan.key_blocks).view(rows, -1, num_kv_heads, head_dim)
    values = _gather_blocks(value_cache, group.block_index, plan.value_blocks).view(rows, -1, num_kv_heads, head_dim)
    # A decode's query heads that share a kv head attend to the same keys, so they can ride
    # as that kv head's query rows: plain attention, no K/V repetition for GQA.
    grouped_query = query[group.token_index].view(rows, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(
        grouped_query,
        keys[:, :group.max_len].transpose(1, 2).to(query.dtype),
        values[:, :group.max_len].transpose(1, 2).to(query.dtype),
        attn_mask=group.attn_mask,
        scale=scale,
    )
    output[group.token_index] = attended.reshape(rows, num_q_heads, head_dim)


def _attend_sequence(query, key_cache, value_cache, plan: TorchAttentionPlan, sequence: SequenceAttention, scale: float,
                     output) -> None:
    keys = _gather_blocks(key_cache, sequence.block_index, plan.key_blocks)[:sequence.seq_len]
    values = _gather_blocks(value_cache, sequence.block_index, plan.value_blocks)[:sequence.seq_len]
    seq_query = query[sequence.query_start:sequence.query_end].transpose(0, 1)  # [heads, q_len, head_dim]
    seq_output = F.scaled_dot_product_attention(
        seq_query,
        keys.transpose(0, 1).to(query.dtype),
        values.transpose(0, 1).to(query.dtype),
        attn_mask=sequence.causal_mask,
        scale=scale,
        enable_gqa=True,
    )
    output[sequence.query_start:sequence.query_end] = seq_output.transpose(0, 1)


def dense_causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 attention of one sequence's newest query tokens over its whole unpaged context.

    query [q_len, num_q_heads, head_dim] are the last q_len positions of keys / values
    [seq_len, num_kv_heads, head_dim]; query head h reads kv head h // (num_q_heads // num_kv_heads).
    """
    query_len, seq_len = query.shape[0], keys.shape[0]
    queries_per_kv = query.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(queries_per_kv, dim=1)
    values = values.double().repeat_interleave(queries_per_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    mask = causal_offset_mask(query_len, seq_len, query.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
