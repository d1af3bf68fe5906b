"""The real default model, SmolLM2-135M-Instruct from its Q4_1 GGUF: the rebuilt tokenizer
equals transformers' own GGUF tokenizer, the engine's greedy tokens equal HF generate() on the
converted checkpoint (fp32, 16 prompts, 32 new tokens) under chunking in a cramped pool
(preemption probed) and prefix caching, and the instruct model answers. (The weights'
conversion is checked against transformers' own GGUF loading, type by type, in test_gguf.py.)"""

from __future__ import annotations

import concurrent.futures
from typing import Iterator

import pytest
import torch
import transformers

from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.text.tokenizer import Tokenizer

MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colours.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "Name a famous painting by Leonardo da Vinci.",
    "What does a bee make?",
    "Describe a cat in one sentence.",
    "What is the boiling point of water in Celsius?",
]
# With a system message of their own, so these two share a prefix the others do not.
SYSTEM = "You are a terse assistant. Always answer in as few words as possible, and never apologise."
TEXTS = [  # multilingual, emoji, code, whitespace, and the chat's special tokens
    "Hello world! 12345 3.14159 — naïve café, Straße, Ünïcödé",
    "日本語のテキストと中文文本，한국어 텍스트, русский текст, العربية, हिन्दी",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 and ZWJ sequences",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint({'a': [1, 2]})",
    "   leading and trailing spaces   \n\n\n  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "URLs https://example.com/a?b=c&d=e#f and e-mail someone@example.org",
]


def chat_prompt(tokenizer: Tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Both sides on one intra-op thread. Token equality does not depend on it, and on a busy
    2-core machine two threads that wait for each other at every op ran a 16x576 GEMM 28 ms
    instead of 1 ms: a 135M model's 16 x 32 HF tokens took minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_prompt(tokenizer, question) for question in QUESTIONS] + [
        chat_prompt(tokenizer, "What colour is grass?", SYSTEM), chat_prompt(tokenizer, "Is ice cold?", SYSTEM)]


@pytest.fixture(scope="module")
def beside(one_torch_thread, smollm2_dir, prompts) -> Iterator[dict[str, concurrent.futures.Future]]:
    """Work run in this order on a thread beside the tests, on one intra-op thread as theirs: HF
    generate()'s tokens (the first test's engine run takes the other core meanwhile), then the
    prefix-cache test's engine run (beside the cramped-pool test's). The tokens are the same
    either way; the module took ~36 s one run at a time, ~24 s two at once on two cores."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="smollm2-beside")
    try:
        yield {"hf": pool.submit(hf_generate, smollm2_dir, prompts),
               "prefix_cached": pool.submit(prefix_cached_run, smollm2_dir, prompts)}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # what no test asked for (a test run alone) is not run


@pytest.fixture(scope="module")
def hf_outputs(beside) -> list[list[int]]:
    return beside["hf"].result()


def hf_generate(smollm2_dir, prompts) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # Past EOS like the engine's ignore_eos (min_new_tokens would instead forbid EOS, changing the tokens).
    model.generation_config.eos_token_id = None
    # One left-padded batch: 8 s where one prompt at a time took 50 s on two cores, and the same
    # tokens (the padding is masked out; checked on every prompt against the one-at-a-time run
    # when this changed, 2026-11-29).
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[2] * (width - len(prompt)) + prompt for prompt in prompts])
    attention_mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    with torch.inference_mode():
        generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS,
                                   do_sample=False, pad_token_id=2)
    outputs = generated[:, width:].tolist()
    assert all(len(output) == MAX_NEW_TOKENS for output in outputs)
    return outputs


def engine(model_dir, **overrides) -> LLMEngine:
    config = dict(block_size=16, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=512)
    return LLMEngine(make_engine_config(**{**config, **overrides}), str(model_dir), device="cpu", dtype="float32")


def prefix_cached_run(model_dir, prompts) -> tuple[LLMEngine, list[list[int]]]:
    """test_prefix_cache_hits_keep_the_tokens' engine and its tokens for the prompts."""
    llm = engine(model_dir, enable_prefix_caching=True)
    llm.generate(prompts[:1], GREEDY)  # caches the default system prompt every other prompt opens with
    return llm, llm.generate(prompts, GREEDY)


def test_sixteen_prompts_of_real_weights_generate_hf_generates_tokens(smollm2_dir, prompts, beside):
    assert len(prompts) == 16
    llm = engine(smollm2_dir)
    assert llm.generate(prompts, GREEDY) == beside["hf"].result()  # HF generates them meanwhile
    assert llm.scheduler.kv_cache.num_free_blocks == llm.scheduler.kv_cache.num_usable_blocks


def test_chunked_prefill_in_a_cramped_pool_that_preempts_keeps_the_tokens(smollm2_dir, prompts, hf_outputs):
    # Prompts prefilled 13 tokens at a time (each is longer), in 32 usable blocks of 16 tokens
    # against the batch's ~1,200: preempts, without recomputing every prompt many times over
    # (each recompute is a 30-layer prefill). One run for both: each alone took 8-12 s.
    assert min(len(prompt) for prompt in prompts) > 13, "every prompt must be prefilled in chunks"
    llm = engine(smollm2_dir, num_kv_blocks=33, max_num_batched_tokens=128, long_prefill_token_threshold=13)
    assert llm.generate(prompts, GREEDY) == hf_outputs
    assert llm.scheduler.counters.preemptions > 0, "the cramped pool must really preempt"


def test_prefix_cache_hits_keep_the_tokens(beside, hf_outputs):
    llm, outputs = beside["prefix_cached"].result()  # run beside the cramped-pool test: prefix_cached_run
    assert outputs == hf_outputs
    assert llm.scheduler.kv_cache.prefix_cache_hits >= 14 * 16, "each prompt's system prefix must come from cache"


def test_the_instruct_model_answers_through_its_chat_template(smollm2_dir, tokenizer):
    llm = engine(smollm2_dir)
    prompt = chat_prompt(tokenizer, "What is the capital of France? Answer in one sentence.")
    (answer,) = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))
    assert answer[-1] == tokenizer.eos_token_id  # <|im_end|> ends the turn
    assert "Paris" in tokenizer.decode(answer)


def test_tokenizer_equals_transformers_gguf_tokenizer_encoding_and_decoding(smollm2_gguf, tokenizer):
    reference = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=True)
        assert tokenizer.encode(text) == expected, text
        assert tokenizer.decode(expected, skip_special_tokens=False) == reference.decode(expected), text
        assert tokenizer.decode(expected) == reference.decode(expected, skip_special_tokens=True), text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert tokenizer.vocab_size == len(reference)
