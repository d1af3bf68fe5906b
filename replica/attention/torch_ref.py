"""Pure-torch paged attention: the reference the Triton kernels are tested against, and the CPU backend.

One scaled_dot_product_attention call per prefill sequence over its gathered cache blocks;
single-token decodes share padded calls in groups of DECODE_GROUP_SIZE, sorted by context
length. Simple enough to read as the specification of the contract in base.py;
`dense_causal_attention` is the float64 ground truth both backends are measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica.attention.base import AttentionBackend, AttentionMetadata


DECODE_GROUP_SIZE = 16


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        # Negative slots mark padding tokens that own no cache slot.
        is_real_token = slot_mapping >= 0
        if not bool(is_real_token.all()):
            key, value, slot_mapping = key[is_real_token], value[is_real_token], slot_mapping[is_real_token]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = key_cache.shape[1:]
        output = torch.empty_like(query)
        # One host sync for the whole batch rather than one per sequence.
        query_starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        decode_rows = [i for i in range(len(seq_lens)) if query_starts[i + 1] - query_starts[i] == 1]
        batched = set()
        if len(decode_rows) > 1:
            # Single-token queries (decodes) share padded attention calls: per-call overhead
            # dominates small decode batches on a CPU. Sorted by context length and split into
            # groups, the padding that is gathered and attended for nothing stays small.
            decode_rows.sort(key=lambda i: seq_lens[i])
            for first in range(0, len(decode_rows), DECODE_GROUP_SIZE):
                group = decode_rows[first:first + DECODE_GROUP_SIZE]
                self._batched_decode(query, key_cache, value_cache, meta, scale, output,
                                     group, [query_starts[i] for i in group], [seq_lens[i] for i in group])
            batched = set(decode_rows)
        for seq_idx, seq_len in enumerate(seq_lens):
            if seq_idx in batched:
                continue
            query_start, query_end = query_starts[seq_idx], query_starts[seq_idx + 1]
            query_len = query_end - query_start
            if query_len == 0:
                continue
            num_blocks = -(-seq_len // block_size)
            block_ids = meta.block_tables[seq_idx, :num_blocks].long()
            keys = key_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            values = value_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            seq_query = query[query_start:query_end].transpose(0, 1)  # [heads, q_len, head_dim]
            seq_output = F.scaled_dot_product_attention(
                seq_query,
                keys.transpose(0, 1).to(query.dtype),
                values.transpose(0, 1).to(query.dtype),
                attn_mask=_causal_offset_mask(query_len, seq_len, query.device),
                scale=scale,
                enable_gqa=True,
            )
            output[query_start:query_end] = seq_output.transpose(0, 1)
        return output

    @staticmethod
    def _batched_decode(query, key_cache, value_cache, meta, scale, output, rows, query_rows, seq_lens) -> None:
        block_size, num_kv_heads, head_dim = key_cache.shape[1:]
        max_len = max(seq_lens)
        num_blocks = -(-max_len // block_size)
        device = query.device
        row_index = torch.tensor(rows, device=device)
        block_ids = meta.block_tables[row_index, :num_blocks].long()  # [batch, blocks]; padding -> null block
        keys = key_cache[block_ids].reshape(len(rows), -1, num_kv_heads, head_dim)[:, :max_len]
        values = value_cache[block_ids].reshape(len(rows), -1, num_kv_heads, head_dim)[:, :max_len]
        lengths = torch.tensor(seq_lens, device=device)
        padding = torch.arange(max_len, device=device)[None, :] >= lengths[:, None]  # [batch, max_len]
        # An additive float mask: the CPU kernel takes a faster path than with a boolean one.
        attn_mask = torch.zeros(len(rows), 1, 1, max_len, dtype=query.dtype, device=device)
        attn_mask.masked_fill_(padding[:, None, None, :], float("-inf"))
        token_index = torch.tensor(query_rows, device=device)
        num_q_heads = query.shape[1]
        # A decode's query heads that share a kv head attend to the same keys, so they can ride
        # as that kv head's query rows: plain attention, no K/V repetition for GQA.
        grouped_query = query[token_index].view(len(rows), num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        attended = F.scaled_dot_product_attention(
            grouped_query,
            keys.transpose(1, 2).to(query.dtype),
            values.transpose(1, 2).to(query.dtype),
            attn_mask=attn_mask,
            scale=scale,
        )
        output[token_index] = attended.reshape(len(rows), num_q_heads, head_dim)


def _causal_offset_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean [query_len, seq_len] mask: the queries are the last query_len positions of the context."""
    if query_len == 1:
        return None  # a single newest token sees the whole context
    query_positions = torch.arange(seq_len - query_len, seq_len, device=device)
    key_positions = torch.arange(seq_len, device=device)
    return key_positions[None, :] <= query_positions[:, None]


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
    mask = _causal_offset_mask(query_len, seq_len, query.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
