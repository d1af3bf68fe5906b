"""Sampler: greedy is argmax, filters bound what can be drawn, seeds make draws reproducible."""

import math

import pytest
import torch

from replica.request import SamplingParams
from replica.executor.sampler import Sampler, SamplerOutput

VOCAB_SIZE = 64


@pytest.fixture(autouse=True)
def deterministic_global_rng():
    """Unseeded rows draw from the global RNG; fix it so the statistical tests cannot flake."""
    torch.manual_seed(0)


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 3


def logits_from_probs(probs: list[float], num_rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(num_rows, -1).clone()


def sample_tokens(logits: torch.Tensor, params: SamplingParams, step_index: int = 0) -> list[int]:
    """One draw per row, every row with the same (unseeded or seeded) params."""
    num_rows = logits.shape[0]
    return Sampler().sample(logits, [params] * num_rows, [step_index] * num_rows).token_ids


def test_greedy_picks_the_argmax_of_every_row():
    logits = random_logits(8)
    output = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 8, [0] * 8)
    assert output == SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * 8)


def test_greedy_breaks_ties_toward_the_lowest_token_id():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, [7, 3, 40]] = 5.0
    assert Sampler().sample(logits, [SamplingParams(temperature=0.0)], [0]).token_ids == [3]


def test_greedy_ignores_the_seed_and_the_filters():
    logits = random_logits(1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=0.0, seed=2, top_k=1, top_p=0.1, min_p=0.9),
    ]
    tokens = {Sampler().sample(logits, [p], [step]).token_ids[0] for p in params for step in range(3)}
    assert tokens == {logits.argmax().item()}


def test_same_seed_and_step_gives_the_same_token_in_any_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)
    target_row = random_logits(1, seed=7)
    for step_index in range(20):
        alone = Sampler().sample(target_row, [seeded], [step_index]).token_ids[0]
        neighbours = random_logits(5, seed=step_index)
        batch = torch.cat([neighbours[:2], target_row, neighbours[2:]])
        batch_params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0), seeded,
                        SamplingParams(seed=99), SamplingParams(temperature=1.3, min_p=0.1), SamplingParams()]
        in_batch = Sampler().sample(batch, batch_params, [3, 0, step_index, 1, 8, 2]).token_ids[2]
        assert in_batch == alone


def test_seeded_draws_vary_with_the_step_and_repeat_on_recompute():
    row = torch.zeros(1, VOCAB_SIZE)  # uniform: every token equally likely
    seeded = SamplingParams(temperature=1.0, seed=5)
    first_pass = [Sampler().sample(row, [seeded], [step]).token_ids[0] for step in range(30)]
    recomputed = [Sampler().sample(row, [seeded], [step]).token_ids[0] for step in range(30)]
    assert first_pass == recomputed
    assert len(set(first_pass)) > 10


def test_different_seeds_give_different_draws():
    row = torch.zeros(1, VOCAB_SIZE)
    draws = {Sampler().sample(row, [SamplingParams(seed=seed)], [0]).token_ids[0] for seed in range(30)}
    assert len(draws) > 10


def test_top_k_samples_only_from_the_k_best():
    logits = random_logits(2000)
    tokens = torch.tensor(sample_tokens(logits, SamplingParams(temperature=5.0, top_k=3)))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens.unsqueeze(1)).any(dim=1).all()


def test_top_p_samples_only_from_the_nucleus():
    # Mass before token 1 is 0.5 < 0.7 (kept); before token 2 it is 0.8 >= 0.7 (cut).
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], num_rows=2000)
    tokens = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert set(tokens) == {0, 1}


def test_top_p_of_one_keeps_every_token():
    logits = logits_from_probs([0.25] * 4, num_rows=2000)
    assert set(sample_tokens(logits, SamplingParams(temperature=1.0, top_p=1.0))) == {0, 1, 2, 3}


def test_min_p_drops_tokens_below_its_fraction_of_the_top_probability():
    # min_p 0.3 of the top 0.4 is 0.12: tokens at 0.3 and 0.2 stay, 0.1 is dropped.
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1], num_rows=2000)
    tokens = sample_tokens(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert set(tokens) == {0, 1, 2}


def test_min_p_bound_holds_on_random_logits():
    logits = random_logits(2000)
    min_p = 0.2
    tokens = torch.tensor(sample_tokens(logits, SamplingParams(temperature=1.0, min_p=min_p)))
    probs = logits.softmax(dim=-1)
    sampled_probs = probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert (sampled_probs >= min_p * probs.amax(dim=-1) * (1 - 1e-5)).all()


def test_filters_apply_in_order_top_k_then_top_p():
    # top_k 2 leaves [0.5, 0.3] -> renormalized [0.625, 0.375]; top_p 0.6 then keeps only token 0.
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], num_rows=500)
    assert set(sample_tokens(logits, SamplingParams(top_k=2, top_p=0.6))) == {0}


def test_sampling_follows_the_temperature_scaled_distribution():
    logits = logits_from_probs([0.6, 0.3, 0.1], num_rows=20000)
    tokens = torch.tensor(sample_tokens(logits, SamplingParams(temperature=1.0)))
    frequencies = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(frequencies, torch.tensor([0.6, 0.3, 0.1]), atol=0.02)


def test_low_temperature_concentrates_on_the_top_token():
    logits = logits_from_probs([0.4, 0.35, 0.25], num_rows=2000)
    # At temperature 0.02 the runner-up has (0.35 / 0.4) ** 50, about 0.1%, of the top's weight.
    tokens = sample_tokens(logits, SamplingParams(temperature=0.02))
    assert tokens.count(0) > 0.99 * len(tokens)


def test_logprobs_are_the_raw_log_softmax_of_the_sampled_token():
    logits = random_logits(6)
    params = [SamplingParams(temperature=t, top_k=4, logprobs=True) for t in (0.0, 0.5, 1.0, 2.0, 1.0, 0.0)]
    output = Sampler().sample(logits, params, [0] * 6)
    expected = logits.log_softmax(dim=-1)
    for row, (token_id, logprob) in enumerate(zip(output.token_ids, output.logprobs)):
        assert logprob <= 0.0
        assert math.isclose(logprob, expected[row, token_id].item(), rel_tol=1e-6, abs_tol=1e-6)


def test_logprobs_are_none_for_rows_that_did_not_ask():
    params = [SamplingParams(logprobs=flag) for flag in (True, False, True)]
    output = Sampler().sample(random_logits(3), params, [0] * 3)
    assert [logprob is None for logprob in output.logprobs] == [False, True, False]


def test_mismatched_batch_lengths_are_rejected():
    with pytest.raises(ValueError, match="3 logit rows, 2 sampling params"):
        Sampler().sample(random_logits(3), [SamplingParams()] * 2, [0] * 3)
