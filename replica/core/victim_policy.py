"""Victim policies: which running request gives up its KV blocks when an allocation fails.

- fcfs: the most recently admitted (vLLM's choice);
- priority: the lowest priority (largest value), then the latest arrival;
- cheapest: the one cheapest to preempt in the preemption mode chosen for it
  (replica/core/preemption_mode.py): recompute costs its computed tokens that are not
  covered by prefix blocks other live requests hold (those survive the preemption), swap
  its blocks' round trip to host memory; the most recently admitted among equals
  (seniority protects older requests).
"""

from __future__ import annotations

from typing import Callable

from replica.core.request import Request

# (running requests in admission order, the cost of preempting one) -> index of the victim
PreemptionCost = Callable[[Request], float]
VictimSelector = Callable[[list[Request], PreemptionCost], int]


def fcfs_victim(running: list[Request], cost: PreemptionCost) -> int:
    return len(running) - 1


def priority_victim(running: list[Request], cost: PreemptionCost) -> int:
    return max(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time, i))


def cheapest_victim(running: list[Request], cost: PreemptionCost) -> int:
    # min over (cost, -index): equal costs go to the latest admitted (highest index).
    return min(range(len(running)), key=lambda i: (cost(running[i]), -i))


VICTIM_POLICIES: dict[str, VictimSelector] = {
    "fcfs": fcfs_victim,
    "priority": priority_victim,
    "cheapest": cheapest_victim,
}
