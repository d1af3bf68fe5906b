"""One engine core serving several fronts (`headroom replica --api-server-count N`), through
the front API: each front's streams get their own requests' rows only, even under the same
request id; every front sees each step's load and the same KV events; a front that leaves
takes its requests out of the core (their blocks come back) while the others' streams go on;
and when the front that started the core stops it, the others' streams end with the dead core.

The two fronts here share one event loop; `headroom replica` runs each in a process of its
own (tests/replica/test_server.py serves one that way)."""

from __future__ import annotations

import asyncio
import time

import pytest

from replica.config import make_engine_config
from replica.core.request import SamplingParams
from replica.errors import EngineDeadError
from replica.front.async_engine import AsyncEngine
from replica.ipc.messages import CoreSpec

CONFIG = make_engine_config(max_model_len=256, block_size=16, num_kv_blocks=129)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


async def two_fronts() -> tuple[AsyncEngine, AsyncEngine]:
    first = AsyncEngine(CoreSpec(CONFIG, "builtin", device="cpu"), fronts=2)
    await first.start()
    (socket_of_second,) = first.core.take_front_sockets()
    second = AsyncEngine(CoreSpec(CONFIG, "builtin", device="cpu"), front_index=1, core_socket=socket_of_second)
    await second.start()
    return first, second


async def collect(stream) -> list:
    return [output async for output in stream]


async def until(front: AsyncEngine, condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not condition(front.load()):
        if time.monotonic() > deadline:
            raise AssertionError(f"load never reached the condition: {front.load()}")
        await front.wait_for_load(front.load_version, timeout=0.5)
    return front.load()


def tokens(outputs) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def test_two_fronts_share_one_core_and_each_gets_only_its_own_streams():
    prompt_a, prompt_b = list(range(3, 40)), list(range(60, 90))

    async def scenario():
        first, second = await two_fronts()
        try:
            kv_first, kv_second = [], []
            first.on_kv_events(kv_first.extend)
            second.on_kv_events(kv_second.extend)
            # The same client id on both fronts, different prompts.
            a = first.add_request(prompt_a, GREEDY, request_id="same")
            b = second.add_request(prompt_b, GREEDY, request_id="same")
            out_a, out_b = await asyncio.gather(collect(a), collect(b))
            # Alone on the first front, for the reference.
            ref_a = await collect(first.add_request(prompt_a, GREEDY))
            ref_b = await collect(first.add_request(prompt_b, GREEDY))
            return out_a, out_b, ref_a, ref_b, kv_first, kv_second, first.load_version, second.load_version
        finally:
            await second.shutdown(grace_period_s=0)
            await first.shutdown(grace_period_s=0)

    out_a, out_b, ref_a, ref_b, kv_first, kv_second, versions_first, versions_second = asyncio.run(scenario())
    assert {output.request_id for output in out_a + out_b} == {"same"}
    assert len(tokens(out_a)) == len(tokens(out_b)) == 24
    assert tokens(out_a) == tokens(ref_a) and tokens(out_b) == tokens(ref_b)
    assert tokens(out_a) != tokens(out_b), "the prompts' outputs do not differ: the probe proves nothing"
    assert out_a[-1].finish_reason == out_b[-1].finish_reason == "length"
    assert kv_first and kv_first == kv_second  # every front mirrors the whole prefix cache
    # The second front read the load of steps that ran only the first front's requests too.
    assert versions_second >= versions_first - 1


def test_an_idle_core_tells_every_front_it_is_busy_before_its_first_step():
    """A front takes an idle load for current however old (AsyncEngine.load_is_current: it knows
    of no request the core may not show), so a load must reach it as soon as another front's
    request makes the core busy, before a step that might never end: the first load the first
    front sees after the idle one shows the request waiting, not yet run."""
    async def scenario():
        first, second = await two_fronts()
        try:
            await until(first, lambda load: load is not None)
            assert first.load_is_current()
            seen = []
            on_step = first.core._on_step  # every StepOutputs the core sends this front, as it arrives

            def recording(step) -> None:
                seen.append(step.load)
                on_step(step)

            first.core._on_step = recording
            await collect(second.add_request(list(range(3, 40)), GREEDY))
            # The first front's copy of the last (idle) load may still be on its way.
            await until(first, lambda load: load.num_running == 0 and load.num_waiting == 0)
            return seen, first.load_is_current()
        finally:
            await second.shutdown(grace_period_s=0)
            await first.shutdown(grace_period_s=0)

    from replica.ipc.messages import load_from_wire

    seen, current_after = asyncio.run(scenario())
    busy = [load for load in map(load_from_wire, seen) if load.num_running or load.num_waiting]
    assert busy and (busy[0].num_waiting, busy[0].num_running) == (1, 0), busy[:2]
    assert current_after  # idle again once it finished


def test_a_client_id_shaped_like_another_fronts_core_id_stays_apart_and_its_abort_touches_only_it():
    """Front 0's client picks "x|f1", the core id front 1 gives its client's "x". With every
    front's ids suffixed (front 0's too) they are two requests: the abort of front 0's leaves
    front 1's streaming to its end."""
    async def scenario():
        first, second = await two_fronts()
        try:
            theirs = second.add_request(list(range(60, 90)), LONG, request_id="x")
            first_of_theirs = await theirs.__anext__()  # the outputs it merged, if its reader was behind
            forged = first.add_request(list(range(3, 40)), LONG, request_id="x|f1")
            await forged.__anext__()
            first.abort("x|f1")
            rest = [first_of_theirs] + await collect(theirs)
            ended = await collect(forged)
            assert await first.core.call_utility("check_invariants")
            return rest, ended
        finally:
            await second.shutdown(grace_period_s=0)
            await first.shutdown(grace_period_s=0)

    rest, ended = asyncio.run(scenario())
    assert rest[-1].finish_reason == "length" and sum(len(output.new_token_ids) for output in rest) == 200
    assert ended[-1].finish_reason == "abort"


def test_a_disconnected_stream_aborts_its_own_request_though_another_clients_id_is_its_core_id():
    """Client A's "x" is core id "x|f0"; client B picked the id "x|f0" (core id "x|f0|f0"). A's
    reader going away (generate() closed, as a cancelled gRPC call's) aborted B by that id, and
    A ran on to max_tokens with nobody reading it."""
    async def scenario():
        first, second = await two_fronts()
        try:
            reader_a = first.generate(list(range(3, 40)), LONG, request_id="x")
            await reader_a.__anext__()
            b = first.add_request(list(range(60, 90)), LONG, request_id="x|f0")
            first_of_b = await b.__anext__()
            await reader_a.aclose()  # A's client went away
            rest = [first_of_b] + await collect(b)
            state_a = await first.core.call_utility("request_state", "x|f0")
            assert await first.core.call_utility("check_invariants")
            return rest, state_a
        finally:
            await second.shutdown(grace_period_s=0)
            await first.shutdown(grace_period_s=0)

    rest, state_a = asyncio.run(scenario())
    assert rest[-1].finish_reason == "length" and sum(len(output.new_token_ids) for output in rest) == 200
    assert state_a is None  # A left the core


def test_a_front_that_leaves_takes_its_requests_out_of_the_core_and_the_others_stream_on():
    async def scenario():
        first, second = await two_fronts()
        try:
            kept = first.add_request(list(range(3, 40)), LONG, request_id="kept")
            left = [second.add_request(list(range(50 + 7 * index, 90 + 7 * index)), LONG,
                                       request_id=f"left{index}") for index in range(3)]
            for stream in left:
                await stream.__anext__()
            first_kept = await kept.__anext__()  # the outputs it merged, if its reader was behind
            before = await until(first, lambda load: load.num_running == 4)
            await second.shutdown(grace_period_s=0)  # its streams end "abort"; the core drops them
            after = await until(first, lambda load: load.num_running == 1)
            states = [await first.core.call_utility("request_state", f"left{index}|f1") for index in range(3)]
            ends = [(await collect(stream))[-1].finish_reason for stream in left]
            rest = [first_kept] + await collect(kept)
            assert await first.core.call_utility("check_invariants")
            return before, after, states, ends, rest
        finally:
            await first.shutdown(grace_period_s=0)

    before, after, states, ends, rest = asyncio.run(scenario())
    assert states == [None, None, None], "the core still holds a request of the front that left"
    assert ends == ["abort"] * 3
    assert after.kv_blocks_free >= before.kv_blocks_free + 3 * 3  # each held 3+ blocks
    assert rest[-1].finish_reason == "length"
    assert sum(len(output.new_token_ids) for output in rest) == 200


def test_when_the_starting_front_stops_the_core_the_other_fronts_streams_fail_and_it_refuses_more():
    async def scenario():
        first, second = await two_fronts()
        try:
            stream = second.add_request(list(range(3, 40)), LONG)
            await stream.__anext__()
            await first.shutdown(grace_period_s=0)
            with pytest.raises(EngineDeadError):
                await collect(stream)
            with pytest.raises(EngineDeadError):
                second.add_request(list(range(3, 40)), LONG)
            return second.dead
        finally:
            await second.shutdown(grace_period_s=0)

    assert isinstance(asyncio.run(scenario()), EngineDeadError)


def test_a_shared_port_is_never_one_another_servers_fronts_already_share():
    """SO_REUSEPORT lets a second listener that sets it join a port: a replica's front 0 checks
    with a plain bind (both families for a wildcard host) that nothing holds a port first, so
    it moves on from one another replica's fronts serve (here on IPv6 only: a probe of the
    IPv4 address alone would miss it)."""
    import grpc

    from replica.server.replica_server import SHARED_PORT_SERVER_OPTIONS, _bind_first_free

    async def scenario():
        other = grpc.aio.server(options=SHARED_PORT_SERVER_OPTIONS)
        taken = other.add_insecure_port("[::1]:0")
        await other.start()
        ours = grpc.aio.server(options=SHARED_PORT_SERVER_OPTIONS)
        try:
            return taken, _bind_first_free(ours, "::", taken, 8, check_free=True)
        finally:
            await ours.stop(None)
            await other.stop(None)

    taken, bound = asyncio.run(scenario())
    assert bound != taken and taken < bound < taken + 8


def test_a_replica_counting_up_from_a_taken_port_skips_it_without_grpcs_bind_error(capfd):
    """Co-located replicas count up from one base port: the next one tried the taken port with
    gRPC first, which logged "Failed to add port ... Address already in use" on every start (a
    QA pass read it as a fault). The plain-bind check now skips it before gRPC tries."""
    import socket

    import grpc

    from replica.server.replica_server import SERVER_OPTIONS, _bind_first_free

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]

        async def scenario():
            ours = grpc.aio.server(options=SERVER_OPTIONS)
            try:
                return _bind_first_free(ours, "127.0.0.1", taken, 8, check_free=True)
            finally:
                await ours.stop(None)

        bound = asyncio.run(scenario())
    assert taken < bound < taken + 8
    assert "Failed to add port" not in capfd.readouterr().err
