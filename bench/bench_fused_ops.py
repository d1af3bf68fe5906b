"""The decoder's elementwise ops three ways, to settle `fused_ops` (replica/model/fused_ops.py):
unfused torch (the reference), our Triton kernels, and torch.compile of the unfused ops; per op
and for one whole decoder layer, at decode batch sizes, against the copy-bandwidth floor.

    python bench/bench_fused_ops.py                      # on a GPU: 1.1B-Llama shapes, bf16, batch 1/64/256
    python bench/bench_fused_ops.py --device cpu --quick # smoke run (add TRITON_INTERPRET=1 for the kernels)

Shapes: hidden 2048, intermediate 5632, 32 query / 8 kv heads of 64, each sequence decoding at
~400 tokens of context (the issue 15 workload). "graph" times replay a CUDA graph holding
GRAPH_CALLS calls (GPU time, what a captured decode step pays); "eager" times are wall time per
call (launch-bound). Ratios are unfused torch time / variant time; floor = bytes moved / the
device-to-device copy bandwidth measured in this run. Outputs are checked against the reference first.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from replica.attention import AttentionMetadata, allocate_kv_cache, get_attention_backend
from replica.model import FusedOps, ModelConfig, get_fused_ops
from replica.model.llama import DecoderLayer, RotaryEmbedding

LLAMA_1B = dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048)
TINY = dict(LLAMA_1B, hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4)
BLOCK_SIZE = 16
GRAPH_CALLS = 20  # calls captured per graph, so one replay's launch cost is spread thin
COMPILED_LAYER = "compile-layer"  # the whole layer (reference ops + attention) under torch.compile


@dataclass
class Timing:
    graph_us: float | None  # None off CUDA
    eager_us: float


@dataclass
class Case:
    """One workload: a factory giving a zero-argument call for a FusedOps choice, and its bytes moved."""

    name: str
    batch: int
    make_call: Callable[[str], Callable[[], object]]
    bytes_moved: int


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write), the floor's yardstick."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 20 / (start.elapsed_time(end) / 1e3)


def time_call(call: Callable[[], object], device: torch.device, iters: int) -> Timing:
    for _ in range(3):  # compile, autotune, allocate
        call()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            call()
        return Timing(None, (time.perf_counter() - start) / iters * 1e6)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) / iters * 1e6

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    graph.replay()
    replays = max(iters // GRAPH_CALLS, 5)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return Timing(begin.elapsed_time(end) * 1e3 / (replays * GRAPH_CALLS), eager_us)


class Workloads:
    """Inputs at one batch size, built once per variant so in-place kernels never share them."""

    def __init__(self, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype, device: torch.device):
        self.cfg, self.batch, self.context, self.dtype, self.device = cfg, batch, context, dtype, device
        self.generator = torch.Generator(device=device).manual_seed(batch)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, device=self.device).to(self.dtype)

    def case(self, name: str, factory: Callable[[str], Callable[[], object]], bytes_moved: int) -> Case:
        """Every call of make_call draws the same inputs (and layer weights), so variants can be compared."""

        def make_call(variant: str) -> Callable[[], object]:
            self.generator.manual_seed(self.batch)
            torch.manual_seed(self.batch)
            return factory(variant)

        return Case(name, self.batch, make_call, bytes_moved)

    def ops_for(self, name: str) -> FusedOps:
        return get_fused_ops(name, self.device)

    def op_cases(self) -> list[Case]:
        cfg, batch, element = self.cfg, self.batch, self.dtype.itemsize
        hidden, intermediate, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        cache = RotaryEmbedding(cfg, FusedOps()).cos_sin_cache.to(self.device, self.dtype)
        positions = torch.full((batch,), self.context - 1, dtype=torch.int64, device=self.device)
        weight = self.randn(hidden)

        def rms_norm(name):
            ops, x = self.ops_for(name), self.randn(batch, hidden)
            return lambda: ops.rms_norm(x, weight, eps)

        def add_rms_norm(name):
            ops, x, residual = self.ops_for(name), self.randn(batch, hidden), self.randn(batch, hidden)
            return lambda: ops.add_rms_norm(x, residual, weight, eps)

        def rotary(name):
            ops = self.ops_for(name)
            query, key, _ = self.randn(batch, q_size + 2 * kv_size).split([q_size, kv_size, kv_size], dim=-1)
            query = query.view(batch, cfg.num_attention_heads, cfg.head_dim)
            key = key.view(batch, cfg.num_key_value_heads, cfg.head_dim)
            return lambda: ops.rotary(positions, query, key, cache)

        def silu_and_mul(name):
            ops, gate_up = self.ops_for(name), self.randn(batch, 2 * intermediate)
            return lambda: ops.silu_and_mul(gate_up)

        return [
            self.case("rms_norm", rms_norm, 2 * batch * hidden * element),
            self.case("add_rms_norm", add_rms_norm, 4 * batch * hidden * element),
            self.case("rotary", rotary, (2 * batch * (q_size + kv_size) + batch * cfg.head_dim) * element),
            self.case("silu_and_mul", silu_and_mul, 3 * batch * intermediate * element),
        ]

    def gemm_cases(self) -> list[Case]:
        """Merged q/k/v and gate/up GEMMs against the separate ones they replace ("torch" = separate)."""
        cfg, batch, element = self.cfg, self.batch, self.dtype.itemsize
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        cases = []
        for name, sizes in (("qkv_proj", (q_size, kv_size, kv_size)),
                            ("gate_up_proj", (cfg.intermediate_size, cfg.intermediate_size))):
            x = self.randn(batch, cfg.hidden_size)
            weights = [self.randn(size, cfg.hidden_size) for size in sizes]
            merged = torch.cat(weights)

            def make_call(variant, x=x, weights=weights, merged=merged):
                if variant == "torch":
                    return lambda: [torch.nn.functional.linear(x, w) for w in weights]
                return lambda: torch.nn.functional.linear(x, merged)

            cases.append(self.case(name, make_call, merged.numel() * element))
        return cases

    def layer_case(self) -> Case:
        cfg, batch, context, device = self.cfg, self.batch, self.context, self.device
        blocks_per_seq = -(-context // BLOCK_SIZE)
        block_tables = (1 + torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32)
                        ).view(batch, blocks_per_seq)
        last_slot = block_tables[:, (context - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
        meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            block_tables=block_tables, slot_mapping=last_slot, max_query_len=1, max_seq_len=context,
        )
        [kv_cache] = allocate_kv_cache(1, batch * blocks_per_seq + 1, BLOCK_SIZE, cfg.num_key_value_heads,
                                       cfg.head_dim, self.dtype, device)
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
        backend = get_attention_backend("auto", device)

        def make_call(variant):
            ops = self.ops_for("torch" if variant == COMPILED_LAYER else variant)
            with torch.device(device):
                layer = DecoderLayer(cfg, backend, ops).to(self.dtype).eval()
            # The rotary table is built on the CPU whatever the default device: move it explicitly.
            rotary_emb = RotaryEmbedding(cfg, ops).to(device=device, dtype=self.dtype)
            forward = torch.compile(layer, dynamic=False) if variant == COMPILED_LAYER else layer
            hidden, residual = self.randn(batch, cfg.hidden_size), self.randn(batch, cfg.hidden_size)
            return lambda: forward(positions, hidden, residual, rotary_emb, kv_cache, meta)

        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        weights = cfg.hidden_size * (2 * q_size + 2 * kv_size + 3 * cfg.intermediate_size + 2)
        kv_reads = 2 * batch * context * kv_size
        return self.case("decoder layer", make_call, (weights + kv_reads) * self.dtype.itemsize)


def check_against_reference(case: Case, variant: str, dtype: torch.dtype) -> None:
    """A variant that is fast but wrong must not be timed: outputs vs the reference on fresh inputs."""
    expected, actual = case.make_call("torch")(), case.make_call(variant)()
    if isinstance(expected, torch.Tensor):
        expected, actual = [expected], [actual]
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for want, got in zip(expected, actual):
        torch.testing.assert_close(got.float(), want.float(), **tolerance,
                                   msg=lambda m: f"{case.name} batch {case.batch} {variant}: {m}")


def print_table(title: str, rows: list[tuple[Case, dict[str, Timing]]], variants: list[str],
                bandwidth: float, graph: bool) -> None:
    print(f"\n{title}")
    header = f"{'workload':<14} {'batch':>5} " + " ".join(f"{v + ' us':>17}" for v in variants)
    header += " " + " ".join(f"{'torch/' + v:>20}" for v in variants[1:])
    print(header + (f" {'floor us':>9} {'best/floor':>10}" if graph else ""))
    for case, timings in rows:
        values = {v: (t.graph_us if graph else t.eager_us) for v, t in timings.items()}
        line = f"{case.name:<14} {case.batch:>5} " + " ".join(
            f"{values[v]:>17.1f}" if v in values else f"{'n/a':>17}" for v in variants)
        line += " " + " ".join(
            f"{values['torch'] / values[v]:>19.2f}x" if v in values else f"{'n/a':>20}" for v in variants[1:])
        if graph:
            floor_us = case.bytes_moved / bandwidth * 1e6
            line += f" {floor_us:>9.1f} {min(values.values()) / floor_us:>9.1f}x"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=400, help="tokens of context per decoding sequence")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, batches 1 and 4, few iterations")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    cfg = ModelConfig.from_hf_config(TINY if args.quick else LLAMA_1B)
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    iters = 5 if args.quick else args.iters
    context = 40 if args.quick else args.context

    variants = ["torch", "compile"]
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        variants.insert(1, "triton")
    else:
        print("triton: skipped (no GPU; TRITON_INTERPRET=1 runs the kernels interpreted)")
    bandwidth = copy_bandwidth(device)
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) "
          f"dtype={dtype} torch {torch.__version__} hidden={cfg.hidden_size} context={context} "
          f"copy bandwidth={bandwidth / 1e12:.2f} TB/s")

    rows, gemm_rows, layer_rows = [], [], []
    torch.set_grad_enabled(False)
    for batch in batches:
        workloads = Workloads(cfg, batch, context, dtype, device)
        for case in workloads.op_cases():
            for variant in variants[1:]:
                check_against_reference(case, variant, dtype)
            rows.append((case, {v: time_call(case.make_call(v), device, iters) for v in variants}))
        for case in workloads.gemm_cases():
            gemm_rows.append((case, {v: time_call(case.make_call(v), device, iters) for v in ("torch", "merged")}))
        layer_rows.append((workloads.layer_case(), {}))
    # Variant by variant, so each one's compilations (per batch for the whole layer) happen together.
    for variant in [*variants, COMPILED_LAYER]:
        for layer, timings in layer_rows:
            try:
                check_against_reference(layer, variant, dtype)
                timings[variant] = time_call(layer.make_call(variant), device, iters)
            except Exception as err:  # noqa: BLE001  (a variant that cannot run is reported, not fatal)
                print(f"decoder layer batch {layer.batch} {variant}: n/a ({type(err).__name__}: {str(err)[:160]})")

    layer_variants = [*variants, COMPILED_LAYER]
    for graph in ([True, False] if device.type == "cuda" else [False]):
        kind = "graph-replayed (GPU time per call)" if graph else "eager (wall time per call)"
        print_table(f"elementwise ops, {kind}", rows, variants, bandwidth, graph)
        print_table(f"GEMMs: separate ('torch') vs merged, {kind}", gemm_rows, ["torch", "merged"], bandwidth, graph)
        print_table(f"one decoder layer, {kind}", layer_rows, layer_variants, bandwidth, graph)
    for layer, timings in layer_rows:
        per_op = {v: t for v, t in timings.items() if v != COMPILED_LAYER}
        best = min(per_op, key=lambda v: per_op[v].graph_us if per_op[v].graph_us is not None else per_op[v].eager_us)
        print(f"batch {layer.batch}: fastest fused_ops choice for a decoder layer = {best}")


if __name__ == "__main__":
    main()
