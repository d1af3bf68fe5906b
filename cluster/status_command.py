"""`headroom status`: every engine replica of a running cluster with its live load (KV headroom
and usage, preemption rate, running and waiting requests), read from the load endpoint each
replica announces to the routers, with the cluster token it reads from Ray as the routers do
(joining the Ray cluster is what entitles it); then, per application, the replicas running
against the count its autoscaling policy wants (and why) and those draining.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import grpc
import ray
from ray.serve.exceptions import RayServeException
from rich.console import Console
from rich.table import Table

from cluster.autoscaling import decision_changes, latest_decision
from cluster.deployment import ReplicaCounts, replica_counts, routing_stats, running_replicas
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.server.auth import authorization_metadata
from router.cluster_token import cluster_token
from router.serve_router import LOAD_ENDPOINT_STAT

LOAD_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ReplicaStatus:
    application: str
    replica_id: str
    node_ip: str
    load_endpoint: Optional[str]
    load: Optional[pb.ReplicaLoad]  # None when the replica could not be reached
    error: Optional[str] = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: %(default)s, the local one)")


def connect(address: str) -> None:
    """Joins a running Ray cluster as a driver (a no-op when already connected)."""
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as `headroom serve` starts it
        ray.init(address=address, include_dashboard=False, log_to_driver=False)


def replica_statuses() -> list[ReplicaStatus]:
    """Every running LLMReplica of every application, with its load now (needs Ray connected
    and Serve running). The endpoints come from the replicas' own routing stats: the one
    place they are announced."""
    metadata = authorization_metadata(cluster_token())
    return [_status_of(app_name, replica, metadata) for app_name, replica in running_replicas()]


def _status_of(app_name: str, replica: dict, metadata: tuple[tuple[str, str], ...]) -> ReplicaStatus:
    replica_id, node_ip = replica["replica_id"], replica.get("node_ip") or "?"
    try:
        endpoint = routing_stats(replica).get(LOAD_ENDPOINT_STAT)
    except Exception as error:  # the replica died between the listing and now
        return ReplicaStatus(app_name, replica_id, node_ip, None, None, f"unreachable: {error}")
    if endpoint is None:
        return ReplicaStatus(app_name, replica_id, node_ip, None, None, "no load endpoint announced yet")
    try:
        with grpc.insecure_channel(endpoint) as channel:
            load = pb_grpc.LoadReporterStub(channel).GetLoad(pb.LoadRequest(), metadata=metadata,
                                                             timeout=LOAD_TIMEOUT_S)
    except grpc.RpcError as error:
        return ReplicaStatus(app_name, replica_id, node_ip, endpoint, None, f"{error.code().name}: {error.details()}")
    return ReplicaStatus(app_name, replica_id, node_ip, endpoint, load)


def scale_lines(counts: dict[str, ReplicaCounts], decisions: dict[str, Optional[dict]],
                changes: dict[str, list[dict]]) -> list[str]:
    """Per application: replicas running against what the autoscaling policy wants, and why;
    and the policy's last change of the count."""
    lines = []
    for app_name, count in counts.items():
        line = f"{app_name}: {count.running} replicas running"
        decision = decisions.get(app_name)
        if not count.autoscaling:
            line += f" of {count.target} (fixed)"
        elif decision is None:
            line += f", Serve's target {count.target} (autoscaling: no decision published yet)"
        else:
            line += (f", desired {decision['desired_replicas']} ({decision['policy']} policy: {decision['reason']}), "
                     f"Serve's target {count.target}")
            if changes.get(app_name):
                change = changes[app_name][-1]
                line += (f"; last change to {change['desired_replicas']} ({change['reason']}) "
                         f"{time.time() - change['timestamp']:.0f} s ago")
        if count.draining:
            line += f", {count.draining} draining"
        lines.append(line)
    return lines


def status_table(statuses: list[ReplicaStatus]) -> Table:
    table = Table(title="headroom replicas")
    for column in ("application", "replica", "node"):
        table.add_column(column, no_wrap=True)
    for column in ("KV headroom (tokens)", "KV usage", "preemptions/s", "running", "waiting"):
        table.add_column(column, justify="right")
    for status in statuses:
        load = status.load
        if load is None:
            table.add_row(status.application, status.replica_id, status.node_ip, status.error or "?", "", "", "", "")
            continue
        table.add_row(
            status.application, status.replica_id, status.node_ip, str(load.headroom_tokens),
            f"{load.kv_usage:.1%}", f"{load.preemption_rate:.2f}", str(load.num_running), str(load.num_waiting),
        )
    return table


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        connect(args.address)
        statuses = replica_statuses()
        counts = replica_counts()
        decisions = {app_name: latest_decision(app_name) for app_name, count in counts.items() if count.autoscaling}
        changes = {app_name: decision_changes(app_name) for app_name in decisions}
    except (ConnectionError, RuntimeError, RayServeException) as error:
        print(f"headroom status: no running cluster at {args.address}: {error}", file=sys.stderr)
        return 1
    if not statuses:
        print("headroom status: Serve runs no LLMReplica", file=sys.stderr)
        return 1
    # Piped output gets room for the whole table rather than rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(status_table(statuses))
    for line in scale_lines(counts, decisions, changes):
        console.print(line)
    return 0
