"""The attention contract: the per-step metadata, the backend interface and the paged KV cache layout.

Both backends (pure torch for CPU, Triton for GPU) implement `AttentionBackend`; the model
and the model runner code against this module only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens and cached context live for one forward pass.

    Tokens of all sequences are flattened into one dimension; sequence i owns query rows
    query_start_loc[i]:query_start_loc[i + 1]. Its new tokens are the last ones of its context,
    so token j sits at absolute position seq_lens[i] - q_len_i + j.
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]: physical block ids, 0-padded
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset of each new token
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends queries to it.

    Cache layout: key_cache and value_cache are [num_blocks, block_size, num_kv_heads, head_dim];
    block 0 is a reserved null block that padded block-table entries point at.
    """

    name: str
    # Whether a forward pass through it never waits for the host, so CUDA graphs can capture it.
    supports_cuda_graphs: bool = False

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store key/value [num_tokens, num_kv_heads, head_dim] at the flat cache slots in slot_mapping."""

    def warm_up(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                max_model_len: int, device: torch.device | str) -> object:
        """Compile whatever a model of this shape can launch, so no step compiles; nothing to do by default."""
        return None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of query [num_tokens, num_q_heads, head_dim] over each sequence's cached context.

        The new tokens' K/V must already be in the cache. key / value, when given, are those same
        new K/V as write_kv took them: a backend may read the new tokens' K/V there rather than
        back from the cache (the torch backend does; the Triton kernel reads the cache). Query head
        h reads kv head h // (num_q_heads // num_kv_heads). Returns a tensor shaped like query.
        """


# Triton specializes an integer argument on its divisibility by 16, and the block table's row
# stride (its width) is one: a pool sized by profiling cuts max_model_len to what it holds, and a
# width that followed it would pick other kernel variants than the warm-up compiled, compiling
# them inside the first live steps.
BLOCK_TABLE_WIDTH_MULTIPLE = 16


def block_table_width(max_model_len: int, block_size: int) -> int:
    """Columns of a block table: one per block of a max_model_len sequence, rounded up to
    BLOCK_TABLE_WIDTH_MULTIPLE (the spare columns stay 0, the null block, and are never read)."""
    blocks = -(-max_model_len // block_size)
    return -(-blocks // BLOCK_TABLE_WIDTH_MULTIPLE) * BLOCK_TABLE_WIDTH_MULTIPLE


class KVCaches(list):
    """One (key_cache, value_cache) pair per layer, each [num_blocks, block_size, num_kv_heads,
    head_dim]: views of one tensor, `stacked` [num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim], so a copy of whole blocks across every layer is one op."""

    def __init__(self, stacked: torch.Tensor):
        super().__init__((stacked[layer, 0], stacked[layer, 1]) for layer in range(stacked.shape[0]))
        self.stacked = stacked


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCaches:
    """The zeroed KV cache of every layer (KVCaches: one tensor, a view per layer)."""
    return KVCaches(torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype,
                                device=device))
