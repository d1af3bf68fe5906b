"""Load subscriptions and the Ray-free router core against a real ReplicaServer on loopback:
snapshots arrive, age grows while the replica is down, the stream resumes after a restart,
stale loads (a replica down, an engine core stuck with work) fall back to Ray Serve's choice
while an idle core's stay fresh, a stuck core's load sent again does not forget the sends it
cannot show, a burst spreads before any snapshot, and a replica whose engine core died is
routed around at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time
from typing import Callable, Optional

from protos.not_serving import ENGINE_CORE_DIED
from replica.front.async_engine import AsyncEngine
from replica.ipc.messages import CoreSpec
from replica.config import make_engine_config
from replica.core.request import SamplingParams
from replica.server.metrics import ReplicaMetrics
from replica.server.replica_server import ReplicaServer
from router.headroom_router import ROUTING_KWARG, UNSIZED_REQUEST, HeadroomRouter, routing_request_of
from router.load_subscriber import Backoff, LoadSubscriber
from router.policies import RoutingRequest

ENGINE_CONFIG = dict(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def start_replica(port: int, replica_id: str = "r0") -> ReplicaServer:
    """replica_id: what the server says it is in its streams; the router checks it against the
    id it subscribed under ("" says nothing, and is trusted)."""
    engine = AsyncEngine(CoreSpec(make_engine_config(**ENGINE_CONFIG), "builtin", device="cpu"))
    server = ReplicaServer(engine, replica_id, "builtin", ReplicaMetrics(replica_id or "anonymous", "builtin"))
    await server.start("127.0.0.1", port)
    return server


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_backoff_doubles_up_to_its_cap_with_at_least_half_of_each_delay_fixed():
    backoff = Backoff(initial_s=0.05, multiplier=2.0, max_s=2.0)
    rng = random.Random(7)
    for attempt in range(12):
        nominal = min(0.05 * 2**attempt, 2.0)
        delays = [backoff.delay_s(attempt, rng) for _ in range(50)]
        assert all(nominal / 2 <= delay <= nominal for delay in delays)
        assert max(delays) - min(delays) > nominal / 10  # jittered, not fixed
    assert backoff.delay_s(10_000, rng) <= 2.0  # no overflow far into an outage


def test_subscription_streams_fresh_snapshots_at_the_report_interval():
    async def scenario() -> None:
        server = await start_replica(0)
        subscriber = LoadSubscriber()
        try:
            subscriber.subscribe("r0", f"127.0.0.1:{server.port}")
            subscription = subscriber.get("r0")
            await eventually(lambda: subscription.load is not None)
            first_seq = subscription.load.seq
            await asyncio.sleep(0.35)
            # An idle replica still reports every 100 ms, so a live stream never looks stale.
            assert subscription.load.seq >= first_seq + 2
            assert subscription.age_s() < 0.2
            assert subscription.load.kv_blocks_total == ENGINE_CONFIG["num_kv_blocks"] - 1
        finally:
            await subscriber.close()
            await server.stop(0.5)

    asyncio.run(scenario())


def test_subscription_ages_while_the_replica_is_down_and_resumes_after_it_restarts():
    async def scenario() -> None:
        port = free_port()
        server = await start_replica(port)
        subscriber = LoadSubscriber(backoff=Backoff(initial_s=0.05, max_s=0.2))
        try:
            subscriber.subscribe("r0", f"127.0.0.1:{port}")
            subscription = subscriber.get("r0")
            await eventually(lambda: subscription.load is not None)
            await server.stop(0.5)
            stopped_at = time.monotonic()
            await asyncio.sleep(0.6)
            # The last snapshot is kept, ageing, while reconnects keep failing.
            assert subscription.age_s() >= time.monotonic() - stopped_at - 0.15
            assert subscription.age_s() > 0.5
            assert subscription.failed_attempts >= 2
            assert subscription.connects == 1

            server = await start_replica(port)
            await eventually(lambda: subscription.connects == 2)
            await eventually(lambda: subscription.age_s() < 0.15)
            assert subscription.failed_attempts == 0
            assert subscription.load.seq <= 3  # numbered by the new server
        finally:
            await subscriber.close()
            await server.stop(0.5)

    asyncio.run(scenario())


def test_a_new_replica_on_a_gone_replicas_port_is_not_taken_for_it():
    """Ports are reused: until Serve reports r0 gone, its subscription reconnects to whatever
    listens there. A replica answering under another id is neither its load nor its cache."""
    async def scenario() -> None:
        port = free_port()
        server = await start_replica(port, "r0")
        router = HeadroomRouter("headroom", staleness_s=0.3, backoff=Backoff(initial_s=0.05, max_s=0.2))
        try:
            router.sync_replicas({"r0": f"127.0.0.1:{port}"})
            loads = router.loads.get("r0")
            await eventually(lambda: loads.load is not None and router.cache_index.get("r0") is not None)
            await server.stop(0.5)
            server = await start_replica(port, "r9")  # a new replica takes the port
            await eventually(lambda: loads.wrong_replica == "r9" and router.kv_events.get("r0").wrong_replica == "r9")
            await asyncio.sleep(0.4)
            assert loads.load.replica_id == "r0" and loads.age_s() > 0.3  # r0's last load, ageing
            assert router.cache_index.get("r0") is None  # nothing of r9's cache under r0
            assert loads.connects == 1 and loads.failed_attempts >= 2  # backing off, not streaming
            assert router.rank(RoutingRequest(prompt_tokens=40, max_tokens=60), {"r0": 0}, "k") is None
            # Nor is it among the replicas Serve's queue lengths choose from (r0's unknown queue counts
            # 0): r0 stopped cleanly and said so, but one killed outright (SIGKILL, a lost node) says nothing.
            assert loads.not_serving is not None
            loads.not_serving = None  # as if r0 had been killed without a word
            assert router.serving(["r0", "r1"]) == ["r1"] and router.serving(["r0"]) == ["r0"]
        finally:
            await router.close()
            await server.stop(0.5)

    asyncio.run(scenario())


def test_stale_loads_fall_back_to_ray_serves_choice_and_fresh_ones_rank():
    """A load is stale when its replica is down, and when its engine core has work but makes
    no new load (a step that never ends; here the core process is stopped, its front serving
    on): WatchLoad sends the core's latest load again every 100 ms, and each message carries
    the load's age (ReplicaLoad.load_age_ms) and when the core took it (timestamp), not when it
    was sent. Stamped at each send, a stuck core's load looked fresh forever, and it claimed the
    router's sends made since the core's last step, which the router then forgot (a burst
    landed on one replica). An idle core's load stays true and fresh, stopped or not."""
    async def scenario() -> None:
        port = free_port()
        server: Optional[ReplicaServer] = await start_replica(port)
        router = HeadroomRouter("headroom", staleness_s=0.3)
        request = RoutingRequest(prompt_tokens=40, max_tokens=60)
        core = server.engine.core.process
        stopped = False
        try:
            router.sync_replicas({"r0": f"127.0.0.1:{port}", "r1": None})
            subscription = router.loads.get("r0")
            await eventually(lambda: subscription.load is not None)
            # r1 has not announced an endpoint: it ranks by queue length beside r0.
            assert sorted(router.rank(request, {"r0": 3, "r1": 0}, "a")) == ["r0", "r1"]
            router.abandoned("a")

            os.kill(core.pid, signal.SIGSTOP)
            stopped = True
            await asyncio.sleep(0.45)  # past staleness_s: an idle core's load is still true
            assert subscription.age_s() < 0.2 and subscription.load.load_age_ms == 0
            assert router.rank(request, {"r0": 0}, "idle") == ["r0"]
            router.abandoned("idle")

            # A send the core has not seen (it reached the front; the core does not step).
            router.routed(request, "sent", "r0")
            stream = server.engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=2, temperature=0.0))
            seq = subscription.load.seq
            await eventually(lambda: subscription.load.seq >= seq + 2, timeout_s=2.0)  # the load sent again
            # Its messages do not cover the send: it still counts against r0.
            assert router._view(request, "r0", 0).inflight_since_snapshot.requests == 1
            # The load ages though the stream goes on, and stops ranking after staleness_s.
            await eventually(lambda: subscription.age_s() > 0.3, timeout_s=2.0)
            assert subscription.load.load_age_ms > 100  # the replica says so: no clocks compared
            assert router.rank(request, {"r0": 0}, "stuck") is None

            os.kill(core.pid, signal.SIGCONT)  # the core steps again: fresh loads that cover the send
            stopped = False
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
            await eventually(lambda: router._view(request, "r0", 0).inflight_since_snapshot.requests == 0,
                             timeout_s=2.0)
            await eventually(lambda: subscription.age_s() < 0.15, timeout_s=2.0)
            assert router.rank(request, {"r0": 0}, "b") == ["r0"]

            await server.stop(0.5)
            server = None
            await asyncio.sleep(0.45)
            assert router.rank(request, {"r0": 3, "r1": 0}, "c") is None
        finally:
            if stopped:
                os.kill(core.pid, signal.SIGCONT)
            await router.close()
            if server is not None:
                await server.stop(0.5)

    asyncio.run(scenario())


def test_a_burst_with_no_new_snapshot_spreads_over_equally_loaded_replicas():
    async def scenario() -> None:
        server = await start_replica(0, replica_id="")  # read under two ids
        router = HeadroomRouter("headroom", rng=random.Random(3))
        try:
            endpoint = f"127.0.0.1:{server.port}"
            # Two replica ids reading one server see identical loads: only the router's own
            # count of what it chose can tell them apart.
            router.sync_replicas({"r0": endpoint, "r1": endpoint})
            await eventually(lambda: all(router.loads.get(r).load is not None for r in ("r0", "r1")))
            request = RoutingRequest(prompt_tokens=100, max_tokens=100)
            firsts = [router.rank(request, {"r0": 0, "r1": 0}, f"burst-{i}")[0] for i in range(8)]
            assert firsts.count("r0") == firsts.count("r1") == 4
        finally:
            await router.close()
            await server.stop(0.5)

    asyncio.run(scenario())


def test_routed_requests_count_as_decisions_per_policy_and_replica():
    async def scenario() -> None:
        router = HeadroomRouter("pow2")
        request = RoutingRequest(prompt_tokens=10, max_tokens=10)
        router.routed(request, "a", "r0")
        router.routed(request, "b", "r0")
        router.routed(request, "c", "r1")
        assert (router.metrics.decisions("r0"), router.metrics.decisions("r1")) == (2.0, 1.0)
        assert router.metrics.registry.get_sample_value(
            "headroom_router_decisions_total", {"policy": "pow2", "replica": "r0"}
        ) == 2.0
        await router.close()

    asyncio.run(scenario())


def test_requests_without_a_routing_hint_are_routed_as_short_chat_turns():
    hint = RoutingRequest(prompt_tokens=500, max_tokens=20)
    assert routing_request_of({ROUTING_KWARG: hint}) is hint
    assert routing_request_of({}) is UNSIZED_REQUEST
    assert routing_request_of({ROUTING_KWARG: {"prompt_tokens": 5}}) is UNSIZED_REQUEST


def test_a_replica_whose_engine_core_died_is_routed_around_at_once_though_its_queue_is_empty():
    """A dead core fails requests fast, so its queue looks shortest: the replica's stream
    says it serves nothing more and the router drops it long before its load goes stale."""
    async def scenario() -> None:
        dying, healthy = await asyncio.gather(start_replica(0, "dying"), start_replica(0, "healthy"))  # side by side
        router = HeadroomRouter("headroom", staleness_s=5.0)
        request = RoutingRequest(prompt_tokens=40, max_tokens=60)
        try:
            router.sync_replicas({"dying": f"127.0.0.1:{dying.port}", "healthy": f"127.0.0.1:{healthy.port}"})
            await eventually(lambda: all(router.loads.get(r).load is not None for r in ("dying", "healthy")))
            assert sorted(router.rank(request, {"dying": 0, "healthy": 9}, "before")) == ["dying", "healthy"]
            core = dying.engine.core.process
            os.kill(core.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            subscription = router.loads.get("dying")
            await eventually(lambda: subscription.not_serving is not None)
            assert time.monotonic() - killed_at < 1.0  # at once, not when the snapshot goes stale (5 s)
            assert subscription.not_serving == ENGINE_CORE_DIED
            assert subscription.age_s() < 5.0  # its last load is still "fresh": only the signal excludes it
            assert router.rank(request, {"dying": 0, "healthy": 9}, "after") == ["healthy"]
            assert router.serving(["dying", "healthy"]) == ["healthy"]
            assert router.serving(["dying"]) == ["dying"]  # alone, it is still better than nothing
            await asyncio.sleep(0.3)  # reconnects meet the same answer and keep it excluded
            assert subscription.not_serving == ENGINE_CORE_DIED and subscription.connects == 1
            assert core.wait(timeout=10) == -signal.SIGKILL  # the probe: the core really died
        finally:
            await router.close()
            await dying.stop(0.5)
            await healthy.stop(0.5)

    asyncio.run(scenario())
