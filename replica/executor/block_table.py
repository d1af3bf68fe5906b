"""Block tables that live on the device and change by the blocks a step adds.

One row per running request (its slot in the persistent batch) plus a last, all-zero row
that padded sequences of a graph batch point at (block 0 is the reserved null block). The
host keeps a mirror (slot mappings are computed there) and a list of (flat index, block
id) changes that the next step ships with its inputs and scatters on the device.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    def __init__(self, num_rows: int, max_blocks_per_row: int, device: torch.device):
        self.max_blocks_per_row = max_blocks_per_row
        self.null_row = num_rows
        self.host = np.zeros((num_rows + 1, max_blocks_per_row), dtype=np.int32)
        self.num_blocks = [0] * (num_rows + 1)
        self.device = torch.zeros((num_rows + 1, max_blocks_per_row), dtype=torch.int32, device=device)
        # Plain lists: a decode step appends one block to a few rows, where building small
        # arrays per append would cost more than the one conversion in take_changes.
        self._changed_index: list[int] = []
        self._changed_ids: list[int] = []

    def set_row(self, row: int, block_ids: list[int]) -> None:
        """A request (re)starts in `row` holding exactly these blocks. Entries past them are
        stale but never read: attention reads only the blocks its sequence length covers."""
        self.num_blocks[row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.max_blocks_per_row:
            raise ValueError(f"row {row} would hold {end} blocks; a sequence of max_model_len needs "
                             f"at most {self.max_blocks_per_row}")
        self.host[row, start:end] = block_ids
        self.num_blocks[row] = end
        offset = row * self.max_blocks_per_row
        self._changed_index.extend(range(offset + start, offset + end))
        self._changed_ids.extend(block_ids)

    def take_changes(self) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices, block ids) changed since the last call, for the device copy."""
        if not self._changed_index:
            empty = np.zeros(0, dtype=np.int32)
            return empty, empty
        index, ids = np.array(self._changed_index, dtype=np.int32), np.array(self._changed_ids, dtype=np.int32)
        self._changed_index, self._changed_ids = [], []
        return index, ids

    def apply_on_device(self, flat_index: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Scatter staged changes (already on the device) into the device table."""
        self.device.view(-1)[flat_index] = block_ids
