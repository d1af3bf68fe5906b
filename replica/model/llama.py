"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) running attention through a paged-KV backend.

Parameter names follow Hugging Face's except the merged projections (qkv_proj, gate_up_proj), which
the loader stacks from HF's tensors; elementwise ops go through FusedOps (torch reference or kernels).
The numerics follow HF (fp32 RMSNorm and RoPE angles), so logits match its forward.
Under tensor parallelism (replica/parallel/) each rank builds it from its shard of the config
(its heads and MLP width) with row-parallel o_proj / down_proj and a vocab-parallel embedding
and LM head; at size 1 every module is the plain one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from replica.attention.base import AttentionBackend, AttentionMetadata
from replica.model.config import ModelConfig
from replica.model.fused_ops import FusedOps
from replica.parallel.group import NO_TENSOR_PARALLEL, TensorParallel, vocab_rows_per_rank
from replica.parallel.layers import RowParallelLinear, VocabParallelEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class OutputRows:
    """The rows of a flattened batch whose final hidden states a pass returns (the rows that sample, in
    sampling order), and attention metadata in which each is a one-token query over its sequence's context.

    The last decoder layer's output feeds nothing but the final norm and lm_head, so past its K/V write
    (which later tokens read) it runs for these rows only: a prefill chunk computes its last layer's
    attention, o_proj and MLP for the one token that samples, an intermediate chunk for none.
    """

    token_index: torch.Tensor  # long [rows]: their positions in the batch's flattened tokens
    attn_metadata: AttentionMetadata  # rows one-token sequences: query_start_loc 0..rows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: FusedOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised, residual stream): HF's `residual + hidden` then norm, in one op once a residual exists;
        before the first layer the stream is hidden itself."""
        if residual is None:
            return self.ops.rms_norm(hidden, self.weight, self.eps), hidden
        return self.ops.add_rms_norm(hidden, residual, self.weight, self.eps)


class MergedLinear(nn.Linear):
    """One GEMM for several projections of the same input, their weights stacked along the output
    dimension in shard order. Shard names are the checkpoint's own (q_proj, ...): the loader stacks them."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = shard_sizes


def rope_inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """fp32 [head_dim // 2] rotation frequencies, with linear or llama3 scaling applied as HF does."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device="cpu").float() / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate smoothly in between.
    original_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / scaling["low_freq_factor"]
    high_freq_wavelen = original_context / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


def rope_cos_sin_table(cfg: ModelConfig) -> torch.Tensor:
    """fp32 [max_position_embeddings, head_dim]: cos | sin of every position's angles, as HF computes them."""
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.int64, device="cpu").float()
    angles = positions[:, None] * rope_inverse_frequencies(cfg)[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: FusedOps):
        super().__init__()
        # Computed once for every position (never per step from the batch's positions), on the CPU even
        # when the model is built on the meta device; the loader moves it to the weights' device and dtype
        # (HF casts cos/sin to the model dtype too). Not persistent: checkpoints do not carry it.
        self.register_buffer("cos_sin_cache", rope_cos_sin_table(cfg), persistent=False)
        self.ops = ops

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary(positions, query, key, self.cos_sin_cache)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> nn.Linear:
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend, tp: TensorParallel = NO_TENSOR_PARALLEL):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.attn_backend = attn_backend
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=cfg.attention_bias,
        )
        self.o_proj = row_parallel_linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, tp)

    def forward(self, positions, hidden, rotary_emb: RotaryEmbedding, kv_cache: KVCache,
                attn_metadata: AttentionMetadata, output_rows: OutputRows | None = None) -> torch.Tensor:
        """Attention output of every token, or only of output_rows' (all tokens' K/V are written either way)."""
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, key = rotary_emb(
            positions,
            query.view(num_tokens, self.num_heads, self.head_dim),
            key.view(num_tokens, self.num_kv_heads, self.head_dim),
        )
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        # The backend reads this step's keys from the cache, so they go in first.
        self.attn_backend.write_kv(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        if output_rows is not None:  # one-token queries: their keys, this step's included, are in the cache
            query = query.index_select(0, output_rows.token_index)
            attended = self.attn_backend.forward(query, key_cache, value_cache, output_rows.attn_metadata, self.scale)
        else:
            attended = self.attn_backend.forward(query, key_cache, value_cache, attn_metadata, self.scale,
                                                 key=key, value=value)
        return self.o_proj(attended.reshape(query.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one GEMM."""

    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel = NO_TENSOR_PARALLEL):
        super().__init__()
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
            bias=cfg.mlp_bias,
        )
        self.down_proj = row_parallel_linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)
        self.ops = ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend, ops: FusedOps,
                 tp: TensorParallel = NO_TENSOR_PARALLEL):
        super().__init__()
        self.self_attn = Attention(cfg, attn_backend, tp)
        self.mlp = MLP(cfg, ops, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, rotary_emb: RotaryEmbedding, kv_cache: KVCache,
                attn_metadata: AttentionMetadata, output_rows: OutputRows | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, residual stream before it); the next norm adds the two. With
        output_rows, both only for those rows.

        Deferring each residual add into the following norm is what lets one kernel do both.
        """
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rotary_emb, kv_cache, attn_metadata, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows.token_index)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend, ops: FusedOps,
                 tp: TensorParallel = NO_TENSOR_PARALLEL):
        super().__init__()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp.size == 1
                             else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        self.layers = nn.ModuleList(DecoderLayer(cfg, attn_backend, ops, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(cfg, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend, ops: FusedOps,
                 tp: TensorParallel = NO_TENSOR_PARALLEL):
        """cfg: the whole model's, or under tensor parallelism this rank's shard of it
        (replica/parallel/group.py: shard_config), whose vocabulary stays whole."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.attn_backend = attn_backend  # every layer's
        self.model = LlamaModel(cfg, attn_backend, ops, tp)
        # This rank's rows of the vocabulary (padded to a multiple of the ranks).
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows_per_rank(cfg.vocab_size, tp.size), bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so (again after loading)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def store_linear_weights_input_major(self) -> None:
        """Store each projection's [out, in] weight as the transpose of a contiguous [in, out] one.

        For the CPU: F.linear(x, weight) is x @ weight.t(), and with weight.t() contiguous the GEMM
        runs untransposed, which MKL does faster at decode's row counts (SmolLM2's four projections
        of a layer, one thread: 1.16x at 64 rows, 1.3-1.4x at 16-32; 1.00x at prefill's 1-2k rows)
        with bitwise-equal results from 16 rows up. Values, shapes and names do not change. A weight
        shared with the embedding (tied lm_head) stays as it is: the embedding reads its rows.
        """
        embedding = self.model.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not embedding:
                module.weight = nn.Parameter(module.weight.t().contiguous().t(), requires_grad=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [num_tokens, hidden] for a flattened batch of new tokens, or only
        [rows, hidden] of output_rows (whose last layer then runs past its K/V write for them alone).

        layer_hook(i) runs before decoder layer i; raising from it abandons the pass between layers.
        """
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        rotary_emb = self.model.rotary_emb
        last_layer = len(self.model.layers) - 1
        for layer_idx, layer in enumerate(self.model.layers):
            if layer_hook is not None:
                layer_hook(layer_idx)
            hidden, residual = layer(positions, hidden, residual, rotary_emb, kv_caches[layer_idx], attn_metadata,
                                     output_rows if layer_idx == last_layer else None)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the hidden states of the positions that sample (every
        rank's vocabulary block gathered, on every rank, less the padding's columns)."""
        return self.tp.all_gather_last_dim(self.lm_head(hidden).float(), self.cfg.vocab_size)
