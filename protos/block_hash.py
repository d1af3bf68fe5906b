"""Prefix-cache block hashes, part of the wire contract: a replica keys its prefix cache and
its KV events with them, and a router computes the same keys from a prompt's token ids.

A full block's hash is blake2b (16 bytes) of its parent block's hash and its token ids as
little-endian uint32; the first block's parent is a seeded root (per cache salt). The hash of
block i therefore names the whole prefix up to and including block i, on every host and in
every process (unlike Python's `hash()`, which is salted per process).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Optional, Sequence

# Changing the seed (or the byte layout below) changes every key: routers and replicas of
# different versions would then see no common prefixes, which costs cache hits, never
# correctness.
PREFIX_HASH_SEED = b"headroom.v1/prefix-cache"
HASH_BYTES = 16
_TOKEN_BYTES = 4

_UINT32 = "I" if array("I").itemsize == _TOKEN_BYTES else "L"
assert array(_UINT32).itemsize == _TOKEN_BYTES, "no 4-byte unsigned array type on this platform"
_SWAP_TO_LITTLE_ENDIAN = sys.byteorder != "little"


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


ROOT_HASH = _digest(PREFIX_HASH_SEED)


def root_hash(cache_salt: Optional[str] = None) -> bytes:
    """Parent of a sequence's first block; a salt gives its requests a cache of their own."""
    if not cache_salt:
        return ROOT_HASH
    return _digest(ROOT_HASH + cache_salt.encode("utf-8"))


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32. OverflowError for ids outside [0, 2**32)."""
    tokens = array(_UINT32, token_ids)
    if _SWAP_TO_LITTLE_ENDIAN:
        tokens.byteswap()
    return tokens.tobytes()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None
) -> list[bytes]:
    """Append to `hashes` (the chain of the first len(hashes) blocks of `token_ids`) the
    hashes of the remaining full blocks of `token_ids`; returns `hashes`.

    Incremental, so a request's chain grows with its output at the cost of its new blocks
    only. OverflowError for a token id outside [0, 2**32).
    """
    num_full = len(token_ids) // block_size
    start = len(hashes)
    if start >= num_full:
        return hashes
    data = token_bytes(token_ids[start * block_size : num_full * block_size])
    parent = hashes[-1] if hashes else root_hash(cache_salt)
    stride = block_size * _TOKEN_BYTES
    digest = hashlib.blake2b
    for offset in range(0, len(data), stride):
        parent = digest(parent + data[offset : offset + stride], digest_size=HASH_BYTES).digest()
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None) -> list[bytes]:
    """The chain hashes of every full block of `token_ids`."""
    return extend_block_hashes([], token_ids, block_size, cache_salt)
