"""`headroom status`'s replica table, without a cluster: its KV headroom is the room the router
scores (net of the KV the replica's live requests are owed), with the gross beside it, each
labelled; the live command against a cluster is in test_e2e."""

from __future__ import annotations

import re

from rich.console import Console

from cluster.status_command import ReplicaStatus, status_table
from protos import headroom_pb2 as pb
from router.inflight import InflightCounts
from router.policies import HeadroomPolicy, ReplicaView, RoutingRequest

BLOCK_SIZE = 16
# 250 blocks free beyond the watermark (4,000 tokens), 2,500 of them owed to the live requests.
LOAD = pb.ReplicaLoad(replica_id="r0", seq=1, block_size=BLOCK_SIZE, kv_blocks_total=1000, kv_blocks_free=250,
                      headroom_tokens=4000, kv_committed_tokens=2500, kv_usage=0.75, preemption_rate=0.5,
                      num_running=7, num_waiting=2, step_time_ms=20.0)


def printed(statuses: list[ReplicaStatus]) -> str:
    console = Console(width=200, record=True)
    console.print(status_table(statuses))
    return console.export_text()


def cells(text: str, replica_id: str) -> list[str]:
    row = next(line for line in text.splitlines() if f" {replica_id} " in line)
    return [cell.strip() for cell in re.split("[│┃]", row)[1:-1]]  # body and header rules


def test_status_shows_the_headroom_the_router_scores_net_of_committed_kv_with_the_gross_beside_it():
    # The router's room before its own sends: a request of no size, sent to an untouched replica.
    room = HeadroomPolicy().score(RoutingRequest(prompt_tokens=0, max_tokens=0),
                                  ReplicaView("r0", LOAD, 0.0, 0, InflightCounts(), 0, BLOCK_SIZE))
    router_room_tokens = round(room.headroom_after * LOAD.kv_blocks_total * BLOCK_SIZE)
    assert router_room_tokens == 1500

    text = printed([ReplicaStatus("llm", "r0", "10.0.0.1", "10.0.0.1:9300", LOAD),
                    ReplicaStatus("llm", "r1", "10.0.0.2", None, None, "no load endpoint announced yet")])
    header = cells(text, "application")
    assert header[3:5] == ["KV headroom net", "gross"]
    assert cells(text, "r0")[3:] == [str(router_room_tokens), "4000", "75.0%", "0.50", "7", "2"]
    assert cells(text, "r1")[3] == "no load endpoint announced yet"
    # The caption says what net means, so an operator does not take it for free memory.
    assert "less the growth the replica's live requests are still owed (kv_committed_tokens)" in " ".join(text.split())
