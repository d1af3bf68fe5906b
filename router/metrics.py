"""The router's Prometheus metrics: decisions per policy and replica, the age of the load
snapshot each decision scored, and the prefix cache as the router sees it (predicted hits,
spills of a hot prefix to other replicas, index size, resyncs); one /metrics per process
serves every router in it. Names and help come from replica.server.metrics.METRIC_NAMES.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterator, Optional
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from replica.server.metrics import METRIC_NAMES, create_metric


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
        self._prefix_hit_tokens = create_metric("headroom_router_prefix_hit_tokens_total", self.registry)
        self._prefix_spills = create_metric("headroom_router_prefix_spills_total", self.registry)
        self._cached_blocks = create_metric("headroom_router_cached_blocks", self.registry)
        self._kv_event_resyncs = create_metric("headroom_router_kv_event_resyncs_total", self.registry)
        _PROCESS_ROUTERS.add(self.registry)

    def decided(self, replica_id: str, cached_tokens: int = 0, spilled: bool = False) -> None:
        """One request sent to `replica_id`, whose cache held `cached_tokens` of its prompt;
        `spilled`: another replica held more of it."""
        self._decisions.labels(self.policy, replica_id).inc()
        if cached_tokens:
            self._prefix_hit_tokens.labels(self.policy, replica_id).inc(cached_tokens)
        if spilled:
            self._prefix_spills.labels(self.policy, replica_id).inc()

    def set_cached_blocks(self, replica_id: str, num_blocks: Optional[int]) -> None:
        """The blocks the router's index holds for the replica; None: it holds no set for it
        (its stream broke, until the next snapshot, or the replica is gone): no series."""
        if num_blocks is not None:
            self._cached_blocks.labels(replica_id).set(num_blocks)
            return
        try:
            self._cached_blocks.remove(replica_id)
        except KeyError:  # never set, or already dropped
            pass

    def kv_event_resynced(self, replica_id: str) -> None:
        self._kv_event_resyncs.labels(replica_id).inc()

    def observe_load_age(self, replica_id: str, age_s: float) -> None:
        self._load_age.labels(replica_id).observe(age_s)

    def remove_replica(self, replica_id: str) -> None:
        """Drop a gone replica's series so dashboards stop showing it."""
        by_policy, by_replica = (self.policy, replica_id), (replica_id,)
        for metric, labels in ((self._decisions, by_policy), (self._prefix_hit_tokens, by_policy),
                               (self._prefix_spills, by_policy), (self._load_age, by_replica),
                               (self._cached_blocks, by_replica), (self._kv_event_resyncs, by_replica)):
            try:
                metric.remove(*labels)
            except KeyError:  # never decided for, or never scored
                pass

    def decisions(self, replica_id: str) -> float:
        """Decisions for `replica_id` so far (what a scrape would read)."""
        return self.sample("headroom_router_decisions_total", replica=replica_id)

    def sample(self, name: str, **labels: str) -> float:
        """A sample's value as a scrape would read it (0 before it exists); `policy` is implied
        for the metrics labelled by it."""
        if "policy" in METRIC_NAMES[name].labels:
            labels = {"policy": self.policy, **labels}
        return self.registry.get_sample_value(name, labels) or 0.0
