"""The two layer kinds tensor parallelism adds to the Llama model (Megatron-style): a
row-parallel linear (o_proj, down_proj: each rank multiplies its slice of the input
features, the partial outputs are summed by one all-reduce, the bias added once after it)
and a vocab-parallel embedding (each rank holds a contiguous block of the vocabulary's rows,
the vocabulary padded to a multiple of the ranks; ids outside it embed to zero and the
all-reduce sums the one rank that has each).
Column-parallel projections (qkv, gate-up) need no class: each rank's MergedLinear is simply
built with its share of the heads / MLP width. The vocab-parallel LM head is a plain Linear
over the rank's rows whose logits LlamaForCausalLM gathers before sampling."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replica.parallel.group import TensorParallel, vocab_rows_per_rank


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features_per_rank, out_features, bias=bias)
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.tp.all_reduce(F.linear(hidden, self.weight))
        return output if self.bias is None else output.add_(self.bias)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        rows = vocab_rows_per_rank(vocab_size, tp.size)
        super().__init__(rows, hidden_size)
        self.tp = tp
        self.vocab_start = tp.rank * rows
        self.vocab_end = self.vocab_start + rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        hidden = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)
