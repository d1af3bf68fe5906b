"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), each with room for exactly one
replica: Serve places a replica on each, the routers on the head reach both load endpoints,
and requests through the gRPC proxy are served from both nodes.
"""

from __future__ import annotations

import collections
import concurrent.futures

import grpc
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.serve.context import _get_global_client  # noqa: E402

from cluster import status_command  # noqa: E402
from cluster.deployment import DEPLOYMENT_NAME  # noqa: E402
from cluster.serve_command import start_applications  # noqa: E402
from tests.cluster.serve_harness import (  # noqa: E402
    APP_NAME, enable_local_ray, generate_request, release_shared_ray, grpc_target, small_config, stream_generate,
)

pytestmark = pytest.mark.timeout(300)

CPUS_PER_NODE = 2
# Every replica takes a whole node's CPUs, so two replicas need both nodes. The proxies stay
# on the head: on one machine a proxy per node would contend for the same ports.
CONFIG = small_config(28500, num_cpus=CPUS_PER_NODE, proxy_location="HeadOnly")


def start_nodes() -> Cluster:
    """The two nodes, the head without a dashboard (nothing here reads it; one process less to start).
    Ray gives a node 30 s to register with its GCS and the GCS 30 s to publish its port; on a
    loaded two-core machine either can elapse (2 of 5 full-suite runs beside other jobs, never
    alone), so a start that fails is torn down and tried once more (a real fault fails both)."""
    for attempt in (1, 2):
        nodes = Cluster()
        try:
            nodes.add_node(num_cpus=CPUS_PER_NODE, include_dashboard=False)
            nodes.add_node(num_cpus=CPUS_PER_NODE)
            nodes.wait_for_nodes()
            return nodes
        except Exception:  # noqa: BLE001 - Ray raises a bare Exception (or its extension's error) for a timeout
            nodes.shutdown()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster():
    release_shared_ray()  # a Ray of its own, two nodes
    enable_local_ray()
    nodes = start_nodes()
    try:
        ray.init(address=nodes.address, log_to_driver=False)
        start_applications(CONFIG)
        yield nodes
    finally:
        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()


def replica_nodes() -> dict[str, str]:
    """Node id of every running LLMReplica, by replica id (from Serve's controller)."""
    deployment = _get_global_client().get_serve_details()["applications"][APP_NAME]["deployments"][DEPLOYMENT_NAME]
    return {replica["replica_id"]: replica["node_id"] for replica in deployment["replicas"]
            if replica["state"] == "RUNNING"}


def test_one_replica_is_placed_on_each_node(cluster):
    nodes = replica_nodes()
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2 and set(nodes.values()) == alive


def test_requests_through_the_proxy_are_served_from_both_nodes(cluster):
    # Up to three bursts of 12: on a loaded machine the router may not yet hold the second
    # replica's first load report when the first burst arrives (seen once in a full-suite run:
    # all 12 on one node); a node that never serves fails every burst.
    served_by_node: collections.Counter = collections.Counter()
    with grpc.insecure_channel(grpc_target(CONFIG)) as channel:
        for _ in range(3):
            with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
                results = list(pool.map(lambda _: stream_generate(channel, generate_request(24)), range(12)))
            assert all(result.code == grpc.StatusCode.OK and result.num_tokens == 24 for result in results)
            nodes = replica_nodes()
            served_by_node = collections.Counter(nodes[result.replica_id] for result in results)
            if len(served_by_node) == 2:
                break
    assert len(served_by_node) == 2, served_by_node


def test_status_reads_the_load_of_the_replica_on_each_node(cluster):
    statuses = status_command.replica_statuses()
    assert {status.replica_id for status in statuses} == set(replica_nodes())
    assert all(status.load is not None and status.load.kv_blocks_total > 0 for status in statuses)
