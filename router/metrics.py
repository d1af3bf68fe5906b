"""The router's Prometheus metrics: decisions per policy and replica, and the age of the load
snapshot each decision scored; one /metrics per process serves every router in it. Names and
help come from replica.metrics.METRIC_NAMES.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterator
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from replica.metrics import create_metric


class _ProcessRouters:
    """A collector over the registries of every live RouterMetrics in this process. Ray Serve
    creates routers lazily, inside handles, so they cannot be handed to an exporter; they
    enlist here instead. A process holds one router per deployment it calls and replica ids
    are unique, so routers in one process never share a series."""

    def __init__(self) -> None:
        self._registries: "weakref.WeakSet[CollectorRegistry]" = weakref.WeakSet()

    def add(self, registry: CollectorRegistry) -> None:
        self._registries.add(registry)

    def collect(self) -> Iterator[Metric]:
        # One family per name: an exposition may describe a metric only once.
        families: dict[str, Metric] = {}
        for registry in list(self._registries):
            for family in registry.collect():  # fresh objects on every collect
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


_PROCESS_ROUTERS = _ProcessRouters()
# auto_describe=False: the set of routers (and so of names) changes after registration.
PROCESS_ROUTER_REGISTRY = CollectorRegistry(auto_describe=False)
PROCESS_ROUTER_REGISTRY.register(_PROCESS_ROUTERS)


def start_http_server(port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
    """Serves every router of this process (present and future) on http://addr:port/metrics
    from a daemon thread; `server.shutdown()` stops it."""
    return prometheus_client.start_http_server(port, addr, registry=PROCESS_ROUTER_REGISTRY)


class RouterMetrics:
    """One router instance's metrics in a registry of its own: Ray Serve may run several
    routers in one process (one per deployment handle), and a shared registry would refuse
    their second registration of the same names."""

    def __init__(self, policy: str, registry: CollectorRegistry | None = None):
        self.policy = policy
        self.registry = registry if registry is not None else CollectorRegistry()
        self._decisions = create_metric("headroom_router_decisions_total", self.registry)
        self._load_age = create_metric("headroom_router_load_age_seconds", self.registry)
        _PROCESS_ROUTERS.add(self.registry)

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
