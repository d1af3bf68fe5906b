"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against the oracle: a full forward
pass of the built-in model in Hugging Face transformers, log_softmax of its logits at each
position gathered at the next prompt token. The engine's are the same whether the prompt is
prefilled whole or in chunks, found in the prefix cache or not (a request that asks takes no
hits), preempted and recomputed (still handed out once, with the first token); they leak no
blocks, and a request that does not ask computes no logits but its sampling row's.
HEADROOM_TEST_DEVICE=cuda runs the engines on a GPU (the oracle stays on the CPU)."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch
import transformers

from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.outputs import GatheredPromptLogprobs, PromptLogprobArrays, PromptLogprobs, RequestOutput, TopLogprobs
from replica.core.request import SamplingParams
from replica.errors import InvalidRequestError
from replica.front.async_engine import MergingOutput
from replica.model.builtin import VOCAB_SIZE
from replica.model.registry import resolve_model_path

TOP = 3
TEST_DEVICE = os.environ.get("HEADROOM_TEST_DEVICE", "cpu")
# fp32 on both sides, different kernels (HF's eager attention against the engine's paged one).
ATOL = 2e-5


def _prompts(lengths=(1, 2, 9, 23, 40), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin"),
                                                             torch_dtype=torch.float32).eval()


def oracle(hf_model, prompt: list[int]) -> tuple[list[float], list[int], list[list[int]]]:
    """Per prompt token after the first: its logprob given the tokens before it, its rank and the
    TOP most likely ids there, from one full forward pass."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long)).logits[0]
    logprobs = logits.float().log_softmax(dim=-1)[:-1]
    targets = torch.tensor(prompt[1:])
    token_logprobs = logprobs.gather(-1, targets.unsqueeze(1))
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # vLLM v1's: a tie takes its worst rank
    return token_logprobs.squeeze(1).tolist(), ranks.tolist(), logprobs.topk(TOP, dim=-1).indices.tolist()


def engine(**overrides) -> LLMEngine:
    config = dict(block_size=4, num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=256, max_num_seqs=8)
    return LLMEngine(make_engine_config(**{**config, **overrides}), "builtin", device=TEST_DEVICE)


def run(llm: LLMEngine, prompts, params: SamplingParams, prefix: str = "p") -> tuple[list, list[list[RequestOutput]]]:
    requests = [llm.make_request(f"{prefix}{index}", prompt, params) for index, prompt in enumerate(prompts)]
    for request in requests:
        llm.add_request(request, detokenize=False)
    outputs: dict[str, list[RequestOutput]] = {request.request_id: [] for request in requests}
    while llm.has_unfinished_requests():
        for output in llm.step():
            outputs[output.request_id].append(output)
        llm.scheduler.check_invariants()
    kv_cache = llm.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "a request leaked KV blocks"
    return requests, [outputs[request.request_id] for request in requests]


def handed_out(outputs: list[RequestOutput]) -> PromptLogprobs:
    """The prompt logprobs of one request's outputs: on its first output, and on no other."""
    assert outputs[0].prompt_logprobs is not None
    assert all(output.prompt_logprobs is None for output in outputs[1:])
    return outputs[0].prompt_logprobs


def check_against_oracle(hf_model, prompt: list[int], gathered: PromptLogprobs) -> None:
    logprobs, ranks, top_ids = oracle(hf_model, prompt)
    assert len(gathered.logprobs) == len(gathered.ranks) == len(gathered.top) == len(prompt) - 1
    assert gathered.logprobs == pytest.approx(logprobs, abs=ATOL)
    assert gathered.ranks == ranks
    assert [top.token_ids for top in gathered.top] == top_ids
    for top, token_logprob, rank in zip(gathered.top, gathered.logprobs, gathered.ranks):
        assert top.logprobs == sorted(top.logprobs, reverse=True)
        assert (rank == 1) == (token_logprob == top.logprobs[0])


@pytest.mark.parametrize("budget, threshold", [(256, 0), (7, 0), (64, 5)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_equal_a_full_forward_pass_prefilled_whole_or_in_chunks(hf_model, budget, threshold,
                                                                                  async_scheduling):
    # A budget of 7 (or a threshold of 5) cuts the 40-token prompt into 6 (or 8) chunks, each in a step of its own.
    llm = engine(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                 async_scheduling=async_scheduling)
    prompts = _prompts()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    requests, outputs = run(llm, prompts, params)
    for prompt, request_outputs in zip(prompts, outputs):
        check_against_oracle(hf_model, prompt, handed_out(request_outputs))
    # Each prompt position's logits once, none of the generated tokens'.
    assert llm.runner.num_prompt_logprob_rows == sum(len(prompt) - 1 for prompt in prompts)


def test_prompt_logprobs_zero_give_the_prompt_tokens_own_without_alternatives(hf_model):
    prompt = _prompts((12,))[0]
    _, outputs = run(engine(), [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    gathered = handed_out(outputs[0])
    logprobs, ranks, _ = oracle(hf_model, prompt)
    assert gathered.top is None and gathered.ranks == ranks
    assert gathered.logprobs == pytest.approx(logprobs, abs=ATOL)


def test_a_prefix_cache_warm_prompt_still_gets_its_prompt_logprobs_and_its_twin_the_same(hf_model):
    """Cached tokens have no logits: a request that asks takes no hits, so a prompt the cache
    holds gets every position's logprob, twice alike; its blocks are still cached for others."""
    llm = engine(enable_prefix_caching=True)
    prompt = _prompts((33,))[0]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    requests, outputs = run(llm, [prompt], params, prefix="first")
    # Without prompt logprobs the same prompt hits the blocks that request cached (8 full blocks
    # short of the last token).
    plain, _ = run(llm, [prompt], SamplingParams(max_tokens=2, temperature=0.0), prefix="plain")
    assert plain[0].num_cached_tokens == 32
    hits_before = llm.scheduler.kv_cache.prefix_cache_hits
    twin_requests, twin_outputs = run(llm, [prompt], params, prefix="twin")
    first, twin = handed_out(outputs[0]), handed_out(twin_outputs[0])
    check_against_oracle(hf_model, prompt, first)
    assert twin == first
    assert requests[0].num_cached_tokens == twin_requests[0].num_cached_tokens == 0
    assert llm.scheduler.kv_cache.prefix_cache_hits == hits_before
    assert plain[0].output_token_ids == requests[0].output_token_ids == twin_requests[0].output_token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_preempted_mid_prefill_and_recomputed_hands_out_its_prompt_logprobs_once(hf_model,
                                                                                          async_scheduling):
    # 16 usable blocks of 4 tokens for prompts of 16, 20 and 24 tokens (prefilled 8 a step) that
    # grow by 30: the latest admission is preempted mid-prefill (and, under async scheduling,
    # again with its first token in flight) and recomputed from scratch.
    llm = engine(num_kv_blocks=17, max_model_len=64, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    preempted_before_first_token = []
    preempt = llm.scheduler._preempt

    def probe(running_index: int) -> None:
        victim = llm.scheduler.running[running_index]
        if not victim.output_token_ids and victim.num_computed_tokens > 0:
            preempted_before_first_token.append(victim.request_id)
        preempt(running_index)

    llm.scheduler._preempt = probe
    prompts = _prompts((16, 20, 24), seed=3)
    requests, outputs = run(llm, prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                         prompt_logprobs=TOP))
    assert preempted_before_first_token, "the cramped pool must preempt a request mid-prefill"
    for prompt, request_outputs in zip(prompts, outputs):
        check_against_oracle(hf_model, prompt, handed_out(request_outputs))
    # The recomputed prefill took no logits for the positions gathered before its preemption.
    assert llm.runner.num_prompt_logprob_rows == sum(len(prompt) - 1 for prompt in prompts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_lets_go_of_its_prompt_logprobs_once_its_first_output_carried_them(async_scheduling):
    """The core held them (a 128k-token prompt's top 20: millions of entries) for the request's
    whole life, long after its first output had sent them."""
    llm = engine(max_num_batched_tokens=4, async_scheduling=async_scheduling)
    request = llm.make_request("r", _prompts((10,))[0], SamplingParams(max_tokens=20, ignore_eos=True,
                                                                        prompt_logprobs=2))
    llm.add_request(request, detokenize=False)
    rows = []
    while not rows:
        rows = llm.step_rows()
    assert PromptLogprobs.from_wire(rows[0][8]).ranks and not request.is_finished
    assert request.prompt_logprobs is None
    while llm.has_unfinished_requests():
        assert all(row[8] is None for row in llm.step_rows())


@pytest.mark.parametrize("steps_before_abort", [1, 2])  # the old prompt's chunk from position 0 in flight, or from 8
def test_a_step_in_flight_gives_its_prompt_logprobs_to_its_own_request_not_a_new_one_under_its_id(hf_model,
                                                                                                 steps_before_abort):
    """Under async scheduling a step's prompt logprobs were added to whatever request held the id
    when the step completed: one aborted meanwhile and a new request under its id got the old
    prompt's values, or (the old one a chunk further on) PromptLogprobs.extend raised and failed
    the whole step. The step's own request objects are matched, the aborted one skipped."""
    llm = engine(max_num_batched_tokens=8, async_scheduling=True)
    old_prompt, new_prompt = _prompts((24, 24), seed=5)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    llm.add_request(llm.make_request("r", old_prompt, params), detokenize=False)
    other = llm.make_request("other", new_prompt[:12], params)  # keeps the engine busy throughout
    llm.add_request(other, detokenize=False)
    for _ in range(steps_before_abort):
        assert llm.step() == []
    assert llm.abort_request("r") is not None
    new = llm.make_request("r", new_prompt, params)
    llm.add_request(new, detokenize=False)
    outputs: dict[str, list[RequestOutput]] = {"r": [], "other": []}
    while llm.has_unfinished_requests():
        for output in llm.step():
            outputs[output.request_id].append(output)
    check_against_oracle(hf_model, new_prompt, handed_out(outputs["r"]))
    check_against_oracle(hf_model, new_prompt[:12], handed_out(outputs["other"]))
    kv_cache = llm.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks


def test_a_request_without_prompt_logprobs_computes_no_full_vocabulary_logits_past_its_sampling_row():
    llm = engine(max_num_batched_tokens=16)
    run(llm, _prompts(), SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=2))
    assert llm.runner.num_prompt_logprob_rows == 0
    _, outputs = run(llm, _prompts((20,)), SamplingParams(max_tokens=3, prompt_logprobs=0), prefix="asks")
    assert llm.runner.num_prompt_logprob_rows == 19 and len(handed_out(outputs[0]).logprobs) == 19


def test_the_engine_cores_rows_carry_the_prompt_logprobs_the_outputs_carry():
    prompt, params = _prompts((10,))[0], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    by_kind = {}
    for kind in ("outputs", "rows"):
        llm = engine(max_num_batched_tokens=4)
        llm.add_request(llm.make_request("r", prompt, params), detokenize=False)
        steps = []
        while llm.has_unfinished_requests():
            steps += llm.step() if kind == "outputs" else llm.step_rows()
        by_kind[kind] = steps
    rows, outputs = by_kind["rows"], by_kind["outputs"]
    assert [row[8] is None for row in rows] == [output.prompt_logprobs is None for output in outputs]
    assert PromptLogprobs.from_wire(rows[0][8]) == outputs[0].prompt_logprobs
    # Numpy arrays, not lists: an 8k-token prompt's top 20 as lists took ~12 ms of the core's GIL
    # to pickle (on the channel's sender thread, beside the step loop).
    logprobs, ranks, top_ids, top_logprobs = rows[0][8]
    assert all(isinstance(values, np.ndarray) for values in rows[0][8])
    assert logprobs.shape == ranks.shape == (9,) and top_ids.shape == top_logprobs.shape == (9, 2)
    assert PromptLogprobs.from_wire(pickle.loads(pickle.dumps(rows[0][8]))) == outputs[0].prompt_logprobs


def test_a_merged_output_keeps_the_first_outputs_prompt_logprobs():
    gathered = PromptLogprobs([-1.0], [2], None)
    first = RequestOutput("r", [1], "a", None, 2, 1, 0, prompt_logprobs=gathered)
    later = RequestOutput("r", [2], "b", "length", 2, 2, 0)
    assert MergingOutput(first).add(later).output().prompt_logprobs == gathered


def test_positions_a_recompute_repeats_are_kept_once():
    def arrays(logprobs, ranks, top_ids, top_logprobs):
        return PromptLogprobArrays(np.array(logprobs, np.float32), np.array(ranks, np.int32),
                                   np.array(top_ids, np.int32), np.array(top_logprobs, np.float32))

    gathered = GatheredPromptLogprobs(1)
    gathered.extend(0, arrays([-1.0, -2.0], [1, 2], [[4], [5]], [[-1.0], [-1.5]]))
    gathered.extend(1, arrays([-2.0, -3.0], [2, 3], [[5], [6]], [[-1.5], [-0.5]]))
    gathered.extend(2, arrays([-3.0], [3], [[6]], [[-0.5]]))
    assert gathered.num_positions == 3
    assert gathered.unpack() == PromptLogprobs([-1.0, -2.0, -3.0], [1, 2, 3], [
        TopLogprobs([4], [-1.0]), TopLogprobs([5], [-1.5]), TopLogprobs([6], [-0.5])])
    with pytest.raises(RuntimeError, match="from position 5 follow only 3"):
        gathered.extend(5, arrays([-1.0], [1], [[1]], [[-1.0]]))


@pytest.mark.parametrize("value, says", [(21, "must be in [0, 20]"), (-1, "must be in [0, 20]"),
                                         (2.0, "must be an integer")])
def test_prompt_logprobs_out_of_range_is_refused_naming_the_field(value, says):
    llm_params = SamplingParams(max_tokens=1, prompt_logprobs=value)
    with pytest.raises(InvalidRequestError) as raised:
        llm_params.validate(prompt_len=3, max_model_len=64)
    assert raised.value.field == "prompt_logprobs" and says in raised.value.message
