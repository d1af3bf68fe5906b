"""KV cache events: what the prefix cache gained and lost, in the order it happened. The
block pool records them, the engine hands them out once per step (`take_kv_events`) as plain
tuples that can cross a process boundary, and the replica streams them to routers.
"""

from __future__ import annotations

import enum
from typing import Optional


class KVEventKind(enum.IntEnum):
    # Values match protos/headroom.proto's KVEventKind.
    BLOCK_STORED = 1  # a full block is now findable in the prefix cache under its hash
    BLOCK_REMOVED = 2  # that hash is gone (its block was reused for other tokens)
    ALL_BLOCKS_CLEARED = 3  # forget every hash; the events after it rebuild the cache's state


# (kind, block hash, parent hash): a plain tuple, cheap on the engine's hot path (two per
# cached block) and to send to another process. The hashes are b"" / None where a kind has none.
KVEvent = tuple[int, bytes, Optional[bytes]]


# The kinds as plain ints: events ride in the engine core's output message, where plain
# values pickle faster than enum members (replica/ipc/messages.py); they compare equal.
BLOCK_STORED, BLOCK_REMOVED = int(KVEventKind.BLOCK_STORED), int(KVEventKind.BLOCK_REMOVED)


def stored(block_hash: bytes, parent_hash: Optional[bytes]) -> KVEvent:
    return (BLOCK_STORED, block_hash, parent_hash)


def removed(block_hash: bytes) -> KVEvent:
    return (BLOCK_REMOVED, block_hash, None)


ALL_BLOCKS_CLEARED: KVEvent = (int(KVEventKind.ALL_BLOCKS_CLEARED), b"", None)
