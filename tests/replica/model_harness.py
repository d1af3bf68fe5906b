"""A minimal model runner for model-level tests: sequences in shuffled paged-cache blocks,
stepped with any split of their tokens, returning each sequence's last-position logits."""

from __future__ import annotations

import random

import torch

from replica.attention import AttentionMetadata, allocate_kv_cache
from replica.model import ModelConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 24


class PagedRunner:
    """Sequences in shuffled cache blocks (in the model's dtype), stepped with any token split."""

    def __init__(self, model, cfg: ModelConfig, seed: int = 0):
        self.model, self.cfg = model, cfg
        self.kv_caches = allocate_kv_cache(cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads,
                                           cfg.head_dim, next(model.parameters()).dtype, "cpu")
        self.free_blocks = list(range(1, NUM_BLOCKS))  # block 0 is the reserved null block
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, new_tokens: dict[str, list[int]], layer_hook=None) -> dict[str, torch.Tensor]:
        """Run each sequence's next tokens in one forward pass; return each one's last-position logits."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq_id, token_ids in new_tokens.items():
            start = self.num_computed.setdefault(seq_id, 0)
            table = self.block_tables.setdefault(seq_id, [])
            for position in range(start, start + len(token_ids)):
                if position // BLOCK_SIZE == len(table):
                    table.append(self.free_blocks.pop())
                slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
                positions.append(position)
            input_ids += token_ids
            query_lens.append(len(token_ids))
            seq_lens.append(start + len(token_ids))
            self.num_computed[seq_id] = start + len(token_ids)
        max_blocks = max(len(self.block_tables[seq_id]) for seq_id in new_tokens)
        block_tables = torch.zeros(len(new_tokens), max_blocks, dtype=torch.int32)
        for row, seq_id in enumerate(new_tokens):
            block_tables[row, : len(self.block_tables[seq_id])] = torch.tensor(self.block_tables[seq_id])
        query_start_loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta, layer_hook)
            logits = self.model.compute_logits(hidden[query_start_loc[1:].long() - 1])
        return dict(zip(new_tokens, logits))
