"""Live Ray Serve: two CPU LLMReplicas behind HeadroomRequestRouter with its KV event index. A
request sharing a long prefix with an earlier one lands on the replica that cached it (its
prefix-cache hit proves it), one under an output constraint too, until that replica's committed
KV is full: then it receives nothing, even for prompts it caches, and the other replica takes
them (the prefix spreads).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Optional

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.deployment import GenerationRequest, build_llm_replica, generate_stream  # noqa: E402
from protos.block_hash import block_hashes  # noqa: E402
from replica.core.request import SamplingParams  # noqa: E402
from replica.core.structured_output import StructuredOutput  # noqa: E402
from router.headroom_router import HeadroomRouter  # noqa: E402
from tests.cluster.serve_harness import generate_on_replica, shared_ray  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

APP_NAME = "prefix"
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 65  # 64 usable: 1,024 tokens
MAX_MODEL_LEN = 512
METRICS_BASE_PORT = 29300  # away from the defaults and from the other live tests
REPLICA_GRPC_BASE_PORT = 29350
PREFIX = [10 + (7 * i) % 300 for i in range(160)]  # 160 tokens (10 full blocks) in the built-in 320-token vocabulary
# Two of these promise 2 x (16 + 496) = 1,024 tokens: the whole pool, to max_tokens.
FILLER = GenerationRequest(prompt_token_ids=list(range(20, 36)),
                           sampling=SamplingParams(max_tokens=496, temperature=0.0, ignore_eos=True))


def shared_prefix_request(suffix: int, structured_output: Optional[StructuredOutput] = None) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=PREFIX + [suffix] * 8,
                             sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                     structured_output=structured_output))


@pytest.fixture(scope="module")
def handle():
    shared_ray()
    try:
        serve.start(proxy_location="Disabled")
        config = ClusterConfig.model_validate({
            "engine": {"block_size": BLOCK_SIZE, "num_kv_blocks": NUM_KV_BLOCKS, "max_model_len": MAX_MODEL_LEN,
                       "max_num_batched_tokens": 256, "max_num_seqs": 16, "max_waiting_requests": 64},
            "replicas": {"num_replicas": 2, "num_cpus": 1},
            # Generous, so a snapshot delayed on a busy shared machine never sends a request
            # down the stale-load fallback.
            "router": {"staleness_s": 5.0},
            "ports": {"metrics": METRICS_BASE_PORT, "replica_grpc": REPLICA_GRPC_BASE_PORT},
        })
        yield serve.run(build_llm_replica(config), name=APP_NAME, route_prefix=None)
    finally:
        serve.shutdown()


def router_of(handle) -> HeadroomRouter:
    """The HeadroomRouter inside this process's handle (Ray Serve internals; test-only)."""
    return handle._router._asyncio_router.request_router.headroom


async def generate(handle, request: GenerationRequest) -> tuple[str, int]:
    """(replica that served it, prompt tokens it found in its prefix cache)."""
    served = [pair async for pair in generate_stream(handle, request)]
    replica_id, last = served[-1]
    assert last.finish_reason == "length"
    return replica_id, last.num_cached_tokens


async def eventually(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_a_shared_prefix_goes_to_its_holder_until_the_holders_committed_kv_is_full(handle):
    async def scenario() -> None:
        await generate(handle, shared_prefix_request(0))  # the handle builds its router lazily
        router = router_of(handle)
        await eventually(lambda: len(router.loads.replica_ids) == 2 and all(
            router.loads.get(r).load is not None and router.cache_index.get(r) is not None
            for r in router.loads.replica_ids), "both replicas' loads and KV events")
        prefix_hashes = block_hashes(PREFIX, BLOCK_SIZE)

        def holders() -> list[str]:
            return [r for r in router.loads.replica_ids if router.cache_index.get(r) is not None
                    and router.cache_index.get(r).leading_blocks(prefix_hashes) == len(prefix_hashes)]

        await eventually(lambda: holders(), "the prefix in the router's index")
        (holder,) = holders()
        (other,) = router.loads.replica_ids - {holder}

        # 1. Follow-ups sharing the prefix land on its holder and hit its cache.
        for suffix in range(1, 5):
            replica_id, cached_tokens = await generate(handle, shared_prefix_request(suffix))
            assert replica_id == holder and cached_tokens >= len(PREFIX)
        # A constrained follow-up routes the same (issue 22): the prompt, not the grammar, is the key.
        constrained = shared_prefix_request(9, StructuredOutput("regex", "[a-z]{20}"))
        assert constrained.routing_request() == shared_prefix_request(9).routing_request()
        replica_id, cached_tokens = await generate(handle, constrained)
        assert replica_id == holder and cached_tokens >= len(PREFIX)
        hits_before = router.metrics.sample("headroom_router_prefix_hit_tokens_total", replica=holder)
        assert hits_before >= 5 * len(PREFIX)

        # 2. Fill the holder's committed KV with long decodes sent to it directly, past the router.
        fillers = [generate_on_replica(APP_NAME, holder, FILLER) for _ in range(2)]
        try:
            await eventually(lambda: full(router, holder), "the holder's committed KV to fill the pool")
            decided_before = router.metrics.decisions(holder)
            served = [await generate(handle, shared_prefix_request(suffix)) for suffix in range(5, 8)]
            still_full = full(router, holder)
        finally:
            for filler in fillers:
                ray.cancel(filler)
        assert still_full, "the fillers ended before the probes were routed; the test proves nothing"
        assert [replica_id for replica_id, _ in served] == [other] * 3
        assert router.metrics.decisions(holder) == decided_before
        # The first probe spilled away from the holder; the prefix then spread with it, so the
        # other replica served the later ones from its own cache.
        assert router.metrics.sample("headroom_router_prefix_spills_total", replica=other) >= 1
        assert served[-1][1] >= len(PREFIX)

    asyncio.run(scenario())


def full(router: HeadroomRouter, replica_id: str) -> bool:
    """Whether the replica's latest load leaves no unpromised room for even one block."""
    load = router.loads.get(replica_id).load
    return load.headroom_tokens - load.kv_committed_tokens < BLOCK_SIZE
