"""The front's share of each output token, measured without gRPC: the replica front's output
path (OutputProcessor.process: detokenizing, usage counts, the request metrics, the stream's
queue and its merging) for a batch of streams fed one token each per step, as the engine
core's StepOutputs feed it, in one process.

    python bench/bench_front.py [--model builtin|DIR] [--streams 256] [--tokens 128]
                                [--tokens-from text|past-vocab|special] [--stop-strings limit]

--tokens-from picks what the streams emit: `text` (the tokenizer's own encoding of English
prose, what a trained model writes), `past-vocab` (ids past the tokenizer's vocabulary, what a
random checkpoint larger than its tokenizer samples: bench_gpu.py's 1.1B model until cd5d5f6)
or `special` (a skipped special token, as `logit_bias` on EOS with `ignore_eos` forces). Each
stream's consumer drains it between steps, as a writer keeping up does. --stop-strings limit
gives each request the stop strings the request limits allow at their worst for matching
(64 strings, 4,096 characters): 63 that never match, and one that is the stream's own text
plus a character it never writes, so the whole output is held back as a possible stop string,
and every token is matched against all of them (the peer there: the same streams without
stop strings).

Printed: microseconds of the front's CPU per output token, split into the processor with and
without the request metrics; the detokenizer alone against `tokenizers`' own incremental
decoder (`DecodeStream`, Rust) on the same ids, as the peer; and the budget one front process
has per token at a GPU's output rate (--gpu-tok-s, default 57,900: bench_gpu.py's offline
engine at 256 streams on the H100, 2026-11-25), which the whole per-token cost (this path plus
gRPC's per-message share and the call's set-up, docs/benchmarks.md) must fit.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from replica.config import EngineConfig
from replica.core.outputs import make_request
from replica.core.request import SamplingParams
from replica.front.async_engine import RequestStream
from replica.front.output_processor import OutputProcessor
from replica.model.registry import resolve_model_path
from replica.server.metrics import ReplicaMetrics
from replica.server.request_metrics import RequestMetrics
from replica.text.tokenizer import IncrementalDetokenizer, Tokenizer

PROSE = ("The engine keeps a paged cache of keys and values for every running request, and the "
         "scheduler admits new work only while the pool has room for what it will grow into. "
         "Caf\u00e9s in Z\u00fcrich serve r\u00f6sti; \u4f60\u597d\uff0c\u4e16\u754c. ")


def token_stream(tokenizer: Tokenizer, kind: str, length: int, seed: int) -> list[int]:
    if kind == "text":
        ids = tokenizer.encode(PROSE * (1 + length // 20), add_special_tokens=False)
        start = random.Random(seed).randrange(len(ids) - length)
        return ids[start:start + length]
    if kind == "past-vocab":
        rng = random.Random(seed)
        return [tokenizer.vocab_size + rng.randrange(30_000) for _ in range(length)]
    return [tokenizer.eos_token_id] * length


def worst_stop_strings(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, ...]:
    """The request limits' worst case for the matcher (module docstring): 4,096 characters in
    64 strings, the last the stream's own text (up to its share) plus a character it never
    writes."""
    own = tokenizer.decode(ids)[:2047] + "\x01"
    filler_length = (4096 - len(own)) // 63
    return tuple(chr(0x2460 + index) * filler_length for index in range(63)) + (own,)


async def process_per_token(tokenizer: Tokenizer, streams: list[list[int]], with_metrics: bool,
                            stop_strings: bool = False) -> float:
    """Seconds of OutputProcessor.process per output token, every stream one token a step."""
    observer = RequestMetrics(ReplicaMetrics("bench", "bench"), time.monotonic) if with_metrics else None
    processor = OutputProcessor(tokenizer, lambda request_id: None, observer)
    config = EngineConfig()
    queues = []
    for index, ids in enumerate(streams):
        stop = worst_stop_strings(tokenizer, ids) if stop_strings else None
        request = make_request(f"r{index}", [1] * 32, SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stop),
                               config=config, eos_token_ids=(), clock=time.monotonic)
        queue = RequestStream(request)
        processor.track(queue)
        queues.append(queue)
    steps = len(streams[0])
    spent = 0.0
    for step in range(steps):
        finish = "length" if step == steps - 1 else None
        rows = [(f"r{index}", [ids[step]], finish, 0, None, None, None, None) for index, ids in enumerate(streams)]
        started = time.perf_counter()
        processor.process(rows)
        spent += time.perf_counter() - started
        for queue in queues:  # the writers keep up: each drains its stream every step
            while queue._pending:
                queue._pending.popleft()
            queue._arrived.clear()
    return spent / (steps * len(streams))


def detokenizer_per_token(tokenizer: Tokenizer, streams: list[list[int]]) -> tuple[float, float]:
    """Seconds per token: IncrementalDetokenizer, and tokenizers' DecodeStream, on the same ids."""
    from tokenizers.decoders import DecodeStream

    started = time.perf_counter()
    for ids in streams:
        detokenizer = IncrementalDetokenizer(tokenizer)
        for token_id in ids:
            detokenizer.add_tokens([token_id])
    ours = time.perf_counter() - started
    fast = tokenizer._fast_tokenizer
    started = time.perf_counter()
    for ids in streams:
        stream = DecodeStream(skip_special_tokens=True)
        for token_id in ids:
            stream.step(fast, token_id)
    peer = time.perf_counter() - started
    tokens = sum(len(ids) for ids in streams)
    return ours / tokens, peer / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin", help="builtin, or a checkpoint directory (its tokenizer)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    parser.add_argument("--tokens-from", choices=("text", "past-vocab", "special"), default="text")
    parser.add_argument("--stop-strings", choices=("none", "limit"), default="none",
                        help="limit: the request limits' worst case for stop-string matching (module docstring)")
    parser.add_argument("--gpu-tok-s", type=float, default=57_900.0,
                        help="the output rate one front must keep up with (tok/s)")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_pretrained(resolve_model_path(args.model))
    streams = [token_stream(tokenizer, args.tokens_from, args.tokens, seed) for seed in range(args.streams)]
    bare = min(asyncio.run(process_per_token(tokenizer, streams, with_metrics=False)) for _ in range(3))
    observed = min(asyncio.run(process_per_token(tokenizer, streams, with_metrics=True)) for _ in range(3))
    ours, peer = min(detokenizer_per_token(tokenizer, streams) for _ in range(3))
    budget = 1.0 / args.gpu_tok_s
    print(f"tokenizer: {args.model} ({tokenizer.vocab_size} ids); {args.streams} streams x {args.tokens} tokens "
          f"from {args.tokens_from}; best of 3")
    print(f"front output path, us per token: {bare * 1e6:.2f} processor, {observed * 1e6:.2f} with the request metrics")
    print(f"detokenizer, us per token: {ours * 1e6:.2f} IncrementalDetokenizer vs {peer * 1e6:.2f} DecodeStream "
          f"(tokenizers, Rust): {ours / peer:.2f}x")
    print(f"one front's budget per token at {args.gpu_tok_s:,.0f} tok/s: {budget * 1e6:.2f} us; this path uses "
          f"{observed / budget:.0%} of it")
    if args.stop_strings == "limit":
        stopped = min(asyncio.run(process_per_token(tokenizer, streams, with_metrics=True, stop_strings=True))
                      for _ in range(3))
        print(f"with the request limits' worst stop strings (64, 4,096 characters, the output held back): "
              f"{stopped * 1e6:.2f} us per token, {stopped / observed:.2f}x the same streams without them")


if __name__ == "__main__":
    main()
