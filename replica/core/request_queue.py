"""Waiting queues: FCFS (a deque; preempted requests go back to the front), priority
(a heap on (priority, arrival time), where a preempted request's early arrival puts it back
ahead of later arrivals of its priority) and SLO (by urgency, which moves with the clock).

`reorder()` tells a queue that time has moved; only the SLO queue's order depends on it."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable, Iterator, Optional

from replica.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def reorder(self) -> None:
        pass


class PriorityQueue:
    """A heap; a removed request's entry stays in it, skipped when it reaches the top (a burst
    of n aborts re-heapified the queue n times: 4,096 waiting requests aborted held the busy
    loop 0.6 s)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()
        self._live: dict[int, int] = {}  # id(request) -> the tiebreak of its entry in the heap

    def add(self, request: Request) -> None:
        tiebreak = next(self._tiebreak)
        heapq.heappush(self._heap, (request.priority, request.arrival_time, tiebreak, request))
        self._live[id(request)] = tiebreak

    add_front = add  # ordering is by (priority, arrival); a preempted request keeps its arrival

    def _top(self) -> tuple[int, float, int, Request]:
        heap, live = self._heap, self._live
        while live.get(id(heap[0][3])) != heap[0][2]:  # removed (or added again since)
            heapq.heappop(heap)
        return heap[0]

    def peek(self) -> Request:
        return self._top()[3]

    def pop(self) -> Request:
        self._top()
        request = heapq.heappop(self._heap)[3]
        del self._live[id(request)]
        return request

    def remove(self, request: Request) -> None:
        if self._live.pop(id(request), None) is None:
            raise ValueError("request not in the queue")
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly removed entries: rebuilt once in a while
            live = self._live
            self._heap = [entry for entry in self._heap if live.get(id(entry[3])) == entry[2]]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        live = self._live
        return (entry[3] for entry in sorted(self._heap) if live.get(id(entry[3])) == entry[2])

    def reorder(self) -> None:
        pass


class SLOQueue:
    """Most urgent first (replica.core.slo.urgency), ties by arrival. Urgency moves with the clock,
    so the order is recomputed by `reorder()`, once per step: O(n log n) over the waiting
    requests, which is cheap next to a forward pass.

    A preempted request that has streamed output goes first, oldest first, as fcfs puts it back
    at the head: its TTFT deadline is behind it (met or missed), and ranked by it the request
    sank below every new arrival and, under a steady stream of them, never resumed its stream.

    Doomed requests sink below every rescuable one, so under a sustained overload they would
    wait for as long as rescuable ones keep arriving. The bound (`doomed_max_wait_ms`, off when
    None): a request past its TTFT deadline that has waited that long since it arrived is
    overdue, and the oldest overdue request goes first, ahead of rescuable ones, for at most
    `doomed_share` of the admissions (each admission earns that share of a credit, at most one
    banked, and an overdue request that goes first spends one), so the rescuable ones keep the
    rest. The bound is a wait, not a multiple of the SLO: under tight SLOs (tens to hundreds of
    ms) a multiple promotes most doomed requests at once and gives the goodput away.
    """

    def __init__(self, urgency_of: Callable[[Request, float], float], clock: Callable[[], float],
                 doomed_max_wait_ms: Optional[float] = None, doomed_share: float = 1.0):
        self._urgency_of = urgency_of
        self._clock = clock
        self._requests: list[Request] = []
        self._sorted = True
        self._doomed_max_wait_s = None if doomed_max_wait_ms is None else doomed_max_wait_ms / 1000.0
        self._doomed_share = doomed_share
        self._credit = 1.0  # overdue requests that may go first now (each costs 1)
        self._promoted: Optional[Request] = None  # the overdue request put first by the last ordering

    def add(self, request: Request) -> None:
        self._requests.append(request)
        self._sorted = False

    add_front = add  # ordering is by urgency, and a preempted stream's by its arrival, ahead (_ordered)

    def reorder(self) -> None:
        self._sorted = False

    def _overdue(self, request: Request, now: float) -> bool:
        deadline = request.ttft_deadline
        return (deadline is not None and request.num_output_tokens == 0 and now >= deadline
                and now - request.arrival_time >= self._doomed_max_wait_s)

    def _ordered(self) -> list[Request]:
        if not self._sorted:
            now = self._clock()
            self._requests.sort(key=lambda r: (r.num_output_tokens == 0,
                                               -self._urgency_of(r, now) if r.num_output_tokens == 0 else 0.0,
                                               r.arrival_time))
            self._promoted = None
            if self._doomed_max_wait_s is not None and self._credit >= 1.0:
                oldest = min((r for r in self._requests if self._overdue(r, now)),
                             key=lambda r: r.arrival_time, default=None)
                if oldest is not None:
                    self._requests.remove(oldest)
                    self._requests.insert(0, oldest)
                    self._promoted = oldest
            self._sorted = True
        return self._requests

    def peek(self) -> Request:
        return self._ordered()[0]

    def pop(self) -> Request:
        request = self._ordered().pop(0)
        if self._doomed_max_wait_s is not None:
            had_credit = self._credit >= 1.0
            self._credit += self._doomed_share
            if request is self._promoted:
                self._credit -= 1.0
                self._promoted = None
                self._sorted = False  # the next overdue one, if its credit is there
            self._credit = min(self._credit, 1.0)
            if self._credit >= 1.0 and not had_credit:
                self._sorted = False  # an overdue one may go first again
        return request

    def remove(self, request: Request) -> None:
        self._requests.remove(request)
        if request is self._promoted:
            self._promoted = None
            self._sorted = False

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._ordered())


def make_waiting_queue(policy: str, urgency_of: Optional[Callable[[Request, float], float]] = None,
                       clock: Optional[Callable[[], float]] = None, doomed_max_wait_ms: Optional[float] = None,
                       doomed_share: float = 1.0):
    """urgency_of(request, now) and clock: required for the "slo" policy; the doomed bound is
    its (SLOQueue)."""
    if policy == "slo":
        return SLOQueue(urgency_of, clock, doomed_max_wait_ms, doomed_share)
    return PriorityQueue() if policy == "priority" else FCFSQueue()
