"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) running attention through a paged-KV backend.

Parameter names follow Hugging Face's, so a checkpoint's state dict loads without renaming;
the numerics follow HF too (fp32 RMSNorm and RoPE frequencies), so logits match its forward.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from replica.attention.base import AttentionBackend, AttentionMetadata
from replica.model.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the model dtype, exactly as HF does.
        input_dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(input_dtype)


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


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: model.to(dtype) must not round it, and the model may
        # be built on the meta device before its weights are loaded.
        self.inv_freq = rope_inverse_frequencies(cfg)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [num_tokens, head_dim], for HF's rotate_half layout."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] by its tokens' angles (HF's rotate_half convention)."""
    first_half, second_half = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second_half, first_half), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.attn_backend = attn_backend
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(self, hidden, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query = apply_rotary(self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        key = apply_rotary(self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        # The backend reads this step's keys from the cache, so they go in first.
        self.attn_backend.write_kv(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        attended = self.attn_backend.forward(query, key_cache, value_cache, attn_metadata, self.scale)
        return self.o_proj(attended.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(cfg, attn_backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, attn_backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, attn_backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so (again after loading)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [num_tokens, hidden] for a flattened batch of new tokens.

        layer_hook(i) runs before decoder layer i; raising from it abandons the pass between layers.
        """
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, hidden.dtype)
        for layer_idx, layer in enumerate(self.model.layers):
            if layer_hook is not None:
                layer_hook(layer_idx)
            hidden = layer(hidden, cos, sin, kv_caches[layer_idx], attn_metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the hidden states of the positions that sample."""
        return self.lm_head(hidden).float()
