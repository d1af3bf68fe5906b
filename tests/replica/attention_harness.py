"""Paged-attention test batches, and the Triton interpreter set up to run the kernels on a CPU.

Import this before replica.attention.triton_backend: TRITON_INTERPRET must be set before the
kernels are decorated.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402
import triton.runtime.interpreter as triton_interpreter  # noqa: E402

from replica.attention import AttentionMetadata, allocate_kv_cache  # noqa: E402
from replica.attention.torch_ref import dense_causal_attention  # noqa: E402


def _index_scalars_under_numpy_2_4(patch_lang_tensor):
    """Triton 3.6's interpreter turns scalar tensors (1-element arrays) into loop bounds with int(),
    which NumPy 2.4 rejects; this applies upstream's fix (triton-lang/triton#9171, PR #9172)."""

    def patched(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patched


if not getattr(triton_interpreter._patch_lang_tensor, "indexes_scalars", False):
    triton_interpreter._patch_lang_tensor = _index_scalars_under_numpy_2_4(triton_interpreter._patch_lang_tensor)
    triton_interpreter._patch_lang_tensor.indexes_scalars = True

BLOCK_SIZE = 4
NUM_BLOCKS = 32
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


class PagedBatch:
    """A batch with random dense K/V per sequence, scattered into shuffled cache blocks.

    `padding_rows` appends graph-style padding: sequences of one query token with seq_len 1 on the
    null block 0 and slot -1. `max_seq_len` overrides the metadata's bound (a graph passes
    max_model_len, larger than any real length). `shuffle_blocks=False` gives each sequence
    consecutive block ids, as a fresh pool hands them out.
    """

    def __init__(self, seq_specs, num_q_heads, num_kv_heads, head_dim, dtype, seed=0, block_size=BLOCK_SIZE,
                 padding_rows=0, max_seq_len=None, shuffle_blocks=True):
        generator = torch.Generator().manual_seed(seed)
        blocks_needed = sum(-(-(cached + new) // block_size) for cached, new in seq_specs)
        num_blocks = max(NUM_BLOCKS, blocks_needed + 1)
        shuffled_block_ids = list(range(1, num_blocks))  # block 0 is the reserved null block
        if shuffle_blocks:
            random.Random(seed).shuffle(shuffled_block_ids)
        else:  # each sequence's blocks consecutive ids, in order (popped from the end)
            shuffled_block_ids.reverse()

        def randn(*shape):
            return torch.randn(*shape, generator=generator).to(dtype)

        self.seq_specs = seq_specs
        self.num_q_heads = num_q_heads
        self.padding_rows = padding_rows
        self.keys = [randn(cached + new, num_kv_heads, head_dim) for cached, new in seq_specs]
        self.values = [randn(cached + new, num_kv_heads, head_dim) for cached, new in seq_specs]
        self.query = randn(sum(new for _, new in seq_specs) + padding_rows, num_q_heads, head_dim)
        [(self.key_cache, self.value_cache)] = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim,
                                                                 dtype, "cpu")

        seq_lens = [cached + new for cached, new in seq_specs] + [1] * padding_rows
        max_blocks = max(-(-seq_len // block_size) for seq_len in seq_lens)
        block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        new_token_slots = []
        for seq_idx, (cached, new) in enumerate(seq_specs):
            seq_len = cached + new
            blocks = [shuffled_block_ids.pop() for _ in range(-(-seq_len // block_size))]
            block_tables[seq_idx, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            slots = [blocks[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
            self.key_cache.view(-1, num_kv_heads, head_dim)[slots] = self.keys[seq_idx]
            self.value_cache.view(-1, num_kv_heads, head_dim)[slots] = self.values[seq_idx]
            new_token_slots += slots[cached:]
        new_token_slots += [-1] * padding_rows

        query_lens = [new for _, new in seq_specs] + [1] * padding_rows
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            slot_mapping=torch.tensor(new_token_slots, dtype=torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len or max(seq_lens),
        )
        self.scale = head_dim**-0.5

    @property
    def args(self):
        return self.query, self.key_cache, self.value_cache, self.meta, self.scale

    @property
    def new_kv(self) -> dict[str, torch.Tensor]:
        """This step's K/V of every query row, as the model hands them to forward (key=, value=)."""
        new_rows = [(keys[cached:], values[cached:])
                    for (cached, _), keys, values in zip(self.seq_specs, self.keys, self.values)]
        return {"key": torch.cat([keys for keys, _ in new_rows]), "value": torch.cat([values for _, values in new_rows])}

    @property
    def num_real_tokens(self) -> int:
        return self.query.shape[0] - self.padding_rows

    def dense_causal_attention(self) -> torch.Tensor:
        """Attention of the real sequences computed in float64 from the unpaged K/V, one sequence at a time."""
        query_starts = [0, *itertools.accumulate(new for _, new in self.seq_specs)]
        return torch.cat([
            dense_causal_attention(self.query[start:end], keys, values, self.scale)
            for start, end, keys, values in zip(query_starts, query_starts[1:], self.keys, self.values)
        ])
