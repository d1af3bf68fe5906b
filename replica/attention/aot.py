"""Ahead-of-time compiles of the attention kernels for an H100 (sm_90), on any machine: no GPU needed.

Triton compiles for a `GPUTarget` without a driver, and the ptxas it ships reports each kernel's
registers per thread and spills; the compile's metadata holds its shared memory. From those,
`programs_per_sm` is how many programs of a kernel an SM can hold at once: the launch plan sizes
split-KV grids for `split_programs_per_sm` of them (AttentionTuning.split_warps_per_sm warps).

Each compile takes its arguments from the same launch builders the kernels run with
(`attention_launch`, `merge_launch`, `write_kv_launch`, on meta-device tensors), so it gets the
specialisation a real launch gets (unit strides folded, 16-byte alignment).

The kernels must be real Triton JIT functions: run this where TRITON_INTERPRET is unset, e.g.

    python -m replica.attention.aot [--jobs 2] [--json]   # the register / spill / occupancy table
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from replica.attention.base import AttentionMetadata
from replica.attention.launch_plan import (
    DEFAULT_TUNING,
    AttentionPlan,
    AttentionTuning,
    KernelConfig,
    config_for,
    split_programs_per_sm,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class SMLimits:
    """What one streaming multiprocessor holds: H100 (compute capability 9.0) by default."""

    capability: int = 90
    registers: int = 65536  # 32-bit registers per SM
    register_unit: int = 256  # registers are granted per warp in units of this many
    max_warps: int = 64
    max_programs: int = 32
    shared_bytes: int = 233472  # 228 KB per SM
    shared_reserved_per_program: int = 1024  # the driver keeps 1 KB of each block's shared memory


H100 = SMLimits()


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int, sm: SMLimits = H100) -> int:
    """Programs of one kernel an SM holds at once: the tightest of registers, warps, shared memory."""
    registers_per_warp = -(-registers * 32 // sm.register_unit) * sm.register_unit
    by_registers = (sm.registers // registers_per_warp) // num_warps
    by_warps = sm.max_warps // num_warps
    by_shared = sm.shared_bytes // (shared_bytes + sm.shared_reserved_per_program)
    return min(by_registers, by_warps, by_shared, sm.max_programs)


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of one model: what fixes a kernel's specialisation besides the plan."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    block_size: int = 16
    max_blocks_per_seq: int = 512  # the block-table width (block_table_width: always a multiple of 16)

    def describe(self) -> str:
        return f"{self.num_q_heads}/{self.num_kv_heads} heads, dim {self.head_dim}, {self.dtype}"


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation: which kernel, for which model shape, launched as `plan` says."""

    kernel: str  # "attention", "merge" or "write_kv"
    shape: ModelShape
    plan: AttentionPlan | None = None  # None for write_kv

    def describe(self) -> str:
        if self.plan is None:
            return f"{self.kernel}, {self.shape.describe()}"
        plan, config = self.plan, self.plan.config
        launch = f"split x{plan.num_segments}" if plan.is_split else "single pass"
        if self.kernel == "merge":
            return f"merge x{plan.num_segments}, {self.shape.describe()}"
        return (f"{plan.tile_rows}-row tile, {launch}, {self.shape.describe()}: key tile {config.key_tile}, "
                f"{config.num_warps} warps, {config.num_stages} stages")


@dataclass(frozen=True)
class KernelResources:
    variant: Variant
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int
    shared_bytes: int
    num_warps: int
    cubin_sha: str  # to tell identical machine code apart (num_stages that change nothing)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def programs_per_sm(self, sm: SMLimits = H100) -> int:
        return programs_per_sm(self.registers, self.num_warps, self.shared_bytes, sm)


def table_shapes(table: str, head_dim: int) -> list[tuple[int, int, int, int]]:
    """The tile shapes one table runs, as (query heads, kv heads, tile rows, segments).

    Registers depend on the tile, the config, the query heads per kv head, and split or not, not
    on the segment count beyond 1. The groupings are those of models at each head size: MHA, GQA 4
    and 8 everywhere, GQA 3 (SmolLM2, the default model; like Qwen2.5's 5 and 7, not a power of two)
    at 32-128, GQA 2 (Gemma 2) at 256; MQA in the split table's tiles (MQA decodes are 32 or 64 rows).
    Head dims masked up to a table size (80, 96) take MHA and GQA 4 and 8, the layouts of such models.
    """
    odd = [(9, 3)] if head_dim in (32, 64, 128) else [(16, 8)] if head_dim == 256 else []
    if table == "decode_configs":  # 16-row tiles: a decode, or a short query whose rows fit 16
        return [(32, 8, 16, 1), *((q, kv, 16, 2) for q, kv in [(32, 8), (64, 8), (32, 32), *odd])]
    if table == "split_configs":  # 8 tokens of GQA 3 or 4, 4 of GQA 8, 8 of GQA 8, MQA decodes
        return [(q, kv, 32, 2) for q, kv in [(32, 8), (64, 8), (32, 1), *odd] if q // kv > 2] + [
            (64, 8, 64, 2), (64, 1, 64, 2)]
    return [(32, 8, 64, 1)]  # prefill: single pass


TABLES = ("decode_configs", "split_configs", "prefill_configs")


def config_variants(table: str, head_dim: int, config: KernelConfig, tuning: AttentionTuning = DEFAULT_TUNING,
                    dtype: str = "bf16") -> list[Variant]:
    """The tile shapes one entry of `table` ("decode_configs", "split_configs", "prefill_configs") runs."""
    variants = []
    for num_q_heads, num_kv_heads, tile_rows, num_segments in table_shapes(table, head_dim):
        plan = AttentionPlan(num_segments, tile_rows, tile_rows // (num_q_heads // num_kv_heads), config,
                             tuning.segment_min_keys)
        variants.append(Variant("attention", ModelShape(num_q_heads, num_kv_heads, head_dim, dtype), plan))
    return variants


def representative_variants(dtypes=("bf16",), tuning: AttentionTuning = DEFAULT_TUNING,
                            extra_dtype_head_dims=(), extra_head_dims=()) -> list[Variant]:
    """Every table config the planner can pick, in each tile shape it is launched with (table_shapes),
    plus the merge (at the most segments: its largest tile) and the cache write. Each head size of
    the tables in each of `dtypes`; `extra_dtype_head_dims` adds (dtype, head dim) pairs and
    `extra_head_dims` head dims that are not powers of two (masked up to the next table size), in
    the first dtype, for the attention kernel only.
    """
    head_dims = sorted({*tuning.decode_configs, *tuning.split_configs, *tuning.prefill_configs})
    cases = [(dtype, head_dim, True) for dtype in dtypes for head_dim in head_dims]
    cases += [(dtype, head_dim, False) for dtype, head_dim in extra_dtype_head_dims]
    cases += [(dtypes[0], head_dim, False) for head_dim in extra_head_dims]
    variants = []
    for dtype, head_dim, with_small_kernels in cases:
        for table in TABLES:
            variants += config_variants(table, head_dim, config_for(getattr(tuning, table), head_dim), tuning, dtype)
        if not with_small_kernels:
            continue
        shape = ModelShape(32, 8, head_dim, dtype)
        merge_plan = AttentionPlan(tuning.max_segments, 16, 4, config_for(tuning.decode_configs, head_dim),
                                   tuning.segment_min_keys)
        variants += [Variant("merge", shape, merge_plan), Variant("write_kv", shape)]
    return variants


def problems(result: KernelResources, tuning: AttentionTuning = DEFAULT_TUNING, sm: SMLimits = H100) -> list[str]:
    """What keeps a compiled variant out of the tables: spills, or (split-KV) fewer programs per SM
    than the plan sizes its grid for. tests/replica/test_attention_compile.py holds the tables to this."""
    found = []
    if result.spills:
        found.append(f"spills {result.spill_stores} B")
    plan = result.variant.plan
    if result.variant.kernel == "attention" and plan.is_split:
        wanted = split_programs_per_sm(plan.config, tuning)
        if result.programs_per_sm(sm) < wanted:
            found.append(f"{result.registers} registers: {result.programs_per_sm(sm)} programs per SM, "
                         f"split-KV wants {wanted}")
    return found


def check_variants(tuning: AttentionTuning = DEFAULT_TUNING) -> list[Variant]:
    """What tests/replica/test_attention_compile.py compiles: every table config in bf16, plus fp16 at
    head dim 128 (the same code but for the conversions: it measured identical) and head dim 80
    (masked up to the 128 entry)."""
    return representative_variants(("bf16",), tuning, extra_dtype_head_dims=[("fp16", 128)], extra_head_dims=(80,))


def _meta_tensors(shape: ModelShape, num_tokens: int, num_seqs: int):
    """Tensors laid out as the model runner lays them out, on the meta device (no memory)."""
    device, dtype = "meta", DTYPES[shape.dtype]
    q_size, kv_size = shape.num_q_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    # The model splits one fused QKV projection, so query, key and value are strided views.
    qkv = torch.empty(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.view(num_tokens, shape.num_q_heads, shape.head_dim)
    key = key.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    value = value.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    cache = torch.empty(8, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.empty(num_seqs, dtype=torch.int32, device=device),
        block_tables=torch.empty(num_seqs, shape.max_blocks_per_seq, dtype=torch.int32, device=device),
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, device=device),
        max_query_len=1, max_seq_len=1,
    )
    return query, key, value, cache, meta


def launch_of(variant: Variant):
    """(kernel, arguments, keyword arguments) of the variant's launch, on meta tensors."""
    from replica.attention import triton_backend as backend

    # Three sequences: never 1 (a launch with one sequence must not need its own compile).
    query, key, value, cache, meta = _meta_tensors(variant.shape, num_tokens=8, num_seqs=3)
    if variant.kernel == "write_kv":
        _, args, options = backend.write_kv_launch(key, value, cache, cache, meta.slot_mapping)
        return backend._write_kv_kernel, args, options
    plan = variant.plan
    output = torch.empty_like(query)
    partials = None
    if plan.is_split:
        partials = backend.SegmentPartials.empty(*query.shape[:2], plan.num_segments, query.shape[2], "meta")
    if variant.kernel == "merge":
        _, args, options = backend.merge_launch(output, partials, meta, plan)
        return backend._merge_segments_kernel, args, options
    _, args, options = backend.attention_launch(query, cache, cache, meta, 0.125, plan, output, partials)
    return backend._paged_attention_kernel, args, options


def compile_variant(variant: Variant, sm: SMLimits = H100):
    """Triton's compile of the variant for `sm`, as a launch would make it (a triton CompiledKernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel, args, options = launch_of(variant)
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("the attention kernels were imported under TRITON_INTERPRET=1: compile them in a "
                           "process without it (python -m replica.attention.aot)")
    target = GPUTarget("cuda", sm.capability, 32)
    backend = make_backend(target)
    # The JIT's own binder: the same specialisation (constexprs, divisibility) a launch computes.
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, launch_options = binder(*args, **options)
    compile_options, signature, constexprs, attrs = kernel._pack_args(backend, launch_options, bound_args,
                                                                       specialization, launch_options)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=compile_options.__dict__)


def measure(variant: Variant, sm: SMLimits = H100) -> KernelResources:
    """Compile the variant and read its registers, spills (ptxas -v) and shared memory (metadata)."""
    import hashlib

    compiled = compile_variant(variant, sm)
    registers, spill_stores, spill_loads = _ptxas_usage(compiled.asm["ptx"], sm.capability)
    return KernelResources(variant, registers, spill_stores, spill_loads, compiled.metadata.shared,
                           compiled.metadata.num_warps, hashlib.sha256(compiled.asm["cubin"]).hexdigest()[:12])


def _ptxas_usage(ptx: str, capability: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from Triton's ptxas run with its own flags."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        result = subprocess.run([get_ptxas(capability).path, "-lineinfo", "-v",
                                 f"--gpu-name={sm_arch_from_capability(capability)}", source,
                                 "-o", os.path.join(tmp, "kernel.cubin")],
                                capture_output=True, text=True, check=True)
    log = result.stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.search(r"Used (\d+) registers", log)
    if spills is None or registers is None:
        raise RuntimeError(f"unexpected ptxas report:\n{log}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def measure_all(variants, jobs: int = 1) -> list[KernelResources]:
    """measure() over the variants, in `jobs` worker processes (each compile is single-threaded)."""
    if jobs <= 1:
        return [measure(variant) for variant in variants]
    # spawn: a fresh interpreter per worker, so a parent's TRITON_INTERPRET import cannot leak in.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init) as pool:
        return list(pool.map(measure, variants))


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)


def format_table(results: list[KernelResources], sm: SMLimits = H100) -> str:
    lines = ["| kernel specialisation | regs/thread | spills (st/ld B) | shared KB | programs/SM |",
             "|---|---:|---:|---:|---:|"]
    for result in results:
        lines.append(f"| {result.variant.describe()} | {result.registers} | {result.spill_stores}/"
                     f"{result.spill_loads} | {result.shared_bytes / 1024:.1f} | {result.programs_per_sm(sm)} |")
    return "\n".join(lines)


def to_record(result: KernelResources, sm: SMLimits = H100) -> dict:
    """One measurement as plain JSON: the variant's numbers, its resources and programs per SM."""
    variant, plan = result.variant, result.variant.plan
    record = dict(kernel=variant.kernel, description=variant.describe(), head_dim=variant.shape.head_dim,
                  dtype=variant.shape.dtype, registers=result.registers, spill_stores=result.spill_stores,
                  spill_loads=result.spill_loads, shared_bytes=result.shared_bytes, num_warps=result.num_warps,
                  programs_per_sm=result.programs_per_sm(sm), cubin_sha=result.cubin_sha)
    if plan is not None:
        record.update(tile_rows=plan.tile_rows, num_segments=plan.num_segments, key_tile=plan.config.key_tile,
                      config_warps=plan.config.num_warps, num_stages=plan.config.num_stages)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", type=lambda text: tuple(text.split(",")), default=("bf16", "fp16"))
    parser.add_argument("--extra-head-dims", type=lambda text: tuple(int(x) for x in text.split(",")), default=(),
                        help="head dims that are not powers of two, in the first dtype (e.g. 80,96)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help="one JSON list of records instead of the table")
    parser.add_argument("--check", action="store_true", help="the test's set (check_variants) instead")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    variants = check_variants() if args.check else representative_variants(args.dtypes,
                                                                            extra_head_dims=args.extra_head_dims)
    results = measure_all(variants, args.jobs)
    print(json.dumps([to_record(result) for result in results]) if args.json else format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
