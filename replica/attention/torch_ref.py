"""Pure-torch paged attention: the reference the Triton kernels are tested against, and the CPU backend.

Every call is 4-D, so scaled_dot_product_attention runs its fused (flash) CPU kernel, which never
holds a sequence's whole score matrix. A prefill attends to its own new K/V with `is_causal`; a
chunk after a cached prefix adds its attention to the prefix (no mask) and merges the two by their
log-sum-exp, so its cost is the work done, not a masked square. Single-token decodes share padded
calls in groups sorted by context length. A context whose cache blocks are consecutive is read in
place; others are gathered. What each call reads is planned once per forward pass (torch_plan.py);
`dense_causal_attention` is the float64 ground truth both backends are measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica.attention.base import AttentionBackend, AttentionMetadata
from replica.attention.torch_plan import (
    DecodeGroup, PerPassCache, SequenceAttention, TorchAttentionPlan, causal_offset_mask,
)
from replica.core.kv_cache_manager import cdiv


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

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, scale: float, *,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        plan = self._plan.get(meta, (key_cache.shape, key_cache.dtype, query.dtype), key_cache,
                              lambda: TorchAttentionPlan.build(meta, key_cache, query.dtype,
                                                               lambda size: self._buffers(size, key_cache)))
        output = torch.empty_like(query)
        for group in plan.decode_groups:
            _attend_decode_group(query, key_cache, value_cache, plan, group, scale, output)
        for sequence in plan.sequences:
            _attend_sequence(query, key, value, key_cache, value_cache, plan, sequence, scale, output)
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


def _attend_sequence(query, key, value, key_cache, value_cache, plan: TorchAttentionPlan,
                     sequence: SequenceAttention, scale: float, output) -> None:
    start, end, prefix_len = sequence.query_start, sequence.query_end, sequence.prefix_len
    if sequence.query_len == 1:  # a lone decode: its newest token sees the whole context, no mask
        keys = _read_context(key_cache, sequence, sequence.seq_len, plan.key_blocks)
        values = _read_context(value_cache, sequence, sequence.seq_len, plan.value_blocks)
        # Its query heads ride as their kv head's query rows (as in a decode group): no GQA expansion.
        grouped_query = query[start].reshape(1, keys.shape[1], -1, keys.shape[2])
        attended = F.scaled_dot_product_attention(grouped_query, _heads_first(keys, query.dtype),
                                                  _heads_first(values, query.dtype), scale=scale)
        output[start] = attended.reshape(output.shape[1:])
        return
    if key is None:  # the new tokens' K/V not handed in: read them back from the cache with the prefix
        keys = _read_context(key_cache, sequence, sequence.seq_len, plan.key_blocks)
        values = _read_context(value_cache, sequence, sequence.seq_len, plan.value_blocks)
        new_keys, new_values = keys[prefix_len:], values[prefix_len:]
    else:
        new_keys, new_values = key[start:end], value[start:end]
    seq_query = _heads_first(query[start:end], query.dtype)  # [1, q_heads, query_len, head_dim]
    new_keys, new_values = _heads_first(new_keys, query.dtype), _heads_first(new_values, query.dtype)
    if prefix_len == 0:
        attended = F.scaled_dot_product_attention(seq_query, new_keys, new_values, is_causal=True, scale=scale,
                                                  enable_gqa=True)
    else:
        if key is not None:
            keys = _read_context(key_cache, sequence, prefix_len, plan.key_blocks)
            values = _read_context(value_cache, sequence, prefix_len, plan.value_blocks)
        attended = _attend_after_prefix(seq_query, _heads_first(keys[:prefix_len], query.dtype),
                                        _heads_first(values[:prefix_len], query.dtype), new_keys, new_values, scale)
    output[start:end] = attended[0].transpose(0, 1)


# The CPU flash kernel behind scaled_dot_product_attention, which also returns each query row's
# log-sum-exp: what merging two partial attentions needs (and the public function does not return).
_cpu_flash_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_after_prefix(query, prefix_keys, prefix_values, new_keys, new_values, scale: float) -> torch.Tensor:
    """[1, q_heads, query_len, head_dim]: a chunk's queries over a cached prefix and, causally, over themselves.

    Every query sees the whole prefix, and the new keys are as many as the queries, so the chunk's
    attention is two unmasked-or-causal flash calls merged by their log-sum-exp: exactly the work
    needed, never a [query_len, seq_len] mask. Off the CPU (the torch backend on another device) it
    falls back to one call with the offset causal mask.
    """
    if _cpu_flash_attention is None or query.device.type != "cpu":
        query_len, prefix_len = query.shape[2], prefix_keys.shape[2]
        mask = causal_offset_mask(query_len, prefix_len + query_len, query.device)
        return F.scaled_dot_product_attention(query, torch.cat((prefix_keys, new_keys), 2),
                                              torch.cat((prefix_values, new_values), 2), attn_mask=mask,
                                              scale=scale, enable_gqa=True)
    prefix_out, prefix_lse = _cpu_flash_attention(query, prefix_keys, prefix_values, scale=scale)
    new_out, new_lse = _cpu_flash_attention(query, new_keys, new_values, is_causal=True, scale=scale)
    lse = torch.logaddexp(prefix_lse, new_lse)
    prefix_weight = (prefix_lse - lse).exp_().unsqueeze(-1)
    new_weight = (new_lse - lse).exp_().unsqueeze(-1)
    return (prefix_out * prefix_weight).add_(new_out * new_weight).to(query.dtype)


def _heads_first(tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, head_dim] -> [1, heads, tokens, head_dim] (a view when the dtype already matches)."""
    return tokens.transpose(0, 1).unsqueeze(0).to(dtype)


def _read_context(cache: torch.Tensor, sequence: SequenceAttention, num_tokens: int,
                  buffer: torch.Tensor) -> torch.Tensor:
    """[num_tokens, num_kv_heads, head_dim]: the sequence's first num_tokens cached positions, a view of the
    cache when its blocks are consecutive, else gathered into `buffer`."""
    block_size = cache.shape[1]
    num_blocks = cdiv(num_tokens, block_size)
    if sequence.first_block is not None:
        run = cache[sequence.first_block:sequence.first_block + num_blocks]
    else:
        run = _gather_blocks(cache, sequence.block_index[:num_blocks], buffer)
    return run.reshape(-1, *cache.shape[2:])[:num_tokens]


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
