"""Live Ray Serve on this machine: two CPU LLMReplicas of the built-in model behind
HeadroomRequestRouter, replica 0 with a KV pool too small for more than one request. The
router steers around it, and keeps routing to the survivor when a replica is killed.
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.deployment import DEPLOYMENT_NAME, GenerationRequest, build_llm_replica, generate_stream  # noqa: E402
from replica.core.request import SamplingParams  # noqa: E402
from router.headroom_router import HeadroomRouter  # noqa: E402
from tests.cluster.serve_harness import shared_ray  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

APP_NAME = "llm"
BLOCK_SIZE = 16
ROOMY_BLOCKS = 256  # 255 usable: room for ~30 test requests at once
# 10 blocks hold one max_model_len (128-token) sequence plus the null block: replica 0
# can run one test request, and its headroom after that request is about zero.
TINY_BLOCKS = 10
MAX_MODEL_LEN = 128
# 40 prompt + 88 output tokens = 128 tokens = 8 blocks: fits the tiny pool only when idle.
# Away from the default (9100), which a real cluster on this machine may hold.
METRICS_BASE_PORT = 29100
REPLICA_GRPC_BASE_PORT = 29150  # the replicas' internal endpoints, counting up from here
REQUEST = GenerationRequest(
    prompt_token_ids=list(range(100, 140)),
    sampling=SamplingParams(max_tokens=88, temperature=0.0, ignore_eos=True),
)


@pytest.fixture(scope="module")
def cluster():
    shared_ray()
    try:
        serve.start(proxy_location="Disabled")
        config = ClusterConfig.model_validate(
            {
                "model": "builtin",
                "engine": {
                    "block_size": BLOCK_SIZE,
                    "num_kv_blocks": ROOMY_BLOCKS,
                    "max_model_len": MAX_MODEL_LEN,
                    "max_num_batched_tokens": 256,
                    "max_num_seqs": 32,
                    "max_waiting_requests": 64,
                },
                "replicas": {"num_replicas": 2, "num_cpus": 1},
                # Generous, so a snapshot delayed on a busy shared machine never sends a
                # request down the stale-load fallback these tests do not exercise.
                "router": {"staleness_s": 5.0},
                "ports": {"metrics": METRICS_BASE_PORT, "replica_grpc": REPLICA_GRPC_BASE_PORT},
            }
        )
        app = build_llm_replica(config, engine_overrides_by_rank={0: {"num_kv_blocks": TINY_BLOCKS}})
        handle = serve.run(app, name=APP_NAME, route_prefix=None)
        yield handle
    finally:
        serve.shutdown()


def router_of(handle) -> HeadroomRouter:
    """The HeadroomRouter inside this process's handle (Ray Serve internals; test-only)."""
    return handle._router._asyncio_router.request_router.headroom


async def generate(handle) -> tuple[str, int, str]:
    """(replica_id, tokens generated, finish reason) of one REQUEST through the router."""
    served = [pair async for pair in generate_stream(handle, REQUEST)]
    replica_id, last = served[-1]
    return replica_id, sum(len(output.new_token_ids) for _, output in served), last.finish_reason


def wait_for_fresh_loads(handle, num_replicas: int, timeout_s: float = 30.0) -> HeadroomRouter:
    """Send one request (the handle builds its router lazily), then wait until the router
    holds a fresh snapshot from `num_replicas` replicas."""
    asyncio.run(generate(handle))
    router = router_of(handle)
    deadline = time.monotonic() + timeout_s
    while True:
        fresh = [
            sub for sub in map(router.loads.get, list(router.loads.replica_ids))
            if sub is not None and sub.load is not None and sub.age_s() < 0.5
        ]
        if len(fresh) == num_replicas:
            return router
        assert time.monotonic() < deadline, f"only {len(fresh)} of {num_replicas} replicas report load"
        time.sleep(0.1)


def replicas_by_pool(router: HeadroomRouter) -> dict[int, str]:
    """Replica id by its KV pool's usable blocks, read from its own load reports."""
    return {router.loads.get(rid).load.kv_blocks_total: rid for rid in router.loads.replica_ids}


def test_router_steers_new_requests_away_from_the_replica_with_a_tiny_kv_pool(cluster):
    router = wait_for_fresh_loads(cluster, num_replicas=2)
    pools = replicas_by_pool(router)
    tiny, roomy = pools[TINY_BLOCKS - 1], pools[ROOMY_BLOCKS - 1]
    decisions_before = router.metrics.decisions(roomy)

    async def bursts() -> list[tuple[str, int, str]]:
        results = []
        for _ in range(3):  # bursts of 8: no snapshot can show a burst before it lands
            results += await asyncio.gather(*(generate(cluster) for _ in range(8)))
        return results

    results = asyncio.run(bursts())
    served = collections.Counter(replica_id for replica_id, _, _ in results)
    # The tiny replica could hold one of these requests, and only with its pool full; the
    # roomy one has room for all 8 of a burst and still scores far higher.
    assert served == {roomy: 24}, f"tiny={tiny}: {served}"
    assert all(tokens == 88 and reason == "length" for _, tokens, reason in results)
    assert router.metrics.decisions(roomy) - decisions_before == 24
    assert router.metrics.decisions(tiny) <= 1  # at most the warm-up request


def test_each_replica_serves_its_metrics_on_consecutive_ports_from_the_base(cluster):
    router = wait_for_fresh_loads(cluster, num_replicas=2)
    node_ip = ray.util.get_node_ip_address()
    replicas_seen = set()
    for port in range(METRICS_BASE_PORT, METRICS_BASE_PORT + 8):
        try:
            with urllib.request.urlopen(f"http://{node_ip}:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:  # nothing there (or not ours)
            continue
        for family in text_string_to_metric_families(text):
            if family.name == "headroom_kv_free_blocks":
                replicas_seen.update(sample.labels["replica"] for sample in family.samples)
    assert replicas_seen == router.loads.replica_ids


def test_each_replicas_internal_endpoint_counts_up_from_its_base_port_and_feeds_the_router(cluster):
    """Two replicas on one node: each binds the first free port from ports.replica_grpc, and
    the router, presenting the cluster token, streams fresh loads from both."""
    router = wait_for_fresh_loads(cluster, num_replicas=2)
    ports = {int(router.loads.get(rid).endpoint.rsplit(":", 1)[1]) for rid in router.loads.replica_ids}
    assert len(ports) == 2 and all(REPLICA_GRPC_BASE_PORT <= port < REPLICA_GRPC_BASE_PORT + 8 for port in ports)


def test_routing_continues_to_the_survivor_when_a_replica_is_killed(cluster):
    router = wait_for_fresh_loads(cluster, num_replicas=2)
    pools = replicas_by_pool(router)
    tiny, roomy = pools[TINY_BLOCKS - 1], pools[ROOMY_BLOCKS - 1]
    # Kill the replica the router prefers: every new request must now find the other.
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{roomy}", namespace="serve"), no_restart=True)

    async def after_kill() -> list[tuple[str, int, str]]:
        sequential = [await generate(cluster) for _ in range(3)]
        return sequential + list(await asyncio.gather(*(generate(cluster) for _ in range(4))))

    results = asyncio.run(after_kill())
    served = collections.Counter(replica_id for replica_id, _, _ in results)
    assert roomy not in served
    assert served[tiny] >= 3  # Serve's replacement takes seconds to load the model
    assert all(tokens == 88 and reason == "length" for _, tokens, reason in results)
    deadline = time.monotonic() + 15.0
    while roomy in router.loads.replica_ids:  # its stream is dropped with the replica
        assert time.monotonic() < deadline, "the dead replica's subscription was not dropped"
        time.sleep(0.1)
