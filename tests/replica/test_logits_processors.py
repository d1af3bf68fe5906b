"""Logits processors: logit_bias and the penalties change exactly the rows that ask, by
OpenAI's and vLLM's formulas (checked against a per-row reference written the slow way);
logprobs are of the raw logits, and the top-k alternatives are torch's topk of them."""

from __future__ import annotations

import math

import pytest
import torch

from replica.executor.logits_processors import PenaltyState, apply_logits_processors
from replica.core.request import SamplingParams
from replica.executor.sampler import Sampler, SamplingBatch

VOCAB_SIZE = 32


class History:
    def __init__(self, prompt_token_ids, output_token_ids):
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids


def random_logits(num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 3


def reference_penalties(row: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """The formulas, one token at a time."""
    row = row.clone()
    for token in set(history.prompt_token_ids) | set(history.output_token_ids):
        value = row[token].item()
        row[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(history.output_token_ids):
        count = history.output_token_ids.count(token)
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    return row


def test_a_rows_penalty_state_is_rebuilt_on_admission_and_counts_each_sampled_token():
    """Each output occurrence counted, prompt and output tokens seen; a row admitted again (a
    new request, or one recomputed after a preemption) holds its own tokens alone."""
    state = PenaltyState(4, VOCAB_SIZE, torch.device("cpu"))
    both = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    state.admit(0, History([2, 2], [1, 1, 5]), both)
    state.admit(2, History([3], [31]), both)
    state.flush()
    state.count(torch.tensor([0, 2]), torch.tensor([5, 7]))
    counts, seen = state.output_counts, state.seen
    assert counts[0, 1] == 2 and counts[0, 5] == 2 and counts[0].sum() == 4 and counts[0, 2] == 0
    assert counts[2, 31] == 1 and counts[2, 7] == 1 and counts[2].sum() == 2
    assert seen[0].nonzero().flatten().tolist() == [1, 2, 5] and seen[2].nonzero().flatten().tolist() == [3, 7, 31]
    state.admit(0, History([9], []), both)
    state.flush()
    assert counts[0].sum() == 0 and seen[0].nonzero().flatten().tolist() == [9] and counts[2].sum() == 2


def test_rows_without_bias_or_penalties_return_the_same_tensor():
    logits = random_logits(3)
    assert apply_logits_processors(logits, [SamplingParams()] * 3, None) is logits


def test_penalties_match_the_per_token_reference_and_leave_other_rows_alone():
    logits = random_logits(4)
    params = [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.5, repetition_penalty=1.3),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.8),
    ]
    histories = [History([1, 2], [3, 3, 4]), History([5], [6]), History([7, 7], [8, 9, 9, 9]), History([], [0, 0])]
    processed = apply_logits_processors(logits, params, histories)
    assert torch.equal(processed[1], logits[1])
    for row in (0, 2, 3):
        assert torch.allclose(processed[row], reference_penalties(logits[row], params[row], histories[row]))


def test_logit_bias_adds_to_the_listed_tokens_only():
    logits = torch.zeros(2, VOCAB_SIZE)
    params = [SamplingParams(logit_bias=((3, 100.0), (5, -100.0))), SamplingParams()]
    processed = apply_logits_processors(logits, params, None)
    assert processed[0, 3] == 100.0 and processed[0, 5] == -100.0 and processed[0].abs().sum() == 200.0
    assert torch.equal(processed[1], logits[1]) and logits.abs().sum() == 0  # the input is not modified


def sample(logits, params, step_indices, histories=None):
    return Sampler().sample(logits, SamplingBatch.of_params(params, step_indices, VOCAB_SIZE, logits.device, histories))


def test_logit_bias_of_100_forces_the_greedy_token():
    logits = random_logits(1)
    params = [SamplingParams(temperature=0.0, logit_bias=((17, 100.0),))]
    assert sample(logits, params, [0]).token_ids.tolist() == [17]


def test_frequency_penalty_steers_greedy_away_from_a_repeated_token():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 4], logits[0, 9] = 2.0, 1.0
    history = [History([], [4, 4])]
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy], [2], history).token_ids.tolist() == [4]
    penalized = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert sample(logits, [penalized], [2], history).token_ids.tolist() == [9]


def test_penalties_without_histories_are_refused():
    with pytest.raises(ValueError, match="history"):
        apply_logits_processors(random_logits(1), [SamplingParams(presence_penalty=1.0)], None)


def test_logprobs_are_of_the_raw_logits_and_top_k_is_torch_topk():
    logits = random_logits(3)
    # Row 0's bias forces token 0, which the raw logits need not favour; greedy throughout.
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, logit_bias=((0, 50.0),)),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=True)]
    out = sample(logits, params, [0, 0, 0])
    raw = logits.log_softmax(dim=-1)
    token_ids = out.token_ids.tolist()
    assert token_ids[0] == 0 and token_ids[2] == int(raw[2].argmax())
    assert out.logprobs[0].item() == pytest.approx(raw[0, 0].item(), abs=1e-5)  # raw, not biased
    assert out.logprobs[2].item() == pytest.approx(raw[2, token_ids[2]].item(), abs=1e-5)
    values, ids = raw[0].topk(5)
    assert out.top_token_ids[0].tolist() == ids.tolist()
    assert out.top_logprobs[0].tolist() == pytest.approx(values.tolist(), abs=1e-5)
    assert math.isclose(sum(math.exp(v) for v in raw[0].tolist()), 1.0, rel_tol=1e-4)
    # Which rows' logprobs reach their requests (rows 0 and 2 here) is the runner's choice:
    # tests/replica/test_engine.py checks that per request.


def test_sampler_returns_top_logprobs_only_when_a_row_asks():
    logits = random_logits(2)
    plain = sample(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    assert plain.top_logprobs is None
    asked = sample(logits, [SamplingParams(temperature=0.0, top_logprobs=3), SamplingParams()], [0, 0])
    # On the device, one [rows, 3] topk; the runner keeps each row's first k (none for row 1).
    assert asked.top_token_ids.shape == (2, 3)
    # Greedy: the sampled token is the most likely one.
    assert asked.top_token_ids[0, 0].item() == asked.token_ids[0].item()


def test_a_temperature_too_small_to_divide_by_samples_greedily_as_in_vllm():
    """1e-40 overflowed the logits to +inf, every one tied, and the lowest such id won: outside
    the top_k the request asked for. Below GREEDY_TEMPERATURE_EPS it is greedy (vLLM's rule)."""
    logits = random_logits(2)
    params = [SamplingParams(temperature=1e-40, top_k=5, seed=1), SamplingParams(temperature=1e-5, top_k=5)]
    assert params[0].greedy and not params[1].greedy
    assert sample(logits, params, [0, 0]).token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_a_huge_repetition_penalty_leaves_a_grammar_its_allowed_tokens():
    """Every token seen and pushed to -100 by logit_bias, then a repetition_penalty of 3e38
    (valid: any > 0, as in vLLM) multiplied them to -inf; with nothing finite left greedy took
    id 0, which the grammar forbade, and the request failed blaming its constraint. The logits
    stay finite: the grammar's one allowed token wins, greedy or sampled at the smallest
    temperature that is not greedy."""
    from replica.core.structured_output import GrammarMask

    allowed = 7
    logits = torch.zeros(2, VOCAB_SIZE)
    bias = tuple((token, -100.0) for token in range(VOCAB_SIZE))
    params = [SamplingParams(temperature=temperature, logit_bias=bias, repetition_penalty=3e38)
              for temperature in (0.0, 1e-5)]
    histories = [History(list(range(VOCAB_SIZE)), [])] * 2
    batch = SamplingBatch.of_params(params, [0, 0], VOCAB_SIZE, logits.device, histories)
    words = (VOCAB_SIZE + 31) // 32
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    bitmask[:, allowed // 32] = 1 << (allowed % 32)
    batch.grammar = GrammarMask(bitmask, torch.tensor([0, 1]), torch.arange(32, dtype=torch.int32))
    assert Sampler().sample(logits, batch).token_ids.tolist() == [allowed, allowed]
    processed = apply_logits_processors(logits, params, histories)
    assert torch.isfinite(processed).all() and (processed < -1e30).all()


def test_a_temperature_or_penalty_past_the_32_bit_range_is_refused_by_name():
    """1e308 is finite, and became inf in the sampler's 32-bit parameters: a constrained row's
    masked logits divided by it were NaN, and the request failed blaming its constraint."""
    from replica.errors import InvalidRequestError

    for name in ("temperature", "repetition_penalty"):
        with pytest.raises(InvalidRequestError, match=r"must be at most 3.403e\+38 in magnitude \(a 32-bit float\), "
                                                      r"got 1e\+308$") as raised:
            SamplingParams(**{name: 1e308}).validate(prompt_len=1, max_model_len=64)
        assert raised.value.field == name
    SamplingParams(temperature=3e38, repetition_penalty=3e38).validate(prompt_len=1, max_model_len=64)
