"""Counter-based random numbers for seeded sampling: a pure function of (seed, step, token).

A seeded row's noise is a hash of its request's seed, the index of the token being sampled
and the vocabulary id, computed on the device for a whole batch at once. Nothing is carried
from step to step, so a seeded request draws the same tokens whatever its batch
neighbours and however often it is preempted and recomputed.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9
# Round constants of the "lowbias32" integer hash (C. Wellons, hash-prospector).
_MULTIPLIER_1 = 0x7FEB352D
_MULTIPLIER_2 = 0x846CA68B
_STEP_SALT = 0x68E31DA4
_ROUND_SALT = 0xB5297A4D


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), without overflowing int64: the
    constant is split in 16-bit halves so every product stays below 2**48."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MULTIPLIER_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MULTIPLIER_2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from int64 seeds (any bit pattern) and step indices."""
    seed_low = seeds & _MASK32
    seed_high = (seeds >> 32) & _MASK32  # arithmetic shift, then the mask keeps the 32 bits
    key = _mix32(seed_high ^ _mix32((steps & _MASK32) ^ _STEP_SALT))
    key = _mix32(seed_low ^ key)
    return key, _mix32(key ^ _ROUND_SALT)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """float32 [rows, num_tokens] of Exp(1) draws; element (r, t) depends only on
    (seeds[r], steps[r], t)."""
    first_key, second_key = row_keys(seeds.to(torch.int64), steps.to(torch.int64))
    token_ids = torch.arange(num_tokens, device=seeds.device, dtype=torch.int64)
    counters = (first_key[:, None] + token_ids[None, :] * _GOLDEN32) & _MASK32
    bits = _mix32(_mix32(counters) ^ second_key[:, None])
    # 24 random bits make a float32 uniform in (0, 1) exactly: never 0, never 1.
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (2.0 ** -24)
    return -torch.log(uniform)
