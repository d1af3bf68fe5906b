"""Builds the ReplicaLoad proto the router scores replicas with, from the engine's
SchedulerLoad snapshot (its fields declared proto=True, copied by name), its StepStats and a
smoothed preemption rate (REPORT_FIELDS in replica/core/load.py). GetLoad, WatchLoad and
the Prometheus gauges all read their load from here, so they never disagree.

A report says when the core took its load (`timestamp`) and how old the load was when sent
(`load_age_ms`), not when it was sent: WatchLoad sends the core's latest load again every
interval whether or not the core has stepped since, and a load re-stamped at each send looked
fresh while the core hung and claimed the requests sent since its last step (the router
forgot them, and a burst landed on one replica).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

from protos.headroom_pb2 import ReplicaLoad
from replica.core.outputs import StepStats
from replica.server.preemption_rate import PreemptionRateEstimator
from replica.core.load import PROTO_FIELDS, SchedulerLoad

# A WatchLoad subscriber gets a snapshot at once when free blocks move by more than this
# fraction of the pool: a router scoring on stale headroom would herd requests onto it.
FREE_BLOCKS_CHANGE_FRACTION = 0.05


def is_significant_change(previous: SchedulerLoad, current: SchedulerLoad) -> bool:
    """Whether the router should hear about `current` now rather than at the next interval."""
    if current.preemptions_total != previous.preemptions_total:
        return True
    if current.num_running != previous.num_running or current.num_waiting != previous.num_waiting:
        return True
    moved_blocks = abs(current.kv_blocks_free - previous.kv_blocks_free)
    return moved_blocks > FREE_BLOCKS_CHANGE_FRACTION * max(current.kv_blocks_total, 1)


class LoadReportBuilder:
    """One replica's ReplicaLoad snapshots: numbered by a shared sequence, stamped with when
    the core took the load (Unix seconds) and its age, with the preemption rate observed from
    every snapshot's counter."""

    def __init__(
        self,
        replica_id: str,
        step_stats: StepStats,
        *,
        monotonic_clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.replica_id = replica_id
        self.step_stats = step_stats
        self.rate_estimator = PreemptionRateEstimator()
        self._monotonic_clock = monotonic_clock
        self._wall_clock = wall_clock
        self._seq = itertools.count(1)

    def build(self, load: SchedulerLoad, *, taken_s_ago: float = 0.0, current: bool = False) -> ReplicaLoad:
        """The ReplicaLoad for `load`, which the core took `taken_s_ago` seconds ago (0: now, as
        the router simulation reads its scheduler); `current`: it still describes the core
        however old (AsyncEngine.load_is_current), so its load_age_ms is 0. Call from one event
        loop (the estimator is not thread-safe)."""
        now = self._monotonic_clock()
        # Observing here (not only on a timer) keeps the rate consistent with the
        # preemptions_total sent beside it.
        self.rate_estimator.observe(load.preemptions_total, now)
        taken_s_ago = max(taken_s_ago, 0.0)
        return ReplicaLoad(
            replica_id=self.replica_id,
            seq=next(self._seq),
            timestamp=self._wall_clock() - taken_s_ago,
            load_age_ms=0.0 if current else taken_s_ago * 1000.0,
            preemption_rate=self.rate_estimator.rate(now),
            preemption_rate_per_running=self.rate_estimator.rate_per_running(now, load.num_running),
            step_time_ms=self.step_stats.step_time_s * 1000.0,
            generation_tokens_per_s=self.step_stats.generation_tokens_per_s,
            **{name: getattr(load, name) for name in PROTO_FIELDS},
        )

    def build_for(self, engine) -> ReplicaLoad:
        """The ReplicaLoad of a front's latest load (an AsyncEngine: its load, how long ago it
        arrived from the core, whether it is still current)."""
        return self.build(engine.load(), taken_s_ago=engine.load_age_s(), current=engine.load_is_current())
