"""The replica-failure test at tensor_parallel_size 2: Serve places each replica's ranks with
one STRICT_PACK placement group, and a worker rank killed under load takes its replica down
as a dead engine (started streams cut with UNAVAILABLE, queued requests retried on the other
replica), after which Serve replaces it."""

from __future__ import annotations

import os
import signal

import pytest

ray = pytest.importorskip("ray")

from tests.cluster.serve_harness import local_cluster, small_config  # noqa: E402
from tests.cluster.test_replica_failure import (  # noqa: E402
    assert_started_streams_cut_and_queued_ones_retried, engine_core_pid, kill_under_load, live_replicas,
)
from tests.replica.test_tensor_parallel import process_gone, tp_worker_pids  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

# Half a CPU per rank: each two-rank replica reserves one of the local cluster's three.
CONFIG = small_config(28900, engine={"max_num_seqs": 2, "tensor_parallel_size": 2}, num_cpus=0.5)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(CONFIG) as config:
        yield config


def test_each_tensor_parallel_replica_runs_in_a_strict_pack_placement_group(cluster):
    replicas = live_replicas(2)
    groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
    assert len([group for group in groups if group["strategy"] == "STRICT_PACK"
                and list(group["bundles"].values()) == [{"CPU": 1.0}]]) == len(replicas) == 2
    for status in replicas:  # each replica's engine core has its one worker rank
        assert len(tp_worker_pids(engine_core_pid(status))) == 1


def test_a_killed_worker_rank_cuts_its_replicas_started_streams_and_serve_replaces_it(cluster):
    live_replicas(2)
    killed = []

    def kill_worker_rank(victim) -> None:
        (worker,) = tp_worker_pids(engine_core_pid(victim))
        killed.append(worker)
        os.kill(worker, signal.SIGKILL)

    victim, results = kill_under_load(cluster, kill_worker_rank)
    assert process_gone(killed[0])  # the probe: the rank really died
    assert_started_streams_cut_and_queued_ones_retried(victim, results, lost="EngineDeadError")
    replicas = live_replicas(2)
    assert victim.replica_id not in {status.replica_id for status in replicas}
