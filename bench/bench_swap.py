"""Preemption that swaps (or recomputes, per victim) against preemption that only recomputes,
on the engine at equal device pool size, in one run (issue 23's targets).

    python bench/bench_swap.py [--model builtin|wide|smollm2-135m|DIR] [--requests 12] [--rounds 2]
                               [--outputs 320-448] [--device cpu|cuda] [--dtype float32|bfloat16]
    python bench/bench_swap.py --workload multiturn [--model ...] [--users 12] [--turns 4]

Workload: short prompts (16-32 tokens) and long outputs (320-448 tokens), all queued at once,
every request admitted together (max_num_seqs = requests); the device pool holds the prompts
and about half of the running set's growth, so requests are preempted over and over. The
same engine configuration runs with preemption_mode recompute and with auto over a host tier
twice the device pool, in turns, `--rounds` times each (the rates auto weighs are measured at
its start). Printed: recomputed tokens (auto / recompute, target <= 0.3x) and output tok/s
(auto / recompute, medians, target >= 1.15x), with preemptions of each mode and the blocks
swapped; auto's swap-ins and the part of them prefetched beside the step before (CUDA only),
and the steps that waited for copies of their own (ReplicaLoad's copy_wait_steps_total and
blocks); both modes' greedy tokens must be equal. Then where the time went: each mode's
step times fitted to fixed + per token (bench/cost_model.py's fit), the recompute-only runs'
re-prefill at that per-token cost, the auto runs' copies as timed, the ratio that price gives
auto, and the modes' measured step totals beside it. --model wide is bench_tp.py's random
1024-wide 4-layer Llama: its CPU steps cost mostly model compute (weight reads, tokens,
attention over each request's KV), where the built-in model's cost mostly per-step host work.

--workload multiturn: the spilling prefix cache (written through to the host tier beside the
forward passes; the blocks written through and those the device evicted before the host had a
copy are printed). Conversations take turns round-robin: each
turn sends the whole history so far plus 32 new tokens and generates 16; the histories of all
users together outgrow the device pool, so by a user's next turn its history has been evicted
from the device. The same device pool with and without a host tier (4x the device pool):
prefix tokens served from cache (target: >= 1.3x with the host tier) and TTFT p90, with every
conversation's greedy tokens equal in both.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_engine.py, bench_tp.py, cost_model.py

BLOCK_SIZE = 16
OUTPUTS = (320, 448)


def workload(num_requests: int, vocab_size: int, seed: int = 0, outputs: tuple[int, int] = OUTPUTS):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 32))], rng.randint(*outputs))
            for _ in range(num_requests)]


def pool_blocks(requests) -> int:
    """Device blocks for every prompt plus about half of the running set's growth (the null block too)."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    prompts = sum(cdiv(len(prompt), BLOCK_SIZE) for prompt, _ in requests)
    final = sum(cdiv(len(prompt) + num_out, BLOCK_SIZE) for prompt, num_out in requests)
    longest = max(cdiv(len(prompt) + num_out, BLOCK_SIZE) for prompt, num_out in requests)
    return max(prompts + (final - prompts) // 2, longest) + 1


def make_engine(model: str, requests, mode: str, device: str = "cpu", dtype: str = "float32"):
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine

    num_blocks = pool_blocks(requests)
    host = dict(num_host_kv_blocks=2 * num_blocks) if mode != "recompute" else {}
    config = make_engine_config(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_num_seqs=len(requests),
                                max_model_len=max(len(p) + n for p, n in requests), max_num_batched_tokens=512,
                                preemption_mode=mode, **host)
    return LLMEngine(config, model, device=device, dtype=dtype)


class StepProfile:
    """Every step's (tokens, KV tokens read, ms) through bench_engine.py's StepRecorder, and the
    host tier's copies. On a CPU both are timed in this process's CPU seconds (every thread's:
    the engine runs in this process), which a shared machine's load moves far less than wall
    time, the copies as they run (they are done when `copy` returns). On CUDA the steps are
    timed in wall seconds and the copies by CUDA events on the copy stream, read after the run:
    waiting for each step's copies on the host would wait for the step before it too (the copy
    stream waits for it), serializing auto's steps that recompute-only's keep overlapped."""

    def __init__(self, engine, on_cpu: bool):
        import torch
        from bench_engine import StepRecorder

        self.recorder = StepRecorder(engine)
        self.clock = time.process_time if on_cpu else time.perf_counter
        self.unit = "CPU s" if on_cpu else "wall s"
        self._copy_s = 0.0
        self._copy_events: list = []  # CUDA: (start, end) around each step's copies, on the copy stream
        self.copied_blocks = 0
        kv_swap = engine.runner.kv_swap
        if kv_swap is not None:
            copy = kv_swap.copy

            def timed_copy(copies):
                self.copied_blocks += len(copies.swap_out) + len(copies.swap_in) + len(copies.prefetch)
                if kv_swap.stream is None:
                    start = self.clock()
                    copy(copies)
                    self._copy_s += self.clock() - start
                    return
                # The copy stream waits for the compute stream's work so far first (copy() makes the
                # same wait), so the start event marks when the copies can begin, not the wait.
                queued = torch.cuda.Event()
                queued.record(torch.cuda.current_stream(kv_swap.device))
                kv_swap.stream.wait_event(queued)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(kv_swap.stream)
                copy(copies)
                end.record(kv_swap.stream)
                self._copy_events.append((start, end))

            kv_swap.copy = timed_copy

    @property
    def copy_s(self) -> float:
        """Seconds the copies took so far (CUDA: the copy stream's busy time between each step's
        events, read once they are done)."""
        if self._copy_events:
            self._copy_events[-1][1].synchronize()
            self._copy_s += sum(start.elapsed_time(end) for start, end in self._copy_events) / 1000
            self._copy_events.clear()
        return self._copy_s

    @property
    def samples(self) -> list[tuple[int, int, float]]:
        return self.recorder.samples


def run(engine, requests, profile: StepProfile | None = None) -> dict:
    from replica.core.request import SamplingParams

    counters = engine.scheduler.counters
    kv_cache = engine.scheduler.kv_cache
    kv_swap = engine.runner.kv_swap
    before = (counters.preemptions, counters.swap_preemptions, counters.recomputed_tokens,
              counters.recompute_tokens_avoided, kv_cache.swapped_out_blocks, counters.scheduled_tokens,
              kv_swap.runs if kv_swap is not None else 0, kv_cache.prefetched_blocks, kv_cache.copy_wait_steps,
              kv_cache.copy_wait_blocks, kv_cache.swapped_in_blocks)
    handles = []
    start, start_cpu = time.perf_counter(), time.process_time()
    for index, (prompt, num_out) in enumerate(requests):
        request = engine.make_request(f"swap-{index}-{time.monotonic_ns()}", prompt,
                                      SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True))
        engine.add_request(request, detokenize=False)
        handles.append(request)
    num_samples = len(profile.samples) if profile is not None else 0
    copy_s = profile.copy_s if profile is not None else 0.0
    while engine.has_unfinished_requests():
        step_start = profile.clock() if profile is not None else 0.0
        engine.step()
        engine.take_kv_events()
        if profile is not None:
            profile.recorder.on_step(engine, (profile.clock() - step_start) * 1000)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    after = (counters.preemptions, counters.swap_preemptions, counters.recomputed_tokens,
             counters.recompute_tokens_avoided, kv_cache.swapped_out_blocks, counters.scheduled_tokens,
             kv_swap.runs if kv_swap is not None else 0, kv_cache.prefetched_blocks, kv_cache.copy_wait_steps,
             kv_cache.copy_wait_blocks, kv_cache.swapped_in_blocks)
    (preemptions, swaps, recomputed, avoided, swapped_out, computed, runs, prefetched, wait_steps,
     wait_blocks, swapped_in) = (b - a for a, b in zip(before, after))
    engine.scheduler.check_invariants()
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks
    assert kv_cache.num_free_host_blocks == kv_cache.num_host_blocks
    num_tokens = sum(n for _, n in requests)
    return dict(tokens_per_s=num_tokens / elapsed, tokens_per_cpu_s=num_tokens / cpu, elapsed=elapsed, preemptions=preemptions,
                swaps=swaps, recomputed=recomputed, avoided=avoided, swapped_out_blocks=swapped_out, computed=computed,
                runs=runs, swapped_in_blocks=swapped_in, prefetched_blocks=prefetched, copy_wait_steps=wait_steps, copy_wait_blocks=wait_blocks,
                outputs=[list(r.output_token_ids) for r in handles],
                steps=profile.samples[num_samples:] if profile is not None else [],
                copy_s=profile.copy_s - copy_s if profile is not None else 0.0)


def multiturn(args, model: str) -> None:
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.core.request import SamplingParams

    rng = random.Random(1)
    histories = [[rng.randrange(3, 256) for _ in range(64)] for _ in range(args.users)]
    turns = [[[rng.randrange(3, 256) for _ in range(32)] for _ in range(args.turns)] for _ in range(args.users)]
    longest = 64 + args.turns * (32 + 16)
    # The device pool holds about a third of the users' histories at their longest.
    num_blocks = max(args.users * -(-longest // BLOCK_SIZE) // 3, 2 * -(-longest // BLOCK_SIZE)) + 1
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for name, host in (("device only", {}), ("host tier", dict(num_host_kv_blocks=4 * num_blocks))):
        config = make_engine_config(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_model_len=longest,
                                    max_num_seqs=4, max_num_batched_tokens=512, **host)
        engine = LLMEngine(config, model, device="cpu", dtype="float32")
        kv_swap = engine.runner.kv_swap

        def link() -> tuple[int, int]:  # (blocks copied, copies issued) so far
            if kv_swap is None:
                return 0, 0
            return kv_swap.written_through_blocks + kv_swap.swapped_in_blocks + kv_swap.swapped_out_blocks, kv_swap.runs

        link_at_start = link()  # the start-up measurement's copies
        conversation = [list(history) for history in histories]
        ttfts, outputs = [], []
        start = time.perf_counter()
        for turn in range(args.turns):
            for user in range(args.users):  # one user's turn at a time, as people take turns
                conversation[user] += turns[user][turn]
                request = engine.make_request(f"{name}-{user}-{turn}", conversation[user], params)
                engine.add_request(request, detokenize=False)
                sent = time.perf_counter()
                first = None
                while engine.has_unfinished_requests():
                    if engine.step() and first is None:
                        first = time.perf_counter() - sent
                    engine.take_kv_events()
                ttfts.append(first)
                conversation[user] += request.output_token_ids
                outputs.append(list(request.output_token_ids))
        kv_cache = engine.scheduler.kv_cache
        # The blocks copied over the link against the copies issued (one per run of consecutive host blocks).
        blocks, copies = (now - start for now, start in zip(link(), link_at_start))
        links = f"; {blocks} blocks copied in {copies} copies" if kv_swap is not None else ""
        results[name] = dict(hits=kv_cache.prefix_cache_hits, queries=kv_cache.prefix_cache_queries,
                             host_hits=kv_cache.host_hit_blocks * BLOCK_SIZE, outputs=outputs,
                             written_through=kv_cache.spilled_blocks,
                             forgotten=kv_cache.evicted_without_host_copy_blocks,
                             ttft_p90=sorted(ttfts)[int(0.9 * (len(ttfts) - 1))], elapsed=time.perf_counter() - start)
        print(f"{name:11s}: prefix tokens from cache {results[name]['hits']:6d} of {results[name]['queries']:6d} "
              f"({results[name]['host_hits']} from the host tier), TTFT p90 {results[name]['ttft_p90'] * 1e3:7.1f} ms, "
              f"{results[name]['elapsed']:.1f} s" + (f"; blocks written through to the host {results[name]['written_through']}, "
                                                   f"evicted from the device with no host copy "
                                                   f"{results[name]['forgotten']}" if host else "") + links)
    assert results["device only"]["outputs"] == results["host tier"]["outputs"], "greedy tokens differ"
    hits, device_hits = results["host tier"]["hits"], results["device only"]["hits"]
    met = hits >= 1.3 * device_hits and hits > 0
    ratio = f"{hits / device_hits:.2f}x" if device_hits else f"{hits} tokens against none"
    print(f"{args.users} users x {args.turns} turns, device pool {num_blocks - 1} blocks of {BLOCK_SIZE}: prefix "
          f"tokens served from cache {ratio} with the host tier (target >= 1.3x: "
          f"{'met' if met else 'missed'}); TTFT p90 {results['host tier']['ttft_p90'] * 1e3:.1f} vs "
          f"{results['device only']['ttft_p90'] * 1e3:.1f} ms; greedy tokens identical")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin", help="builtin | wide | smollm2-135m | a model directory")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--outputs", default=f"{OUTPUTS[0]}-{OUTPUTS[1]}",
                        help="the range output lengths are drawn from (default %(default)s)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); 1 makes CPU seconds the steps' own work")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workload", choices=("preemption", "multiturn"), default="preemption")
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    try:
        low, high = (int(bound) for bound in args.outputs.split("-"))
        if not 1 <= low <= high:
            raise ValueError
    except ValueError:
        parser.error(f"--outputs: expected LOW-HIGH with 1 <= LOW <= HIGH, got {args.outputs!r}")
    args.outputs = (low, high)

    import torch

    from replica.model.registry import resolve_model_path

    torch.manual_seed(0)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    scratch = None
    if args.model == "wide":
        from bench_tp import write_wide_model

        scratch = Path(tempfile.mkdtemp(prefix="bench-swap-"))
        model = str(write_wide_model(scratch / "wide"))
    else:
        model = str(resolve_model_path(args.model))
    try:
        if args.workload == "multiturn":
            multiturn(args, model)
        else:
            preemption(args, model)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch)


def preemption(args, model: str) -> None:
    import torch

    requests = workload(args.requests, vocab_size=256, outputs=args.outputs)  # ids every tokenizer here has
    engines = {mode: make_engine(model, requests, mode, args.device, args.dtype) for mode in ("recompute", "auto")}
    costs = engines["auto"].scheduler.preemption.costs
    print(f"model {args.model} ({args.dtype} on {args.device}, {torch.get_num_threads()} torch threads): "
          f"{args.requests} requests, prompts 16-32, outputs {args.outputs[0]}-{args.outputs[1]} tokens; device pool "
          f"{pool_blocks(requests) - 1} blocks of {BLOCK_SIZE}, host tier {engines['auto'].config.num_host_kv_blocks}; "
          f"auto's rates: recompute {costs.recompute_s_per_token * 1e3:.3f} ms/token, swap "
          f"{costs.swap_s_per_block * 1e3:.4f} ms/block each way")
    for engine in engines.values():  # warm-up, outside the measurement
        run(engine, requests[:2])
    profiles = {mode: StepProfile(engine, args.device == "cpu") for mode, engine in engines.items()}
    results: dict[str, list[dict]] = {"recompute": [], "auto": []}
    for round_index in range(args.rounds):
        # ABBA order: a load that drifts over the run (a shared machine) favours neither mode.
        for mode in ("recompute", "auto") if round_index % 2 == 0 else ("auto", "recompute"):
            result = run(engines[mode], requests, profiles[mode])
            results[mode].append(result)
            print(f"round {round_index + 1} {mode:9s}: {result['tokens_per_s']:8.1f} tok/s ({result['tokens_per_cpu_s']:7.1f} per CPU s)  "
                  f"{result['elapsed']:6.1f} s  "
                  f"preemptions {result['preemptions']:4d} (swapped {result['swaps']:4d})  recomputed tokens "
                  f"{result['recomputed']:6d}  avoided {result['avoided']:6d}  blocks swapped out "
                  f"{result['swapped_out_blocks']:5d}  tokens computed {result['computed']:6d}  copies over the link "
                  f"{result['runs']:4d}  blocks prefetched {result['prefetched_blocks']:4d}  steps that waited for "
                  f"copies {result['copy_wait_steps']:4d} ({result['copy_wait_blocks']:5d} blocks)")
    reference = results["recompute"][0]["outputs"]
    if args.dtype == "float32":  # the oracle: greedy output never depends on the preemption mode
        assert all(r["outputs"] == reference for rs in results.values() for r in rs), \
            "greedy tokens differ between the modes"
    else:  # a re-prefill rebuilds the KV decode wrote (and later rounds read prefix-cached KV): in
        # bf16 near-tied logits may break either way, so the equality is asserted in float32 only
        same = sum(a == b for auto, recompute in zip(results["auto"], results["recompute"])
                   for a, b in zip(auto["outputs"], recompute["outputs"]))
        print(f"{args.dtype}: requests with the same greedy tokens in both modes, round by round: "
              f"{same}/{len(reference) * args.rounds} (asserted equal in float32)")
    recomputed = {mode: statistics.median(r["recomputed"] for r in rs) for mode, rs in results.items()}
    speed = {mode: statistics.median(r["tokens_per_s"] for r in rs) for mode, rs in results.items()}
    recomputed_ratio = recomputed["auto"] / max(recomputed["recompute"], 1)
    speed_ratio = speed["auto"] / speed["recompute"]
    cpu_speed = {mode: statistics.median(r["tokens_per_cpu_s"] for r in rs) for mode, rs in results.items()}
    print(f"recomputed tokens: auto {recomputed['auto']:.0f} vs recompute {recomputed['recompute']:.0f} = "
          f"{recomputed_ratio:.3f}x (target <= 0.3x: {'met' if recomputed_ratio <= 0.3 else 'missed'})")
    print(f"output tok/s: auto {speed['auto']:.1f} vs recompute {speed['recompute']:.1f} = {speed_ratio:.3f}x "
          f"(target >= 1.15x: {'met' if speed_ratio >= 1.15 else 'missed'})")
    print(f"output tokens per CPU second (this process; steadier on a shared machine): auto {cpu_speed['auto']:.1f} vs "
          f"recompute {cpu_speed['recompute']:.1f} = {cpu_speed['auto'] / cpu_speed['recompute']:.3f}x")
    computed = {mode: rs[0]["computed"] for mode, rs in results.items()}
    print(f"tokens the model computed (prompts, outputs, recompute; machine-independent): auto {computed['auto']} vs "
          f"recompute {computed['recompute']} = {computed['auto'] / computed['recompute']:.3f}x")
    auto_runs = results["auto"]
    # The prefetch's share of the swap-ins (CUDA only: the engine copies in turn on the CPU) and
    # the copies the steps still waited for (the counters ReplicaLoad and /metrics report).
    print(f"auto's swap-ins: {sum(r['swapped_in_blocks'] for r in auto_runs)} blocks, "
          f"{sum(r['prefetched_blocks'] for r in auto_runs)} prefetched beside the step before; steps that waited for "
          f"copies {sum(r['copy_wait_steps'] for r in auto_runs)} of {sum(len(r['steps']) for r in auto_runs)} "
          f"({sum(r['copy_wait_blocks'] for r in auto_runs)} blocks)")
    if args.dtype == "float32":
        print("greedy tokens: identical in both modes")
    for line in time_budget(results, profiles["auto"].unit):
        print(line)


def time_budget(results: dict[str, list[dict]], unit: str) -> list[str]:
    """Where each mode's step time went, over all its rounds: the steps fitted to fixed + per
    batched token + per KV token read (bench/cost_model.py), the recompute-only runs'
    re-prefill priced at their fitted per-token cost, the auto runs' copies as timed, the ratio
    that price gives auto if everything else cost the same in both, and the modes' measured
    totals beside it."""
    import cost_model

    lines = [f"where the time went (all rounds; steps timed in {unit}, fitted per mode):"]
    fits, step_s = {}, {}
    for mode, runs in results.items():
        samples = [sample for run in runs for sample in run["steps"]]
        fits[mode] = cost_model.fit(samples, source=mode)
        step_s[mode] = sum(ms for _, _, ms in samples) / 1000
        lines.append(f"  {mode:9s}: {len(samples)} steps, {step_s[mode]:.1f} {unit}; {fits[mode].describe().split(' (')[0]}, "
                     f"R^2 {fits[mode].fit_r2:.2f}")
    recompute_runs, auto_runs = results["recompute"], results["auto"]
    recomputed = sum(run["recomputed"] for run in recompute_runs)
    num_recomputes = sum(run["preemptions"] - run["swaps"] for run in recompute_runs)
    reprefill_s = recomputed * fits["recompute"].per_batched_token_ms / 1000
    copy_s = sum(run["copy_s"] for run in auto_runs)
    num_swaps = sum(run["swaps"] for run in auto_runs)
    lines.append(f"  recompute-only re-prefilled {recomputed} tokens in {num_recomputes} preemptions: ~{reprefill_s:.2f} s "
                 f"at its fitted per-token cost ({1e3 * reprefill_s / max(num_recomputes, 1):.1f} ms per preemption), "
                 f"{100 * reprefill_s / step_s['recompute']:.1f}% of its step time")
    lines.append(f"  auto copied blocks for {num_swaps} swapped victims in {copy_s:.3f} s "
                 f"({1e3 * copy_s / max(num_swaps, 1):.2f} ms per swapped victim, spills and host hits included)")
    priced = step_s["recompute"] / max(step_s["recompute"] - reprefill_s + copy_s, 1e-9)
    lines.append(f"  re-prefill at that price less the copies: ~{priced:.2f}x for auto, all else equal")
    # What the fit leaves out shows in the modes' own totals (the same output tokens in both):
    # the fit prices a re-prefilled token as any batched token, not its attention over the
    # prefix it rebuilds.
    lines.append(f"  measured: recompute-only's steps {step_s['recompute']:.2f} {unit}, auto's {step_s['auto']:.2f} "
                 f"({step_s['recompute'] / max(step_s['auto'], 1e-9):.3f}x); every computed token at one price "
                 f"would be {sum(r['computed'] for r in recompute_runs) / max(sum(r['computed'] for r in auto_runs), 1):.2f}x")
    return lines


if __name__ == "__main__":
    main()
