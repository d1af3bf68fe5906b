"""Sizes the KV pool on a GPU from a profiling run, as vLLM's gpu_memory_utilization does.

The engine may use `gpu_memory_utilization` of the device's total memory. A profiling run
executes the largest step the scheduler can form (max_num_batched_tokens prompt tokens,
then logits and sampling for max_num_seqs rows with every filter on) and measures its peak
activation memory; the KV pool gets what is left after the weights, that peak and the
memory torch does not manage (the CUDA context, other processes). Under tensor parallelism
each rank profiles its own GPU and the pool is the smallest any of them holds (all_reduce MIN).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from replica.attention import AttentionMetadata, allocate_kv_cache
from replica.config import ConfigError, EngineConfig
from replica.executor.sampler import Sampler, SamplingBatch, logprobs_of, prompt_logits_rows
from replica.model import LlamaForCausalLM, ModelConfig
from replica.model.config import kv_block_bytes
from replica.core.request import MAX_TOP_LOGPROBS, SamplingParams
from replica.parallel.group import NO_TENSOR_PARALLEL, TensorParallel

logger = logging.getLogger(__name__)

# Every filter on and every row seeded: the sampler's most memory-hungry path.
# Penalties too: their token history is a persistent [rows, vocab] state on the device (39 + 156 MB
# at 256 rows of a 152k vocabulary), allocated when a first request asks for one, after the pool
# was sized; so the profile holds it (and the penalties' scratch) in its peak.
_WORST_CASE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, seed=0, logprobs=True,
                                      top_logprobs=MAX_TOP_LOGPROBS, repetition_penalty=1.1, frequency_penalty=0.1)


@dataclass(frozen=True)
class _ProfileHistory:
    prompt_token_ids: tuple[int, ...] = (0,)
    output_token_ids: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class MemoryProfile:
    """What a profiling run measured on the device, in bytes."""

    total: int
    free: int  # after the run, with torch's cache emptied
    reserved: int  # held by torch's allocator after the run
    weights: int  # allocated before the run: the weights
    peak_activations: int  # the run's peak above the weights (its scratch KV cache excluded)
    device: torch.device = torch.device("cpu")  # the agreement among tensor-parallel ranks runs on it

    @property
    def non_torch(self) -> int:
        """The CUDA context and other processes: used memory torch's allocator does not hold."""
        return self.total - self.free - self.reserved

    def kv_cache_bytes(self, utilization: float) -> int:
        """The engine's share of the device minus everything else it needs."""
        return int(self.total * utilization) - self.weights - self.peak_activations - self.non_torch

    def num_kv_blocks(self, utilization: float, bytes_per_block: int, min_blocks: int,
                      tp: TensorParallel = NO_TENSOR_PARALLEL, needed_for: str = "one max_model_len sequence") -> int:
        """KV blocks that fit, on every rank of `tp` the fewest any rank's device holds (one
        scheduler plans for all ranks, each holding its shard of every block); ConfigError
        (naming gpu_memory_utilization) on every rank when that is below min_blocks. Every rank
        reaches the agreement before any raises: a rank that raised first would leave the
        others waiting in the collective."""
        budget = max(self.kv_cache_bytes(utilization), 0)
        own_blocks = budget // bytes_per_block
        num_blocks = int(tp.min_at_start(own_blocks, self.device))
        if num_blocks < min_blocks:
            gib = 2**30
            tightest = "" if num_blocks == own_blocks else (
                f" (another tensor-parallel rank holds only {num_blocks} blocks: see its log; this rank, {tp.rank})")
            raise ConfigError(
                f"gpu_memory_utilization: {utilization} of {self.total / gib:.1f} GiB leaves {budget / gib:.2f} GiB "
                f"for the KV cache after weights ({self.weights / gib:.2f} GiB), peak activations "
                f"({self.peak_activations / gib:.2f} GiB) and memory outside torch ({self.non_torch / gib:.2f} GiB): "
                f"{own_blocks} blocks{tightest}, but {needed_for} needs {min_blocks}"
            )
        return num_blocks


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of one block, across all layers (model_config: this rank's shard)."""
    return kv_block_bytes(model_config, block_size, dtype.itemsize)


@dataclass(frozen=True)
class DummyPrefill:
    """A prefill step of whole prompts of dummy tokens over a scratch KV cache of its own
    (block 0 the null block, then each prompt's blocks in turn), for a measurement's forward
    pass: `model(*prefill.model_inputs())`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_caches: list
    metadata: AttentionMetadata
    num_kv_blocks: int  # the scratch cache's, the null block included

    @classmethod
    def of(cls, model: LlamaForCausalLM, model_config: ModelConfig, seq_lens: list[int], block_size: int,
           device: torch.device) -> "DummyPrefill":
        blocks_per_seq = [-(-length // block_size) for length in seq_lens]
        table = np.zeros((len(seq_lens), max(blocks_per_seq)), dtype=np.int32)
        next_block = 1  # block 0 is the null block
        for row, num_blocks in enumerate(blocks_per_seq):
            table[row, :num_blocks] = np.arange(next_block, next_block + num_blocks)
            next_block += num_blocks
        positions = np.concatenate([np.arange(length) for length in seq_lens])
        rows = np.repeat(np.arange(len(seq_lens)), seq_lens)
        slots = table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        kv_caches = allocate_kv_cache(model_config.num_hidden_layers, next_block, block_size,
                                      model_config.num_key_value_heads, model_config.head_dim,
                                      next(model.parameters()).dtype, device)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(seq_lens)]), dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(table).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
        )
        return cls(torch.zeros(len(positions), dtype=torch.int64, device=device), torch.from_numpy(positions).to(device),
                   kv_caches, metadata, next_block)

    def model_inputs(self) -> tuple:
        return self.input_ids, self.positions, self.kv_caches, self.metadata


@torch.inference_mode()
def profile_run(model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
                device: torch.device) -> int:
    """Run the largest step once on dummy inputs; returns the bytes of the scratch KV cache
    it allocated (part of the measured peak, but not activation memory)."""
    num_tokens, max_len, block_size = config.max_num_batched_tokens, config.max_model_len, config.block_size
    seq_lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
    prefill = DummyPrefill.of(model, model_config, seq_lens, block_size, device)
    hidden = model(*prefill.model_inputs())
    num_rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:num_rows])
    Sampler().sample(logits, SamplingBatch.of_params([_WORST_CASE_SAMPLING] * num_rows, [0] * num_rows,
                                                     model_config.vocab_size, device, [_ProfileHistory()] * num_rows))
    del logits
    # A prefill chunk's prompt log-probabilities: one piece of full-vocabulary logits at a time.
    num_rows = min(prompt_logits_rows(model_config.vocab_size), num_tokens)
    logprobs_of(model.compute_logits(hidden[:num_rows]), torch.zeros(num_rows, dtype=torch.int64, device=device),
                MAX_TOP_LOGPROBS)
    return prefill.num_kv_blocks * kv_cache_bytes_per_block(model_config, block_size, next(model.parameters()).dtype)


def profile_num_kv_blocks(model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
                          device: torch.device, min_tokens: int, tp: TensorParallel = NO_TENSOR_PARALLEL) -> int:
    """KV blocks (the null block included) that fit the engine's share of the GPU; under tensor
    parallelism every rank profiles its own GPU and they agree on the fewest. ConfigError unless
    they hold `min_tokens` (one max_model_len sequence, or a block where max_model_len follows
    the pool)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    scratch_kv_bytes = profile_run(model, model_config, config, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - scratch_kv_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    profile = MemoryProfile(total, free, torch.cuda.memory_reserved(device), weights, peak, device)
    per_block = kv_cache_bytes_per_block(model_config, config.block_size, next(model.parameters()).dtype)
    num_blocks = profile.num_kv_blocks(
        config.gpu_memory_utilization, per_block, min_blocks=-(-min_tokens // config.block_size) + 1, tp=tp,
        needed_for="one max_model_len sequence" if min_tokens == config.max_model_len else f"a {min_tokens}-token block")
    gib = 2**30
    logger.info("KV pool sized by profiling: %d blocks x %d tokens = %.2f GiB (%.2f of %.1f GiB; weights %.2f GiB, "
                "peak activations %.2f GiB, outside torch %.2f GiB)", num_blocks, config.block_size,
                num_blocks * per_block / gib, config.gpu_memory_utilization, total / gib, weights / gib,
                peak / gib, profile.non_torch / gib)
    return num_blocks
