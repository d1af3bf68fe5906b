"""The router's Prometheus metrics: decisions per policy and replica, and the age of the load
snapshot each decision scored. Names and help come from replica.metrics.METRIC_NAMES.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from replica.metrics import create_metric


class RouterMetrics:
    """One router instance's metrics in a registry of its own: Ray Serve may run several
    routers in one process (one per deployment handle), and a shared registry would refuse
    their second registration of the same names."""

    def __init__(self, policy: str, registry: CollectorRegistry | None = None):
        self.policy = policy
        self.registry = registry if registry is not None else CollectorRegistry()
        self._decisions = create_metric("headroom_router_decisions_total", self.registry)
        self._load_age = create_metric("headroom_router_load_age_seconds", self.registry)

    def decided(self, replica_id: str) -> None:
        self._decisions.labels(self.policy, replica_id).inc()

    def observe_load_age(self, replica_id: str, age_s: float) -> None:
        self._load_age.labels(replica_id).observe(age_s)

    def remove_replica(self, replica_id: str) -> None:
        """Drop a gone replica's series so dashboards stop showing it."""
        for metric, labels in ((self._decisions, (self.policy, replica_id)), (self._load_age, (replica_id,))):
            try:
                metric.remove(*labels)
            except KeyError:  # never decided for, or never scored
                pass

    def decisions(self, replica_id: str) -> float:
        """Decisions for `replica_id` so far (what a scrape would read)."""
        value = self.registry.get_sample_value(
            "headroom_router_decisions_total", {"policy": self.policy, "replica": replica_id}
        )
        return value or 0.0
