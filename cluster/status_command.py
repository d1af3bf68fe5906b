"""`headroom status`: every engine replica of a running cluster with its live load (KV headroom
net of the KV its live requests are owed, as the router scores it, and gross; KV usage,
preemption rate, running and waiting requests), read from the load endpoint each
replica announces to the routers, with the cluster token it reads from Ray as the routers do
(joining the Ray cluster is what entitles it); then, per application, the replicas running
against the count its autoscaling policy wants (and why), the pressure floor holding it if one
is in force, and those draining, and what the
public gRPC door (Serve's gRPC proxy) answers a client: open, requires an API key, accepts or
refuses the one given (--api-key, else $HEADROOM_API_KEY), as a client outside would see it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Optional

import grpc
import ray
from ray.serve.exceptions import RayServeException
from rich.console import Console
from rich.table import Table

from ray.serve.context import _get_global_client

from cluster.autoscaling import decision_changes, latest_decision
from cluster.deployment import ReplicaCounts, replica_counts, routing_stats, running_replicas
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from replica.server.auth import (
    CredentialsError, add_client_api_key_argument, authorization_metadata, client_api_key,
)
from router.cluster_token import cluster_token
from router.serve_router import LOAD_ENDPOINT_STAT

LOAD_TIMEOUT_S = 5.0
DOOR_TIMEOUT_S = 10.0


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
    add_client_api_key_argument(parser, "check that the cluster's gRPC door accepts this API key")


def connect(address: str) -> None:
    """Joins a running Ray cluster as a driver (a no-op when already connected)."""
    if not ray.is_initialized():
        # With Ray's token auth, as `headroom serve` starts it: the token from ~/.ray/auth_token.
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


def grpc_door_address() -> Optional[str]:
    """Where a client reaches Serve's gRPC proxy from here: on loopback when one runs on this
    node (Serve binds it to every interface), else on the first healthy one's node; None when
    Serve runs none."""
    details = _get_global_client().get_serve_details()
    grpc_options = details.get("grpc_options") or {}
    proxies = [proxy for proxy in (details.get("proxies") or {}).values() if proxy.get("status") == "HEALTHY"]
    if not grpc_options.get("grpc_servicer_functions") or not proxies:
        return None
    port = grpc_options["port"]
    here = ray.util.get_node_ip_address()
    if any(proxy.get("node_ip") == here for proxy in proxies):
        return f"127.0.0.1:{port}"
    return f"{proxies[0]['node_ip']}:{port}"


def door_line(app_name: str, address: Optional[str], api_key: Optional[str]) -> str:
    """What the gRPC door answers a client of `app_name`, in words: first without a key (an
    open door serves any key, so that is all there is to say), then with `api_key`."""
    if address is None:
        return f"{app_name}: no gRPC door (Serve runs no gRPC proxy)"
    code, details = _door_answer(app_name, address, None)
    verdict = {grpc.StatusCode.OK: "open: serves clients without an API key"}.get(code)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if api_key is None:
            verdict = "requires an API key (--api-key or $HEADROOM_API_KEY checks one)"
        else:
            code, details = _door_answer(app_name, address, api_key)
            verdict = {grpc.StatusCode.OK: "accepts the API key",
                       grpc.StatusCode.UNAUTHENTICATED: "refuses the API key"}.get(code)
    return f"{app_name}: gRPC door {address} {verdict or f'{code.name}: {details}'}"


def _door_answer(app_name: str, address: str, api_key: Optional[str]) -> tuple[grpc.StatusCode, str]:
    metadata = (("application", app_name),) + authorization_metadata(api_key)
    try:
        with grpc.insecure_channel(address) as channel:
            pb_grpc.GenerationStub(channel).GetModelInfo(pb.ModelInfoRequest(), metadata=metadata,
                                                         timeout=DOOR_TIMEOUT_S)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def scale_lines(counts: dict[str, ReplicaCounts], decisions: dict[str, Optional[dict]],
                changes: dict[str, list[dict]]) -> list[str]:
    """Per application: replicas running against what the autoscaling policy wants, and why;
    the pressure floor that holds it, if any; and the policy's last change of the count."""
    lines = []
    for app_name, count in counts.items():
        line = f"{app_name}: {count.running} replica{'' if count.running == 1 else 's'} running"
        decision = decisions.get(app_name)
        if not count.autoscaling:
            line += f" of {count.target} (fixed)"
        elif decision is None:
            line += f", Serve's target {count.target} (autoscaling: no decision published yet)"
        else:
            line += (f", desired {decision['desired_replicas']} ({decision['policy']} policy: {decision['reason']}), "
                     f"Serve's target {count.target}")
            line += pressure_floor_text(decision)
            if changes.get(app_name):
                change = changes[app_name][-1]
                line += (f"; last change to {change['desired_replicas']} ({change['reason']}) "
                         f"{time.time() - change['timestamp']:.0f} s ago")
        if count.draining:
            line += f", {count.draining} draining"
        lines.append(line)
    return lines


def pressure_floor_text(decision: dict) -> str:
    """The headroom policy's pressure floor in `decision`, if one is in force: its count and what
    holds it (the rest of its delay, or the KV demand it is lifted at); "" without one."""
    floor = decision.get("pressure_floor")
    if not floor:
        return ""
    text = f"; pressure floor {floor} (a scale-down rebounded): "
    if decision.get("pressure_floor_until") is not None:
        return text + (f"held {max(0.0, decision['pressure_floor_until'] - time.time()):.0f} s more, then until "
                       "the KV demand eases by the scale-down band")
    return text + (f"held until the KV demand falls to {decision['pressure_floor_release_tokens']:.0f} tokens "
                   f"(now {decision['kv_demand_tokens']:.0f})")


NET_HEADROOM_COLUMN = "KV headroom net"
GROSS_HEADROOM_COLUMN = "gross"
HEADROOM_CAPTION = (
    "KV headroom in tokens. net: free KV beyond the admission watermark less the growth the replica's live "
    "requests are still owed (kv_committed_tokens), the room the router scores; gross: without that growth"
)


def net_headroom_tokens(load: pb.ReplicaLoad) -> int:
    """The room the router scores a replica by (router/policies.py, HeadroomPolicy.score, before
    its own sends and the request): free tokens beyond the watermark less the committed growth.
    Negative when the live requests are owed more than is free."""
    return load.headroom_tokens - load.kv_committed_tokens


def status_table(statuses: list[ReplicaStatus]) -> Table:
    table = Table(title="headroom replicas", caption=HEADROOM_CAPTION)
    for column in ("application", "replica", "node"):
        table.add_column(column, no_wrap=True)
    for column in (NET_HEADROOM_COLUMN, GROSS_HEADROOM_COLUMN, "KV usage", "preemptions/s", "running", "waiting"):
        table.add_column(column, justify="right")
    for status in statuses:
        load = status.load
        if load is None:
            table.add_row(status.application, status.replica_id, status.node_ip, status.error or "?",
                          "", "", "", "", "")
            continue
        table.add_row(
            status.application, status.replica_id, status.node_ip, str(net_headroom_tokens(load)),
            str(load.headroom_tokens), f"{load.kv_usage:.1%}", f"{load.preemption_rate:.2f}", str(load.num_running),
            str(load.num_waiting),
        )
    return table


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        api_key = client_api_key(args.api_key)
    except CredentialsError as error:
        parser.error(str(error))
    try:
        connect(args.address)
        statuses = replica_statuses()
        counts = replica_counts()
        decisions = {app_name: latest_decision(app_name) for app_name, count in counts.items() if count.autoscaling}
        changes = {app_name: decision_changes(app_name) for app_name in decisions}
        door = grpc_door_address()
    except ValueError as error:  # ray.init's refusal of the address itself: a usage error
        parser.error(f"--address: {error}")
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
    for app_name in counts:  # the error's details are the server's text, not rich markup
        console.print(door_line(app_name, door, api_key), markup=False, highlight=False)
    return 0
