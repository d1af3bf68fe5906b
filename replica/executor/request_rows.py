"""The persistent batch: one row per running request, holding what a step needs of it as
arrays (block table, prompt length, sampling parameters) and, for a request with penalties,
its token history on the device (PenaltyState), set once when the request is admitted. A step
gathers its rows by index instead of rebuilding them from the requests (vLLM v1's InputBatch
in miniature; rows are not kept dense, a step lists its own, so a row never moves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from replica.executor.block_table import BlockTables
from replica.executor.logits_processors import PenaltyState
from replica.executor.sampler import SamplingArrays, batch_facts
from replica.core.request import Request


@dataclass(frozen=True)
class RowsSampling:
    """The sampling parameters of some rows, in their order, and what a step derives from
    them on the host. Shared by the steps that sample the same rows: read only."""

    arrays: SamplingArrays
    seeded: np.ndarray  # positions among these rows of the seeded ones
    facts: dict  # SamplingBatch's host facts (batch_facts)
    wants_logprobs: list[bool]
    num_top_logprobs: Optional[list[int]]  # alternatives each row asked for, when any did
    any_processed: bool  # some row has logit_bias or penalties
    any_logit_bias: bool
    any_repetition: bool  # some row has a repetition penalty
    any_additive: bool  # some row has a frequency or presence penalty

    @property
    def any_penalized(self) -> bool:
        return self.any_repetition or self.any_additive

    @classmethod
    def of(cls, arrays: SamplingArrays) -> "RowsSampling":
        facts = batch_facts(arrays)
        return cls(arrays, np.flatnonzero(arrays.has_seed), facts, arrays.logprobs.tolist(),
                   arrays.top_logprobs.tolist() if facts["max_top_logprobs"] else None, bool(arrays.processed.any()),
                   bool(arrays.logit_bias.any()), bool((arrays.repetition_penalty != 1.0).any()),
                   bool((arrays.frequency_penalty != 0.0).any() or (arrays.presence_penalty != 0.0).any()))


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
        # The token histories of the rows of requests with penalties (the null row's too, unread).
        self.penalties = PenaltyState(max_num_rows + 1, vocab_size, device)
        self._sampling_cache: Optional[tuple[bytes, RowsSampling]] = None  # (rows' bytes, their sampling)

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
        params = request.sampling_params
        self.sampling.set_row(row, params, self.vocab_size)
        if params.has_penalties:  # its history, built on the device at the step's flush_admissions()
            self.penalties.admit(row, request, params)
        self._sampling_cache = None
        return row

    def flush_admissions(self) -> None:
        """Queue the device work of this step's admissions (before the step samples)."""
        self.penalties.flush()

    def sampling_of(self, rows: np.ndarray) -> RowsSampling:
        """The sampling parameters of these rows, in this order. A step that samples the same
        rows as the one before (every decode step between admissions) reuses that step's:
        a row's parameters change only when a request is added."""
        key = rows.tobytes()
        cached = self._sampling_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        sampling = RowsSampling.of(self.sampling.take(rows))
        self._sampling_cache = (key, sampling)
        return sampling

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
