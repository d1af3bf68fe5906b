"""EngineConfig.stream_interval on a real replica server on loopback (the built-in model): with
interval N the first token is streamed at once, later tokens in messages of N, the last
message flushes what is held; the tokens, text and logprobs are exactly interval 1's. The
Serve deployment's streams (the cluster's HTTP and gRPC doors) read the same per-request
stream (AsyncEngine.generate), so they are grouped the same way."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica_harness import RunningReplica, collect_stream, sampling, start_replicas

INTERVAL = 4
ENGINE = dict(max_model_len=256, block_size=16, num_kv_blocks=129)
# Each step of the paced engine takes at least this long, so that a stream's writer always
# finishes before the next step's tokens arrive, even on a loaded machine: a writer that falls
# behind merges outputs (by design), which would make the message counts below vary.
STEP_PACE_S = 0.02


class PacedEngine(LLMEngine):
    """Engine factory for the engine-core process: the built-in model's steps, each at least
    STEP_PACE_S apart (the tokens are the plain engine's)."""

    def step_rows(self):
        time.sleep(STEP_PACE_S)
        return super().step_rows()


@pytest.fixture(scope="module")
def replicas():
    """(interval 1, interval INTERVAL) replicas of the same paced engine."""
    running = start_replicas(*(dict(engine_factory=f"{__name__}:PacedEngine", stream_interval=interval, **ENGINE)
                               for interval in (1, INTERVAL)))
    try:
        yield tuple(running)
    finally:
        for replica in running:
            replica.close()


def implied_sizes(num_tokens: int, interval: int) -> list[int]:
    """Tokens per message that `interval` implies for a stream of num_tokens: the first alone,
    then groups of `interval`, the last group whatever remains."""
    rest = num_tokens - 1
    return [1] + [interval] * (rest // interval) + ([rest % interval] if rest % interval else [])


def generate(replica: RunningReplica, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            return await collect_stream(pb_grpc.GenerationStub(channel), request)

    return asyncio.run(run())


def test_implied_sizes():
    assert implied_sizes(10, 4) == [1, 4, 4, 1]
    assert implied_sizes(5, 4) == [1, 4]
    assert implied_sizes(3, 4) == [1, 2]
    assert implied_sizes(1, 4) == [1]
    assert implied_sizes(4, 1) == [1, 1, 1, 1]


def test_interval_groups_the_tokens_of_interval_1_exactly(replicas):
    per_token, grouped = replicas
    request = pb.GenerateRequest(text="The quick brown fox", add_special_tokens=True,
                                 sampling=sampling(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True,
                                                   top_logprobs=2))
    streams = {interval: generate(replica, request) for interval, replica in ((1, per_token), (INTERVAL, grouped))}
    for interval, responses in streams.items():
        assert [len(response.token_ids) for response in responses] == implied_sizes(10, interval), interval
        assert [len(response.logprobs) for response in responses] == implied_sizes(10, interval), interval
        assert [response.finish_reason for response in responses] == (
            [pb.FINISH_REASON_UNSPECIFIED] * (len(responses) - 1) + [pb.FINISH_REASON_LENGTH])
        assert responses[-1].usage.completion_tokens == 10
    concatenated = {
        interval: ([t for r in responses for t in r.token_ids], "".join(r.text for r in responses),
                   [p for r in responses for p in r.logprobs],
                   [(list(top.token_ids), list(top.logprobs)) for r in responses for top in r.top_logprobs])
        for interval, responses in streams.items()
    }
    assert concatenated[INTERVAL] == concatenated[1]
    tokens, text, _, _ = concatenated[1]
    assert len(tokens) == 10 and text == per_token.engine.tokenizer.decode(tokens)
    # Each message's usage counts the tokens streamed so far.
    assert [r.usage.completion_tokens for r in streams[INTERVAL]] == [1, 5, 9, 10]


@pytest.mark.parametrize("max_tokens", [1, 3, 5, 6])
def test_the_finish_flushes_a_partial_group_at_once(replicas, max_tokens):
    _, grouped = replicas
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9]),
                                 sampling=sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    responses = generate(grouped, request)
    assert [len(response.token_ids) for response in responses] == implied_sizes(max_tokens, INTERVAL)
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == max_tokens


def test_the_first_message_is_as_soon_as_the_first_token(replicas):
    """TTFT is unchanged: the first message comes one prefill step after the request, not
    INTERVAL steps; the second only after INTERVAL more steps."""
    _, grouped = replicas
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9]),
                                 sampling=sampling(max_tokens=9, temperature=0.0, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(grouped.address) as channel:
            start = time.perf_counter()
            times, sizes = [], []
            async for response in pb_grpc.GenerationStub(channel).Generate(request):
                times.append(time.perf_counter() - start)
                sizes.append(len(response.token_ids))
            return times, sizes

    times, sizes = asyncio.run(run())
    assert sizes == [1, 4, 4]
    # The second message waits for INTERVAL paced steps after the first.
    assert times[1] - times[0] >= INTERVAL * STEP_PACE_S * 0.9


def test_the_serve_deployments_stream_and_each_of_several_requests_group_their_own_tokens(replicas):
    """The Ray Serve deployment (the cluster's HTTP and gRPC doors; n > 1 is one request per
    choice) streams from AsyncEngine.generate: concurrent requests each get their own groups."""
    _, grouped = replicas
    prompts = [grouped.engine.tokenizer.encode(text) for text in ("one", "two choices", "three of them")]

    async def consume(prompt, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [output async for output in grouped.async_engine.generate(prompt, params)]

    async def run():
        return await asyncio.gather(*(consume(prompt, 7 + index) for index, prompt in enumerate(prompts)))

    streams = grouped.call(run())
    for index, outputs in enumerate(streams):
        assert [len(output.new_token_ids) for output in outputs] == implied_sizes(7 + index, INTERVAL)
        assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 7 + index


def test_cancelling_while_tokens_are_held_frees_the_request(replicas):
    _, grouped = replicas
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(10, 60))),
                                 sampling=sampling(max_tokens=200, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(grouped.address) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(request)
            first = await call.read()
            await asyncio.sleep(2.5 * STEP_PACE_S)  # tokens after the first are now held on the replica
            call.cancel()
            return first

    first = asyncio.run(run())
    assert len(first.token_ids) == 1
    load = grouped.wait_until_idle()
    assert load.kv_blocks_free == load.kv_blocks_total
    assert grouped.core_call("check_invariants")
    assert grouped.on_loop(lambda: len(grouped.async_engine._processor)) == 0  # no stream left on the front
