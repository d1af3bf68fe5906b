"""`headroom bench`: drives load against a running cluster over gRPC (closed loop at a fixed
concurrency, or open loop replaying a trace's arrivals and sizes) with a progress bar, then
prints latency (TTFT, ITL), throughput and the preemptions the replicas counted meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import grpc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster import status_command
from cluster.arg_types import positive_int, positive_number
from cluster.generate_command import add_target_arguments, max_tokens_value, open_channel, target_connection
from cluster.stats import percentile
from cluster.trace import read_trace
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc

REQUEST_TIMEOUT_S = 600.0
DEFAULT_REQUESTS = 64  # a closed-loop run's; a trace replays whole unless --requests says
DEFAULT_CONCURRENCY = 8  # a closed-loop run's; a trace's arrivals are not capped unless --concurrency says


@dataclass(frozen=True)
class BenchRequest:
    arrival_s: float  # offset from the start; 0 for every request of a closed-loop run
    prompt_tokens: int
    max_tokens: int


@dataclass
class RequestResult:
    ttft_s: Optional[float] = None
    inter_token_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: Optional[str] = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument("--requests", type=positive_int, default=None,
                        help=f"requests to send (default: {DEFAULT_REQUESTS}; with --trace, the whole trace)")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help=f"most requests in flight at once (default: {DEFAULT_CONCURRENCY}; with --trace, no cap: "
                             "a capped replay times TTFT from each request's arrival in the trace, its wait included)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="prompt length without a trace (default: %(default)s)")
    parser.add_argument("--max-tokens", type=max_tokens_value, default=64, help="output length without a trace (default: %(default)s)")
    parser.add_argument("--trace", default=None,
                        help="CSV with TIMESTAMP, ContextTokens, GeneratedTokens (the Azure LLM trace format): "
                             "replay its arrivals and sizes, clipped to the model's context length")
    parser.add_argument("--trace-scale", type=positive_number, default=1.0,
                        help="replay the trace this many times faster (default: %(default)s)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address for the replicas' preemption counters (default: the local one, "
                             "if any; without one the summary has no preemptions)")


def trace_requests(path: str, num_requests: Optional[int], speedup: float) -> list[BenchRequest]:
    """The trace's first `num_requests` requests (None: all) at their recorded offsets, divided by `speedup`."""
    return [BenchRequest(request.arrival_s / speedup, request.prompt_tokens, request.output_tokens)
            for request in read_trace(path, num_requests)]


def fit_to_context(request: BenchRequest, max_model_len: int) -> BenchRequest:
    """Shrinks a request (output first, keeping at least one token) to the model's context."""
    prompt_tokens = min(request.prompt_tokens, max_model_len - 1)
    return BenchRequest(request.arrival_s, prompt_tokens, min(request.max_tokens, max_model_len - prompt_tokens))


def prompt_ids(index: int, length: int, vocab_size: int) -> list[int]:
    # The first tokens encode the index, so no two prompts share a prefix-cache block.
    usable = min(vocab_size, 256)  # plain byte-range ids exist in every vocabulary we load
    head = [1 + index % (usable - 1), 1 + (index // (usable - 1)) % (usable - 1)]
    return (head + [(index * 7 + position) % usable for position in range(length)])[:length]


async def run_load(target: str, metadata: tuple[tuple[str, str], ...],
                   credentials: Optional[grpc.ChannelCredentials], requests: list[BenchRequest],
                   concurrency: Optional[int], vocab_size: int, progress: Progress,
                   open_loop: bool = False) -> tuple[list[RequestResult], float]:
    """Sends every request (at its arrival offset, at most `concurrency` at once; None: no cap)
    with the call `metadata` over a channel with `credentials`
    (cluster.generate_command.target_connection); returns the results and the wall time of the
    run. `open_loop` (a trace's replay): TTFT counts from the request's arrival, so a request the
    cap held counts its wait, as the trace's user would have waited."""
    task = progress.add_task("requests", total=len(requests))
    slots = asyncio.Semaphore(concurrency or len(requests))
    async with open_channel(target, credentials, aio=True) as channel:
        stub = pb_grpc.GenerationStub(channel)
        started = time.monotonic()

        async def one(index: int, request: BenchRequest) -> RequestResult:
            arrival = started + request.arrival_s
            await asyncio.sleep(max(0.0, arrival - time.monotonic()))
            async with slots:
                result = await _generate(stub, metadata, index, request, vocab_size, arrival if open_loop else None)
            progress.advance(task)
            return result

        results = await asyncio.gather(*(one(index, request) for index, request in enumerate(requests)))
        return list(results), time.monotonic() - started


async def _generate(stub, metadata, index: int, request: BenchRequest, vocab_size: int,
                    arrival: Optional[float] = None) -> RequestResult:
    """arrival: when the request arrived (time.monotonic()), if not now: TTFT counts from it."""
    proto = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids(index, request.prompt_tokens, vocab_size)),
        sampling=pb.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
    )
    result = RequestResult()
    last = time.monotonic()
    sent = last if arrival is None else min(last, arrival)
    try:
        async for response in stub.Generate(proto, timeout=REQUEST_TIMEOUT_S, metadata=metadata):
            if not response.token_ids:
                continue
            now = time.monotonic()
            if result.ttft_s is None:
                result.ttft_s = now - sent
            else:  # a response may carry several tokens: spread its gap over them
                result.inter_token_s += [(now - last) / len(response.token_ids)] * len(response.token_ids)
            last = now
            result.output_tokens += len(response.token_ids)
    except grpc.RpcError as error:
        result.error = error.code().name
    return result


def preemptions_total() -> Optional[int]:
    """Preemptions the running replicas have counted, or None without a reachable cluster."""
    try:
        statuses = status_command.replica_statuses()
    except Exception:
        return None
    loads = [status.load for status in statuses if status.load is not None]
    return sum(load.preemptions_total for load in loads) if loads else None


def summary_table(results: list[RequestResult], wall_s: float, preemptions: Optional[int]) -> Table:
    completed = [result for result in results if result.error is None]
    ttfts = [result.ttft_s for result in completed if result.ttft_s is not None]
    itls = [gap for result in completed for gap in result.inter_token_s]
    output_tokens = sum(result.output_tokens for result in completed)
    errors = sorted({result.error for result in results if result.error is not None})
    table = Table(title="headroom bench", show_header=False)
    rows = [
        ("requests", f"{len(completed)} completed, {len(results) - len(completed)} failed"
                     + (f" ({', '.join(errors)})" if errors else "")),
        ("duration", f"{wall_s:.1f} s"),
        ("throughput", f"{len(completed) / wall_s:.2f} req/s, {output_tokens / wall_s:.1f} output tok/s"),
        ("TTFT p50 / p99", f"{percentile(ttfts, 0.5) * 1e3:.0f} / {percentile(ttfts, 0.99) * 1e3:.0f} ms"),
        ("ITL mean / p99", f"{(statistics.fmean(itls) if itls else math.nan) * 1e3:.1f} / "
                           f"{percentile(itls, 0.99) * 1e3:.1f} ms"),
        ("preemptions", "n/a (no Ray cluster reachable)" if preemptions is None else str(preemptions)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        if args.trace is not None:
            requests = trace_requests(args.trace, args.requests, args.trace_scale)
        else:
            requests = [BenchRequest(0.0, args.prompt_tokens, args.max_tokens)] * (args.requests or DEFAULT_REQUESTS)
    except (ValueError, KeyError, TypeError) as error:  # TypeError: a row short of a column
        message = str(error)
        parser.error(message if message.startswith("--trace:") else f"--trace: {args.trace}: not a trace ({message})")
    if not requests:
        parser.error(f"--trace: {args.trace} holds no request")
    # A trace's arrivals are not capped unless --concurrency says (None: no cap).
    concurrency = args.concurrency or (None if args.trace is not None else DEFAULT_CONCURRENCY)
    metadata, credentials = target_connection(args, parser)
    try:
        status_command.connect(args.address or "auto")
    except ValueError as error:  # ray.init's refusal of the address itself: a usage error, as in `headroom status`
        if args.address is not None:
            parser.error(f"--address: {error}")
    except Exception as error:  # latency and throughput still mean something without the counters,
        if args.address is not None:  # unless they were asked for
            print(f"headroom bench: no running cluster at {args.address}: {error}", file=sys.stderr)
            return 1
    with open_channel(args.target, credentials) as channel:
        try:
            info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=metadata)
        except grpc.RpcError as error:
            print(f"headroom bench: {args.target}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    requests = [fit_to_context(request, info.max_model_len) for request in requests]
    preemptions_before = preemptions_total()
    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        results, wall_s = asyncio.run(
            run_load(args.target, metadata, credentials, requests, concurrency, info.vocab_size, progress,
                     open_loop=args.trace is not None)
        )
    preemptions_after = preemptions_total()
    preemptions = (None if preemptions_before is None or preemptions_after is None
                   else preemptions_after - preemptions_before)
    console.print(summary_table(results, wall_s, preemptions))
    return 0 if all(result.error is None for result in results) else 1
