"""Issue 15 in one command on a CUDA machine (about 8 minutes on an H100; one table last).

    python bench/bench_gpu.py [--quick] [--json PATH] [--skip-tests] [--skip-peers] [--cpu-smoke]

1. the engine's HF-parity tests on CUDA (fp32, Triton attention, CUDA graphs and async
   scheduling on): tests/replica/test_engine.py and test_slo_engine.py with
   HEADROOM_TEST_DEVICE=cuda, in a subprocess;
2. bf16 greedy agreement with HF on a random 1.1B Llama (hidden 2048, 16 layers, 32 q /
   8 kv heads, vocab 32000): the first 32 tokens of 16 prompts, with HF's logit gap at each
   divergence (near-ties in a random model's flat logits are expected to flip);
3. the engine against HF generate() (batch 64) on that model in bf16, 256 requests of
   bench_engine.py's workload: steps, mean decode step at the largest batch, host time per
   step, output tok/s; with CUDA graphs and async scheduling, then without async, and a
   timed decode step at batch 256 with ~400-token contexts;
4. the same with graphs off (enforce_eager), so the gain is visible;
5. bench/bench_attention.py and bench/bench_fused_ops.py with --quick, when they exist.

Builds its own checkpoint with transformers; needs torch, triton, transformers, safetensors,
tokenizers, numpy, pytest, hypothesis and what the engine imports (no Ray; pydantic: see
docs/benchmarks.md for the wheels to carry).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_engine import run_hf, run_workload, workload  # noqa: E402

MODEL_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
ENGINE_CONFIG = dict(max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048, gpu_memory_utilization=0.9)
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 16, 32
DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS = 256, 400, 32
DEVICE = "cuda"
# --cpu-smoke: every code path of this script on a CPU with a tiny model, in a minute.
SMOKE_MODEL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32000, max_position_embeddings=2048)
SMOKE_ENGINE_CONFIG = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=2048, num_kv_blocks=2048)


@dataclass
class Row:
    section: str
    metric: str
    value: str
    target: str = ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 requests and 8 decode steps (a smoke run)")
    parser.add_argument("--json", help="also write the table as JSON here")
    parser.add_argument("--skip-tests", action="store_true", help="skip section 1")
    parser.add_argument("--skip-peers", action="store_true", help="skip section 5")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny model on the CPU, no tests or peers: checks this script, measures nothing")
    args = parser.parse_args()
    if args.cpu_smoke:
        global DEVICE, DECODE_BATCH, DECODE_CONTEXT, AGREEMENT_PROMPTS, AGREEMENT_TOKENS
        DEVICE, DECODE_BATCH, DECODE_CONTEXT, AGREEMENT_PROMPTS, AGREEMENT_TOKENS = "cpu", 8, 40, 4, 8
        MODEL_SHAPE.update(SMOKE_MODEL_SHAPE)
        ENGINE_CONFIG.clear()
        ENGINE_CONFIG.update(SMOKE_ENGINE_CONFIG)
        args.quick = args.skip_tests = args.skip_peers = True
    elif not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device (--cpu-smoke checks the script on a CPU)")
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)"
    import transformers
    import triton

    print(f"device={device_name} torch={torch.__version__} triton={triton.__version__} "
          f"transformers={transformers.__version__}", flush=True)
    rows: list[Row] = []
    num_requests = 64 if args.quick else 256
    decode_steps = 8 if args.quick else DECODE_STEPS
    if args.cpu_smoke:
        num_requests, decode_steps = 8, 2
    if not args.skip_tests:
        section(rows, "1 parity", parity_tests)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as model_dir:
        section(rows, "setup", lambda: build_checkpoint(Path(model_dir)))
        requests = workload(num_requests, MODEL_SHAPE["vocab_size"],
                            **(dict(max_prompt=48, max_output=24) if args.cpu_smoke else {}))
        prompts = agreement_prompts()
        hf_greedy: dict = {}
        section(rows, "2 HF greedy", lambda: hf_greedy.update(hf_reference(model_dir, prompts)))
        hf_result: dict = {}
        section(rows, "3 HF generate", lambda: hf_throughput(model_dir, requests, hf_result))
        section(rows, "2-3 engine, graphs", lambda: engine_sections(
            model_dir, requests, prompts, hf_greedy, hf_result, eager=False, decode_steps=decode_steps))
        section(rows, "4 engine, graphs off", lambda: engine_sections(
            model_dir, requests, prompts, hf_greedy, hf_result, eager=True, decode_steps=decode_steps))
    if not args.skip_peers:
        for script in ("bench_attention.py", "bench_fused_ops.py"):
            if (REPO / "bench" / script).is_file():
                section(rows, f"5 {script}", lambda script=script: peer_benchmark(script))
    rows.append(Row("all", "wall time (s)", f"{time.perf_counter() - started:.0f}", "<= 600"))
    print_table(rows, device_name)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "rows": [asdict(r) for r in rows]}, indent=1))


def section(rows: list[Row], name: str, run) -> None:
    """Run one section; its rows, or one row saying how it failed (the others still run)."""
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        for row in run() or []:
            rows.append(Row(name, *row))
    except Exception as error:  # a failed section must not hide the others' figures
        import traceback

        traceback.print_exc()
        rows.append(Row(name, "FAILED", f"{type(error).__name__}: {str(error)[:120]}"))
    print(f"   {name}: {time.perf_counter() - start:.1f} s", flush=True)
    free_device_memory()


def free_device_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ---- 1: the HF-parity tests on CUDA -----------------------------------------------------------
def parity_tests() -> list[tuple]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/replica/test_engine.py", "tests/replica/test_slo_engine.py"]
    env = {**os.environ, "HEADROOM_TEST_DEVICE": "cuda", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    output, returncode = run_subprocess(command, env, timeout_s=300)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    summary = f"{summary} (exit {returncode})"
    return [("test_engine + test_slo_engine on CUDA (fp32, Triton, graphs, async)", summary, "all pass")]


def run_subprocess(command: list[str], env=None, timeout_s: int = 240) -> tuple[str, object]:
    """(output, exit code or "timed out ..."), printing its tail; a file keeps what a
    command wrote before a timeout killed it."""
    with tempfile.TemporaryFile(mode="w+") as log:
        try:
            returncode = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            returncode = f"timed out after {timeout_s} s"
        log.seek(0)
        output = log.read()
    print(output[-8000:], flush=True)
    return output, returncode


# ---- the checkpoint and HF's side ---------------------------------------------------------------
def build_checkpoint(model_dir: Path) -> list[tuple]:
    import transformers

    from replica.builtin_model import build_byte_level_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL_SHAPE, tie_word_embeddings=False)
    with torch.device(DEVICE):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    build_byte_level_tokenizer().save(str(model_dir / "tokenizer.json"))  # ids are used directly; text unused
    num_params = sum(p.numel() for p in model.parameters())
    del model
    return [("random Llama checkpoint (bf16)", f"{num_params / 1e9:.2f} B parameters")]


def agreement_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(rng.randint(16, 128))]
            for _ in range(AGREEMENT_PROMPTS)]


def hf_reference(model_dir: str, prompts: list[list[int]]) -> dict:
    """HF's greedy tokens and per-step logits for each prompt, one prompt at a time (no padding)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    tokens, scores = [], []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], device=DEVICE)
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=AGREEMENT_TOKENS,
                                 min_new_tokens=AGREEMENT_TOKENS, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            scores.append(torch.stack(out.logits)[:, 0].float().cpu())  # raw, before any logits processor
    del model
    return dict(tokens=tokens, scores=scores)


def hf_throughput(model_dir: str, requests, result: dict) -> list[tuple]:
    result.update(run_hf(model_dir, requests, batch_size=64, device=DEVICE, dtype="bfloat16"))
    return [("HF generate (batch 64): output tok/s, wall s", f"{result['tokens_per_s']:,.0f}, {result['elapsed']:.1f}")]


# ---- 2-4: the engine --------------------------------------------------------------------------
def engine_sections(model_dir, requests, prompts, hf_greedy, hf_result, *, eager: bool, decode_steps: int):
    from replica.config import make_engine_config
    from replica.engine import LLMEngine

    engine = LLMEngine(make_engine_config(**ENGINE_CONFIG, enforce_eager=eager), model_dir, device=DEVICE,
                       dtype="bfloat16")
    rows = [("KV pool", f"{engine.config.num_kv_blocks} blocks of {engine.config.block_size}")]
    try:
        if not eager and hf_greedy:
            rows += agreement_rows(engine, prompts, hf_greedy)
        modes = [("graphs off, async", True)] if eager else [("graphs + async", True), ("graphs, no async", False)]
        for label, async_scheduling in modes:
            engine.async_scheduling = async_scheduling
            rows += throughput_rows(engine, requests, hf_result, label)
            rows += decode_rows(engine, label, decode_steps)
    finally:
        engine.shutdown()
        del engine
    return rows


def agreement_rows(engine, prompts, hf_greedy) -> list[tuple]:
    from replica.request import SamplingParams

    ours = engine.generate(prompts, SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True))
    matched, exact, gaps = 0, 0, []
    for our_tokens, hf_tokens, hf_scores in zip(ours, hf_greedy["tokens"], hf_greedy["scores"]):
        prefix = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens)) if a != b), len(hf_tokens))
        matched += prefix
        exact += prefix == len(hf_tokens)
        if prefix < len(hf_tokens):  # how close HF's own logits were to our choice there
            gaps.append(float(hf_scores[prefix, hf_tokens[prefix]] - hf_scores[prefix, our_tokens[prefix]]))
    total = len(prompts) * AGREEMENT_TOKENS
    rows = [("greedy tokens equal to HF before the first divergence", f"{matched}/{total} = {matched / total:.1%}",
             "near 100%"),
            (f"prompts identical for all {AGREEMENT_TOKENS} tokens", f"{exact}/{len(prompts)}")]
    if gaps:
        rows.append(("HF logit gap at each divergence (median, max)",
                     f"{statistics.median(gaps):.3f}, {max(gaps):.3f} (logit std ~1: near-ties)"))
    return rows


def throughput_rows(engine, requests, hf_result, label: str) -> list[tuple]:
    timings = []
    run_workload(engine, requests[:8])  # warm-up: first-use kernels and allocator growth
    result = run_workload(engine, requests, on_step=lambda e: timings.append(e.last_step))
    decodes = [t for t in timings if t.num_seqs and t.num_tokens == t.num_seqs]
    largest = max((t.num_seqs for t in decodes), default=0)
    at_largest = [t for t in decodes if t.num_seqs == largest]
    rows = [
        (f"{label}: output tok/s", f"{result['tokens_per_s']:,.0f}", ">= 25,000"),
        (f"{label}: steps, wall s, preemptions", f"{result['steps']}, {result['elapsed']:.2f}, {result['preemptions']}"),
        (f"{label}: mean decode step at the largest batch ({largest}), ms", f"{_mean_ms(t.wall_s for t in at_largest):.2f}"),
        (f"{label}: host ms per step (wall - wait), all / decode steps",
         f"{_mean_ms(t.host_s for t in timings):.2f} / {_mean_ms(t.host_s for t in decodes):.2f}"),
        (f"{label}: runner launch ms per decode step", f"{_mean_ms(t.launch_s for t in decodes):.3f}", "<= 0.5"),
    ]
    if hf_result:
        ratio = result["tokens_per_s"] / hf_result["tokens_per_s"]
        rows.append((f"{label}: vs HF generate (batch 64)", f"{ratio:.1f}x", ">= 20x"))
    return rows


def decode_rows(engine, label: str, steps: int) -> list[tuple]:
    """Time decode steps at batch 256 once every request is past its prefill."""
    from replica.request import SamplingParams

    rng = random.Random(2)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(f"decode-{label}-{i}",
                                    [rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(DECODE_CONTEXT)],
                                    params) for i in range(DECODE_BATCH)]
    for request in requests:
        engine.add_request(request, detokenize=False)
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    timings = []
    for _ in range(steps):
        engine.step()
        timings.append(engine.last_step)
    for request in requests:
        engine.abort_request(request.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # drains a step still in flight
    return [
        (f"{label}: decode step at batch {DECODE_BATCH}, ~{DECODE_CONTEXT}-token contexts, wall ms",
         f"{_mean_ms(t.wall_s for t in timings):.2f}", "<= 3"),
        (f"{label}: same, host ms (wall - wait) / runner launch ms",
         f"{_mean_ms(t.host_s for t in timings):.2f} / {_mean_ms(t.launch_s for t in timings):.3f}", "launch <= 0.5"),
    ]


def _mean_ms(values) -> float:
    values = list(values)
    return 1000 * statistics.fmean(values) if values else float("nan")


# ---- 5: the other helpers' benchmarks ------------------------------------------------------------
def peer_benchmark(script: str) -> list[tuple]:
    _, returncode = run_subprocess([sys.executable, str(REPO / "bench" / script), "--quick"])
    return [(f"{script} --quick", f"exit {returncode} (its table is printed above)")]


def print_table(rows: list[Row], device_name: str) -> None:
    print(f"\n## bench_gpu.py on {device_name}\n")
    print("| section | metric | value | target |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row.section} | {row.metric} | {row.value} | {row.target} |")


if __name__ == "__main__":
    main()
