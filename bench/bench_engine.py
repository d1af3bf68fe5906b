"""Engine throughput against HF transformers on the same checkpoint and workload, one run:
continuous batching (headroom) vs static batching (HF batched generate()) at each HF batch
size asked for; the ratio is against HF's best.

    python bench/bench_engine.py [--model builtin|smollm2-135m|FILE.gguf|DIR] [--requests 64]
                                 [--hf-batch-sizes 16] [--profile] [--quick] [--cost-model FILE]

Workload: prompt lengths 16-512 and output lengths 16-256 drawn from a fixed seed; outputs
are forced to their length (ignore_eos / min_new_tokens). HF pads each batch and runs it to
its longest output; only each request's own tokens count as useful output. --profile runs
headroom once more under cProfile and prints where its time goes. --cost-model FILE fits the
router simulation's step-time model (bench/cost_model.py: fixed + per batched token + per KV
token read) to the timed run's steps, measures the host KV tier's link for it (the model's KV
bytes per token, and whole blocks copied through the engine's own copy path as an engine with a
host tier does at start-up) and writes it to FILE as JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

import torch

from cluster.stats import percentile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/cost_model.py, run from anywhere


def workload(num_requests: int, vocab_size: int, seed: int = 0, max_prompt: int = 512, max_output: int = 256):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab_size) for _ in range(rng.randint(16, max_prompt))], rng.randint(16, max_output))
            for _ in range(num_requests)]


def make_engine(model_dir: str, requests, device: str, dtype: str):
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.core.request import SamplingParams

    max_len = max(len(p) + n for p, n in requests)
    config = make_engine_config(max_model_len=max(max_len, 1024), num_kv_blocks=4096, max_num_seqs=len(requests),
                                max_num_batched_tokens=2048)
    engine = LLMEngine(config, model_dir, device=device, dtype=dtype)
    # Warm-up: a step of the whole token budget (two prompts of half of it each, which no
    # workload prompt begins like, so nothing timed hits their cached blocks), so the allocator
    # has grown to the largest step before anything is timed, then a few decodes.
    half = min(config.max_num_batched_tokens // 2, config.max_model_len - 8)
    engine.generate([[3] * half, [4] * half], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return engine


def run_workload(engine, requests, on_step=None) -> dict:
    """Queue every request at once and step the engine until all are done; on_step(engine)
    runs after each step (to read engine.last_step)."""
    from replica.core.request import SamplingParams

    preemptions_before = engine.scheduler.counters.preemptions
    start = time.perf_counter()
    handles = []
    for index, (prompt, num_out) in enumerate(requests):
        request = engine.make_request(f"bench-{index}-{id(requests)}", prompt,
                                      SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True))
        engine.add_request(request, detokenize=False)
        handles.append(request)
    finish_times = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finish_times[output.request_id] = time.perf_counter() - start
        steps += 1
        if on_step is not None:
            on_step(engine)
    elapsed = time.perf_counter() - start
    useful = sum(n for _, n in requests)
    assert all(len(r.output_token_ids) == n for r, (_, n) in zip(handles, requests))
    return dict(elapsed=elapsed, tokens_per_s=useful / elapsed, latencies=list(finish_times.values()),
                preemptions=engine.scheduler.counters.preemptions - preemptions_before, steps=steps)


class StepRecorder:
    """(tokens, KV tokens read, wall ms) of each engine step, for the cost-model fit: the
    scheduler's output is kept as schedule() returns it and paired with the step's
    wall time after the step (`on_step`). Steps that ran nothing are left out. Under async
    scheduling a step() call launches one step and waits for the one before it, so its time is
    the earlier step's: each output is paired with the next call's time (the first call's,
    a launch alone, is dropped; the call that drains the last step times it)."""

    def __init__(self, engine):
        self.samples: list[tuple[int, int, float]] = []
        self._output = None
        self._in_flight = None  # async scheduling: the output the next call's time belongs to
        schedule = engine.scheduler.schedule

        def recording_schedule():
            self._output = schedule()
            return self._output

        engine.scheduler.schedule = recording_schedule

    def on_step(self, engine, step_ms: float | None = None) -> None:
        """After a step: its sample, timed by the engine's wall clock unless `step_ms` is given."""
        from cost_model import kv_tokens_read

        output, self._output = self._output, None
        if engine.async_scheduling:
            output, self._in_flight = self._in_flight, output
        if output is not None and not output.is_empty:
            step_ms = engine.last_step.wall_s * 1000 if step_ms is None else step_ms
            self.samples.append((output.num_scheduled_tokens, kv_tokens_read(output), step_ms))
        if not engine.has_unfinished_requests():
            self._in_flight = None  # a step launched past the last token is discarded, not waited for


def load_hf_model(model_dir, dtype: str | torch.dtype, device: str):
    """transformers' model in `dtype` on `device`, eval mode. `dtype=` is from_pretrained's
    keyword since transformers 4.56; older versions take (only) `torch_dtype=`."""
    import transformers
    from packaging.version import Version

    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    keyword = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, **{keyword: dtype}).to(device).eval()


def run_hf(model_dir: str, requests, batch_size: int, device: str, dtype: str) -> dict:
    model = load_hf_model(model_dir, dtype, device)
    warm = torch.tensor([requests[0][0][:16]], device=device)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    latencies = []
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(p) for p, _ in batch)
        # Left padding, as HF recommends for batched decoder-only generation.
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
        batch_done = time.perf_counter() - start
        latencies += [batch_done] * len(batch)  # static batching: everyone waits for the batch
    elapsed = time.perf_counter() - start
    return dict(elapsed=elapsed, tokens_per_s=sum(n for _, n in requests) / elapsed, latencies=latencies)


def profile_headroom(engine, requests) -> None:
    """Runs the same workload under cProfile and prints each part's share of the engine's time.

    Cumulative times of the functions that own each part; GEMMs are every nn.Linear call
    (projections, MLP, lm_head) and "other model ops" is the model's forward less its GEMMs
    and attention (norms, rotary, SiLU, embedding lookups)."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_workload(engine, requests)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = sum(timing[2] for timing in stats.values())  # every function's own time adds up to the run

    def seconds(*functions) -> float:
        """Cumulative seconds of these functions (found by their code objects, as cProfile keys them)."""
        keys = {(f.__code__.co_filename, f.__code__.co_firstlineno, f.__code__.co_name) for f in functions}
        return sum(timing[3] for key, timing in stats.items() if key in keys)

    from replica.model.llama import LlamaForCausalLM
    from replica.executor import ModelRunner
    from replica.executor.model_runner import StepInFlight
    from replica.core.scheduler import Scheduler

    backend = type(engine.model.model.layers[0].self_attn.attn_backend)
    gemms = sum(timing[3] for (filename, _, name), timing in stats.items()
                if filename == "~" and name == "<built-in method torch._C._nn.linear>")
    lm_head = seconds(LlamaForCausalLM.compute_logits)
    attention = seconds(backend.forward, backend.write_kv)
    model = seconds(LlamaForCausalLM.forward)
    sampler = seconds(type(engine.runner.sampler).sample)
    runner = seconds(ModelRunner.launch, StepInFlight.result)
    scheduler = seconds(Scheduler.schedule, Scheduler.update)
    parts = [
        ("GEMMs (q/k/v/o, MLP)", gemms - lm_head),
        ("lm_head (logits of sampling rows)", lm_head),
        ("attention: KV write + paged attention", attention),
        ("other model ops (norms, rotary, SiLU, embed)", model - (gemms - lm_head) - attention),
        ("sampler", sampler),
        ("model runner: inputs, metadata", runner - model - lm_head - sampler),
        ("scheduler: schedule + update", scheduler),
        ("rest (engine loop, bookkeeping)", total - runner - scheduler),
    ]
    print(f"where headroom's time goes (cProfile, {total:.1f} s profiled):")
    for label, part in parts:
        print(f"  {label:<46} {100 * part / total:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="16",
                        help="comma-separated HF generate() batch sizes; the best one is the peer (default: 16)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="16 short requests (smoke run)")
    parser.add_argument("--profile", action="store_true", help="print where headroom's time goes (an extra run)")
    parser.add_argument("--cost-model", metavar="FILE", default=None,
                        help="fit the router simulation's step-time model to the timed run's steps and write it here (JSON)")
    args = parser.parse_args()

    from replica.model.registry import resolve_model_path

    hf_batch_sizes = [int(size) for size in args.hf_batch_sizes.split(",")]

    model_dir = str(resolve_model_path(args.model))
    import json
    import pathlib

    vocab_size = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
    if args.quick:
        requests = workload(16, vocab_size, max_prompt=64, max_output=32)
    else:
        requests = workload(args.requests, vocab_size)
    torch.manual_seed(0)
    print(f"model={args.model} device={args.device} dtype={args.dtype} requests={len(requests)} "
          f"prompt tokens={sum(len(p) for p, _ in requests)} output tokens={sum(n for _, n in requests)} "
          f"torch threads={torch.get_num_threads()}")
    engine = make_engine(model_dir, requests, args.device, args.dtype)
    recorder = StepRecorder(engine) if args.cost_model else None
    ours = run_workload(engine, requests, on_step=recorder.on_step if recorder is not None else None)
    if recorder is not None:  # before the HF runs, which take longest and do not touch it
        write_cost_model(recorder.samples, args, engine)
    hf_runs = {size: run_hf(model_dir, requests, size, args.device, args.dtype) for size in hf_batch_sizes}
    print(f"{'engine':>22} {'output tok/s':>13} {'wall s':>8} {'latency p50 s':>14} {'p99 s':>8}")
    rows = [("headroom (continuous)", ours)] + [(f"HF generate (batch {size})", run) for size, run in hf_runs.items()]
    for name, result in rows:
        print(f"{name:>22} {result['tokens_per_s']:>13.1f} {result['elapsed']:>8.1f} "
              f"{statistics.median(result['latencies']):>14.2f} {percentile(result['latencies'], 0.99):>8.2f}")
    best_size = max(hf_runs, key=lambda size: hf_runs[size]["tokens_per_s"])
    ratio = ours["tokens_per_s"] / hf_runs[best_size]["tokens_per_s"]
    print(f"throughput ratio headroom / HF's best (batch {best_size}) = {ratio:.2f}x "
          f"(target >= 3x: {'MET' if ratio >= 3 else 'MISSED'}); headroom preemptions: {ours['preemptions']}")
    if args.profile:
        profile_headroom(engine, requests)


def measure_host_link(engine) -> tuple[float, float]:
    """(KV bytes per token, bytes per second each way) of whole blocks copied between the
    engine's KV cache and a scratch host tier, by the engine's start-up probe (a round trip:
    the device blocks end as they were)."""
    from replica.executor.kv_swap import KVSwapper
    from replica.executor.preemption_profile import SWAP_PROBE_BLOCKS, measure_swap_bytes_per_s

    swapper = KVSwapper(engine.runner.kv_caches, SWAP_PROBE_BLOCKS, engine.device)
    swap_bytes_per_s = measure_swap_bytes_per_s(swapper, engine.config.num_usable_blocks, SWAP_PROBE_BLOCKS)
    return swapper.bytes_per_block / engine.config.block_size, swap_bytes_per_s


def write_cost_model(samples: list[tuple[int, int, float]], args: argparse.Namespace, engine) -> None:
    import dataclasses
    import datetime
    import platform

    import cost_model

    where = f"{torch.cuda.get_device_name()}" if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    source = (f"fitted by bench/bench_engine.py: model {args.model}, {args.dtype} on {where}, "
              f"{platform.node() or 'unknown host'}, {datetime.date.today().isoformat()}")
    kv_bytes_per_token, swap_bytes_per_s = measure_host_link(engine)
    # Every timed step is fitted: make_engine's warm-up already paid the one-time costs
    # (allocator growth to a whole-budget step, lazy initialisation). Dropping the first steps
    # instead dropped every prefill of a workload whose prompts all fit in its first steps (the
    # 64-request run's 14k prompt tokens are its first 7 steps), so the fit saw decodes only.
    model = dataclasses.replace(cost_model.fit(samples, source), kv_bytes_per_token=kv_bytes_per_token,
                                swap_bytes_per_s=swap_bytes_per_s,
                                swap_source=f"measured by bench/bench_engine.py: {args.model}'s KV in {args.dtype}, "
                                            f"device <-> host copies on {where}")
    model.save(args.cost_model)
    print(f"cost model -> {args.cost_model}: {model.describe()}")


if __name__ == "__main__":
    main()
