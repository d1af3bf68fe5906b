"""What happens to a batch of logits between the model and the sampler, as tensor functions:
logit_bias, then presence / frequency / repetition penalties (log-probabilities are the
sampler's, of the raw logits: replica/executor/sampler.py). Rows that ask for nothing pass
untouched, and nothing is computed unless some row asks.

The penalties read each request row's token history from PenaltyState: on the device, per row of
the runner's persistent batch (replica/executor/request_rows.py), which prompt and output tokens
it has seen and how often each output token came, built once when the request is admitted and
updated by every token the row samples (vLLM v1 keeps its output token counts so). A decode
step's penalties therefore cost a few kernels over [rows, vocab] and no host work per token of
history; the token sampled by a step still in flight is already counted, in stream order.
Host values reach the device by asynchronous copies and nothing is read back, so a GPU step
in flight is never waited for (replica/executor/sampler.py calls this on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from replica.core.request import FLOAT32_MAX, GREEDY_TEMPERATURE_EPS, SamplingParams
from replica.executor import cuda_runtime

MAX_PROCESSED_LOGIT = FLOAT32_MAX * GREEDY_TEMPERATURE_EPS / 10


class TokenHistory(Protocol):
    """The tokens a penalty looks at; replica.core.request.Request has both fields."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


class PenaltyState:
    """Per row (a request's row in the runner's persistent batch), on the device: `seen`, bool
    [rows, vocab], the tokens in its prompt or output (repetition_penalty), and `output_counts`,
    int32 [rows, vocab], how often each token came in its output (frequency / presence). Each is
    allocated when the first request that needs it is admitted (a replica whose requests ask for
    no penalty holds neither; 256 rows of a 152k vocabulary: 39 MB and 156 MB).

    A penalized request's row is rebuilt from its tokens when it is admitted (again, after a
    preemption: from the tokens the host kept), and every step with a penalized row counts each
    sampling row's token (`count`). A row without penalties may hold stale counts: its neutral
    parameters (1, 0, 0) leave its logits exactly as they were, whatever they are."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, torch.device(device)
        self.seen: Optional[torch.Tensor] = None
        self.output_counts: Optional[torch.Tensor] = None
        self._admitted: list[tuple[int, TokenHistory]] = []

    def admit(self, row: int, history: TokenHistory, params: SamplingParams) -> None:
        """Rebuild `row` for a newly admitted request with penalties from its tokens, at the
        next flush() (one copy for all of a step's admissions)."""
        if params.repetition_penalty != 1.0 and self.seen is None:
            self.seen = torch.zeros((self.num_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and self.output_counts is None:
            self.output_counts = torch.zeros((self.num_rows, self.vocab_size), dtype=torch.int32, device=self.device)
        self._admitted.append((row, history))

    def flush(self) -> None:
        """Queue the rebuild of the rows admitted since the last flush: each zeroed, then its
        prompt and output tokens seen and its output tokens counted."""
        if not self._admitted:
            return
        admitted, self._admitted = self._admitted, []
        vocab_size = self.vocab_size
        rows = np.array([row for row, _ in admitted], dtype=np.int64)
        outputs = [np.asarray(history.output_token_ids, dtype=np.int64) for _, history in admitted]
        output_keys = np.concatenate([row * vocab_size + ids for (row, _), ids in zip(admitted, outputs)])
        row_index = to_device(rows, None, self.device)
        if self.output_counts is not None:
            self.output_counts.index_fill_(0, row_index, 0)
            if len(output_keys):
                keys = to_device(output_keys, None, self.device)
                self.output_counts.view(-1).index_add_(0, keys, torch.ones(keys.shape, dtype=torch.int32,
                                                                               device=self.device))
        if self.seen is not None:
            self.seen.index_fill_(0, row_index, False)
            prompt_keys = np.concatenate([row * vocab_size + np.asarray(history.prompt_token_ids, dtype=np.int64)
                                          for row, history in admitted])
            keys = np.concatenate([prompt_keys, output_keys])
            if len(keys):
                self.seen.view(-1).index_fill_(0, to_device(keys, None, self.device), True)

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Each of `rows` (int64, on the device) sampled its token in `token_ids`."""
        keys = rows * self.vocab_size + token_ids
        if self.output_counts is not None:
            self.output_counts.view(-1).index_add_(0, keys, torch.ones(keys.shape, dtype=torch.int32,
                                                                           device=keys.device))
        if self.seen is not None:
            self.seen.view(-1).index_fill_(0, keys, True)


@dataclass
class Penalties:
    """A batch's penalties: per batch row, its row of `state` and its parameters (float32 on
    the device; 1, 0, 0 for a row without them), and which kinds some row uses (host facts)."""

    state: PenaltyState
    rows: torch.Tensor  # int64 [batch rows]
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    any_repetition: bool
    any_additive: bool  # some row has a frequency or presence penalty

    @classmethod
    def of_histories(cls, params: Sequence[SamplingParams], histories: Sequence[TokenHistory], vocab_size: int,
                     device: torch.device) -> "Penalties":
        """A batch's penalties from its rows' whole histories, in a state of its own (tests, the
        memory profile run; the runner keeps one state for its rows across steps)."""
        device = torch.device(device)
        state = PenaltyState(len(params), vocab_size, device)
        for row, (row_params, history) in enumerate(zip(params, histories)):
            if row_params.has_penalties:
                state.admit(row, history, row_params)
        state.flush()

        def values(name: str) -> torch.Tensor:
            return to_device(np.array([getattr(row_params, name) for row_params in params], dtype=np.float32),
                             None, device)

        return cls(state, torch.arange(len(params), device=device), values("repetition_penalty"),
                   values("frequency_penalty"), values("presence_penalty"), state.seen is not None,
                   state.output_counts is not None)


def apply_logits_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                            histories: Optional[Sequence[TokenHistory]]) -> torch.Tensor:
    """process_logits for rows with these parameters and whole token histories (tests)."""
    penalties = None
    if any(row_params.has_penalties for row_params in params):
        if histories is None:
            raise ValueError("penalties need each row's token history")
        penalties = Penalties.of_histories(params, histories, logits.shape[-1], logits.device)
    return process_logits(logits, params, penalties)


def process_logits(logits: torch.Tensor, bias_params: Optional[Sequence[SamplingParams]],
                   penalties: Optional[Penalties]) -> torch.Tensor:
    """logit_bias (each row's of bias_params, when given), then the penalties, in vLLM's order;
    returns `logits` itself when neither applies (so callers may keep using it as the raw
    logits), a new tensor otherwise."""
    if bias_params is not None:
        logits = _apply_logit_bias(logits, bias_params)
    if penalties is None:
        return logits
    return _apply_penalties(logits, penalties)


def to_device(values: Sequence | np.ndarray | torch.Tensor, dtype: Optional[torch.dtype], device: torch.device
              ) -> torch.Tensor:
    """Host values on the device without waiting (pinned, non-blocking): a plain copy from
    pageable memory would wait for everything queued on the GPU (a whole forward pass in
    flight). `dtype` None keeps the values' own."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if not cuda_runtime.pins_host_memory(device):
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


def _apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Every row of the batch at once (a row without penalties is unchanged: x / 1, x * 1 and
    x - 0 are x), from its row of the state."""
    state = penalties.state
    penalized = logits
    if penalties.any_repetition:
        # vLLM's (and CTRL's) rule: a token seen in the prompt or the output has its logit
        # moved toward zero's side of less likely: divided when positive, multiplied when not.
        repetition = penalties.repetition.unsqueeze(1)
        seen = state.seen.index_select(0, penalties.rows)
        penalized = torch.where(seen, torch.where(penalized > 0, penalized / repetition, penalized * repetition),
                                penalized)
    if penalties.any_additive:
        # OpenAI's rule, on generated tokens only: frequency per occurrence, presence once.
        counts = state.output_counts.index_select(0, penalties.rows).to(logits.dtype)
        penalized = (penalized - penalties.frequency.unsqueeze(1) * counts
                     - penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype))
    # A huge repetition_penalty (any > 0 is valid, as in vLLM) took -100 x 3e38 to -inf: a row
    # whose every allowed token is seen then had nothing finite, and greedy took id 0 though a
    # grammar mask forbade it (the request failed, blaming its constraint). Kept finite, and so
    # past the smallest temperature's division (1 / GREEDY_TEMPERATURE_EPS): ties instead.
    return penalized.clamp(-MAX_PROCESSED_LOGIT, MAX_PROCESSED_LOGIT)
