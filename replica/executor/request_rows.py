"""The persistent batch: one row per running request, holding what a step needs of it as
arrays (block table, prompt length, sampling parameters), set once when the request is
admitted. A step gathers its rows by index instead of rebuilding them from the requests
(vLLM v1's InputBatch in miniature; rows are not kept dense, a step lists its own).
"""

from __future__ import annotations

import numpy as np
import torch

from replica.executor.block_table import BlockTables
from replica.executor.sampler import SamplingArrays
from replica.request import Request


class RequestRows:
    def __init__(self, max_num_rows: int, max_blocks_per_row: int, vocab_size: int, device: torch.device):
        self.max_num_rows = max_num_rows
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_rows - 1, -1, -1))  # pop() hands out the lowest first
        self.block_tables = BlockTables(max_num_rows, max_blocks_per_row, device)
        # One extra row (the block tables' null row) so padded graph rows can index everything.
        self.num_prompt_tokens = np.zeros(max_num_rows + 1, dtype=np.int64)
        self.sampling = SamplingArrays.empty(max_num_rows + 1)

    @property
    def null_row(self) -> int:
        return self.block_tables.null_row

    def add(self, request: Request, block_ids: list[int]) -> int:
        """Give a newly admitted (or re-admitted) request a row holding its whole block table."""
        self.remove(request.request_id)
        if not self._free_rows:
            raise RuntimeError(f"more than {self.max_num_rows} running requests (max_num_seqs)")
        row = self._free_rows.pop()
        self.row_of[request.request_id] = row
        self.block_tables.set_row(row, block_ids)
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        self.sampling.set_row(row, request.sampling_params, self.vocab_size)
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
