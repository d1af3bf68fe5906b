"""Picks one token per row of logits: greedy, or temperature with top-k / top-p / min-p.

Seeded rows draw their noise from (seed, step_index) alone, so a seeded request's tokens do
not depend on its batch neighbours or on being preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from replica.request import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[float]]  # None for rows whose params did not ask for logprobs


class Sampler:
    def __init__(self) -> None:
        # One generator per device, reseeded for every seeded row: no state survives a step.
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], step_indices: Sequence[int]
    ) -> SamplerOutput:
        """logits [num_rows, vocab]; step_indices[i] = tokens row i's request has generated so far."""
        if not logits.shape[0] == len(params) == len(step_indices):
            raise ValueError(
                f"{logits.shape[0]} logit rows, {len(params)} sampling params, {len(step_indices)} step indices"
            )
        logits = logits.float()
        token_ids = logits.argmax(dim=-1)  # greedy rows keep this; ties go to the lowest id
        random_rows = [row for row, row_params in enumerate(params) if not row_params.greedy]
        if random_rows:
            row_index = torch.tensor(random_rows, device=logits.device)
            random_params = [params[row] for row in random_rows]
            filtered = _filtered_logits(logits[row_index], random_params)
            noise = self._exponential_noise(filtered, random_params, [step_indices[row] for row in random_rows])
            # Exponential race (Gumbel-max): argmax of logits - log(E), E ~ Exp(1), is a
            # draw from softmax(logits); masked tokens stay at -inf and never win.
            token_ids[row_index] = (filtered - noise.log()).argmax(dim=-1)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_sampled_logprobs(logits, token_ids, params))

    def _exponential_noise(
        self, like: torch.Tensor, params: Sequence[SamplingParams], step_indices: Sequence[int]
    ) -> torch.Tensor:
        noise = torch.empty_like(like).exponential_()  # unseeded rows: the global RNG
        for row, (row_params, step_index) in enumerate(zip(params, step_indices)):
            if row_params.seed is not None:
                generator = self._generator(like.device)
                generator.manual_seed(_row_seed(row_params.seed, step_index))
                noise[row].exponential_(generator=generator)
        # exponential_ can return exactly 0; its log (-inf) would turn a masked -inf score into NaN.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def _filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k, then top-p, then min-p at -inf."""
    device = logits.device
    vocab_size = logits.shape[-1]
    temperatures = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperatures.unsqueeze(1)

    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab_size for k in top_ks) or any(p < 1.0 for p in top_ps):
        scaled = _apply_top_k_top_p(scaled, top_ks, top_ps)

    min_ps = [p.min_p for p in params]
    if any(min_p > 0.0 for min_p in min_ps):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); renormalizing after
        # top-k/top-p scales every probability alike, so the ratio test is unaffected.
        log_min_ps = torch.tensor(min_ps, device=device).log()  # log(0) = -inf: no bound
        threshold = scaled.amax(dim=-1, keepdim=True) + log_min_ps.unsqueeze(1)
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    return scaled


def _apply_top_k_top_p(scaled: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """One descending sort serves both filters; rows with k = vocab and p = 1 pass unchanged."""
    device = scaled.device
    sorted_logits, sorted_token_ids = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scaled.shape[-1], device=device).unsqueeze(0)
    outside = ranks >= torch.tensor(top_ks, device=device).unsqueeze(1)

    if any(p < 1.0 for p in top_ps):
        top_p = torch.tensor(top_ps, device=device).unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # The nucleus is the shortest prefix holding top_p of the mass: keep a token while
        # the mass ranked above it is still short of top_p. Rows with top_p = 1 are exempt,
        # since rounding can push the running sum to 1 before the tail ends.
        outside |= (mass_before >= top_p) & (top_p < 1.0)

    filtered_sorted = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, sorted_token_ids, filtered_sorted)


def _sampled_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> list[Optional[float]]:
    """vLLM's convention: log_softmax of the raw logits, before temperature or filtering."""
    if not any(p.logprobs for p in params):
        return [None] * len(params)
    logprobs = logits.log_softmax(dim=-1).gather(-1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    return [logprob if p.logprobs else None for logprob, p in zip(logprobs, params)]


def _row_seed(seed: int, step_index: int) -> int:
    """A well-mixed 64-bit seed for one (request seed, step) pair: splitmix64's finalizer."""
    mixed = ((seed & _MASK64) + (step_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mixed ^ (mixed >> 31)
