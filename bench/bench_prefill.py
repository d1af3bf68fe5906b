"""Prefill of one prompt: the engine against HF transformers' forward on the same checkpoint, in one run.

    python bench/bench_prefill.py [--model smollm2-135m] [--lengths 256,1024,2048,4096] [--repeat 3]
                                  [--threads 2] [--dtype float32]

Per prompt length: `LLMEngine.generate(max_tokens=1)` with prefix caching off (the engine's own
chunking: prompts past `max_num_batched_tokens` run in chunks) against one
`AutoModelForCausalLM` forward over the same random tokens (`use_cache=False`,
`logits_to_keep=1`: only the last position's logits, all a prefill needs), taken in turns
(engine, HF, engine, HF, ...) so that drift in the machine's speed weighs on both; each side's
median is quoted. Ratio = HF time / engine time (> 1: the engine is faster). Also the engine's
cost per token at the longest length against the shortest, which stays near 1 when prefill
grows like the work (GEMMs linear in tokens, causal attention a small quadratic term) and
not like a full score matrix. The first token must equal HF's argmax at every length.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench_engine import load_hf_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="256,1024,2048,4096", help="comma-separated prompt lengths")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per side and length (median quoted)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both sides)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's step budget (default: EngineConfig's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from replica.config import EngineConfig, make_engine_config
    from replica.core.engine import LLMEngine
    from replica.model.registry import resolve_model_path
    from replica.core.request import SamplingParams

    lengths = [int(length) for length in args.lengths.split(",")]
    model_dir = str(resolve_model_path(args.model))
    block_size = EngineConfig.model_fields["block_size"].default
    overrides = dict(enable_prefix_caching=False, max_model_len=max(lengths) + 1,
                     num_kv_blocks=-(-(max(lengths) + 1) // block_size) + 1)
    if args.max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine = LLMEngine(make_engine_config(**overrides), model_dir, device="cpu", dtype=args.dtype)
    hf = load_hf_model(model_dir, args.dtype, "cpu")
    vocab_size = engine.model_config.vocab_size
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)

    def engine_prefill(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        [[token]] = engine.generate([prompt], greedy_one)
        return time.perf_counter() - start, token

    def hf_forward(prompt: list[int]) -> tuple[float, int]:
        with torch.inference_mode():
            start = time.perf_counter()
            logits = hf(torch.tensor([prompt]), use_cache=False, logits_to_keep=1).logits
            return time.perf_counter() - start, int(logits[0, -1].argmax())

    warm = [rng.randrange(3, vocab_size) for _ in range(64)]
    engine_prefill(warm), hf_forward(warm)
    print(f"model={args.model} dtype={args.dtype} torch threads={torch.get_num_threads()} "
          f"step budget={engine.config.max_num_batched_tokens} repeat={args.repeat}")
    print(f"{'tokens':>7} {'engine s':>9} {'HF s':>8} {'engine/HF speed':>16} {'engine ms/token':>16} {'same token':>11}")
    per_token = {}
    ratios = {}
    for length in lengths:
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        engine_times, hf_times, same = [], [], True
        for _ in range(args.repeat):
            seconds, token = engine_prefill(prompt)
            engine_times.append(seconds)
            hf_seconds, hf_token = hf_forward(prompt)
            hf_times.append(hf_seconds)
            same = same and token == hf_token
        engine_s, hf_s = statistics.median(engine_times), statistics.median(hf_times)
        per_token[length], ratios[length] = engine_s / length, hf_s / engine_s
        print(f"{length:>7} {engine_s:>9.3f} {hf_s:>8.3f} {ratios[length]:>15.2f}x {1000 * per_token[length]:>16.3f} "
              f"{'yes' if same else 'NO':>11}", flush=True)
    shortest, longest = min(lengths), max(lengths)
    growth = per_token[longest] / per_token[shortest]
    slowest = min(ratios.values())
    print(f"engine/HF speed >= 1.0x at every length: {'MET' if slowest >= 1.0 else 'MISSED'} (lowest {slowest:.2f}x); "
          f"cost per token at {longest} / at {shortest}: {growth:.2f} (target <= 2: {'MET' if growth <= 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
