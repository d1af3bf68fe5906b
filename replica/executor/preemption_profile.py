"""Measures, once at start-up, the two rates the auto preemption mode weighs per victim
(replica/core/preemption_mode.py): how long a token takes to prefill, and how fast whole KV
blocks cross between the device and the host tier. A configured rate is used as given.
Under tensor parallelism every rank measures, together (preemption_costs says how).
"""

from __future__ import annotations

import logging
import time

import torch

from replica.executor import cuda_runtime
from replica.config import EngineConfig
from replica.core.host_pool import BlockCopies
from replica.core.preemption_mode import PreemptionCosts, prefill_probe_tokens
from replica.executor.kv_swap import KVSwapper
from replica.executor.memory_profile import DummyPrefill
from replica.model import LlamaForCausalLM, ModelConfig
from replica.parallel.group import NO_TENSOR_PARALLEL, TensorParallel

logger = logging.getLogger(__name__)

SWAP_PROBE_BLOCKS = 16  # at most, each way
REPEATS = 3  # the fastest of these counts: the others met a cold cache or a busy host


def _synchronize(device: torch.device) -> None:
    if cuda_runtime.on_cuda(device):
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_prefill_s_per_token(model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
                                device: torch.device) -> float:
    """One prompt's forward pass on dummy tokens, over a scratch KV cache."""
    num_tokens = prefill_probe_tokens(config)
    prefill = DummyPrefill.of(model, model_config, [num_tokens], config.block_size, device)
    timings = []
    for _ in range(REPEATS + 1):  # the first warms up
        _synchronize(device)
        start = time.perf_counter()
        hidden = model(*prefill.model_inputs())
        model.compute_logits(hidden[-1:])
        _synchronize(device)
        timings.append(time.perf_counter() - start)
    return min(timings[1:]) / num_tokens


def measure_swap_bytes_per_s(kv_swap: KVSwapper, num_device_blocks: int, num_host_blocks: int) -> float:
    """Round trips of a few blocks through the real copy path (at start nothing is cached,
    so the blocks' contents do not matter)."""
    num_blocks = max(1, min(SWAP_PROBE_BLOCKS, num_device_blocks, num_host_blocks))
    block_ids = range(1, num_blocks + 1)
    copies = BlockCopies(tuple(zip(block_ids, block_ids)), tuple(zip(block_ids, block_ids)))
    timings = []
    for _ in range(REPEATS + 1):
        _synchronize(kv_swap.device)
        start = time.perf_counter()
        kv_swap.copy(copies)
        kv_swap.synchronize()
        _synchronize(kv_swap.device)
        timings.append(time.perf_counter() - start)
    return 2 * num_blocks * kv_swap.bytes_per_block / max(min(timings[1:]), 1e-9)


def preemption_costs(model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
                     device: torch.device, kv_swap: KVSwapper,
                     tp: TensorParallel = NO_TENSOR_PARALLEL) -> PreemptionCosts:
    """The rates the config sets, the others measured now; logged either way.

    Under tensor parallelism every rank calls this at start, in step. The prefill probe is one
    forward pass of the whole group (its all-reduces make each rank's timing the group's), so
    rank 0's stands for all. Each rank copies only its own shard of a block, all at once, so a
    swap takes as long as the slowest rank's copy: the bandwidth is each rank's own, measured,
    and the ranks agree on the lowest, over their shard's bytes per block."""
    recompute_s_per_token = config.preemption_recompute_s_per_token
    recompute_source = "configured"
    if recompute_s_per_token is None:
        recompute_s_per_token = measure_prefill_s_per_token(model, model_config, config, device)
        recompute_source = "measured"
    swap_bytes_per_s = config.preemption_swap_bytes_per_s
    swap_source = "configured"
    if swap_bytes_per_s is None:
        swap_bytes_per_s = tp.min_at_start(
            measure_swap_bytes_per_s(kv_swap, config.num_usable_blocks, config.num_host_kv_blocks), device)
        swap_source = "measured" if tp.size == 1 else f"measured, the slowest of {tp.size} ranks"
    costs = PreemptionCosts.of(recompute_s_per_token, swap_bytes_per_s, kv_swap.bytes_per_block)
    logger.info("preemption costs: recompute %.3g ms/token (%s), swap %.2f GB/s (%s) = %.3g ms per %d-token block "
                "each way; mode %s, host tier %d blocks", recompute_s_per_token * 1e3, recompute_source,
                swap_bytes_per_s / 1e9, swap_source, costs.swap_s_per_block * 1e3, config.block_size,
                config.preemption_mode, config.num_host_kv_blocks)
    return costs
