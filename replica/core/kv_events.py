"""KV cache events: what the prefix cache gained and lost, in the order it happened. The
block pool records them, the engine hands them out once per step (`take_kv_events`) as plain
tuples that can cross a process boundary, and the replica streams them to routers.
"""

from __future__ import annotations

import enum
from typing import Optional


class KVEventKind(enum.IntEnum):
    # Values match protos/headroom.proto's KVEventKind.
    BLOCK_STORED = 1  # a full block is now findable in the prefix cache under its hash (in its medium)
    BLOCK_REMOVED = 2  # that hash is gone from that medium (its block was reused for other tokens)
    ALL_BLOCKS_CLEARED = 3  # forget every hash; the events after it rebuild the cache's state


class KVMedium(enum.IntEnum):
    # Values match protos/headroom.proto's KVMedium: where a cached block's KV lives.
    DEVICE = 0  # the device pool: a prefix hit is read in place
    HOST = 1  # the host tier (replica/core/host_pool.py): a prefix hit is copied back first


# (kind, block hash, parent hash) for the device pool, (kind, block hash, parent hash, medium)
# for the host tier: a plain tuple, cheap on the engine's hot path (two per cached block) and to
# send to another process. The hashes are b"" / None where a kind has none. A hash may be
# cached in both media at once; each medium's entries come and go by their own events.
KVEvent = tuple
MEDIUM_DEVICE, MEDIUM_HOST = int(KVMedium.DEVICE), int(KVMedium.HOST)


def medium_of(event: KVEvent) -> int:
    return event[3] if len(event) > 3 else MEDIUM_DEVICE


# The kinds as plain ints: events ride in the engine core's output message, where plain
# values pickle faster than enum members (replica/ipc/messages.py); they compare equal.
BLOCK_STORED, BLOCK_REMOVED = int(KVEventKind.BLOCK_STORED), int(KVEventKind.BLOCK_REMOVED)


def stored(block_hash: bytes, parent_hash: Optional[bytes], medium: int = MEDIUM_DEVICE) -> KVEvent:
    return (BLOCK_STORED, block_hash, parent_hash) if medium == MEDIUM_DEVICE else (
        BLOCK_STORED, block_hash, parent_hash, medium)


def removed(block_hash: bytes, medium: int = MEDIUM_DEVICE) -> KVEvent:
    return (BLOCK_REMOVED, block_hash, None) if medium == MEDIUM_DEVICE else (BLOCK_REMOVED, block_hash, None, medium)


ALL_BLOCKS_CLEARED: KVEvent = (int(KVEventKind.ALL_BLOCKS_CLEARED), b"", None)
