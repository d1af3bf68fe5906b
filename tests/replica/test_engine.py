"""The whole engine against the correctness oracle: greedy output equals HF transformers'
generate() on the same checkpoint, and stays equal under chunking, a cramped pool
(preemption, probed) and prefix caching; sampling and abort behave."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from replica.builtin_model import build_byte_level_tokenizer
from replica.config import make_engine_config
from replica.engine import LLMEngine
from replica.request import SamplingParams

VOCAB = 320  # the byte-level test tokenizer's size
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _save_checkpoint(hf_config, path):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # spread weights so greedy argmax has clear winners
        for name, param in hf_model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    hf_model.save_pretrained(path, safe_serialization=True)
    build_byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    hf_config = (transformers.LlamaConfig(**SHAPE) if request.param == "llama"
                 else transformers.Qwen2Config(**SHAPE))
    path = tmp_path_factory.mktemp(request.param)
    hf_model = _save_checkpoint(hf_config, path)
    return path, hf_model


def _prompts():
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(16)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 41)]
    prompts += [prefix + [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 7)]  # shared prefix
    return prompts


@pytest.fixture(scope="module")
def hf_outputs(checkpoint):
    _, hf_model = checkpoint
    outputs = []
    for prompt in _prompts():  # one at a time: no padding can perturb the reference
        input_ids = torch.tensor([prompt])
        generated = hf_model.generate(  # explicit mask: HF would treat prompt tokens equal to pad as padding
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0,
        )
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def _engine(path, **overrides) -> LLMEngine:
    config = dict(block_size=4, num_kv_blocks=256, max_model_len=64, max_num_batched_tokens=256)
    config.update(overrides)
    return LLMEngine(make_engine_config(**config), str(path), device="cpu", dtype="float32")


def test_greedy_matches_hf_generate_for_a_mixed_batch(checkpoint, hf_outputs):
    engine = _engine(checkpoint[0])
    assert engine.generate(_prompts(), GREEDY) == hf_outputs
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_usable_blocks


@pytest.mark.parametrize("budget, threshold", [(5, 0), (16, 7)])
def test_greedy_matches_hf_with_chunked_prefill(checkpoint, hf_outputs, budget, threshold):
    engine = _engine(checkpoint[0], max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    assert engine.generate(_prompts(), GREEDY) == hf_outputs


def test_greedy_matches_hf_in_a_cramped_pool_that_preempts(checkpoint, hf_outputs):
    # 16 usable blocks of 4 tokens: far less than the batch's ~290 tokens.
    engine = _engine(checkpoint[0], num_kv_blocks=17, max_num_batched_tokens=32)
    assert engine.generate(_prompts(), GREEDY) == hf_outputs
    assert engine.scheduler.counters.preemptions > 0, "the cramped pool must really preempt"


def test_greedy_matches_hf_with_prefix_cache_hits(checkpoint, hf_outputs):
    engine = _engine(checkpoint[0], enable_prefix_caching=True)
    prompts = _prompts()
    engine.generate(prompts[5:6], GREEDY)  # warms the cache with the shared prefix
    assert engine.generate(prompts, GREEDY) == hf_outputs
    assert engine.scheduler.kv_cache.prefix_cache_hits >= 16, "the shared prefix must be served from cache"
    uncached = _engine(checkpoint[0], enable_prefix_caching=False)
    assert uncached.generate(prompts, GREEDY) == hf_outputs


def test_seeded_sampling_is_reproducible_and_independent_of_batch_neighbours(checkpoint):
    engine = _engine(checkpoint[0])
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], seeded)[0]
    in_batch = engine.generate([[1, 2], [5, 6, 7], [9] * 20], seeded)[1]
    other_seed = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert alone == in_batch
    assert alone != other_seed


def test_abort_mid_generation_returns_every_block(checkpoint):
    engine = _engine(checkpoint[0])
    requests = [engine.make_request(f"r{i}", list(range(1, 30 + i)), SamplingParams(max_tokens=30, ignore_eos=True))
                for i in range(4)]
    for request in requests:
        engine.add_request(request)
    for _ in range(5):
        engine.step()
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.num_free_blocks < kv_cache.num_usable_blocks
    for request in requests:
        engine.abort_request(request.request_id)
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_streamed_text_deltas_concatenate_to_the_full_decode():
    engine = LLMEngine(make_engine_config(max_model_len=256, num_kv_blocks=64), "builtin", device="cpu")
    request = engine.make_request("t", engine.tokenizer.encode("héllo wörld ✓"), SamplingParams(max_tokens=40, seed=3))
    engine.add_request(request)
    text, finish = "", None
    while engine.has_unfinished_requests():
        for output in engine.step():
            text += output.text
            finish = output.finish_reason
    assert finish in ("stop", "length")
    assert text == engine.tokenizer.decode(request.output_token_ids)


def _run_to_completion(engine: LLMEngine, prompt: str, params: SamplingParams):
    request = engine.make_request(f"r-{id(params)}", engine.tokenizer.encode(prompt), params)
    engine.add_request(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return request, outputs


@pytest.fixture(scope="module")
def builtin_engine() -> LLMEngine:
    return LLMEngine(make_engine_config(max_model_len=256, num_kv_blocks=64), "builtin", device="cpu")


def test_stop_token_id_is_reported_as_the_stop_reason(builtin_engine):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    request, _ = _run_to_completion(builtin_engine, "abc", greedy)
    stop_token = request.output_token_ids[3]
    _, outputs = _run_to_completion(builtin_engine, "abc", SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_token,)))
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop_token


def test_top_logprobs_come_with_every_token_and_rank_the_greedy_choice_first(builtin_engine):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=4)
    request, outputs = _run_to_completion(builtin_engine, "hi", params)
    tops = [top for output in outputs for top in output.top_logprobs]
    assert len(tops) == 6 and all(len(top.token_ids) == 4 for top in tops)
    assert [top.token_ids[0] for top in tops] == request.output_token_ids
    assert all(top.logprobs == sorted(top.logprobs, reverse=True) for top in tops)
    logprobs = [logprob for output in outputs for logprob in output.logprobs]
    assert logprobs == pytest.approx([top.logprobs[0] for top in tops])


def test_repetition_penalty_changes_greedy_output_and_penalty_free_requests_do_not_change(builtin_engine):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first, _ = _run_to_completion(builtin_engine, "la la la la", plain)
    penalized, _ = _run_to_completion(builtin_engine, "la la la la", SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.0))
    again, _ = _run_to_completion(builtin_engine, "la la la la", plain)
    assert penalized.output_token_ids != first.output_token_ids
    assert again.output_token_ids == first.output_token_ids
