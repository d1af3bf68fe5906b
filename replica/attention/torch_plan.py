"""The torch backend's per-step attention plan: everything that depends on the step's metadata, not the layer.

The host read of query starts and lengths, the length-sorted decode groups with their block indices
and padding masks, each other sequence's blocks (and whether they lie consecutively in the pool, so a
layer reads them in place), the gather buffers: built by the first layer of a forward pass and reused
by the rest, left with the K/V reads and the attention math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from replica.attention.base import AttentionMetadata
from replica.core.kv_cache_manager import cdiv

DECODE_GROUP_SIZE = 16
# The most K+V bytes one decode group gathers. Each layer gathers a group's blocks and its attention
# reads them straight back: a gather that stays cache-sized is re-read from the CPU's caches, not
# memory. SmolLM2 at batch 64 and ~350-token contexts (2-core EPYC, 1 MiB L2 per core, 32 MiB L3):
# the 30 layers' decode attention takes 358-496 ms of CPU in groups of 4 rows (~2 MiB) against
# 612-734 ms in groups of 16 (~8 MiB); groups of 1-2 rows lose it again to per-call overhead.
DECODE_GROUP_BYTES = 2 << 20


class PerPassCache:
    """A value derived from one forward pass's inputs by its first layer and reused by the others.

    A pass is recognised by the identity of the object the value derives from (and an equal
    `key` of the shapes it was built for); a layer's cache seen a second time means a new pass
    over the same object (buffers refilled in place between steps), so the value is rebuilt
    rather than served stale.
    """

    def __init__(self):
        self._source = None
        self._key: tuple = ()
        self._layers_served: set[int] = set()
        self._value = None

    def get(self, source, key: tuple, layer_cache: torch.Tensor, build):
        layer = id(layer_cache)
        if source is not self._source or key != self._key or layer in self._layers_served:
            self._value, self._source, self._key, self._layers_served = build(), source, key, set()
        self._layers_served.add(layer)
        return self._value


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token queries that share one padded attention call."""

    token_index: torch.Tensor  # long [rows]: each decode's query row
    block_index: torch.Tensor  # long [rows * blocks]: each row's first `blocks` table entries (0 = null block)
    max_len: int
    attn_mask: torch.Tensor  # [rows, 1, 1, max_len] additive: -inf on each row's padding

    @property
    def num_rows(self) -> int:
        return self.token_index.shape[0]


@dataclass(frozen=True)
class SequenceAttention:
    """One sequence attended on its own: a prefill chunk, or a decode with no other decode to share a call.

    Its queries are the newest query_len positions of its context; the prefix_len before them were
    cached by earlier steps (or found in the prefix cache).
    """

    query_start: int
    query_end: int
    seq_len: int
    block_index: torch.Tensor  # long [blocks]: the blocks holding its context
    # The first block's id when the blocks are consecutive ids: then the context is one run of the
    # cache, read as a view instead of gathered. None when they are not.
    first_block: int | None

    @property
    def query_len(self) -> int:
        return self.query_end - self.query_start

    @property
    def prefix_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass(frozen=True)
class TorchAttentionPlan:
    decode_groups: tuple[DecodeGroup, ...]
    sequences: tuple[SequenceAttention, ...]
    # Where every layer gathers its K and V blocks: flat buffers holding at least the step's
    # largest gather, owned by the backend and reused pass after pass (a fresh multi-megabyte
    # tensor costs more in page faults than the copy itself).
    key_blocks: torch.Tensor
    value_blocks: torch.Tensor

    @classmethod
    def build(cls, meta: AttentionMetadata, key_cache: torch.Tensor, mask_dtype: torch.dtype,
              gather_buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> TorchAttentionPlan:
        """The step's plan; `gather_buffers(elements)` returns K and V buffers at least that large."""
        block_size = key_cache.shape[1]
        # One host sync for the whole step rather than one per sequence (and per layer).
        query_starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        query_lens = [end - start for start, end in zip(query_starts, query_starts[1:])]
        decode_rows = [i for i, query_len in enumerate(query_lens) if query_len == 1]
        if len(decode_rows) < 2:
            decode_rows = []
        # Single-token queries (decodes) share padded attention calls: per-call overhead
        # dominates small decode batches on a CPU. Sorted by context length and split into
        # groups, the padding that is gathered and attended for nothing stays small.
        decode_rows.sort(key=lambda i: seq_lens[i])
        block_bytes = 2 * key_cache[0].numel() * key_cache.element_size()  # one block's K and V
        groups = tuple(
            _decode_group(meta.block_tables, rows, query_starts, seq_lens, block_size, mask_dtype)
            for rows in _split_decode_rows(decode_rows, seq_lens, block_size, block_bytes)
        )
        grouped = set(decode_rows)
        sequences = tuple(
            _sequence(meta.block_tables[i, :cdiv(seq_lens[i], block_size)], query_starts[i], query_starts[i + 1],
                      seq_lens[i])
            for i in range(len(seq_lens)) if i not in grouped and query_lens[i] > 0
        )
        gathered = (*groups, *(sequence for sequence in sequences if sequence.first_block is None))
        most_blocks = max((part.block_index.numel() for part in gathered), default=0)
        buffer_size = most_blocks * key_cache[0].numel()
        return cls(groups, sequences, *gather_buffers(buffer_size))


def _split_decode_rows(sorted_rows: list[int], seq_lens: list[int], block_size: int,
                       block_bytes: int) -> list[list[int]]:
    """Decode rows, sorted by context length, in groups of at most DECODE_GROUP_SIZE rows whose padded
    gather (rows x the longest row's blocks) stays within DECODE_GROUP_BYTES; a row longer than
    that on its own is a group of one."""
    groups: list[list[int]] = []
    for row in sorted_rows:  # ascending: the newest row is its group's longest
        gather_bytes = cdiv(seq_lens[row], block_size) * block_bytes
        if (groups and len(groups[-1]) < DECODE_GROUP_SIZE
                and (len(groups[-1]) + 1) * gather_bytes <= DECODE_GROUP_BYTES):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _decode_group(block_tables, rows, query_starts, seq_lens, block_size, mask_dtype) -> DecodeGroup:
    device = block_tables.device
    lengths = [seq_lens[i] for i in rows]
    max_len = max(lengths)
    row_index = torch.tensor(rows, device=device)
    padding = torch.arange(max_len, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    # An additive float mask: the CPU kernel takes a faster path than with a boolean one.
    attn_mask = torch.zeros(len(rows), 1, 1, max_len, dtype=mask_dtype, device=device)
    attn_mask.masked_fill_(padding[:, None, None, :], float("-inf"))
    return DecodeGroup(
        token_index=torch.tensor([query_starts[i] for i in rows], device=device),
        # Padded table entries point at the null block; the mask hides whatever a row reads past its length.
        block_index=block_tables[row_index, :cdiv(max_len, block_size)].long().view(-1),
        max_len=max_len,
        attn_mask=attn_mask,
    )


def _sequence(blocks: torch.Tensor, query_start: int, query_end: int, seq_len: int) -> SequenceAttention:
    block_ids = blocks.tolist()
    consecutive = block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids)))
    return SequenceAttention(query_start, query_end, seq_len, blocks.long(), block_ids[0] if consecutive else None)


def causal_offset_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean [query_len, seq_len] mask: the queries are the last query_len positions of the context.

    Only the dense reference and the torch backend off the CPU materialise it; on the CPU no
    sequence's attention does."""
    if query_len == 1:
        return None  # a single newest token sees the whole context
    query_positions = torch.arange(seq_len - query_len, seq_len, device=device)
    key_positions = torch.arange(seq_len, device=device)
    return key_positions[None, :] <= query_positions[:, None]
