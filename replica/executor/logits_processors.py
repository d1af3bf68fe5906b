"""What happens to a batch of logits between the model and the sampler, as tensor functions:
logit_bias, then presence / frequency / repetition penalties (log-probabilities are the
sampler's, of the raw logits: replica/executor/sampler.py). Rows that ask for nothing pass
untouched, and nothing is computed unless some row asks: one scatter-add builds every row's
token counts, with no per-row loop over tensors.
Host values reach the device by asynchronous copies and nothing is read back, so a GPU step
in flight is never waited for (replica/executor/sampler.py calls this on the device).
"""

from __future__ import annotations

import itertools
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from replica.core.request import FLOAT32_MAX, GREEDY_TEMPERATURE_EPS, SamplingParams

MAX_PROCESSED_LOGIT = FLOAT32_MAX * GREEDY_TEMPERATURE_EPS / 10


class TokenHistory(Protocol):
    """The tokens a penalty looks at; replica.core.request.Request has both fields."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def apply_logits_processors(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Optional[Sequence[TokenHistory]],
    pending_token_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """logit_bias, then the penalties, in vLLM's order; returns `logits` itself when no row
    asks for either (so callers may keep using it as the raw logits), a new tensor otherwise.
    pending_token_ids (int64 [rows] on the device, -1 for none): each row's latest output
    token that its history does not hold yet (it was sampled by a step still in flight)."""
    logits = _apply_logit_bias(logits, params)
    rows = [row for row, row_params in enumerate(params) if row_params.has_penalties]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("penalties need each row's token history")
    return _apply_penalties(logits, rows, params, histories, pending_token_ids)


def to_device(values: Sequence | np.ndarray | torch.Tensor, dtype: Optional[torch.dtype], device: torch.device
              ) -> torch.Tensor:
    """Host values on the device without waiting (pinned, non-blocking): a plain copy from
    pageable memory would wait for everything queued on the GPU (a whole forward pass in
    flight). `dtype` None keeps the values' own."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)  # a no-op on the CPU; tests pass the meta device
    return tensor.pin_memory().to(device, non_blocking=True)


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    entries = [(row, token_id, bias) for row, row_params in enumerate(params) for token_id, bias in row_params.logit_bias]
    if not entries:
        return logits
    rows, token_ids, biases = zip(*entries)
    device = logits.device
    biased = logits.clone(memory_format=torch.contiguous_format)  # viewed flat below
    # One index into the flattened logits, added to: index_put_(accumulate=True) takes CUDA's
    # sort path, whose index range check has read the index's min and max back on the host.
    keys = np.asarray(rows, dtype=np.int64) * logits.shape[-1] + np.asarray(token_ids, dtype=np.int64)
    biased.view(-1).index_add_(0, to_device(keys, None, device), to_device(biases, logits.dtype, device))
    return biased


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                     histories: Sequence[TokenHistory], pending_token_ids: Optional[torch.Tensor]) -> torch.Tensor:
    device = logits.device
    vocab_size = logits.shape[-1]
    row_index = to_device(rows, torch.long, device)
    penalized = logits[row_index]
    output_counts = token_counts([histories[row].output_token_ids for row in rows], vocab_size, device)
    if pending_token_ids is not None:
        pending = pending_token_ids[row_index].unsqueeze(1)
        output_counts.scatter_add_(1, pending.clamp(min=0), (pending >= 0).to(output_counts.dtype))

    repetition_penalties = [params[row].repetition_penalty for row in rows]
    if any(penalty != 1.0 for penalty in repetition_penalties):  # decided on the host: no device read
        repetition = to_device(repetition_penalties, torch.float32, device).unsqueeze(1)
        # vLLM's (and CTRL's) rule: a token seen in the prompt or the output has its logit
        # moved toward zero's side of less likely: divided when positive, multiplied when not.
        prompt_counts = token_counts([histories[row].prompt_token_ids for row in rows], vocab_size, device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
        penalized = torch.where(seen, scaled, penalized)

    # OpenAI's rule, on generated tokens only: frequency per occurrence, presence once.
    frequency = to_device([params[row].frequency_penalty for row in rows], torch.float32, device).unsqueeze(1)
    presence = to_device([params[row].presence_penalty for row in rows], torch.float32, device).unsqueeze(1)
    penalized = penalized - frequency * output_counts - presence * (output_counts > 0).to(penalized.dtype)
    # A huge repetition_penalty (any > 0 is valid, as in vLLM) took -100 x 3e38 to -inf: a row
    # whose every allowed token is seen then had nothing finite, and greedy took id 0 though a
    # grammar mask forbade it (the request failed, blaming its constraint). Kept finite, and so
    # past the smallest temperature's division (1 / GREEDY_TEMPERATURE_EPS): ties instead.
    penalized.clamp_(-MAX_PROCESSED_LOGIT, MAX_PROCESSED_LOGIT)

    result = logits.clone()
    result[row_index] = penalized.to(logits.dtype)
    return result


def token_counts(sequences: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), vocab_size] float counts of each token id in each sequence, from one
    scatter-add of ones at (row * vocab_size + token id). Not torch.bincount: its output size
    depends on the largest key, so on CUDA it reads that back to the host and waits for the
    step in flight."""
    lengths = torch.tensor([len(sequence) for sequence in sequences], dtype=torch.long)
    flat_ids = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
    row_of_token = torch.repeat_interleave(torch.arange(len(sequences)), lengths)
    keys = to_device(row_of_token * vocab_size + flat_ids, torch.long, device)
    counts = torch.zeros(len(sequences) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, keys, torch.ones(keys.shape, dtype=torch.float32, device=device))
    return counts.view(len(sequences), vocab_size)
