"""What a rank does between loading its model and building its runner, the same on every rank
of a tensor-parallel group (the engine core's rank 0 and each worker; their start-up
collectives must meet): decide max_model_len, compile the attention kernels (CUDA), size the
KV pool (profiled under gpu_memory_utilization: the fewest blocks any rank's GPU holds) and
turn the host tier into blocks."""

from __future__ import annotations

import torch

from replica.config import EngineConfig, make_engine_config, resolve_host_kv_blocks, resolve_max_model_len
from replica.executor import cuda_runtime
from replica.executor.memory_profile import kv_cache_bytes_per_block, profile_num_kv_blocks
from replica.model import LlamaForCausalLM, ModelConfig
from replica.parallel.group import TensorParallel


def resolve_rank_config(config: EngineConfig, model: LlamaForCausalLM, model_config: ModelConfig,
                        device: torch.device, tp: TensorParallel) -> EngineConfig:
    """`config` as this rank runs it, model_config being its shard's; equal on every rank."""
    dtype = next(model.parameters()).dtype
    kernels_compile = device.type == "cuda"  # Triton on a GPU (the runtime's branches ask cuda_runtime)
    profiled = config.gpu_memory_utilization is not None and cuda_runtime.on_cuda(device)
    follows_model = config.max_model_len is None
    # A pool that profiling will size cannot bound max_model_len before it exists: that bound
    # (the default num_kv_blocks') would cap a long-context model at ~32k tokens, or refuse an
    # explicit longer max_model_len the profiled pool holds.
    config = resolve_max_model_len(config, model_config.max_model_len, pool_sized_later=profiled)
    if not profiled:
        config.check_pool_holds_max_model_len()  # skipped at validation while gpu_memory_utilization is set
    if kernels_compile:  # every kernel variant a batch shape can pick compiles now, not inside a step
        model.attn_backend.warm_up(model_config.num_attention_heads, model_config.num_key_value_heads,
                                   model_config.head_dim, dtype, config.block_size, config.max_model_len, device)
    if profiled:
        # An explicit max_model_len must fit the profiled pool (else a ConfigError naming
        # gpu_memory_utilization); one that follows the model is then cut to what the pool holds.
        num_blocks = profile_num_kv_blocks(model, model_config, config, device,
                                           config.block_size if follows_model else config.max_model_len, tp)
        config = resolve_max_model_len(make_engine_config(**{
            **config.model_dump(), "num_kv_blocks": num_blocks,
            "max_model_len": None if follows_model else config.max_model_len}), model_config.max_model_len)
    if config.has_host_tier:
        # The replica's tier: each rank keeps its shard of every host block, all in the node's memory.
        config = resolve_host_kv_blocks(config, tp.size * kv_cache_bytes_per_block(model_config, config.block_size,
                                                                                    dtype))
    return config
