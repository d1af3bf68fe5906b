"""Triton kernels for the decoder's elementwise ops: one launch each where the torch reference
(fused_ops.FusedOps) runs 3-12 small kernels. Each kernel rounds to the model dtype where HF
does, so outputs match the reference up to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replica.model.fused_ops import FusedOps

# Columns of gate/up one SiLU-mul program handles: at decode batch 1 (one row), several
# programs still share an intermediate row of 5-14k columns.
_SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    hidden_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_hidden, stride_residual, stride_out,
    hidden_size, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row per program. With ADD_RESIDUAL, residual <- hidden + residual (in place) is what is normalised."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    hidden = tl.load(hidden_ptr + row * stride_hidden + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # HF adds in the model dtype: round the sum before it is normalised (and kept as the residual).
        hidden = (hidden.to(tl.float32) + residual.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, hidden, mask=mask)
    hidden = hidden.to(tl.float32)
    variance = tl.sum(hidden * hidden, axis=0) / hidden_size
    # fp32 normalisation cast to the model dtype, then the weight multiply rounded once more (HF's two roundings).
    normed = (hidden * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    row_ptr, stride_head, cos, sin, dims,
    NUM_HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr, HALF_DIM: tl.constexpr,
):
    """Rotate every head of one token in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    heads = tl.arange(0, HEADS_PADDED)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF_DIM)
    first_ptrs = row_ptr + heads[:, None] * stride_head + dims[None, :]
    first = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_ptrs + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    tl.store(first_ptrs, (first * cos[None, :] - second * sin[None, :]).to(row_ptr.dtype.element_ty), mask=mask)
    tl.store(first_ptrs + HALF_DIM, (second * cos[None, :] + first * sin[None, :]).to(row_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, query_ptr, key_ptr, cos_sin_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_cache_position,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF_DIM: tl.constexpr,
    Q_HEADS_PADDED: tl.constexpr, KV_HEADS_PADDED: tl.constexpr, HALF_DIM_PADDED: tl.constexpr,
):
    """One token per program: its position's cos/sin row is read once for all its query and key heads."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_DIM_PADDED)
    cache_row = cos_sin_ptr + position * stride_cache_position
    cos = tl.load(cache_row + dims, mask=dims < HALF_DIM, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + HALF_DIM + dims, mask=dims < HALF_DIM, other=0.0).to(tl.float32)
    _rotate_heads(query_ptr + token * stride_q_token, stride_q_head, cos, sin, dims,
                  NUM_Q_HEADS, Q_HEADS_PADDED, HALF_DIM)
    _rotate_heads(key_ptr + token * stride_k_token, stride_k_head, cos, sin, dims,
                  NUM_KV_HEADS, KV_HEADS_PADDED, HALF_DIM)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_gate_up, stride_out, intermediate_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(gate_up_ptr + row * stride_gate_up + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gate_up + intermediate_size + cols, mask=mask, other=0.0)
    # HF rounds silu(gate) to the model dtype before multiplying by up.
    activated = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def _row_warps(block: int) -> int:
    """Warps for a program that reduces one row of `block` elements: ~256 elements per warp."""
    return min(max(block // 256, 1), 16)


class TritonFusedOps(FusedOps):
    """One kernel per op. Launches depend only on shapes, never on tensor values (CUDA-graph safe)."""

    name = "triton"

    @staticmethod
    def rms_norm(hidden, weight, eps):
        out = torch.empty_like(hidden)
        _launch_rms_norm(hidden, hidden, weight, out, eps, add_residual=False)
        return out

    @staticmethod
    def add_rms_norm(hidden, residual, weight, eps):
        # In place: residual becomes hidden + residual, hidden's storage takes the normalised output.
        _launch_rms_norm(hidden, residual, weight, hidden, eps, add_residual=True)
        return hidden, residual

    @staticmethod
    def rotary(positions, query, key, cos_sin_cache):
        num_tokens, num_q_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        if num_tokens == 0:
            return query, key
        assert query.stride(2) == 1 and key.stride(2) == 1 and cos_sin_cache.stride(1) == 1
        half_dim = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos_sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF_DIM=half_dim,
            Q_HEADS_PADDED=triton.next_power_of_2(num_q_heads), KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
            HALF_DIM_PADDED=triton.next_power_of_2(half_dim),
        )
        return query, key

    @staticmethod
    def silu_and_mul(gate_up):
        num_tokens, double_size = gate_up.shape
        intermediate_size = double_size // 2
        out = torch.empty((num_tokens, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
        if num_tokens == 0:
            return out
        assert gate_up.stride(1) == 1
        grid = (num_tokens, triton.cdiv(intermediate_size, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), intermediate_size,
                                   BLOCK=_SILU_BLOCK, num_warps=4)
        return out


def _launch_rms_norm(hidden, residual, weight, out, eps: float, *, add_residual: bool) -> None:
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return
    assert hidden.stride(1) == 1 and residual.stride(1) == 1 and out.stride(1) == 1
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        hidden, residual, weight, out,
        hidden.stride(0), residual.stride(0), out.stride(0),
        hidden_size, eps,
        ADD_RESIDUAL=add_residual, BLOCK=block, num_warps=_row_warps(block),
    )
