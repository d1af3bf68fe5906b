"""Turns a SchedulerOutput into one forward pass: flattened input ids, positions, slot
mapping, block tables and query offsets; logits only for the rows that sample; sampling.

It keeps each running request's block table, extended by the blocks the scheduler hands
out each step, and owns the paged KV cache tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from replica.attention import AttentionMetadata, allocate_kv_cache
from replica.model import LlamaForCausalLM, ModelConfig
from replica.executor.sampler import Sampler
from replica.scheduler import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    """One sampled token (and its logprob when asked) per request that caught up this step."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, Optional[float]]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, num_kv_blocks: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(
            model_config.num_hidden_layers, num_kv_blocks, block_size, model_config.num_key_value_heads,
            model_config.head_dim, dtype, device,
        )
        self.block_tables: dict[str, list[int]] = {}
        self.sampler = Sampler()

    @staticmethod
    def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return (2 * model_config.num_hidden_layers * block_size * model_config.num_key_value_heads
                * model_config.head_dim * element_size)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput,
                layer_hook: Optional[Callable[[int], None]] = None) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_req_ids:
            self.block_tables.pop(request_id, None)
        for request_id in scheduler_output.preempted_req_ids:
            self.block_tables.pop(request_id, None)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput({}, {})

        block_size = self.block_size
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, tables = [], [], []
        for entry in scheduled:
            request_id = entry.request.request_id
            if entry.is_new:
                table = self.block_tables[request_id] = list(entry.new_block_ids)
            else:
                table = self.block_tables[request_id]
                table.extend(entry.new_block_ids)
            start, count = entry.start_pos, entry.num_new_tokens
            token_positions = np.arange(start, start + count, dtype=np.int64)
            input_ids.append(np.asarray(entry.token_ids, dtype=np.int64))
            positions.append(token_positions)
            query_lens.append(count)
            seq_lens.append(start + count)
            tables.append(table)

        max_blocks = max(len(table) for table in tables)
        block_table_array = np.zeros((len(tables), max_blocks), dtype=np.int32)  # 0 = the null block
        for row, table in enumerate(tables):
            block_table_array[row, : len(table)] = table
            token_positions = positions[row]
            slots.append(block_table_array[row, token_positions // block_size].astype(np.int64) * block_size
                         + token_positions % block_size)
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])

        device = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(block_table_array).to(device),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.from_numpy(np.concatenate(input_ids)).to(device),
            torch.from_numpy(np.concatenate(positions)).to(device),
            self.kv_caches, metadata, layer_hook,
        )

        sampling = [(row, entry) for row, entry in enumerate(scheduled) if entry.samples]
        if not sampling:
            return ModelRunnerOutput({}, {})
        last_rows = torch.tensor([int(query_start_loc[row + 1]) - 1 for row, _ in sampling], device=device)
        logits = self.model.compute_logits(hidden[last_rows])
        requests = [entry.request for _, entry in sampling]
        sampled = self.sampler.sample(
            logits, [r.sampling_params for r in requests], [r.num_output_tokens for r in requests]
        )
        ids = [r.request_id for r in requests]
        return ModelRunnerOutput(dict(zip(ids, sampled.token_ids)), dict(zip(ids, sampled.logprobs)))
