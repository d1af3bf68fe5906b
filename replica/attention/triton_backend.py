"""Triton paged attention for mixed batches: prefill chunks and decode tokens in one launch.

`_paged_attention_kernel` tiles each sequence's queries together with all query heads that
share one kv head (GQA), streams that sequence's K/V through its block table and keeps an
online softmax in fp32. `_write_kv_kernel` scatters new K/V into their cache slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replica.attention.base import AttentionBackend, AttentionMetadata

# Rows of a query tile for decode-only batches (one token per sequence): the smallest tl.dot size.
_DECODE_TILE_ROWS = 16
# Rows of a query tile once any sequence brings several tokens: bigger tiles reread K/V less often.
_PREFILL_TILE_ROWS = 64
# Keys per inner-loop step; independent of the cache block size, which only shapes the address math.
_KEY_TILE = 32


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_tile_idx, num_seqs, TILE_TOKENS: tl.constexpr):
    """Binary search for the sequence owning global query tile q_tile_idx.

    Sequence i owns global tiles starting at query_start_loc[i] // TILE_TOKENS + i: enough room
    for cdiv(q_len_i, TILE_TOKENS) tiles whatever the alignment, so no search table is needed.
    """
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile_of_mid = tl.load(query_start_loc_ptr + mid) // TILE_TOKENS + mid
        if first_tile_of_mid <= q_tile_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, num_seqs, block_size,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_o_token, stride_o_head, stride_o_dim,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_cache_dim,
    stride_block_table_seq,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_TOKENS: tl.constexpr,
    KEY_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_tile_idx, num_seqs, TILE_TOKENS)
    query_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - query_start
    local_tile_idx = q_tile_idx - (query_start // TILE_TOKENS + seq_idx)
    if local_tile_idx * TILE_TOKENS >= query_len:
        return  # spare tile: the grid is an upper bound on tiles needed

    seq_len = tl.load(seq_lens_ptr + seq_idx)
    num_cached_before = seq_len - query_len

    # Row r of the tile is query token r // QUERIES_PER_KV with query head r % QUERIES_PER_KV of this kv head.
    rows = tl.arange(0, TILE_ROWS)
    token_in_seq = local_tile_idx * TILE_TOKENS + rows // QUERIES_PER_KV
    q_head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows // QUERIES_PER_KV < TILE_TOKENS) & (token_in_seq < query_len)
    query_position = num_cached_before + token_in_seq

    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    token_row = (query_start + token_in_seq).to(tl.int64)
    q_offsets = token_row[:, None] * stride_q_token + q_head[:, None] * stride_q_head + dims[None, :] * stride_q_dim
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Padding rows never see a key; a finite floor keeps their exp() at 0 instead of NaN.
    running_max = tl.full([TILE_ROWS], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([TILE_ROWS], dtype=tl.float32)
    acc = tl.zeros([TILE_ROWS, HEAD_DIM_PADDED], dtype=tl.float32)

    # Causality: no row of this tile looks past its last token's position.
    last_token_in_tile = tl.minimum((local_tile_idx + 1) * TILE_TOKENS, query_len) - 1
    num_visible_keys = num_cached_before + last_token_in_tile + 1
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    for key_start in range(0, num_visible_keys, KEY_TILE):
        key_position = key_start + tl.arange(0, KEY_TILE)
        key_valid = key_position < num_visible_keys
        block_id = tl.load(
            block_tables_ptr + seq_idx.to(tl.int64) * stride_block_table_seq + key_position // block_size,
            mask=key_valid, other=0,
        ).to(tl.int64)
        slot_offset = block_id * stride_cache_block + (key_position % block_size).to(tl.int64) * stride_cache_offset
        kv_mask = key_valid[None, :] & dim_valid[:, None]
        k = tl.load(key_cache_ptr + head_offset + slot_offset[None, :] + dims[:, None] * stride_cache_dim,
                    mask=kv_mask, other=0.0)  # [HEAD_DIM_PADDED, KEY_TILE]
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = key_valid[None, :] & (key_position[None, :] <= query_position[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(value_cache_ptr + head_offset + slot_offset[:, None] + dims[None, :] * stride_cache_dim,
                    mask=tl.trans(kv_mask), other=0.0)  # [KEY_TILE, HEAD_DIM_PADDED]
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    out = acc / running_sum[:, None]
    o_offsets = token_row[:, None] * stride_o_token + q_head[:, None] * stride_o_head + dims[None, :] * stride_o_dim
    tl.store(output_ptr + o_offsets, out.to(output_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, block_size,
    stride_k_token, stride_k_head, stride_k_dim,
    stride_v_token, stride_v_head, stride_v_dim,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_cache_dim,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return  # padding token
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    cache_offsets = ((slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_offset
                     + heads[:, None] * stride_cache_head + dims[None, :] * stride_cache_dim)
    key = tl.load(key_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :] * stride_k_dim,
                  mask=mask)
    value = tl.load(value_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :] * stride_v_dim,
                    mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        _write_kv_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping, key_cache.shape[1],
            *key.stride(), *value.stride(), *key_cache.stride(),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HEADS_PADDED=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        )

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens, num_q_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        output = torch.empty_like(query)
        if num_tokens == 0:
            return output
        queries_per_kv = num_q_heads // num_kv_heads
        tile_rows = _DECODE_TILE_ROWS if meta.max_query_len == 1 else _PREFILL_TILE_ROWS
        tile_rows = max(tile_rows, triton.next_power_of_2(queries_per_kv))
        tile_tokens = tile_rows // queries_per_kv
        num_seqs = meta.num_seqs
        grid = (num_tokens // tile_tokens + num_seqs, num_kv_heads)
        _paged_attention_kernel[grid](
            query, key_cache, value_cache, output,
            meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale * 1.4426950408889634,  # log2(e): the kernel works in exp2
            num_seqs, key_cache.shape[1],
            # One set of cache strides serves both caches: allocate_kv_cache makes them alike.
            *query.stride(), *output.stride(), *key_cache.stride(),
            meta.block_tables.stride(0),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
            QUERIES_PER_KV=queries_per_kv, TILE_ROWS=tile_rows, TILE_TOKENS=tile_tokens,
            KEY_TILE=_KEY_TILE,
            # fp32 caches ask for fp32 results; tf32 would drift ~1e-3 from the reference.
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        )
        return output
