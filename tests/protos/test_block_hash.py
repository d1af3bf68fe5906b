"""The prefix-cache block hash is a wire contract: the same token ids give the same keys in
every process and on every host, chained so that a key names its whole prefix."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from protos.block_hash import HASH_BYTES, block_hashes, extend_block_hashes, root_hash

TOKENS = list(range(100, 164))  # 4 blocks of 16


def test_layout_is_blake2b_of_the_parent_and_little_endian_uint32_tokens():
    # A change of seed, byte layout or digest makes routers and replicas of different
    # versions disagree; the known digest pins all three.
    root = hashlib.blake2b(b"headroom.v1/prefix-cache", digest_size=16).digest()
    first = hashlib.blake2b(root + struct.pack("<16I", *TOKENS[:16]), digest_size=16).digest()
    second = hashlib.blake2b(first + struct.pack("<16I", *TOKENS[16:32]), digest_size=16).digest()
    assert block_hashes(TOKENS[:32], 16) == [first, second]
    assert first.hex() == "5276571ecf3d7f198acf75036a7d3793"


def test_hashes_are_the_same_in_a_process_with_another_hash_seed():
    code = "from protos.block_hash import block_hashes; print(block_hashes(list(range(100, 164)), 16)[-1].hex())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == block_hashes(TOKENS, 16)[-1].hex()


def test_each_key_names_its_whole_prefix():
    hashes = block_hashes(TOKENS, 16)
    assert len(hashes) == 4 and all(len(h) == HASH_BYTES for h in hashes)
    changed_first_block = block_hashes([7] + TOKENS[1:], 16)
    # Blocks 1..3 hold the same tokens but follow a different first block.
    assert not set(hashes) & set(changed_first_block)
    assert block_hashes(TOKENS[:48] + [1] * 16, 16)[:3] == hashes[:3]


def test_partial_blocks_get_no_hash_and_extension_matches_one_pass():
    assert len(block_hashes(TOKENS[:31], 16)) == 1
    grown: list[bytes] = []
    for end in (5, 16, 40, 64):
        extend_block_hashes(grown, TOKENS[:end], 16)
    assert grown == block_hashes(TOKENS, 16)


def test_a_cache_salt_separates_the_chains():
    assert root_hash("tenant-a") != root_hash("tenant-b") != root_hash()
    assert not set(block_hashes(TOKENS, 16, "tenant-a")) & set(block_hashes(TOKENS, 16))


def test_token_ids_outside_uint32_are_refused():
    with pytest.raises(OverflowError):
        block_hashes([-1] * 16, 16)
    with pytest.raises(OverflowError):
        block_hashes([2**32] * 16, 16)

