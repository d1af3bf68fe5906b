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


# Three tables, per head size (padded to a power of two): DECODE_CONFIGS for 16-row query tiles
# (decodes, and short queries whose rows fit 16), SPLIT_CONFIGS for larger tiles of short queries
# (up to split_max_query_len tokens x the query heads of a kv head: speculative decoding, MQA
# decodes), PREFILL_CONFIGS for 64-row tiles of prefill chunks. The first two may run split-KV.
#
# Chosen from ahead-of-time compiles for sm_90 (`python -m replica.attention.aot`: registers,
# spills, shared memory, hence programs per SM) and H100 timings of the candidates that compiled
# clean (CUDA-graph replays, 2026-11-25, docs/benchmarks.md "Decode attention kernel"). Every entry
# compiles with no spills, and an H100 holds split_programs_per_sm of each entry that can split
# (tests/replica/test_attention_compile.py). `bench/bench_attention.py --sweep` re-times them.
# Comments: registers per thread, programs per SM, in the tile shapes of GQA 4 (32/8 heads), as
# Triton 3.6.0 compiles them (3.7.1: within 11 registers and one program of these).
#
# Decodes: two stages beat three at head dims 128 (geometric mean over batch 1 x 16k to 256 x 4k
# +3%, batch 256 +8%) and 256, in fewer registers (three: 140 at 256, 3 programs per SM); head dim
# 64 keeps 64 keys and three stages (7% ahead of 32 keys and two). Head dim 256 now runs one stage
# all the same: with two, Triton 3.7.1 spills the MHA split tile (32/32 heads: 96 registers, 8 B
# stored); one compiles clean under 3.6.0 and 3.7.1 in 120-128 registers, 4 programs per SM, in
# every tile shape (8 warps and two stages would too, in 74-100); not yet timed against two.
DECODE_CONFIGS: Mapping[int, KernelConfig] = MappingProxyType({
    32: KernelConfig(key_tile=64, num_warps=4, num_stages=2),  # 64, 8
    64: KernelConfig(key_tile=64, num_warps=4, num_stages=3),  # 80, 6
    128: KernelConfig(key_tile=32, num_warps=4, num_stages=2),  # 72-80, 6-7
    256: KernelConfig(key_tile=16, num_warps=4, num_stages=1),  # 120-128 (128: no margin for 4), 4
})
# Short-query tiles of 32 or 64 rows: 4 warps hold 4 programs per SM up to head dim 64; at 128
# they would not (32 keys, 3 stages: 126-168 registers, 3 programs with 3 or 8 query heads per kv
# head), so 8 warps; 256 needs 16 at 64 rows (8 warps: 160 registers, 1 program), which costs
# about 1.5x on such batches against 8 warps (bench: 8 x 8-token queries).
SPLIT_CONFIGS: Mapping[int, KernelConfig] = MappingProxyType({
    32: KernelConfig(key_tile=32, num_warps=4, num_stages=3),  # 80, 6
    64: KernelConfig(key_tile=32, num_warps=4, num_stages=2),  # 96, 5
    128: KernelConfig(key_tile=32, num_warps=8, num_stages=2),  # 100, 2 of 8 warps
    256: KernelConfig(key_tile=32, num_warps=16, num_stages=2),  # 97, 1 of 16 warps
})
# 64-row prefill tiles (single pass). Head dims 32 and 128 keep the settings the kernel ran with
# before they were tunable (32 keys, 4 warps, 3 stages; at 128 the fastest timed: 8 warps cost
# 1.5x on a 2k chunk); 64 keys and two stages run head dim 64's mixed batches 11-15% faster; 256
# holds a 64 KB fp32 accumulator, so 8 warps (16 warps ran a 2k chunk 2x slower).
PREFILL_CONFIGS: Mapping[int, KernelConfig] = MappingProxyType({
    32: KernelConfig(key_tile=32, num_warps=4, num_stages=3),  # 72, 7
    64: KernelConfig(key_tile=64, num_warps=4, num_stages=2),  # 128, 4
    128: KernelConfig(key_tile=32, num_warps=4, num_stages=3),  # 152, 3
    256: KernelConfig(key_tile=32, num_warps=8, num_stages=2),  # 160, 1
})

# Query tile rows: tl.dot needs at least 16; prefill tiles of 64 reread K/V four times less often.
DECODE_TILE_ROWS = 16
PREFILL_TILE_ROWS = 64


@dataclass(frozen=True)
class AttentionTuning:
    """Every knob of the launch choice, so a benchmark can sweep them and tests can shrink them."""

    decode_configs: Mapping[int, KernelConfig] = field(default_factory=lambda: DECODE_CONFIGS)
    split_configs: Mapping[int, KernelConfig] = field(default_factory=lambda: SPLIT_CONFIGS)
    prefill_configs: Mapping[int, KernelConfig] = field(default_factory=lambda: PREFILL_CONFIGS)
    # Split-KV sizes its grid for this many resident warps per SM (4 programs of 4 warps): a
    # decode program keeps a key tile or two of K and V in flight, so one per SM cannot cover HBM
    # latency. Counted in warps, so an 8-warp config gets half the programs. Registers decide
    # what an SM can hold: tests/replica/test_attention_compile.py compiles every config that can
    # split for sm_90 and checks an H100 holds this many of its warps (split_programs_per_sm).
    split_warps_per_sm: int = 16
    # A segment reads at least this many keys (a multiple of every key tile): fewer would spend
    # more on writing and merging partial results than on reading K/V.
    segment_min_keys: int = 256
    # Bounds the fp32 scratch (tokens x query heads x segments x head dim) and the merge's width.
    max_segments: int = 64
    # Longer query segments (prefill chunks) fill the GPU with query tiles; no split.
    split_max_query_len: int = 8


def split_programs_per_sm(config: KernelConfig, tuning: AttentionTuning) -> int:
    """Resident programs per SM split-KV sizes its grid for, with this kernel config."""
    return max(1, tuning.split_warps_per_sm // config.num_warps)


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
    short = _short(max_query_len, tuning)
    tile_rows = _tile_rows(max_query_len, queries_per_kv, tuning)
    num_segments = 1
    if short:
        busy_programs = _busy_programs(num_seqs, max_query_len, tile_rows // queries_per_kv, num_kv_heads)
        wanted_programs = num_sms * split_programs_per_sm(_config(tile_rows, short, head_dim, tuning), tuning)
        num_segments = _num_segments(busy_programs, max_seq_len, wanted_programs, tuning)
    return _plan(tile_rows, short, num_segments, queries_per_kv, head_dim, tuning)


def reachable_plans(num_q_heads: int, num_kv_heads: int, head_dim: int, num_sms: int, max_model_len: int,
                    tuning: AttentionTuning = DEFAULT_TUNING) -> list[AttentionPlan]:
    """Every plan plan_attention returns for this model on this GPU, over all batch shapes.

    Each plan is one kernel specialisation (tile, config, segment count): `warm_up` compiles them
    all before serving, so no batch shape compiles inside a timed or served step. A few dozen at
    most: segment counts are powers of two, and query lengths past split_max_query_len share one plan.
    """
    queries_per_kv = num_q_heads // num_kv_heads
    plans = set()
    for max_query_len in range(1, min(tuning.split_max_query_len, max_model_len) + 1):
        tile_rows = _tile_rows(max_query_len, queries_per_kv, tuning)
        # One sequence keeps the fewest programs busy, so it splits the most; any power of two
        # below that is reached by a shorter context.
        busy_programs = _busy_programs(1, max_query_len, tile_rows // queries_per_kv, num_kv_heads)
        wanted_programs = num_sms * split_programs_per_sm(_config(tile_rows, True, head_dim, tuning), tuning)
        most = _num_segments(busy_programs, max_model_len, wanted_programs, tuning)
        plans.update(_plan(tile_rows, True, 1 << i, queries_per_kv, head_dim, tuning)
                     for i in range(most.bit_length()))
    if max_model_len > tuning.split_max_query_len:
        plans.add(_plan(_tile_rows(max_model_len, queries_per_kv, tuning), False, 1, queries_per_kv, head_dim,
                        tuning))
    return sorted(plans, key=lambda plan: (plan.tile_rows, plan.num_segments))


def _tile_rows(max_query_len: int, queries_per_kv: int, tuning: AttentionTuning) -> int:
    if _short(max_query_len, tuning):  # a tile just big enough for one sequence's rows
        tile_rows = min(max(_next_power_of_2(max_query_len * queries_per_kv), DECODE_TILE_ROWS), PREFILL_TILE_ROWS)
    else:
        tile_rows = PREFILL_TILE_ROWS
    return max(tile_rows, _next_power_of_2(queries_per_kv))  # a tile holds every query head of a token


def _short(max_query_len: int, tuning: AttentionTuning) -> bool:
    """Short query segments (decodes, speculative tokens) may split; prefill chunks fill the GPU with tiles."""
    return max_query_len <= tuning.split_max_query_len


def _busy_programs(num_seqs: int, max_query_len: int, tile_tokens: int, num_kv_heads: int) -> int:
    """Programs the single pass would keep busy: one per query tile per kv head."""
    return max(1, num_seqs * -(-max_query_len // tile_tokens) * num_kv_heads)


def _num_segments(busy_programs: int, max_seq_len: int, wanted_programs: int, tuning: AttentionTuning) -> int:
    """Segments per sequence: enough programs to fill every SM, none under segment_min_keys.

    Rounded down to a power of two: the count is a kernel constant, so each distinct value is a
    compile; powers of two keep the variants few (7 up to 64) and enumerable (reachable_plans).
    """
    for_occupancy = wanted_programs // busy_programs
    for_length = -(-max_seq_len // tuning.segment_min_keys)
    return _previous_power_of_2(max(1, min(for_occupancy, for_length, tuning.max_segments)))


def _config(tile_rows: int, short: bool, head_dim: int, tuning: AttentionTuning) -> KernelConfig:
    """16-row tiles take the decode table; larger tiles the split table for short queries, else prefill's."""
    if tile_rows <= DECODE_TILE_ROWS:
        configs = tuning.decode_configs
    else:
        configs = tuning.split_configs if short else tuning.prefill_configs
    return config_for(configs, head_dim)


def _plan(tile_rows: int, short: bool, num_segments: int, queries_per_kv: int, head_dim: int,
          tuning: AttentionTuning) -> AttentionPlan:
    return AttentionPlan(num_segments, tile_rows, tile_rows // queries_per_kv,
                         _config(tile_rows, short, head_dim, tuning), tuning.segment_min_keys)


def _previous_power_of_2(value: int) -> int:
    return 1 << (value.bit_length() - 1)


def _next_power_of_2(value: int) -> int:
    return 1 << (max(value, 1) - 1).bit_length()
