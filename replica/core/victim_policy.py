"""Victim policies: which running request gives up its KV blocks when an allocation fails.

- fcfs: the most recently admitted (vLLM's choice);
- priority: the lowest priority (largest value), then the latest arrival;
- cheapest: the one cheapest to rebuild, i.e. with the fewest computed tokens that are not
  covered by prefix blocks other live requests hold (those survive the preemption), the
  most recently admitted among equals (seniority protects older requests).
"""

from __future__ import annotations

from typing import Callable

from replica.core.kv_cache_manager import KVCacheManager
from replica.core.request import Request

VictimSelector = Callable[[list[Request], KVCacheManager], int]


def fcfs_victim(running: list[Request], kv_cache: KVCacheManager) -> int:
    return len(running) - 1


def priority_victim(running: list[Request], kv_cache: KVCacheManager) -> int:
    return max(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time, i))


def cheapest_victim(running: list[Request], kv_cache: KVCacheManager) -> int:
    # min over (cost, -index): equal costs go to the latest admitted (highest index).
    return min(range(len(running)), key=lambda i: (kv_cache.rebuild_cost(running[i]), -i))


VICTIM_POLICIES: dict[str, VictimSelector] = {
    "fcfs": fcfs_victim,
    "priority": priority_victim,
    "cheapest": cheapest_victim,
}
