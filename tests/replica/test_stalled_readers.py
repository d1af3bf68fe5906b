"""Readers that stop reading, with the real engine core: a stream whose consumer takes
nothing for stream_stall_timeout_s is aborted (its KV blocks freed, its backlog dropped, the
reader told StreamStalledError, the request counted as finished "abort") while a slow reader
that reads at all streams to its end; a front that stops reading its channel (wedged, its
socket full) is taken out of the core after front_stall_timeout_s (its requests aborted, its
unsent messages dropped, its channel closed) while the other front streams on. Each test
first sees the stall take hold (tokens generated that nobody read, messages piling up for the
wedged front), then the abort, then every KV block free again."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.config import ConfigError, make_engine_config
from replica.core.request import SamplingParams
from replica.errors import StreamStalledError
from replica.front.async_engine import AsyncEngine
from replica.ipc.channel import ChannelClosed, FrameSocket
from replica.ipc.messages import AddRequest, CoreReady, CoreSpec, to_wire
from replica.server.metrics import REPLICA_LABELS, ReplicaMetrics
from replica.server.request_metrics import RequestMetrics
from replica_harness import RunningReplica, sampling

# Long enough that every request below is still generating when its stall is acted on
# (~4 ms a token for the built-in model on a CPU: ~4 s a request, twice the stall bounds below).
LONG = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=20)
PROMPT, OTHER_PROMPT = list(range(3, 40)), list(range(60, 90))
# Through gRPC the stall starts only once HTTP/2's window has filled: more tokens for that.
GRPC_MAX_TOKENS = 2000


async def wait_for(condition, what: str, timeout_s: float = 60.0):
    """Poll the async `condition` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while not (value := await condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return value


async def read_all(stream, pause_s: float = 0.0) -> list:
    outputs = []
    async for output in stream:
        outputs.append(output)
        await asyncio.sleep(pause_s)
    return outputs


def test_a_stream_nobody_reads_is_aborted_after_the_stall_timeout_while_a_slow_reader_streams_on():
    config = make_engine_config(max_model_len=2048, block_size=16, num_kv_blocks=400, stream_stall_timeout_s=2.0)
    metrics = ReplicaMetrics("replica", "builtin")
    aborted = lambda: metrics.registry.get_sample_value(  # noqa: E731
        "headroom_request_success_total", {**dict(zip(REPLICA_LABELS, ("replica", "builtin"))), "finish_reason": "abort"})

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu")
        front.observe_requests(RequestMetrics(metrics, time.monotonic))
        try:
            blocks_free = front.load().kv_blocks_free
            stalled = front.add_request(PROMPT, LONG, request_id="stalled")
            # Reads a message every 0.3 s: it falls behind the engine (its outputs merge) but
            # always takes something within the timeout.
            slow = asyncio.create_task(read_all(front.add_request(OTHER_PROMPT, LONG, request_id="slow"), 0.3))
            read_before = (await stalled.__anext__()).num_output_tokens  # then its reader stops reading
            aborted_before = aborted()
            generated_unread = (await front.core.call_utility("request_state", "stalled"))["num_output_tokens"]
            gone_after_s = await _seconds_until_gone(front, "stalled")
            still_running = await front.core.call_utility("request_state", "slow")
            with pytest.raises(StreamStalledError) as stalled_error:
                await stalled.__anext__()
            slow_outputs = await slow
            assert await front.core.call_utility("check_invariants")
            blocks_free_after = (await wait_for(
                lambda: _load_when_idle(front), "the core to go idle")).kv_blocks_free
            return (generated_unread - read_before, aborted_before, gone_after_s, still_running, stalled_error.value, slow_outputs,
                    aborted(), blocks_free, blocks_free_after)
        finally:
            await front.shutdown(grace_period_s=0)

    (generated_unread, aborted_before, gone_after_s, still_running, error, slow_outputs, aborted_after, blocks_free,
     blocks_free_after) = asyncio.run(scenario())
    # The stall took hold: the core generated on for a reader who took nothing, for the timeout.
    assert generated_unread > 0
    stalled_s, unread = float(str(error).split(" took nothing for ")[1].split()[0]), int(
        str(error).split(" while ")[1].split()[0])
    assert stalled_s >= 2.0 and "stream_stall_timeout_s 2" in str(error)
    assert unread >= generated_unread  # the unread backlog it dropped
    assert still_running is not None, "the stalled request ran to its end: it was not aborted"
    assert gone_after_s < 30
    assert (aborted_before, aborted_after) == (0, 1)  # counted once, as finished "abort"
    assert slow_outputs[-1].finish_reason == "length"
    assert sum(len(output.new_token_ids) for output in slow_outputs) == LONG.max_tokens
    assert len(slow_outputs) < LONG.max_tokens  # the slow reader did fall behind (its outputs merged)
    assert blocks_free_after == blocks_free  # no leaked KV blocks


def test_a_front_that_stops_reading_is_taken_out_of_the_core_while_the_other_front_streams_on(capfd):
    config = make_engine_config(max_model_len=2048, block_size=16, num_kv_blocks=400, front_stall_timeout_s=1.0)

    async def scenario():
        first = AsyncEngine(CoreSpec(config, "builtin", device="cpu"), fronts=2)
        await first.start()
        try:
            blocks_free = first.load().kv_blocks_free
            # Front 1: a front process that adds a request and then never reads its channel again.
            (socket_of_second,) = first.core.take_front_sockets()
            wedged = FrameSocket(socket_of_second)
            assert isinstance(wedged.recv(), CoreReady)
            wedged.send(to_wire(AddRequest.of(first.engine.make_request("wedged|f1", OTHER_PROMPT, LONG))))
            kept = first.add_request(PROMPT, LONG, request_id="kept")
            reading = asyncio.create_task(read_all(kept))
            backlog = await wait_for(lambda: _unsent_to(first, 1, 20), "messages to pile up for the wedged front")
            running_then = await first.core.call_utility("request_state", "wedged|f1")
            gone_after_s = await _seconds_until_gone(first, "wedged|f1")
            kept_then = await first.core.call_utility("request_state", "kept|f0")
            unsent_after = await first.core.call_utility("unsent_messages")
            outputs = await reading
            assert await first.core.call_utility("check_invariants")
            blocks_free_after = (await wait_for(lambda: _load_when_idle(first), "the core to go idle")).kv_blocks_free
            return backlog, running_then, gone_after_s, kept_then, unsent_after, outputs, wedged, blocks_free, \
                blocks_free_after
        finally:
            await first.shutdown(grace_period_s=0)

    (backlog, running_then, gone_after_s, kept_then, unsent_after, outputs, wedged, blocks_free,
     blocks_free_after) = asyncio.run(scenario())
    assert backlog > 20 and running_then is not None  # the stall took hold, its request still generating
    assert kept_then is not None, "the wedged front's request ran to its end: it was not aborted"
    assert gone_after_s < 30
    assert unsent_after[1] <= 1  # its backlog dropped (its sender's stop mark may be left)
    assert outputs[-1].finish_reason == "length"
    assert sum(len(output.new_token_ids) for output in outputs) == LONG.max_tokens
    assert blocks_free_after == blocks_free  # no leaked KV blocks
    # Its channel was closed: what reached its socket before the stall, then EOF.
    with pytest.raises(ChannelClosed):
        while True:
            wedged.recv()
    wedged.close()
    err = capfd.readouterr().err
    assert "front 1 read no output for" in err and "front_stall_timeout_s 1" in err
    assert "aborted its 1 requests and closed its channel" in err


def test_a_front_still_starting_is_not_taken_for_a_wedged_one_and_serves_once_it_attaches():
    """Another front's process takes seconds to start while front 0 serves already: every step's
    load piled up in its socket, and past front_stall_timeout_s the core took it out as wedged
    before it had read a thing, so its attach failed (and with it the replica's start). The clock
    starts once the front has attached."""
    config = make_engine_config(max_model_len=2048, block_size=16, num_kv_blocks=400, front_stall_timeout_s=1.0)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def scenario():
        first = AsyncEngine(CoreSpec(config, "builtin", device="cpu"), fronts=2)
        await first.start()
        second = None
        try:
            (socket_of_second,) = first.core.take_front_sockets()
            busy = asyncio.create_task(read_all(first.add_request(PROMPT, LONG, request_id="busy")))
            await wait_for(lambda: _unsent_to(first, 1, 20), "messages to pile up for the starting front")
            await asyncio.sleep(2.0)  # twice the stall timeout, its sender blocked all along
            second = AsyncEngine(CoreSpec(config, "builtin", device="cpu"), front_index=1,
                                 core_socket=socket_of_second)
            await second.start()
            served = await asyncio.wait_for(read_all(second.add_request(OTHER_PROMPT, short)), 60)
            busy.cancel()
            return served
        finally:
            if second is not None:
                await second.shutdown(grace_period_s=0)
            await first.shutdown(grace_period_s=0)

    served = asyncio.run(scenario())
    assert served[-1].finish_reason == "length"
    assert sum(len(output.new_token_ids) for output in served) == short.max_tokens


def test_a_front_that_never_attaches_is_taken_out_after_the_attach_deadline_while_front_0_serves_on(caplog):
    """The stall clock starts at a front's attach, so a front process that hung while starting
    (its socket open, its attach word never sent) was never timed out: the core queued it a
    message every step for ever. Here the real core, in a thread, serves front 0 over a raw
    socket while front 1's raw socket never says a word: past the attach deadline front 1 is
    taken out (its channel shut: it reads EOF) and front 0's request runs to its end."""
    import socket
    import threading

    from replica.core.engine import LLMEngine
    from replica.core.engine_core import EngineCore
    from replica.ipc.messages import Shutdown, StepOutputs, from_wire

    engine = LLMEngine(make_engine_config(max_model_len=256, num_kv_blocks=64, borrow_idle_cpus_min_tokens=0),
                       "builtin", device="cpu")
    pairs = [socket.socketpair() for _ in range(2)]
    core = EngineCore(engine, [FrameSocket(core_end) for core_end, _ in pairs])
    core._front_attach_timeout_s = 0.5  # FRONT_ATTACH_TIMEOUT_S's 120 s, shortened for the test
    front_0, silent = FrameSocket(pairs[0][1]), pairs[1][1]
    running = threading.Thread(target=core.run, name="engine-core")
    running.start()
    try:
        time.sleep(1.0)  # past the deadline: the core idles meanwhile, sending nothing
        short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        front_0.send(to_wire(AddRequest.of(engine.make_request("served", PROMPT, short))))
        rows = []
        while not rows or rows[-1][2] is None:
            message = from_wire(front_0.recv())
            if isinstance(message, StepOutputs):
                rows += message.outputs
        open_then = list(core._fronts_open)
        silent.settimeout(10.0)
        received = b""
        while chunk := silent.recv(65536):  # old code: no EOF, the recv times out
            received += chunk
    finally:
        front_0.send(to_wire(Shutdown()))
        running.join(timeout=30)
        for _, front_end in pairs:
            front_end.close()
    assert not running.is_alive()
    assert open_then == [True, False]
    assert received == b""  # taken out before its first message: nothing was ever queued for it
    assert sum(len(row[1]) for row in rows) == short.max_tokens and rows[-1][2] == "length"
    assert "front 1 did not attach within 0.5 s of the engine core's start" in caplog.text


def test_dropping_a_wedged_fronts_backlog_survives_its_sender_taking_the_last_message_meanwhile():
    """The backlog was emptied with `while not empty(): get_nowait()`, while the front's sender
    thread may take the last message between the two: queue.Empty escaped the busy loop and
    ended the engine core, every front's requests with it."""
    import queue
    import socket

    from replica.core.engine_core import EngineCore

    class SenderTakesTheLast(queue.SimpleQueue):
        def empty(self) -> bool:
            was_empty = super().empty()
            if not was_empty:
                self.get()  # the sender, right after this look
            return was_empty

    core = object.__new__(EngineCore)  # the drop alone: no engine, one wedged front
    ends = socket.socketpair()
    backlog = SenderTakesTheLast()
    backlog.put(("a step's outputs",))
    core.channels, core._outboxes = [None, FrameSocket(ends[0])], [queue.SimpleQueue(), backlog]
    core._fronts_open, core._owners, core._requests = [True, True], {}, {}
    core._front_stall_timeout_s = 1.0
    core._sending_since, core._attached_at = [None, time.monotonic() - 5.0], [0.0, 0.0]
    try:
        core._drop_stalled_fronts()
    finally:
        for end in ends:
            end.close()
    assert core._fronts_open == [True, False] and backlog.get_nowait() is None  # only its stop mark left


async def _unsent_to(front: AsyncEngine, index: int, count: int):
    unsent = (await front.core.call_utility("unsent_messages"))[index]
    return unsent > count and unsent


async def _seconds_until_gone(front: AsyncEngine, request_id: str) -> float:
    started = time.monotonic()

    async def gone():
        return await front.core.call_utility("request_state", request_id) is None

    await wait_for(gone, f"{request_id} to leave the core")
    return time.monotonic() - started


async def _load_when_idle(front: AsyncEngine):
    load = front.load()
    return load if load.num_running == load.num_waiting == 0 else None


def test_a_grpc_client_that_stops_reading_has_its_request_aborted_and_is_told_resource_exhausted():
    """End to end: the servicer's writes block on HTTP/2 flow control once the client reads
    nothing (its window kept small: no BDP probing), its request's stream stalls, and the
    request is aborted in the core; the client, reading again, gets what was written before the
    stall and then RESOURCE_EXHAUSTED naming it."""
    replica = RunningReplica(max_model_len=2048, block_size=16, num_kv_blocks=400, stream_stall_timeout_s=2.0)
    request = pb.GenerateRequest(request_id="stalled", token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling(
        max_tokens=GRPC_MAX_TOKENS, temperature=0.0, ignore_eos=True, top_logprobs=20))

    async def scenario():
        async with grpc.aio.insecure_channel(replica.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(request)
            read = len((await call.read()).token_ids)  # then the client reads nothing
            state, generated_then = await asyncio.to_thread(replica.core_call, "request_state", "stalled"), 0
            while state is not None and state["num_output_tokens"] < GRPC_MAX_TOKENS:
                generated_then, state = state["num_output_tokens"], await asyncio.to_thread(
                    replica.core_call, "request_state", "stalled")
                await asyncio.sleep(0.1)
            responses = []
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                while (response := await call.read()) is not grpc.aio.EOF:
                    responses.append(response)
            return read, generated_then, state, responses, failed.value

    try:
        blocks_free = replica.wait_until_idle().kv_blocks_free
        read, generated_then, state, responses, error = asyncio.run(scenario())
        blocks_free_after = replica.wait_until_idle().kv_blocks_free
        samples = replica.scrape()
    finally:
        replica.close()
    assert state is None, "the request ran to its end: it was not aborted"
    assert generated_then > read  # the stall took hold: the core generated on, unread
    received = read + sum(len(response.token_ids) for response in responses)
    assert received < GRPC_MAX_TOKENS and not any(response.finish_reason for response in responses)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "stream_stall_timeout_s 2" in error.details()
    aborted = [value for (name, labels), value in samples.items()
               if name == "headroom_request_success_total" and ("finish_reason", "abort") in labels]
    assert aborted == [1.0]
    assert blocks_free_after == blocks_free  # no leaked KV blocks


@pytest.mark.parametrize("field", ["stream_stall_timeout_s", "front_stall_timeout_s"])
def test_a_negative_stall_timeout_is_refused_naming_the_field_and_0_turns_it_off(field):
    with pytest.raises(ConfigError, match=f"{field}: Input should be greater than or equal to 0"):
        make_engine_config(**{field: -1})
    assert getattr(make_engine_config(**{field: 0}), field) == 0
