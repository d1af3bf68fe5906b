"""A HeadroomRouter over given load snapshots, with no replica behind it: for decisions that
depend on what the loads and the index say, not on the streams that deliver them."""

from __future__ import annotations

import random
from typing import Mapping

from protos import headroom_pb2 as pb
from router.headroom_router import HeadroomRouter
from router.load_subscriber import LoadSubscription

NOW = 10.0


def router_over(loads: Mapping[str, pb.ReplicaLoad], policy: str = "headroom") -> HeadroomRouter:
    """A router whose subscriptions hold `loads` (each given its replica id and seq 1), fresh."""
    router = HeadroomRouter(policy, rng=random.Random(0), clock=lambda: NOW, wall_clock=lambda: NOW)
    for replica_id, load in loads.items():
        subscription = LoadSubscription(replica_id, "unused:1", clock=lambda: NOW)
        subscription.load = pb.ReplicaLoad(replica_id=replica_id, seq=1)
        subscription.load.MergeFrom(load)
        subscription.received_at = NOW
        router.loads._subscriptions[replica_id] = subscription
    return router
