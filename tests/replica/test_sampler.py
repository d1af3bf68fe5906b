"""Sampler: greedy is argmax, filters bound what can be drawn, seeds make draws reproducible
whatever the batch, and a whole batch is sampled on the device without reading it back;
logit_bias and penalties (logits_processors.py) count a token still in flight as history,
and top logprobs come out as device tensors."""

import math

import numpy as np
import pytest
import torch

from replica.executor.counter_rng import exponential_noise
from replica.executor.sampler import (
    LogitsProcessing, Sampler, SamplerOutput, SamplingArrays, SamplingBatch, logprobs_of,
)
from replica.executor.logits_processors import Penalties, apply_logits_processors, process_logits
from replica.core.request import SamplingParams

VOCAB_SIZE = 64


@pytest.fixture(autouse=True)
def deterministic_global_rng():
    """Unseeded rows draw from the global RNG; fix it so the statistical tests cannot flake."""
    torch.manual_seed(0)


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 3


def logits_from_probs(probs: list[float], num_rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(num_rows, -1).clone()


def sample(logits: torch.Tensor, params: list[SamplingParams], step_indices: list[int]) -> SamplerOutput:
    return Sampler().sample(logits, SamplingBatch.of_params(params, step_indices, logits.shape[-1], logits.device))


def sample_ids(logits: torch.Tensor, params: list[SamplingParams], step_indices: list[int]) -> list[int]:
    return sample(logits, params, step_indices).token_ids.tolist()


def sample_tokens(logits: torch.Tensor, params: SamplingParams, step_index: int = 0) -> list[int]:
    """One draw per row, every row with the same (unseeded or seeded) params."""
    num_rows = logits.shape[0]
    return sample_ids(logits, [params] * num_rows, [step_index] * num_rows)


def test_greedy_picks_the_argmax_of_every_row():
    logits = random_logits(8)
    output = sample(logits, [SamplingParams(temperature=0.0)] * 8, [0] * 8)
    assert output.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert output.logprobs is None


def test_greedy_breaks_ties_toward_the_lowest_token_id():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, [7, 3, 40]] = 5.0
    assert sample_ids(logits, [SamplingParams(temperature=0.0)], [0]) == [3]


def test_a_tokens_rank_counts_every_token_at_least_as_likely_so_a_tie_takes_its_worst_rank():
    """vLLM v1's convention (batched_count_greater_than: x >= value): two tokens tied for the most
    likely are both rank 2, not 1 (vLLM v0's, which this counted before), so a prompt_logprobs
    entry's rank agrees with vLLM's."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5]] * 3 + [[2.0, 2.0, 2.0, 2.0]])
    token_logprobs, ranks, top_logprobs, top_ids = logprobs_of(logits, torch.tensor([1, 2, 3, 0]), 2)
    assert ranks.tolist() == [2, 2, 4, 4]
    assert token_logprobs.tolist() == logits.log_softmax(dim=-1)[[0, 1, 2, 3], [1, 2, 3, 0]].tolist()
    assert top_ids[0].tolist() == [1, 2] and top_logprobs[0, 0] == top_logprobs[0, 1]
    untied = logprobs_of(torch.tensor([[1.0, 3.0, 2.0]]), torch.tensor([1]), 0)
    assert untied[1].tolist() == [1] and untied[2] is None


def test_greedy_ignores_the_seed_and_the_filters():
    logits = random_logits(1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=0.0, seed=2, top_k=1, top_p=0.1, min_p=0.9),
    ]
    tokens = {sample_ids(logits, [p], [step])[0] for p in params for step in range(3)}
    assert tokens == {logits.argmax().item()}


def test_same_seed_and_step_gives_the_same_token_in_any_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)
    target_row = random_logits(1, seed=7)
    for step_index in range(20):
        alone = sample_ids(target_row, [seeded], [step_index])[0]
        neighbours = random_logits(5, seed=step_index)
        batch = torch.cat([neighbours[:2], target_row, neighbours[2:]])
        batch_params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0), seeded,
                        SamplingParams(seed=99), SamplingParams(temperature=1.3, min_p=0.1), SamplingParams()]
        in_batch = sample_ids(batch, batch_params, [3, 0, step_index, 1, 8, 2])[2]
        assert in_batch == alone


def test_seeded_draws_vary_with_the_step_and_repeat_on_recompute():
    row = torch.zeros(1, VOCAB_SIZE)  # uniform: every token equally likely
    seeded = SamplingParams(temperature=1.0, seed=5)
    first_pass = [sample_ids(row, [seeded], [step])[0] for step in range(30)]
    recomputed = [sample_ids(row, [seeded], [step])[0] for step in range(30)]
    assert first_pass == recomputed
    assert len(set(first_pass)) > 10


def test_different_seeds_give_different_draws():
    row = torch.zeros(1, VOCAB_SIZE)
    draws = {sample_ids(row, [SamplingParams(seed=seed)], [0])[0] for seed in range(30)}
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


def test_a_top_p_below_the_smallest_32_bit_float_keeps_the_best_token():
    """1e-46 is a valid top_p (> 0) that the sampler's float32 holds as 0: every token was
    masked, and id 0 won however unlikely. The best token always stays."""
    logits = logits_from_probs([0.1, 0.2, 0.6, 0.1], num_rows=50)
    assert set(sample_tokens(logits, SamplingParams(temperature=1.0, top_p=1e-46))) == {2}


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
    output = sample(logits, params, [0] * 6)
    expected = logits.log_softmax(dim=-1)
    for row, (token_id, logprob) in enumerate(zip(output.token_ids.tolist(), output.logprobs.tolist())):
        assert logprob <= 0.0
        assert math.isclose(logprob, expected[row, token_id].item(), rel_tol=1e-6, abs_tol=1e-6)


def test_logprobs_are_computed_only_when_a_row_asks():
    assert sample(random_logits(3), [SamplingParams()] * 3, [0] * 3).logprobs is None
    assert sample(random_logits(3), [SamplingParams(logprobs=flag) for flag in (True, False, True)],
                  [0] * 3).logprobs.shape == (3,)


def test_mismatched_batch_lengths_are_rejected():
    batch = SamplingBatch.of(SamplingArrays.of([SamplingParams()] * 2, VOCAB_SIZE), np.zeros(2), "cpu")
    with pytest.raises(ValueError, match="3 logit rows for a sampling batch of 2 rows"):
        Sampler().sample(random_logits(3), batch)


def test_a_whole_mixed_batch_samples_without_reading_a_tensor_on_the_host():
    # Meta tensors have shapes but no data: .item(), .tolist(), bool() or a data-dependent
    # shape (boolean masks, nonzero) raise. What runs here never waits for a GPU either.
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5, seed=3),
              SamplingParams(top_p=0.9, min_p=0.1), SamplingParams(seed=-7, logprobs=True)]
    arrays = SamplingArrays.of(params, VOCAB_SIZE)
    batch = SamplingBatch.of(arrays, np.arange(4), "meta")
    output = Sampler().sample(torch.empty(4, VOCAB_SIZE, device="meta"), batch)
    assert output.token_ids.shape == (4,) and output.logprobs.shape == (4,)
    assert output.top_token_ids is None
    # Rows that ask for logit_bias and alternatives add work, still without a host read.
    params[1] = SamplingParams(temperature=0.8, logit_bias=((3, 5.0),), top_logprobs=4)
    output = Sampler().sample(torch.empty(4, VOCAB_SIZE, device="meta"),
                              SamplingBatch.of_params(params, range(4), VOCAB_SIZE, "meta"))
    assert output.top_token_ids.shape == output.top_logprobs.shape == (4, 4)
    # Penalties count every row's tokens (torch.bincount would read its largest key back).
    params[2] = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    histories = [History([1, 2], [3]), History([4], [5, 5]), History([6, 7], [8]), History([9], [])]
    output = Sampler().sample(torch.empty(4, VOCAB_SIZE, device="meta"),
                              SamplingBatch.of_params(params, range(4), VOCAB_SIZE, "meta", histories))
    assert output.token_ids.shape == (4,)


class History:
    def __init__(self, prompt_token_ids, output_token_ids):
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids


def test_penalties_count_an_output_token_still_in_flight_as_history():
    # Async scheduling: the token sampled by the step in flight is on the device only; the
    # rows' persistent state counted it there, as if the history held it.
    logits = random_logits(3, seed=5)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    known = [History([1, 2], [7, 9]), History([3], []), History([4], [8])]
    with_pending = [History([1, 2], [7, 9, 9]), History([3], []), History([4], [8])]
    arrays = SamplingArrays.of(params, VOCAB_SIZE)
    counted = Penalties.of_histories(params, known, VOCAB_SIZE, "cpu")
    counted.state.count(torch.tensor([0]), torch.tensor([9]))
    whole = Penalties.of_histories(params, with_pending, VOCAB_SIZE, "cpu")
    assert torch.equal(process_logits(logits, None, counted), process_logits(logits, None, whole))
    assert torch.equal(process_logits(logits, None, whole), apply_logits_processors(logits, params, with_pending))
    batch = SamplingBatch.of(arrays, np.zeros(3), "cpu", LogitsProcessing(None, counted))
    expected = SamplingBatch.of(arrays, np.zeros(3), "cpu", LogitsProcessing(None, whole))
    assert torch.equal(Sampler().sample(logits, batch).token_ids, Sampler().sample(logits, expected).token_ids)


def test_top_logprobs_are_the_raw_logits_best_and_only_computed_when_a_row_asks():
    logits = random_logits(3, seed=2)
    assert sample(logits, [SamplingParams(temperature=0.0, logprobs=True)] * 3, [0] * 3).top_token_ids is None
    params = [SamplingParams(temperature=0.0, top_logprobs=3, logit_bias=((0, 50.0),)), SamplingParams(),
              SamplingParams(temperature=0.0, top_logprobs=2)]
    output = sample(logits, params, [0] * 3)
    values, ids = logits.log_softmax(dim=-1).topk(3, dim=-1)  # of the raw logits: before the bias
    assert torch.equal(output.top_token_ids, ids) and torch.allclose(output.top_logprobs, values)
    assert output.token_ids[0].item() == 0  # the bias did move the sample
    assert output.token_ids[2].item() == output.top_token_ids[2, 0].item()  # greedy: the best alternative
    assert output.logprobs[2].item() == pytest.approx(values[2, 0].item(), abs=1e-6)


def test_top_k_of_the_whole_vocabulary_or_more_is_off():
    arrays = SamplingArrays.of([SamplingParams(top_k=VOCAB_SIZE), SamplingParams(top_k=10**6), SamplingParams(top_k=0)],
                               VOCAB_SIZE)
    assert arrays.top_k.tolist() == [0, 0, 0]


def test_seeded_noise_depends_on_seed_step_and_token_only():
    seeds = torch.tensor([5, 5, 6, 2**63 - 1, -(2**63)])
    steps = torch.tensor([0, 1, 0, 7, 7])
    noise = exponential_noise(seeds, steps, 1000)
    # The same (seed, step) in another batch, at another row, gives the same noise.
    assert torch.equal(exponential_noise(seeds[[3, 0]], steps[[3, 0]], 1000), noise[[3, 0]])
    # Another step or another seed gives unrelated noise.
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


def test_seeded_noise_is_exponentially_distributed():
    noise = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096).flatten()
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e; 262k draws pin each within a percent.
    assert abs(noise.mean().item() - 1.0) < 0.01
    assert abs(noise.var().item() - 1.0) < 0.02
    assert abs((noise > 1.0).float().mean().item() - math.exp(-1)) < 0.005
    # Neighbouring tokens are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([noise[:-1], noise[1:]]))[0, 1].item()) < 0.01
