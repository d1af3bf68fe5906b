"""Picks one token per row of logits on the device: greedy, or temperature with top-k /
top-p / min-p, without a Python loop over rows and without reading a tensor on the host.

Per-row parameters arrive as device tensors (`SamplingBatch`); the few facts that decide
which operations run at all (any top-p row? any seeded row?) are host values the runner
already knows, so a step never waits for the device. Seeded rows draw their noise from a
counter-based hash of (seed, step, token) (counter_rng.py), so a seeded request's tokens do
not depend on its batch neighbours or on being preempted and recomputed.

logit_bias and the penalties (replica/executor/logits_processors.py) run only when a row of the batch
asks (`SamplingBatch.processors`), on the logits before temperature; top logprobs come out as
device tensors of the rows' alternatives, copied back with the sampled ids, so a step with no
extras costs what it did before and a step with some never waits for the device either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from replica.core.structured_output import GrammarMask, apply_grammar_bitmask
from replica.executor.counter_rng import exponential_noise
from replica.executor.logits_processors import Penalties, TokenHistory, process_logits
from replica.core.request import SamplingParams


# Full-vocabulary logits computed at once for prompt log-probabilities: a prefill chunk's rows
# are taken this many bytes of float32 logits at a time (341 rows of a 49k vocabulary, 130 of
# 128k), so that a 2,048-token chunk never holds its 2048 x vocab logits, only what is gathered.
PROMPT_LOGITS_BYTES = 64 << 20


def prompt_logits_rows(vocab_size: int) -> int:
    """Rows of logits one piece of a step's prompt log-probabilities computes at once."""
    return max(1, PROMPT_LOGITS_BYTES // (4 * vocab_size))


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per row of raw logits [rows, vocab]: the log-probability of its token in `token_ids`, that
    token's rank (1: the most likely), and with num_top its num_top most likely (logprobs, token
    ids), most likely first. log_softmax of the raw logits, as the sampled tokens' logprobs
    (vLLM's convention). The rank counts the tokens at least as likely as it, itself included, as
    vLLM v1's batched_count_greater_than does: a token tied with others takes the worst rank of
    the tie (vLLM v0 gave it the best)."""
    all_logprobs = logits.float().log_softmax(dim=-1)
    token_logprobs, top_logprobs, top_token_ids = token_and_top_logprobs(all_logprobs, token_ids, num_top)
    ranks = (all_logprobs >= token_logprobs.unsqueeze(1)).sum(dim=-1)
    return token_logprobs, ranks, top_logprobs, top_token_ids


def token_and_top_logprobs(all_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per row of log-probabilities [rows, vocab]: its token's, and with num_top its num_top
    most likely (logprobs, token ids), most likely first (one topk for every row)."""
    token_logprobs = all_logprobs.gather(-1, token_ids.unsqueeze(1)).squeeze(1)
    if not num_top:
        return token_logprobs, None, None
    top_logprobs, top_token_ids = all_logprobs.topk(num_top, dim=-1)
    return token_logprobs, top_logprobs, top_token_ids


@dataclass
class SamplingArrays:
    """Host arrays of per-row sampling parameters (numpy, one entry per row)."""

    temperature: np.ndarray  # float32; 0 = greedy
    top_k: np.ndarray  # int32; 0 = off
    top_p: np.ndarray  # float32; 1 = off
    min_p: np.ndarray  # float32; 0 = off
    seed: np.ndarray  # int64 (the request's seed as 64 bits); meaningful where has_seed
    has_seed: np.ndarray  # bool
    logprobs: np.ndarray  # bool: the row asked for the sampled token's logprob (or alternatives)
    top_logprobs: np.ndarray  # int32: alternatives per token the row asked for; 0 = none
    processed: np.ndarray  # bool: the row has logit_bias or penalties (logits_processors.py)
    logit_bias: np.ndarray  # bool: the row has logit_bias
    repetition_penalty: np.ndarray  # float32; 1 = off
    frequency_penalty: np.ndarray  # float32; 0 = off
    presence_penalty: np.ndarray  # float32; 0 = off

    @classmethod
    def empty(cls, num_rows: int) -> "SamplingArrays":
        return cls(np.zeros(num_rows, np.float32), np.zeros(num_rows, np.int32), np.ones(num_rows, np.float32),
                   np.zeros(num_rows, np.float32), np.zeros(num_rows, np.int64), np.zeros(num_rows, bool),
                   np.zeros(num_rows, bool), np.zeros(num_rows, np.int32), np.zeros(num_rows, bool),
                   np.zeros(num_rows, bool), np.ones(num_rows, np.float32), np.zeros(num_rows, np.float32),
                   np.zeros(num_rows, np.float32))

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab_size: int) -> "SamplingArrays":
        arrays = cls.empty(len(params))
        for row, row_params in enumerate(params):
            arrays.set_row(row, row_params, vocab_size)
        return arrays

    def take(self, rows: np.ndarray) -> "SamplingArrays":
        """The parameters of these rows, in this order."""
        return SamplingArrays(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
                              self.seed[rows], self.has_seed[rows], self.logprobs[rows], self.top_logprobs[rows],
                              self.processed[rows], self.logit_bias[rows], self.repetition_penalty[rows],
                              self.frequency_penalty[rows], self.presence_penalty[rows])

    def set_row(self, row: int, params: SamplingParams, vocab_size: int) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if 0 < params.top_k < vocab_size else 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.has_seed[row] = params.seed is not None
        self.seed[row] = _as_int64(params.seed) if params.seed is not None else 0
        self.logprobs[row] = params.num_logprobs is not None
        self.top_logprobs[row] = params.top_logprobs
        self.processed[row] = bool(params.logit_bias) or params.has_penalties
        self.logit_bias[row] = bool(params.logit_bias)
        self.repetition_penalty[row] = params.repetition_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty


@dataclass
class LogitsProcessing:
    """What logit_bias and the penalties need, built only for a batch where some row asks:
    every row's parameters when some row has logit_bias (host), and the penalties' per-row
    state and parameters on the device when some row has penalties."""

    bias_params: Optional[Sequence[SamplingParams]]
    penalties: Optional[Penalties] = None


@dataclass
class SamplingBatch:
    """One step's sampling rows: per-row device tensors, plus host facts about the batch."""

    temperature: torch.Tensor  # float32 [rows]; 0 = greedy
    top_k: torch.Tensor  # int32 [rows]; 0 = off
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows]
    seeds: torch.Tensor  # int64 [num_seeded]: the seeds of the seeded rows
    seeded_rows: torch.Tensor  # int64 [num_seeded]: which rows those are
    step_indices: torch.Tensor  # int64 [num_seeded]: output index each seeded row samples
    # Host facts, known without reading the device.
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # 0 when no row uses top-k
    any_top_p: bool
    any_min_p: bool
    num_seeded: int
    num_rows: int
    any_logprobs: bool
    max_top_logprobs: int  # 0 when no row asks for alternatives
    processors: Optional[LogitsProcessing] = None  # None when no row has logit_bias or penalties
    grammar: Optional[GrammarMask] = None  # the constrained rows' token bitmasks; None when no row has one

    @classmethod
    def of(cls, arrays: SamplingArrays, step_indices: np.ndarray, device: torch.device,
           processors: Optional[LogitsProcessing] = None) -> "SamplingBatch":
        """A batch built from host arrays with plain copies (tests, the memory profile run);
        the model runner stages the same tensors with its single per-step copy."""
        seeded = np.flatnonzero(arrays.has_seed)

        def tensor(values) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(device)

        return cls(
            tensor(arrays.temperature), tensor(arrays.top_k), tensor(arrays.top_p), tensor(arrays.min_p),
            tensor(arrays.seed[seeded]), tensor(seeded.astype(np.int64)),
            tensor(np.asarray(step_indices, dtype=np.int64)[seeded]),
            **batch_facts(arrays), processors=processors,
        )


    @classmethod
    def of_params(cls, params: Sequence[SamplingParams], step_indices: Sequence[int], vocab_size: int,
                  device: torch.device, histories: Optional[Sequence[TokenHistory]] = None) -> "SamplingBatch":
        """A batch of rows with these parameters (tests, the memory profile run); histories are
        the rows' tokens, which penalties need."""
        arrays = SamplingArrays.of(params, vocab_size)
        processors = None
        if arrays.processed.any():
            penalties = None
            if any(row_params.has_penalties for row_params in params):
                if histories is None:
                    raise ValueError("penalties need each row's token history")
                penalties = Penalties.of_histories(params, histories, vocab_size, device)
            processors = LogitsProcessing(params if arrays.logit_bias.any() else None, penalties)
        return cls.of(arrays, np.asarray(step_indices, dtype=np.int64), device, processors)


def batch_facts(arrays: SamplingArrays) -> dict:
    """The host facts of SamplingBatch for rows with these parameters."""
    greedy = arrays.temperature == 0.0
    return dict(
        all_greedy=bool(greedy.all()),
        any_greedy=bool(greedy.any()),
        max_top_k=int(arrays.top_k.max(initial=0)),
        any_top_p=bool((arrays.top_p < 1.0).any()),
        any_min_p=bool((arrays.min_p > 0.0).any()),
        num_seeded=int(arrays.has_seed.sum()),
        num_rows=len(arrays.temperature),
        any_logprobs=bool(arrays.logprobs.any()),
        max_top_logprobs=int(arrays.top_logprobs.max(initial=0)),
    )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [rows], on the logits' device
    logprobs: Optional[torch.Tensor]  # float32 [rows] when any row asked, else None
    # [rows, max_top_logprobs], most likely first, when any row asked for alternatives; a row
    # that asked for k keeps its first k.
    top_token_ids: Optional[torch.Tensor] = None  # int64
    top_logprobs: Optional[torch.Tensor] = None  # float32


def _argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the lowest index on ties (NaN wins, as in argmax).
    On the CPU through max(): its kernel is vectorised and argmax's is not (64 x 49,152 fp32, one
    thread: ~3 vs ~13 ms, the sampler's whole cost in a greedy decode step)."""
    if scores.device.type == "cpu":
        return scores.max(dim=-1).indices
    return scores.argmax(dim=-1)


class Sampler:
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [rows, vocab] -> one token id per row (and logprobs when asked)."""
        if logits.shape[0] != batch.num_rows:
            raise ValueError(f"{logits.shape[0]} logit rows for a sampling batch of {batch.num_rows} rows")
        raw_logits = logits = logits.float()
        if batch.processors is not None:
            logits = process_logits(raw_logits, batch.processors.bias_params, batch.processors.penalties)
        if batch.grammar is not None:  # structured outputs: what the grammar forbids is at -inf
            logits = apply_grammar_bitmask(logits, batch.grammar)
        greedy_ids = _argmax_rows(logits) if batch.any_greedy else None  # ties go to the lowest id
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            scores = _filtered_logits(logits, batch)
            # Exponential race (Gumbel-max): argmax of logits - log(E), E ~ Exp(1), is a draw
            # from softmax(logits); masked tokens stay at -inf and never win.
            scores.sub_(self._exponential_noise(scores, batch).log_())
            token_ids = _argmax_rows(scores)
            if greedy_ids is not None:
                token_ids = torch.where(batch.temperature == 0.0, greedy_ids, token_ids)
        if not batch.any_logprobs:
            return SamplerOutput(token_ids, None)
        # vLLM's convention: log_softmax of the raw logits, before bias, penalties, temperature
        # or filtering. One topk serves every row's alternatives.
        logprobs, top_logprobs, top_token_ids = token_and_top_logprobs(
            raw_logits.log_softmax(dim=-1), token_ids, batch.max_top_logprobs)
        if top_logprobs is None:
            return SamplerOutput(token_ids, logprobs)
        return SamplerOutput(token_ids, logprobs, top_token_ids, top_logprobs)

    @staticmethod
    def _exponential_noise(like: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(like).exponential_()  # unseeded rows: the global RNG
        if batch.num_seeded:
            seeded = exponential_noise(batch.seeds, batch.step_indices, like.shape[-1])
            noise.index_copy_(0, batch.seeded_rows, seeded)
        # exponential_ can return exactly 0; its log (-inf) would turn a masked -inf score into NaN.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _filtered_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k, then top-p, then min-p at -inf.
    Each filter is decided per row, so a row's result never depends on its neighbours."""
    temperature = torch.where(batch.temperature > 0.0, batch.temperature, 1.0)  # greedy rows: unused
    scaled = logits / temperature.unsqueeze(1)
    if batch.max_top_k:
        scaled = _apply_top_k(scaled, batch.top_k, batch.max_top_k)
    if batch.any_top_p:
        scaled = _apply_top_p(scaled, batch.top_p)
    if batch.any_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); renormalizing after
        # top-k/top-p scales every probability alike, so the ratio test is unaffected.
        threshold = scaled.amax(dim=-1, keepdim=True) + batch.min_p.log().unsqueeze(1)  # log(0) = -inf: no bound
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    return scaled


def _apply_top_k(scaled: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k best scores (ties with the k-th are kept); rows with k = 0 pass."""
    best = scaled.topk(max_top_k, dim=-1).values  # descending
    kth_index = (top_k.clamp(min=1, max=max_top_k) - 1).long().unsqueeze(1)
    threshold = best.gather(-1, kth_index)
    threshold = threshold.masked_fill((top_k == 0).unsqueeze(1), float("-inf"))
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_scores, sorted_token_ids = scaled.sort(dim=-1, descending=True, stable=True)
    sorted_probs = sorted_scores.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = top_p.unsqueeze(1)
    # The nucleus is the shortest prefix holding top_p of the mass: keep a token while the
    # mass ranked above it is still short of top_p. Rows with top_p = 1 are exempt, since
    # rounding can push the running sum to 1 before the tail ends.
    outside = (mass_before >= top_p) & (top_p < 1.0)
    # The best token always stays: a top_p of 1e-46 is 0 as a 32-bit float, and masked every
    # token, so a garbage id won (vLLM keeps one too).
    outside[:, 0] = False
    filtered_sorted = sorted_scores.masked_fill(outside, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, sorted_token_ids, filtered_sorted)


def _as_int64(seed: int) -> int:
    """Any Python int as the signed 64-bit integer with the same low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed
