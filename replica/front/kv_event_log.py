"""The replica's published KV events: each batch the engine hands out (once per step) gets the
next sequence number; a mirror of the prefix-cache index answers snapshots without touching
the engine; a bounded window of recent batches lets every subscriber stream from its own
position, and one that falls out of the window resynchronizes from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from replica.core.kv_events import ALL_BLOCKS_CLEARED, KVEvent, KVEventKind, medium_of, stored

# Batches kept for subscribers that are behind; one per engine step with cache changes, so
# about 10 s at 100 steps/s. A subscriber further behind gets a snapshot instead.
RECENT_BATCHES = 1024
# A snapshot of up to this many cached blocks is built on the event loop (about a millisecond);
# a larger one on a worker thread, which reads the mirror itself: built on the loop, a snapshot
# of 262,144 blocks held it, every stream and admission on it, 65-90 ms, and a copy of the
# mirror for the thread still held it 10-19 ms at 300,000 blocks. Subscribers that resync at once (routers restarting, a replica
# restarting under several routers) share one such build: each building its own cost N x the
# CPU and memory of a snapshot.
INLINE_SNAPSHOT_MAX_BLOCKS = 16384


@dataclass(frozen=True)
class KVEventBatch:
    """Events in order. A snapshot (`snapshot=True`) starts with ALL_BLOCKS_CLEARED and stores
    every cached block: applying it gives the index as of `seq`, whatever came before."""

    seq: int
    events: tuple[KVEvent, ...]
    snapshot: bool = False


class KVEventLog:
    """Single writer (the engine loop, after each step); any number of asyncio readers."""

    def __init__(self, recent_batches: int = RECENT_BATCHES):
        self.seq = 0  # of the latest batch; 0 before the first
        # (cached block hash, its medium) -> parent hash
        self._index: dict[tuple[bytes, int], Optional[bytes]] = {}
        # Worker threads building a snapshot from `_index`: while any does, it is not changed,
        # and the batches published meanwhile wait in `_held` (applied when the last one ends).
        self._readers = 0
        self._held: list[tuple[KVEvent, ...]] = []
        self._recent: deque[KVEventBatch] = deque(maxlen=recent_batches)
        self._published = asyncio.Event()  # replaced on every publish; waiters hold the old one
        # The large snapshot being built on a worker thread, as of its seq: a subscriber that
        # resyncs meanwhile waits for it rather than building its own.
        self._building: Optional[tuple[int, asyncio.Task]] = None
        # The last large snapshot built, for as long as a subscriber still holds it (streaming
        # it): one that resyncs just after it starts from it too.
        self._last_snapshot: Optional[weakref.ref[KVEventBatch]] = None

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index) if not self._held else len(_with_held(self._index, self._held))

    def publish(self, events: Iterable[KVEvent]) -> None:
        events = tuple(events)
        if not events:
            return
        self._apply(events)
        self.seq += 1
        self._recent.append(KVEventBatch(self.seq, events))
        published, self._published = self._published, asyncio.Event()
        published.set()

    def _apply(self, events: tuple[KVEvent, ...]) -> None:
        if self._readers:
            self._held.append(events)
        else:
            _apply_to(self._index, events)

    def snapshot(self) -> KVEventBatch:
        return _snapshot_of(self.seq, self._index, tuple(self._held))

    async def batches_after(self, seq: Optional[int]) -> list[KVEventBatch]:
        """What a subscriber that has applied everything up to `seq` needs next: the newer
        batches in order, or one snapshot if it has nothing yet (None) or is too far behind.
        A large snapshot is built on a worker thread from the mirror as of its `seq` (the
        mirror stays as it is until the thread is done; publishes meanwhile are held): batches
        published meanwhile are newer than it, so the subscriber gets each of them next, once. Subscribers that
        need one meanwhile get the same snapshot (see `_shared_snapshot`)."""
        if seq is not None and seq >= self.seq:
            return []
        recent = self._recent
        if seq is None or not recent or recent[0].seq > seq + 1:
            if len(self._index) <= INLINE_SNAPSHOT_MAX_BLOCKS:
                return [self.snapshot()]
            return [await self._shared_snapshot()]
        return list(itertools.islice(recent, seq + 1 - recent[0].seq, None))

    def _follows(self, snapshot_seq: int) -> bool:
        """Whether a snapshot as of `snapshot_seq` can start a subscriber now: every batch after
        it is still in the window, so the subscriber gets them next rather than another
        snapshot. It is newer than what any subscriber that needs a snapshot has applied (that
        is older than the window's first batch)."""
        return snapshot_seq == self.seq or (bool(self._recent) and self._recent[0].seq <= snapshot_seq + 1)

    async def _shared_snapshot(self) -> KVEventBatch:
        """A large snapshot: the last one built while a subscriber still holds it, else the one
        being built, else a new build, where each still has every batch after it in the window.
        A cancelled waiter leaves the build to the others (shielded); a failed build fails
        its waiters and the next subscriber starts a new one."""
        last = self._last_snapshot() if self._last_snapshot is not None else None
        if last is not None and self._follows(last.seq):
            return last
        building = self._building
        if (building is None or not self._follows(building[0]) or building[1].get_loop() is not asyncio.get_running_loop()
                or (building[1].done() and (building[1].cancelled() or building[1].exception() is not None))):
            loop = asyncio.get_running_loop()
            self._readers += 1  # until the thread is done with the mirror, however the task ends
            task = asyncio.ensure_future(asyncio.to_thread(
                self._read_off_loop, loop, self.seq, self._index, tuple(self._held)))
            building = self._building = (self.seq, task)
            task.add_done_callback(self._built)
        return await asyncio.shield(building[1])

    def _read_off_loop(self, loop: asyncio.AbstractEventLoop, seq: int, index: dict,
                       held: tuple[tuple[KVEvent, ...], ...]) -> KVEventBatch:
        """On a worker thread: the snapshot as of `seq`; tells the loop when it no longer reads
        the mirror."""
        try:
            return _snapshot_of(seq, index, held)
        finally:
            try:
                loop.call_soon_threadsafe(self._reader_done)
            except RuntimeError:  # the loop is closed: nothing publishes any more
                pass

    def _reader_done(self) -> None:
        self._readers -= 1
        if not self._readers:
            for events in self._held:
                _apply_to(self._index, events)
            self._held.clear()

    def _built(self, task: asyncio.Task) -> None:
        if self._building is not None and self._building[1] is task:
            self._building = None
        if not task.cancelled() and task.exception() is None:
            last = self._last_snapshot() if self._last_snapshot is not None else None
            if last is None or last.seq <= task.result().seq:  # builds may end out of order
                self._last_snapshot = weakref.ref(task.result())

    async def wait_for_batch(self, after_seq: Optional[int], timeout: float) -> None:
        """Return once a batch newer than `after_seq` exists, or after `timeout` seconds."""
        if after_seq is None or self.seq > after_seq:
            return
        try:
            await asyncio.wait_for(self._published.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def _apply_to(index: dict[tuple[bytes, int], Optional[bytes]], events: tuple[KVEvent, ...]) -> None:
    for event in events:
        kind = event[0]
        if kind == KVEventKind.BLOCK_STORED:
            index[event[1], medium_of(event)] = event[2]
        elif kind == KVEventKind.BLOCK_REMOVED:
            index.pop((event[1], medium_of(event)), None)
        else:
            index.clear()


def _with_held(index: dict[tuple[bytes, int], Optional[bytes]],
               held: tuple[tuple[KVEvent, ...], ...]) -> dict[tuple[bytes, int], Optional[bytes]]:
    """The mirror as of the latest batch: `index` (unchanged) with the batches held since."""
    index = dict(index)
    for events in held:
        _apply_to(index, events)
    return index


def _snapshot_of(seq: int, index: dict[tuple[bytes, int], Optional[bytes]],
                 held: tuple[tuple[KVEvent, ...], ...] = ()) -> KVEventBatch:
    if held:
        index = _with_held(index, held)
    events = (ALL_BLOCKS_CLEARED,) + tuple(stored(block_hash, parent_hash, medium)
                                           for (block_hash, medium), parent_hash in index.items())
    return KVEventBatch(seq, events, snapshot=True)
