"""Herd avoidance: what this router has sent to each replica that the replica's latest load
snapshot cannot show yet. Policies add it to the snapshot, so a burst between two snapshots
spreads out instead of landing on the replica that looked best at the last one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Optional


@dataclass(frozen=True)
class InflightCounts:
    """Requests sent since a replica's snapshot: the KV blocks of their full sequences (less
    the prefix the replica caches, which they share) and the prompt tokens they must prefill."""

    requests: int = 0
    blocks: int = 0
    prefill_tokens: int = 0

    @classmethod
    def one_send(cls, sequence_blocks: int, prompt_tokens: int, cached_blocks: int, block_size: int,
                 device_blocks: Optional[int] = None) -> "InflightCounts":
        """One request of `sequence_blocks` (prompt + max_tokens) sent where `cached_blocks`
        of its prompt are cached (saving their prefill), `device_blocks` of them on the device
        (saving their memory; None: all of them)."""
        cached_tokens = min(cached_blocks * block_size, prompt_tokens)
        shared_blocks = cached_blocks if device_blocks is None else device_blocks
        return cls(1, max(0, sequence_blocks - shared_blocks), prompt_tokens - cached_tokens)


@dataclass(slots=True)
class _Send:
    sent_at: float
    blocks: int
    prefill_tokens: int
    pending: bool = True  # the request has not ended (an ended one counts neither as a request nor as prefill)


class InflightTracker:
    """Per replica, the sends newer than the replica's latest snapshot, and the ends of requests
    (sent whenever) that the snapshot cannot show yet.

    A snapshot with a higher `seq` than any seen covers every send made at or before the
    moment the engine core took it (`ReplicaLoad.timestamp`: not when it was sent, since a
    replica sends its core's latest load again while the core has not stepped), so those are
    forgotten; sends after it stay counted. With snapshots that arrive at once this is "reset
    on each new snapshot"; with delayed ones, or a load sent again, it keeps counting what the
    old snapshot still misses. Sends are stamped in Unix seconds on the router's clock and
    snapshots on the replica's (virtual seconds in the simulation); clock skew between hosts
    only matters when it approaches the report interval (100 ms).

    A request that ended after the snapshot was taken (`record_ended` with the key its send was
    recorded under: the router sees its end on the response path, however late the replica's
    reports are) freed its KV there: its
    blocks are credited back (`counts().blocks` may go negative: room the snapshot does not
    show), and if it was sent after the snapshot it no longer counts as a request or as
    prefill to do. With reports 500 ms late the snapshot's room was 0.115 of a pool too low
    on mixed_long, nearly all of it the KV of requests that had ended since (bench notes).
    """

    # A replica that never reports would otherwise accumulate sends forever; policies stop
    # trusting its snapshot after a second anyway, so a minute of history is plenty.
    FORGET_AFTER_S = 60.0

    def __init__(self) -> None:
        self._sends: dict[str, deque[_Send]] = {}
        self._ends: dict[str, deque[tuple[float, int]]] = {}  # replica -> (ended_at, blocks freed)
        self._pending: dict[Hashable, tuple[str, _Send]] = {}  # request key -> its replica and send, until it ends
        self._latest_seq: dict[str, int] = {}

    def record_sent(self, replica_id: str, blocks: int, now: float, prefill_tokens: int = 0,
                    request_key: Optional[Hashable] = None) -> None:
        """Counts a send; with `request_key`, record_ended(request_key) credits its end."""
        sends = self._sends.setdefault(replica_id, deque())
        send = _Send(now, blocks, prefill_tokens)
        sends.append(send)
        while sends[0].sent_at < now - self.FORGET_AFTER_S:
            sends.popleft()
        if request_key is not None:
            self._pending[request_key] = (replica_id, send)

    def record_ended(self, request_key: Hashable, now: float) -> None:
        """The request sent under `request_key` ended at `now` (nothing for a key not pending):
        every snapshot taken before that still holds its KV, so its blocks count as freed until
        one taken after it arrives; if the send is itself newer than the snapshot, its request
        and prefill stop counting (its blocks stay, which the credit cancels)."""
        pending = self._pending.pop(request_key, None)
        if pending is None:
            return
        replica_id, send = pending
        send.pending, send.prefill_tokens = False, 0
        ends = self._ends.setdefault(replica_id, deque())
        ends.append((now, send.blocks))
        while ends[0][0] < now - self.FORGET_AFTER_S:
            ends.popleft()

    def observe_snapshot(self, replica_id: str, seq: int, taken_at: float) -> bool:
        """Forget the sends the snapshot covers. Returns False (and changes nothing) for a
        snapshot no newer than one already seen: a reordered or duplicated report."""
        if seq <= self._latest_seq.get(replica_id, -1):
            return False
        self._latest_seq[replica_id] = seq
        sends = self._sends.get(replica_id)
        while sends and sends[0].sent_at <= taken_at:
            sends.popleft()
        ends = self._ends.get(replica_id)
        while ends and ends[0][0] <= taken_at:
            ends.popleft()
        return True

    def counts(self, replica_id: str) -> InflightCounts:
        sends = self._sends.get(replica_id) or ()
        ends = self._ends.get(replica_id) or ()
        if not sends and not ends:
            return InflightCounts()
        return InflightCounts(requests=sum(send.pending for send in sends),
                              blocks=sum(send.blocks for send in sends) - sum(blocks for _, blocks in ends),
                              prefill_tokens=sum(send.prefill_tokens for send in sends))

    def remove_replica(self, replica_id: str) -> None:
        """Drops a dead or removed replica's bookkeeping; a new replica under the same id starts afresh."""
        self._sends.pop(replica_id, None)
        self._ends.pop(replica_id, None)
        for key in [key for key, (owner, _) in self._pending.items() if owner == replica_id]:
            del self._pending[key]
        self._latest_seq.pop(replica_id, None)
