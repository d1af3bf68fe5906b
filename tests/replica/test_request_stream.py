"""A request's output stream merges what arrived while its consumer was busy, so a slow
consumer (a gRPC or HTTP writer) catches up in one message, and loses nothing."""

from __future__ import annotations

import asyncio
import time

import pytest

from replica.async_engine import RequestStream
from replica.config import make_engine_config
from replica.engine import RequestOutput, make_request
from replica.request import SamplingParams


def output(tokens, text, finish_reason=None, logprobs=None) -> RequestOutput:
    return RequestOutput("r", list(tokens), text, finish_reason, num_prompt_tokens=3,
                         num_output_tokens=tokens[-1], num_cached_tokens=0, logprobs=logprobs)


def stream() -> RequestStream:
    request = make_request("r", [1, 2, 3], SamplingParams(max_tokens=8), config=make_engine_config(),
                           eos_token_ids=(0,), clock=time.monotonic)
    return RequestStream(request)


def test_outputs_that_arrive_together_are_read_as_one_in_order():
    async def main():
        outputs = stream()
        outputs.put(output([1], "a", logprobs=[-0.1]))
        outputs.put(output([2], "b", logprobs=[-0.2]))
        outputs.put(output([3], "c", "length", logprobs=[-0.3]))
        merged = [item async for item in outputs]
        assert len(merged) == 1
        (only,) = merged
        assert (only.new_token_ids, only.text, only.logprobs) == ([1, 2, 3], "abc", [-0.1, -0.2, -0.3])
        assert (only.num_output_tokens, only.finish_reason) == (3, "length")

    asyncio.run(main())


def test_a_consumer_that_keeps_up_gets_every_output():
    async def main():
        outputs = stream()
        seen = []
        for index in range(1, 4):
            outputs.put(output([index], str(index), "length" if index == 3 else None))
            seen.append(await outputs.__anext__())
        assert [item.new_token_ids for item in seen] == [[1], [2], [3]]
        with pytest.raises(StopAsyncIteration):
            await outputs.__anext__()

    asyncio.run(main())


def test_an_error_is_not_merged_away_and_ends_the_stream_after_the_tokens_before_it():
    async def main():
        outputs = stream()
        outputs.put(output([1], "a"))
        outputs.put(RuntimeError("step failed"))
        outputs.put(output([2], "b"))  # nothing after the error is read
        assert (await outputs.__anext__()).new_token_ids == [1]
        with pytest.raises(RuntimeError, match="step failed"):
            await outputs.__anext__()
        assert outputs.finished

    asyncio.run(main())
