"""The decoder's elementwise ops behind one interface: RMSNorm (alone or fused with the residual
add), rotary embedding and SiLU-mul. `FusedOps` is the unfused torch reference with HF's numerics;
`InPlaceFusedOps` computes the same results bit for bit with fewer passes and fresh tensors (the
CPU path); Triton kernels (triton_ops.py) and torch.compile of the reference are the GPU choices.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from replica.config import FUSED_OPS_NAMES

logger = logging.getLogger(__name__)



class FusedOps:
    """Reference implementations, op for op what HF transformers computes (the specification).

    Subclasses may write results into their inputs' storage (the residual stream is updated in
    place, as vLLM does): callers use only the returned tensors, never the inputs afterwards.
    """

    name = "torch"

    @staticmethod
    def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32, cast back, then scale in the model dtype, exactly as HF does.
        input_dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        return weight * hidden.to(input_dtype)

    @staticmethod
    def add_rms_norm(
        hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(hidden + residual), hidden + residual); the sum is rounded to the model dtype first, as in HF."""
        residual = hidden + residual
        return FusedOps.rms_norm(residual, weight, eps), residual

    @staticmethod
    def rotary(
        positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [tokens, q_heads, head_dim] and key [tokens, kv_heads, head_dim] by their positions'
        angles, HF's rotate_half convention; cos_sin_cache [max_positions, head_dim] is cos | sin of each half."""
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin = torch.cat((sin, sin), dim=-1)[:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [tokens, 2 * intermediate] = gate | up (SwiGLU's inner product)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first_half, second_half = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second_half, first_half), dim=-1) * sin


class InPlaceFusedOps(FusedOps):
    """The reference's arithmetic, rounding for rounding (bit-identical results), in fewer passes over
    memory: results go into storage the step already owns (the layer output the residual add
    consumes, the gate half of gate_up, the normalised copy) and rotary works on half-width angles
    without concatenating them. On a CPU a fresh activation-sized tensor costs page faults as well as
    a pass, and these ops are about a fifth of a prefill's time.
    """

    name = "inplace"

    @staticmethod
    def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # F.rms_norm is the reference's fp32 x * rsqrt(mean(x^2) + eps), rounding for rounding, in one op.
        normed = F.rms_norm(hidden.float(), hidden.shape[-1:], eps=eps).to(hidden.dtype)
        if normed.dtype != torch.promote_types(normed.dtype, weight.dtype):
            return weight * normed
        return normed.mul_(weight)

    @staticmethod
    def add_rms_norm(
        hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden.add_(residual)  # the sum lands in the layer's output, which nothing else reads
        return InPlaceFusedOps.rms_norm(residual, weight, eps), residual

    @staticmethod
    def rotary(
        positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate_halves(query, cos, sin), _rotate_halves(key, cos, sin)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)  # into the gate half of the GEMM output


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """_rotate with half-width cos / sin: first half x1*cos - x2*sin, second x2*cos + x1*sin, which is
    the reference's x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin) rounding for rounding."""
    first_half, second_half = x.chunk(2, dim=-1)
    rotated = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype))
    rotated_first, rotated_second = rotated.chunk(2, dim=-1)
    torch.mul(first_half, cos, out=rotated_first).sub_(second_half * sin)
    torch.mul(second_half, cos, out=rotated_second).add_(first_half * sin)
    return rotated


class CompiledFusedOps(FusedOps):
    """The reference ops, each handed to torch.compile (Inductor generates the fused kernels).

    dynamic=None: the first token count compiles static, a second one recompiles with a symbolic
    token dimension, so a ladder of batch sizes costs two compilations per op, not one per size.
    """

    name = "compile"

    def __init__(self) -> None:
        for op_name in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
            setattr(self, op_name, torch.compile(getattr(FusedOps, op_name), fullgraph=True, dynamic=None))


@functools.cache
def _compiled_ops() -> CompiledFusedOps:
    """One per process: each torch.compile wrapper compiles its own code, so a second model (or engine)
    in the process would otherwise pay the compilations again."""
    return CompiledFusedOps()


def get_fused_ops(name: str, device: torch.device | str) -> FusedOps:
    """The ops called `name`; "auto" picks Triton on CUDA and the in-place torch ops elsewhere."""
    if name not in FUSED_OPS_NAMES:
        raise ValueError(f"fused ops {name!r} is not one of {', '.join(FUSED_OPS_NAMES)}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "inplace"
    if name == "triton":
        # Imported only when chosen, so CPU installs without Triton still work.
        from replica.model.triton_ops import TritonFusedOps

        ops: FusedOps = TritonFusedOps()
    elif name == "compile":
        ops = _compiled_ops()
    elif name == "inplace":
        ops = InPlaceFusedOps()
    else:
        ops = FusedOps()
    logger.info("fused ops: %s on %s", ops.name, device)
    return ops
