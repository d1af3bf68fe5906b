"""The autoscaler's Prometheus metrics (headroom_autoscaler_*): each application's ingress
exports its latest decision, as Serve's controller published it on the decision board
(cluster/autoscaling.py), on the /metrics its router is scraped at. Names and help come from
replica.server.metrics.METRIC_NAMES.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from cluster.autoscaling import latest_decision
from replica.server.metrics import METRIC_NAMES

logger = logging.getLogger(__name__)

# A scrape waits at most this long for the board.
BOARD_TIMEOUT_S = 1.0


def _family(name: str) -> GaugeMetricFamily:
    spec = METRIC_NAMES[name]
    return GaugeMetricFamily(name, spec.help, labels=spec.labels)


def decision_families(app_name: str, decision: dict[str, Any]) -> list[Metric]:
    """The autoscaler's gauges for one published decision: one desired-replicas series, under
    the decision's reason (a changed reason replaces the series rather than adding one)."""
    desired = _family("headroom_autoscaler_desired_replicas")
    desired.add_metric([app_name, decision["policy"], decision["reason"]], decision["desired_replicas"])
    running = _family("headroom_autoscaler_running_replicas")
    running.add_metric([app_name], decision["running_replicas"])
    families = [desired, running]
    if decision.get("pressure_floor") is not None:
        floor = _family("headroom_autoscaler_pressure_floor_replicas")
        floor.add_metric([app_name], decision["pressure_floor"])
        families.append(floor)
    if decision["kv_capacity_tokens"] > 0 and decision["running_replicas"] > 0:
        ratio = _family("headroom_autoscaler_kv_demand_ratio")
        ratio.add_metric([app_name], decision["kv_demand_tokens"] /
                         (decision["kv_capacity_tokens"] * decision["running_replicas"]))
        families.append(ratio)
    return families


class AutoscalerCollector:
    """A prometheus_client collector of one application's autoscaler gauges, read from the
    board at each scrape (nothing until the policy first decided)."""

    def __init__(self, app_name: str,
                 read: Callable[[str], Optional[dict[str, Any]]] = lambda app: latest_decision(app, BOARD_TIMEOUT_S)):
        self.app_name = app_name
        self.read = read

    def collect(self) -> Iterator[Metric]:
        try:
            decision = self.read(self.app_name)
        except Exception as error:  # the board is gone or slow: this scrape goes without
            logger.warning("autoscaler decisions of %s unreadable: %s", self.app_name, error)
            return
        if decision is not None:
            yield from decision_families(self.app_name, decision)
