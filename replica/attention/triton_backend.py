"""Triton paged attention: one kernel for mixed batches, split-KV (flash-decoding) for small decode batches.

`_paged_attention_kernel` tiles each sequence's queries together with all query heads that
share one kv head (GQA), streams one key range of that sequence's K/V through its block table
and keeps an online softmax in fp32. Single pass: the range is the whole context and the program
writes the output. Split-KV: grid axis 2 cuts each context into segments whose programs write fp32
partials, and `_merge_segments_kernel` combines them. `_write_kv_kernel` scatters new K/V into the cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replica.attention.base import AttentionBackend, AttentionMetadata, allocate_kv_cache, block_table_width
from replica.attention.launch_plan import (
    DEFAULT_TUNING,
    AttentionPlan,
    AttentionTuning,
    padded_head_dim,
    plan_attention,
    reachable_plans,
)

# Triton on a CPU runs only under TRITON_INTERPRET=1 (tests); one "SM" keeps plans small there.
_INTERPRETER_NUM_SMS = 1
# Padding rows never see a key; a finite floor keeps their exp2() at 0 instead of NaN.
_NO_SCORE: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq_idx(query_start_loc_ptr, index, num_seqs, TILE_TOKENS: tl.constexpr, BY_TOKEN: tl.constexpr):
    """Binary search for the sequence owning `index`: a query token (BY_TOKEN) or a global query tile.

    Sequence i owns global tiles starting at query_start_loc[i] // TILE_TOKENS + i: enough room
    for cdiv(q_len_i, TILE_TOKENS) tiles whatever the alignment, so no search table is needed.
    """
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if BY_TOKEN:
            first_of_mid = tl.load(query_start_loc_ptr + mid)
        else:
            first_of_mid = tl.load(query_start_loc_ptr + mid) // TILE_TOKENS + mid
        if first_of_mid <= index:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _keys_per_segment(seq_len, NUM_SEGMENTS: tl.constexpr, KEY_TILE: tl.constexpr, SEGMENT_MIN_KEYS: tl.constexpr):
    """Keys each segment of a sequence reads: its real length split NUM_SEGMENTS ways, on the device.

    A short sequence (or any, under a graph's upper-bound max_seq_len) uses only the first
    cdiv(seq_len, keys) segments. Whole key tiles, so segment boundaries are tile boundaries.
    """
    keys = tl.maximum(tl.cdiv(seq_len, NUM_SEGMENTS), SEGMENT_MIN_KEYS)
    return tl.cdiv(keys, KEY_TILE) * KEY_TILE


@triton.jit(do_not_specialize=["num_seqs"])  # one compile for every batch size
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, num_seqs,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    stride_block_table_seq,
    stride_partial_token, stride_partial_head, stride_partial_segment,
    stride_stats_token, stride_stats_head, stride_stats_segment,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_TOKENS: tl.constexpr,
    KEY_TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SEGMENT_MIN_KEYS: tl.constexpr,
):
    q_tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_tile_idx, num_seqs, TILE_TOKENS, False)
    query_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - query_start
    local_tile_idx = q_tile_idx - (query_start // TILE_TOKENS + seq_idx)
    if local_tile_idx * TILE_TOKENS >= query_len:
        return  # spare tile: the grid is an upper bound on tiles needed

    seq_len = tl.load(seq_lens_ptr + seq_idx)
    keys_per_segment = _keys_per_segment(seq_len, NUM_SEGMENTS, KEY_TILE, SEGMENT_MIN_KEYS)
    segment_start = segment * keys_per_segment
    if segment_start >= seq_len:
        return  # the grid sized segments for max_seq_len; this sequence is shorter (the merge skips it)
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
    q_offsets = token_row[:, None] * stride_q_token + q_head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    running_max = tl.full([TILE_ROWS], _NO_SCORE, dtype=tl.float32)
    running_sum = tl.zeros([TILE_ROWS], dtype=tl.float32)
    acc = tl.zeros([TILE_ROWS, HEAD_DIM_PADDED], dtype=tl.float32)

    # Causality: no row of this tile looks past its last token's position.
    last_token_in_tile = tl.minimum((local_tile_idx + 1) * TILE_TOKENS, query_len) - 1
    num_visible_keys = num_cached_before + last_token_in_tile + 1
    segment_end = tl.minimum(segment_start + keys_per_segment, num_visible_keys)
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    block_table_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_block_table_seq
    for key_start in range(segment_start, segment_end, KEY_TILE):
        key_position = key_start + tl.arange(0, KEY_TILE)
        key_valid = key_position < segment_end
        block_id = tl.load(block_table_row + key_position // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_offset = block_id * stride_cache_block + (key_position % BLOCK_SIZE).to(tl.int64) * stride_cache_offset
        kv_mask = key_valid[None, :] & dim_valid[:, None]
        k = tl.load(key_cache_ptr + head_offset + slot_offset[None, :] + dims[:, None],
                    mask=kv_mask, other=0.0)  # [HEAD_DIM_PADDED, KEY_TILE]
        # ieee: fp32 caches get exact fp32 products (tf32 drifts ~1e-3 from the reference);
        # for fp16/bf16 operands the flag changes nothing.
        scores = tl.dot(q, k, input_precision="ieee") * scale_log2
        visible = key_valid[None, :] & (key_position[None, :] <= query_position[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(value_cache_ptr + head_offset + slot_offset[:, None] + dims[None, :],
                    mask=tl.trans(kv_mask), other=0.0)  # [KEY_TILE, HEAD_DIM_PADDED]
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        running_max = new_max

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SEGMENTS == 1:
        out = acc / running_sum[:, None]
        o_offsets = token_row[:, None] * stride_o_token + q_head[:, None] * stride_o_head + dims[None, :]
        tl.store(output_ptr + o_offsets, out.to(output_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Unnormalised: the merge rescales each segment by its max before dividing once.
        # A row that saw no key in this segment stores (max floor, sum 0, acc 0) and weighs nothing.
        stats_offsets = token_row * stride_stats_token + q_head * stride_stats_head + segment * stride_stats_segment
        tl.store(partial_max_ptr + stats_offsets, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + stats_offsets, running_sum, mask=row_valid)
        partial_offsets = (token_row[:, None] * stride_partial_token + q_head[:, None] * stride_partial_head
                           + segment * stride_partial_segment + dims[None, :])
        tl.store(partial_out_ptr + partial_offsets, acc, mask=store_mask)


@triton.jit(do_not_specialize=["num_seqs"])  # one compile for every batch size
def _merge_segments_kernel(
    output_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    query_start_loc_ptr, seq_lens_ptr, num_seqs,
    stride_o_token, stride_o_head,
    stride_partial_token, stride_partial_head, stride_partial_segment,
    stride_stats_token, stride_stats_head, stride_stats_segment,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, KEY_TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, SEGMENTS_PADDED: tl.constexpr, SEGMENT_MIN_KEYS: tl.constexpr,
):
    """One (token, query head): the softmax over the union of its segments from their partials."""
    token = tl.program_id(0)
    q_head = tl.program_id(1)
    seq_idx = _find_seq_idx(query_start_loc_ptr, token, num_seqs, 1, True)
    if token >= tl.load(query_start_loc_ptr + seq_idx + 1):
        return  # a row past the last sequence's queries
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    # The same split the attention kernel made, so segments it skipped are never read.
    num_used = tl.cdiv(seq_len, _keys_per_segment(seq_len, NUM_SEGMENTS, KEY_TILE, SEGMENT_MIN_KEYS))

    segments = tl.arange(0, SEGMENTS_PADDED)
    used = segments < num_used
    stats_offsets = token.to(tl.int64) * stride_stats_token + q_head * stride_stats_head + segments * stride_stats_segment
    segment_max = tl.load(partial_max_ptr + stats_offsets, mask=used, other=float("-inf"))
    segment_sum = tl.load(partial_sum_ptr + stats_offsets, mask=used, other=0.0)
    weight = tl.where(used, tl.exp2(segment_max - tl.max(segment_max, axis=0)), 0.0)
    total = tl.sum(segment_sum * weight, axis=0)

    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    partial_offsets = (token.to(tl.int64) * stride_partial_token + q_head * stride_partial_head
                       + segments[:, None] * stride_partial_segment + dims[None, :])
    partial = tl.load(partial_out_ptr + partial_offsets, mask=used[:, None] & dim_valid[None, :], other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0) / total
    o_offsets = token.to(tl.int64) * stride_o_token + q_head * stride_o_head + dims
    tl.store(output_ptr + o_offsets, out.to(output_ptr.dtype.element_ty), mask=dim_valid)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, block_size,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cache_block, stride_cache_offset, stride_cache_head,
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
                     + heads[:, None] * stride_cache_head + dims[None, :])
    key = tl.load(key_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :],
                  mask=mask)
    value = tl.load(value_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :],
                    mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _rows(tensor: torch.Tensor) -> tuple[int, ...]:
    """Strides of every dimension but the last, which the kernels take as contiguous.

    Unit stride is built into the kernels rather than left to the JIT's specialisation of
    arguments equal to 1: with a stride argument, the loads can neither vectorise nor pipeline
    (the head-dim-256 prefill tile then spills), and the ahead-of-time compile measures this code.
    """
    assert tensor.stride(-1) == 1, f"the attention kernels need a contiguous last dimension, got {tensor.stride()}"
    return tensor.stride()[:-1]


@dataclass
class SegmentPartials:
    """fp32 scratch of split-KV: per (token, query head, segment) the unnormalised output, max and sum."""

    out: torch.Tensor  # [num_tokens, num_q_heads, num_segments, head_dim], contiguous in head_dim
    max: torch.Tensor  # [num_tokens, num_q_heads, num_segments], log2 domain
    sum: torch.Tensor  # [num_tokens, num_q_heads, num_segments]

    @classmethod
    def empty(cls, num_tokens, num_q_heads, num_segments, head_dim, device) -> "SegmentPartials":
        stats_shape = (num_tokens, num_q_heads, num_segments)
        return cls(
            out=torch.empty(*stats_shape, head_dim, dtype=torch.float32, device=device),
            max=torch.empty(stats_shape, dtype=torch.float32, device=device),
            sum=torch.empty(stats_shape, dtype=torch.float32, device=device),
        )


def paged_attention(query, key_cache, value_cache, meta: AttentionMetadata, scale: float, plan: AttentionPlan,
                    output: torch.Tensor, partials: SegmentPartials | None = None) -> None:
    """Attend `query` to the paged cache into `output`, launched as `plan` says (no host reads of tensors).

    `partials` is split-KV's scratch; allocated here when not given (a CUDA graph pools it).
    """
    if plan.is_split and partials is None:
        partials = SegmentPartials.empty(*query.shape[:2], plan.num_segments, query.shape[2], query.device)
    grid, args, options = attention_launch(query, key_cache, value_cache, meta, scale, plan, output, partials)
    _paged_attention_kernel[grid](*args, **options)
    if plan.is_split:
        merge_segments(output, partials, meta, plan)


def attention_launch(query, key_cache, value_cache, meta: AttentionMetadata, scale: float, plan: AttentionPlan,
                     output: torch.Tensor, partials: SegmentPartials | None):
    """(grid, arguments, keyword arguments) of `_paged_attention_kernel` for this call.

    The launch and the ahead-of-time compile (`replica/attention/aot.py`) both build it here, so
    what the compile measures is what runs.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = meta.num_seqs
    # The single pass never touches the scratch; any tensor fills the pointer slots.
    scratch = partials or SegmentPartials(output, output, output)
    partial_strides = scratch.out.stride()[:3] if plan.is_split else (0, 0, 0)
    stats_strides = scratch.max.stride() if plan.is_split else (0, 0, 0)
    grid = (num_tokens // plan.tile_tokens + num_seqs, num_kv_heads, plan.num_segments)
    args = (
        query, key_cache, value_cache, output,
        scratch.out, scratch.max, scratch.sum,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * 1.4426950408889634,  # log2(e): the kernel works in exp2
        num_seqs,
        # One set of cache strides serves both caches: allocate_kv_cache makes them alike.
        *_rows(query), *_rows(output), *_rows(key_cache),
        meta.block_tables.stride(0),
        *partial_strides, *stats_strides,
    )
    options = dict(
        BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded_head_dim(head_dim),
        QUERIES_PER_KV=num_q_heads // num_kv_heads, TILE_ROWS=plan.tile_rows, TILE_TOKENS=plan.tile_tokens,
        KEY_TILE=plan.config.key_tile, NUM_SEGMENTS=plan.num_segments, SEGMENT_MIN_KEYS=plan.segment_min_keys,
        num_warps=plan.config.num_warps, num_stages=plan.config.num_stages,
    )
    return grid, args, options


def merge_segments(output: torch.Tensor, partials: SegmentPartials, meta: AttentionMetadata,
                   plan: AttentionPlan) -> None:
    """Combine split-KV partials into `output` [num_tokens, num_q_heads, head_dim]."""
    grid, args, options = merge_launch(output, partials, meta, plan)
    _merge_segments_kernel[grid](*args, **options)


def merge_launch(output: torch.Tensor, partials: SegmentPartials, meta: AttentionMetadata, plan: AttentionPlan):
    """(grid, arguments, keyword arguments) of `_merge_segments_kernel`, as attention_launch."""
    num_tokens, num_q_heads, head_dim = output.shape
    args = (
        output, partials.out, partials.max, partials.sum,
        meta.query_start_loc, meta.seq_lens, meta.num_seqs,
        *_rows(output), *partials.out.stride()[:3], *partials.max.stride(),
    )
    options = dict(
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded_head_dim(head_dim), KEY_TILE=plan.config.key_tile,
        NUM_SEGMENTS=plan.num_segments, SEGMENTS_PADDED=triton.next_power_of_2(plan.num_segments),
        SEGMENT_MIN_KEYS=plan.segment_min_keys,
        num_warps=4,  # one [segments x head_dim] fp32 tile, no loop to pipeline
    )
    return (num_tokens, num_q_heads), args, options


def write_kv_launch(key, value, key_cache, value_cache, slot_mapping):
    """(grid, arguments, keyword arguments) of `_write_kv_kernel`, as attention_launch."""
    num_tokens, num_kv_heads, head_dim = key.shape
    args = (
        key, value, key_cache, value_cache, slot_mapping, key_cache.shape[1],
        *_rows(key), *_rows(value), *_rows(key_cache),
    )
    options = dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
                   HEAD_DIM_PADDED=triton.next_power_of_2(head_dim))
    return (num_tokens,), args, options


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # sequence lengths stay on the device

    def __init__(self, tuning: AttentionTuning = DEFAULT_TUNING, num_sms: int | None = None):
        """`num_sms` overrides the device's SM count (tests plan for a GPU while interpreting on a CPU)."""
        self.tuning = tuning
        self.num_sms = num_sms

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        if key.shape[0] == 0:
            return
        grid, args, options = write_kv_launch(key, value, key_cache, value_cache, slot_mapping)
        _write_kv_kernel[grid](*args, **options)

    def plan(self, query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> AttentionPlan:
        """This call's launch, from shapes and the host-side bounds in `meta` only."""
        num_sms = self.num_sms or _num_sms(query.device)
        return plan_attention(meta.num_seqs, meta.max_query_len, meta.max_seq_len, query.shape[1],
                              key_cache.shape[2], query.shape[2], num_sms, self.tuning)

    def warm_up(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                max_model_len: int, device: torch.device | str) -> list[AttentionPlan]:
        """Compile every kernel variant a model of this shape can launch, before any timed or served step.

        Triton compiles a variant on its first launch, and a batch's shape picks the variant (tile,
        config, segment count), so without this a new batch shape compiles inside a step. This
        launches write_kv and each of reachable_plans (with its merge) once, on two one-token
        sequences. The tensors are laid out as the model lays them out (a stride's divisibility by 16
        is part of a variant): query, key and value are views of one fused QKV projection, or query
        and key are fresh tensors (a rotary embedding that is not in place); the block table is
        block_table_width wide, as the runner's (whose stride's divisibility then does not depend on
        max_model_len, which profiling may cut after this). Returns the plans launched.
        """
        device = torch.device(device)
        plans = reachable_plans(num_q_heads, num_kv_heads, head_dim, self.num_sms or _num_sms(device),
                                max_model_len, self.tuning)
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        # Two one-token sequences (not one: a size-1 dimension's stride is arbitrary in a view).
        qkv = torch.zeros(2, q_size + 2 * kv_size, dtype=dtype, device=device)
        query, key, value = (part.view(2, -1, head_dim) for part in qkv.split([q_size, kv_size, kv_size], dim=-1))
        [(key_cache, value_cache)] = allocate_kv_cache(1, 3, block_size, num_kv_heads, head_dim, dtype, device)
        meta = AttentionMetadata(  # each sequence in its own block (block 0 is the null block), at position 0
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
            seq_lens=torch.ones(2, dtype=torch.int32, device=device),
            block_tables=torch.arange(1, 3, dtype=torch.int32, device=device)[:, None].repeat(
                1, block_table_width(max_model_len, block_size)),
            slot_mapping=torch.tensor([block_size, 2 * block_size], dtype=torch.int64, device=device),
            max_query_len=1, max_seq_len=1,
        )
        for query, key in ((query, key), (query.contiguous(), key.contiguous())):
            self.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
            for plan in plans:
                paged_attention(query, key_cache, value_cache, meta, head_dim**-0.5, plan, torch.empty_like(query))
        return plans

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, scale: float, *,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        output = torch.empty_like(query)
        if query.shape[0] == 0:
            return output
        paged_attention(query, key_cache, value_cache, meta, scale, self.plan(query, key_cache, meta), output)
        return output
