"""The messages of one big KV event batch (a snapshot), built once for every WatchKVEvents
stream that sends it at the same time: subscribers resyncing together (routers restarting, a
replica restarting under several routers) each built all of them, ~0.25 s of Python per
subscriber for 262,144 blocks, and N of them N x that.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Callable, Iterator, Optional


class SharedMessages:
    """Messages from `messages` (an iterator that builds each as it is asked for), each built
    once on a worker thread when the first reader reaches it, and kept only until every reader
    has passed it. A reader may join only while the first message is still kept (`joinable`);
    a reader that leaves (done, failed or cancelled) stops nothing for the others."""

    def __init__(self, key: Any, messages: Iterator[Any]):
        self.key = key  # what the messages were built from: held, so the key stays alive
        self._messages = messages
        self._kept: dict[int, Any] = {}  # index -> message, from the slowest reader's on
        self._built = 0  # messages built so far
        self._dropped = 0  # messages before this index are gone
        self._ended = False  # the iterator is done
        self._error: Optional[BaseException] = None
        self._building: Optional[asyncio.Future] = None
        self._positions: dict[object, int] = {}  # reader -> the index it reads next

    @property
    def joinable(self) -> bool:
        return self._dropped == 0 and self._error is None

    def join(self) -> object:
        reader = object()
        self._positions[reader] = 0
        return reader

    def leave(self, reader: object) -> None:
        self._positions.pop(reader, None)
        self._drop_passed()

    async def get(self, reader: object, index: int) -> Optional[Any]:
        """Message `index` (the reader is done with those before it), or None after the last."""
        self._positions[reader] = index
        self._drop_passed()
        while index >= self._built:
            if self._error is not None:
                raise self._error
            if self._ended:
                return None
            building = self._building
            if building is None:
                building = self._building = asyncio.ensure_future(asyncio.to_thread(next, self._messages, None))
                building.add_done_callback(self._add)
            elif building.done():  # its callback has yet to run
                self._add(building)
                continue
            # Shielded: a reader cancelled here leaves the build to the others.
            await asyncio.shield(building)
        return self._kept[index]

    def _add(self, building: asyncio.Future) -> None:
        if building is not self._building:  # added already
            return
        self._building = None
        if building.cancelled():
            self._error = asyncio.CancelledError("the build of a shared message was cancelled")
        elif building.exception() is not None:
            self._error = building.exception()
        elif (message := building.result()) is None:
            self._ended = True
        else:
            self._kept[self._built] = message
            self._built += 1
            self._drop_passed()

    def _drop_passed(self) -> None:
        slowest = min(self._positions.values(), default=self._built)
        while self._dropped < slowest:
            self._kept.pop(self._dropped, None)
            self._dropped += 1


class SharedMessagesCache:
    """The SharedMessages of the latest big batch, for as long as a reader holds it."""

    def __init__(self) -> None:
        self._latest: Optional[weakref.ref[SharedMessages]] = None

    def get(self, key: Any, build: Callable[[], Iterator[Any]]) -> SharedMessages:
        """The shared messages of `key` (by identity) that a reader may still join, else new
        ones from `build()`."""
        shared = self._latest() if self._latest is not None else None
        if shared is None or shared.key is not key or not shared.joinable:
            shared = SharedMessages(key, build())
            self._latest = weakref.ref(shared)
        return shared
