"""`headroom bench`'s load: a trace replays whole by default, and a replay whose arrivals a
concurrency cap held times TTFT from each request's arrival, as its user would have waited.
Against a real gRPC server on loopback answering after a fixed delay."""

from __future__ import annotations

import asyncio

import grpc
from rich.progress import Progress

from cluster.bench_command import BenchRequest, run_load, trace_requests
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc

DELAY_S = 0.3


class SlowGeneration(pb_grpc.GenerationServicer):
    async def Generate(self, request, context):
        await asyncio.sleep(DELAY_S)
        yield pb.GenerateResponse(token_ids=[7])


def ttfts(concurrency, open_loop: bool) -> list[float]:
    async def scenario() -> list[float]:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(SlowGeneration(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            requests = [BenchRequest(0.0, 4, 1)] * 3  # all arrive at once
            results, _ = await run_load(f"127.0.0.1:{port}", (), None, requests, concurrency, 256,
                                        Progress(disable=True), open_loop=open_loop)
        finally:
            await server.stop(0)
        assert all(result.error is None and result.output_tokens == 1 for result in results)
        return sorted(result.ttft_s for result in results)

    return asyncio.run(scenario())


def test_a_capped_replay_counts_each_requests_wait_for_a_slot_in_its_ttft():
    held = ttfts(1, open_loop=True)
    assert [round(t / DELAY_S) for t in held] == [1, 2, 3]  # one slot: each waited for the ones before
    closed = ttfts(1, open_loop=False)  # a closed loop's client sends when a slot frees
    assert all(DELAY_S * 0.9 < t < DELAY_S * 1.6 for t in closed)
    uncapped = ttfts(None, open_loop=True)  # a replay's default: every arrival sent at once
    assert all(DELAY_S * 0.9 < t < DELAY_S * 1.6 for t in uncapped)


def test_a_trace_replays_whole_unless_told_how_many(tmp_path):
    trace = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{i // 10:02d}.{i % 10}000000,{10 + i},{1 + i % 5}" for i in range(100)]
    trace.write_text("\n".join(rows) + "\n")
    whole = trace_requests(str(trace), None, 2.0)
    assert len(whole) == 100 and abs(whole[-1].arrival_s - 9.9 / 2.0) < 1e-6 and whole[-1].prompt_tokens == 109
    assert len(trace_requests(str(trace), 64, 1.0)) == 64
