"""A request's output stream merges what arrived while its consumer was busy, so a slow
consumer (a gRPC or HTTP writer) catches up in one message, and loses nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from replica.front.async_engine import MergingOutput, RequestStream
from replica.config import make_engine_config
from replica.core.outputs import RequestOutput, make_request
from replica.core.request import SamplingParams
from replica.errors import StreamStalledError


def output(tokens, text, finish_reason=None, logprobs=None) -> RequestOutput:
    return RequestOutput("r", list(tokens), text, finish_reason, num_prompt_tokens=3,
                         num_output_tokens=tokens[-1], num_cached_tokens=0, logprobs=logprobs)


def stream(stream_interval: int = 1, stall_timeout_s: float = 0.0) -> RequestStream:
    request = make_request("r", [1, 2, 3], SamplingParams(max_tokens=8), config=make_engine_config(),
                           eos_token_ids=(0,), clock=time.monotonic)
    return RequestStream(request, stream_interval=stream_interval, stall_timeout_s=stall_timeout_s)


def due(outputs: RequestStream) -> bool:
    """Whether a read would return at once (the consumer is woken)."""
    return outputs._arrived.is_set()


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


def test_a_merged_output_carries_every_field_of_the_later_one_but_the_concatenated_deltas():
    # MergingOutput builds the output field by field (for speed): a field added to
    # RequestOutput must not be dropped from merged outputs.
    concatenated = {"new_token_ids", "text", "logprobs", "top_logprobs"}
    earlier = RequestOutput("r", [1], "a", None, 3, 1, 0, logprobs=[-0.1], top_logprobs=[("t1",)])
    later = RequestOutput("r", [2], "b", "stop", 3, 2, 5, logprobs=[-0.2], top_logprobs=[("t2",)], stop_reason=7)
    merged = MergingOutput(earlier).add(later).output()
    for field in dataclasses.fields(RequestOutput):
        if field.name not in concatenated:
            assert getattr(merged, field.name) == getattr(later, field.name), field.name
    assert (merged.new_token_ids, merged.text, merged.logprobs, merged.top_logprobs) == (
        [1, 2], "ab", [-0.1, -0.2], [("t1",), ("t2",)])


def test_a_reader_far_behind_reads_every_delta_once_and_the_held_outputs_are_not_copied_per_step():
    """A stalled reader's held outputs grow in place: merging by building a new output each step
    copied all of them every step (O(L) a step, O(L^2) over the stream, on the front's event loop)."""
    async def main():
        outputs = stream()
        outputs.put(output([1], "a"))  # no logprobs asked until later: None, then lists, as a merge sees them
        outputs.put(output([2], "b", logprobs=[-0.2]))
        held = outputs._pending[-1]
        tokens_list = held.new_token_ids
        for index in range(3, 1001):
            outputs.put(output([index], "x", "length" if index == 1000 else None, logprobs=[-index / 10]))
        assert outputs._pending[-1] is held and held.new_token_ids is tokens_list  # extended, not rebuilt
        (read,) = [item async for item in outputs]
        assert read.new_token_ids == list(range(1, 1001)) and read.text == "ab" + "x" * 998
        assert read.logprobs == [-0.2] + [-index / 10 for index in range(3, 1001)]
        assert (read.finish_reason, read.num_output_tokens) == ("length", 1000) and outputs.finished

    asyncio.run(main())


def test_with_an_interval_the_first_token_is_due_at_once_then_every_n_tokens_and_the_finish_at_once():
    async def main():
        outputs = stream(stream_interval=3)
        read = []
        for index in range(1, 9):
            outputs.put(output([index], str(index), "length" if index == 8 else None, logprobs=[-index / 10]))
            # Due after token 1 (the first), 4 and 7 (three more each), and 8 (the finish).
            assert due(outputs) == (index in (1, 4, 7, 8)), index
            if due(outputs):
                read.append(await outputs.__anext__())
        assert [item.new_token_ids for item in read] == [[1], [2, 3, 4], [5, 6, 7], [8]]
        assert [item.text for item in read] == ["1", "234", "567", "8"]
        assert [item.logprobs for item in read] == [[-0.1], [-0.2, -0.3, -0.4], [-0.5, -0.6, -0.7], [-0.8]]
        assert [item.num_output_tokens for item in read] == [1, 4, 7, 8]
        assert read[-1].finish_reason == "length" and outputs.finished
        with pytest.raises(StopAsyncIteration):
            await outputs.__anext__()

    asyncio.run(main())


def test_with_an_interval_a_reader_waits_for_the_group_and_an_error_flushes_what_is_held():
    async def main():
        outputs = stream(stream_interval=4)
        outputs.put(output([1], "a"))
        assert (await outputs.__anext__()).new_token_ids == [1]
        reader = asyncio.ensure_future(outputs.__anext__())
        outputs.put(output([2], "b"))
        outputs.put(output([3], "c"))
        await asyncio.sleep(0.01)
        assert not reader.done()  # two tokens of a group of four: held
        outputs.put(RuntimeError("core died"))
        assert (await reader).new_token_ids == [2, 3]
        with pytest.raises(RuntimeError, match="core died"):
            await outputs.__anext__()

    asyncio.run(main())


def test_with_an_interval_a_consumer_that_falls_behind_still_gets_everything_merged():
    async def main():
        outputs = stream(stream_interval=2)
        for index in range(1, 7):
            outputs.put(output([index], str(index)))
        outputs.put(output([7], "7", "stop"))
        merged = [item async for item in outputs]
        assert [item.new_token_ids for item in merged] == [[1, 2, 3, 4, 5, 6, 7]]
        assert merged[0].finish_reason == "stop"

    asyncio.run(main())


STALL_S = 0.05


def test_a_reader_that_takes_nothing_for_the_stall_timeout_stalls_the_stream_and_abandon_drops_its_backlog():
    """Timed from the first output that found an earlier one unread: the reader had a step's
    output due and left it, then the timeout passed."""
    async def main():
        outputs = stream(stall_timeout_s=STALL_S)
        assert not outputs.put(output([1], "a"))  # due, nothing unread before it
        assert not outputs.put(output([2], "b"))  # [1] unread: the stall's clock starts
        time.sleep(STALL_S / 2)
        assert not outputs.put(output([3], "c"))
        time.sleep(STALL_S)
        assert outputs.put(output([4], "d"))  # past the timeout since [2] found [1] unread
        error = outputs.abandon()
        assert isinstance(error, StreamStalledError) and "while 4 tokens waited" in str(error)
        assert not outputs._pending and not due(outputs)  # the backlog is gone, not held for the reader
        outputs.put(error)  # as the output processor ends it
        with pytest.raises(StreamStalledError):
            await outputs.__anext__()

    asyncio.run(main())


def test_a_reader_that_takes_something_within_the_stall_timeout_never_stalls_however_far_behind():
    async def main():
        outputs = stream(stall_timeout_s=STALL_S)
        tokens = []
        for index in range(1, 13):
            assert not outputs.put(output([index], str(index), "length" if index == 12 else None))
            time.sleep(STALL_S / 3)
            if index % 2 == 0:  # behind by two outputs, read merged, for 4 timeouts in all
                tokens += (await outputs.__anext__()).new_token_ids
        assert tokens == list(range(1, 13)) and outputs.finished

    asyncio.run(main())


def test_outputs_held_by_the_stream_interval_are_not_unread_and_0_turns_the_stall_timeout_off():
    async def main():
        held = stream(stream_interval=100, stall_timeout_s=STALL_S)
        held.put(output([1], "a"))
        await held.__anext__()
        unbounded = stream()
        unbounded.put(output([1], "a"))
        for index in range(2, 5):
            time.sleep(STALL_S)
            assert not held.put(output([index], "x"))  # held for its group: nothing is due to the reader
            assert not unbounded.put(output([index], "x"))  # due and unread, with no bound

    asyncio.run(main())
