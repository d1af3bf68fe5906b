"""How one paged-attention call is launched: single pass or split-KV, query tile shape, Triton config.

`plan_attention` is a pure function of the batch shape, never of tensor values, so a CUDA graph
captured for one padded batch always replays the same path. Pure Python: no Triton, no device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class KernelConfig:
    """Keys per inner-loop step, and the Triton launch options of one kernel specialisation."""

    key_tile: int
    num_warps: int
    num_stages: int


# Per head size (padded to a power of two), for query tiles of <= 16 rows (decodes, split-KV).
# Starting points from what serves H100 elsewhere: SGLang's decode kernel walks 32 keys per step
# with 4 warps, vLLM's unified kernel keeps Triton's 4 warps / 3 stages. We hold each key tile
# near 8 KB (32 keys at 128 dims, 64 at 64), enough per load to stream at full bandwidth while
# three stages of K and V stay under a quarter of an SM's shared memory (several programs per SM).
# `bench/bench_attention.py --sweep` settles them on a GPU.
DECODE_CONFIGS: Mapping[int, KernelConfig] = MappingProxyType({
    32: KernelConfig(key_tile=64, num_warps=4, num_stages=3),
    64: KernelConfig(key_tile=64, num_warps=4, num_stages=3),
    128: KernelConfig(key_tile=32, num_warps=4, num_stages=3),
    256: KernelConfig(key_tile=16, num_warps=4, num_stages=3),
})
# For 64-row query tiles (prefill chunks in mixed batches). Up to 128 dims these are the settings
# the kernel ran with before they were tunable (32 keys, Triton's 4 warps and 3 stages), whose
# mixed-batch timings issue 10 measured ahead of vLLM's; 256 dims would hold a 64 KB fp32
# accumulator, so it gets 8 warps and two stages.
PREFILL_CONFIGS: Mapping[int, KernelConfig] = MappingProxyType({
    32: KernelConfig(key_tile=32, num_warps=4, num_stages=3),
    64: KernelConfig(key_tile=32, num_warps=4, num_stages=3),
    128: KernelConfig(key_tile=32, num_warps=4, num_stages=3),
    256: KernelConfig(key_tile=32, num_warps=8, num_stages=2),
})

# Query tile rows: tl.dot needs at least 16; prefill tiles of 64 reread K/V four times less often.
DECODE_TILE_ROWS = 16
PREFILL_TILE_ROWS = 64


@dataclass(frozen=True)
class AttentionTuning:
    """Every knob of the launch choice, so a benchmark can sweep them and tests can shrink them."""

    decode_configs: Mapping[int, KernelConfig] = field(default_factory=lambda: DECODE_CONFIGS)
    prefill_configs: Mapping[int, KernelConfig] = field(default_factory=lambda: PREFILL_CONFIGS)
    # Split-KV aims at this many resident programs per SM: a decode program keeps about one key
    # tile of K and V in flight per stage, so one per SM cannot cover HBM latency.
    split_programs_per_sm: int = 4
    # A segment reads at least this many keys (a multiple of every key tile): fewer would spend
    # more on writing and merging partial results than on reading K/V.
    segment_min_keys: int = 256
    # Bounds the fp32 scratch (tokens x query heads x segments x head dim) and the merge's width.
    max_segments: int = 64
    # Longer query segments (prefill chunks) fill the GPU with query tiles; no split.
    split_max_query_len: int = 8


DEFAULT_TUNING = AttentionTuning()


@dataclass(frozen=True)
class AttentionPlan:
    """One launch: `num_segments` == 1 is the single-pass kernel, more is split-KV plus a merge.

    A sequence of length L uses cdiv(L, keys_per_segment(L)) of the segments; the others exit.
    """

    num_segments: int
    tile_rows: int
    tile_tokens: int
    config: KernelConfig
    segment_min_keys: int

    @property
    def is_split(self) -> bool:
        return self.num_segments > 1


def padded_head_dim(head_dim: int) -> int:
    """The power of two (at least 16, tl.dot's minimum) the kernels pad head_dim to."""
    return max(16, _next_power_of_2(head_dim))


def config_for(configs: Mapping[int, KernelConfig], head_dim: int) -> KernelConfig:
    """The table entry for the smallest tabulated size that holds head_dim, else the largest one."""
    padded = padded_head_dim(head_dim)
    fitting = [size for size in configs if size >= padded]
    return configs[min(fitting) if fitting else max(configs)]


def plan_attention(
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    tuning: AttentionTuning = DEFAULT_TUNING,
) -> AttentionPlan:
    """Single pass or split-KV for this batch shape, from shape numbers only.

    max_seq_len may be an upper bound (a captured graph passes max_model_len): it only caps the
    segment count; each sequence splits its real length on the device.
    """
    queries_per_kv = num_q_heads // num_kv_heads
    splittable = max_query_len <= tuning.split_max_query_len
    if splittable:  # short query segments: a tile just big enough for one sequence's rows
        tile_rows = min(max(_next_power_of_2(max_query_len * queries_per_kv), DECODE_TILE_ROWS), PREFILL_TILE_ROWS)
    else:
        tile_rows = PREFILL_TILE_ROWS
    tile_rows = max(tile_rows, _next_power_of_2(queries_per_kv))  # a tile holds every query head of a token
    tile_tokens = tile_rows // queries_per_kv
    configs = tuning.decode_configs if tile_rows <= DECODE_TILE_ROWS else tuning.prefill_configs
    config = config_for(configs, head_dim)

    num_segments = 1
    if splittable:
        # Programs the single pass would keep busy: one per query tile per kv head.
        busy_programs = max(1, num_seqs * -(-max_query_len // tile_tokens) * num_kv_heads)
        for_occupancy = (num_sms * tuning.split_programs_per_sm) // busy_programs
        for_length = -(-max_seq_len // tuning.segment_min_keys)
        num_segments = max(1, min(for_occupancy, for_length, tuning.max_segments))
    return AttentionPlan(num_segments, tile_rows, tile_tokens, config, tuning.segment_min_keys)


def _next_power_of_2(value: int) -> int:
    return 1 << (max(value, 1) - 1).bit_length()
