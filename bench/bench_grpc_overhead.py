"""gRPC overhead: time to first token and per-token latency through the replica's gRPC
server (loopback) against calling the same AsyncEngine (the front of the engine-core process)
directly, on one workload in one run (target: the gRPC path adds <= 2 ms to TTFT at p50).

    python bench/bench_grpc_overhead.py [--sequential 200] [--concurrent 32]

Both paths share one engine core and one front event loop, and alternate request by request
(batch by batch for the concurrent part) so drift in machine load hits both alike. The client
runs in the front's process, so "added" counts the client's and the server's gRPC work together.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from cluster.stats import percentile
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.front.async_engine import AsyncEngine
from replica.config import make_engine_config
from replica.server.metrics import ReplicaMetrics
from replica.core.request import SamplingParams
from replica.server.replica_server import ReplicaServer
from replica.ipc.messages import CoreSpec

TTFT_TARGET_ADDED_MS = 2.0
PROMPT_TOKENS = 16
MAX_TOKENS = 16


@dataclass
class Latencies:
    ttft_ms: list[float] = field(default_factory=list)
    inter_token_ms: list[float] = field(default_factory=list)

    def record(self, start: float, token_times: list[float]) -> None:
        self.ttft_ms.append((token_times[0] - start) * 1000)
        self.inter_token_ms += [(later - earlier) * 1000 for earlier, later in zip(token_times, token_times[1:])]


async def in_process(engine: AsyncEngine, prompt: list[int], latencies: Latencies) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    token_times = [time.perf_counter() async for output in engine.generate(prompt, params) if output.new_token_ids]
    latencies.record(start, token_times)


async def over_grpc(stub: pb_grpc.GenerationStub, prompt: list[int], latencies: Latencies) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    token_times = [time.perf_counter() async for response in stub.Generate(request) if response.token_ids]
    latencies.record(start, token_times)


def report(title: str, local: Latencies, remote: Latencies) -> float:
    """Print p50/p99 of both paths and the difference; returns the added TTFT at p50 in ms."""
    print(f"\n{title}")
    print(f"  {'metric':<22}{'AsyncEngine':>12}{'gRPC':>12}{'added':>10}")
    added_ttft_p50 = 0.0
    for name, local_values, remote_values in (("TTFT", local.ttft_ms, remote.ttft_ms),
                                              ("inter-token", local.inter_token_ms, remote.inter_token_ms)):
        for label, fraction in (("p50", 0.50), ("p99", 0.99)):
            local_ms, remote_ms = percentile(local_values, fraction), percentile(remote_values, fraction)
            print(f"  {name + ' ' + label + ' (ms)':<22}{local_ms:>12.3f}{remote_ms:>12.3f}{remote_ms - local_ms:>+10.3f}")
            if (name, label) == ("TTFT", "p50"):
                added_ttft_p50 = remote_ms - local_ms
    return added_ttft_p50


async def main(num_sequential: int, concurrency: int, num_batches: int) -> None:
    engine = AsyncEngine(CoreSpec(make_engine_config(max_model_len=256, num_kv_blocks=512), "builtin"))
    server = ReplicaServer(engine, "bench", "builtin", ReplicaMetrics("bench", "builtin"))
    port = await server.start("127.0.0.1", 0)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(PROMPT_TOKENS)] for _ in range(max(num_sequential, concurrency))]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            for prompt in prompts[:8]:  # warm up the model, the channel and both code paths
                await in_process(engine, prompt, Latencies())
                await over_grpc(stub, prompt, Latencies())

            sequential_local, sequential_remote = Latencies(), Latencies()
            for prompt in prompts[:num_sequential]:
                await in_process(engine, prompt, sequential_local)
                await over_grpc(stub, prompt, sequential_remote)

            concurrent_local, concurrent_remote = Latencies(), Latencies()
            for _ in range(num_batches):
                await asyncio.gather(*(in_process(engine, p, concurrent_local) for p in prompts[:concurrency]))
                await asyncio.gather(*(over_grpc(stub, p, concurrent_remote) for p in prompts[:concurrency]))
    finally:
        await server.stop(1.0)  # stops the engine core too

    print(f"workload: {PROMPT_TOKENS}-token prompts, {MAX_TOKENS} greedy tokens each, built-in model, loopback")
    added = report(f"{num_sequential} sequential requests", sequential_local, sequential_remote)
    report(f"{num_batches} batches of {concurrency} concurrent requests", concurrent_local, concurrent_remote)
    verdict = "MET" if added <= TTFT_TARGET_ADDED_MS else "MISSED"
    print(f"\ntarget: gRPC adds <= {TTFT_TARGET_ADDED_MS} ms to TTFT at p50 (sequential): "
          f"added {added:.3f} ms -> {verdict}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=200, help="sequential requests per path")
    parser.add_argument("--concurrent", type=int, default=32, help="requests per concurrent batch")
    parser.add_argument("--batches", type=int, default=3, help="concurrent batches per path")
    arguments = parser.parse_args()
    asyncio.run(main(arguments.sequential, arguments.concurrent, arguments.batches))
