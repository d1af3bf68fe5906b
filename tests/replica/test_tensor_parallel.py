"""Tensor-parallel replicas on the CPU: 2 gloo ranks (this process and one worker process).
Greedy output at TP=2 equals TP=1 token for token, with KV heads divided (the built-in model's
4) and replicated (a tiny model with 1 KV head and an odd vocabulary, padded), under chunked
prefill, prefix caching, preemption and padded decode; seeded samples and a grammar's
constraint too; SmolLM2 at TP=3 (its 9 heads rule out 2) as at TP=1; the load report counts
the whole replica's KV; each rank loads only its slices; a cramped pool swapping to every rank's host
shard, and a prefix spilled there, give TP=1's tokens; the ranks size a profiled pool to the
tightest GPU; the SLO abort is a vote every rank reaches at every layer boundary of an
abortable step, cast over the host (control) group, which a peer killed or hung in it fails
within the collective timeout; a dead worker takes the replica down."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from replica.config import ConfigError, make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import RequestStatus, SamplingParams
from replica.core.slo import AbortOrder
from replica.core.preemption_mode import UNMEASURED_COSTS
from replica.core.structured_output import StructuredOutput
from replica.executor.cuda_graphs import capture_sizes, padded_batch_size
from replica.executor.memory_profile import MemoryProfile, kv_cache_bytes_per_block
from replica.executor.rank_config import resolve_rank_config
from replica.front.async_engine import AsyncEngine
from replica.front.core_client import EngineDeadError
from replica.model import load_model
from replica.model.checkpoint import read_model_config
from replica.model.config import DTYPE_BYTES, host_kv_block_bytes
from replica.model.builtin import ensure_builtin_model
from replica.parallel.group import (
    TensorParallel, TensorParallelConfigError, TensorParallelDead, check_divisible, join_group, rendezvous_store,
)
from replica.parallel.vote import UNKNOWN_VICTIM, WorkerVote

from tests.replica.test_kv_swap_engine import GREEDY as SWAP_GREEDY
from tests.replica.test_kv_swap_engine import _check_pools_empty as check_pools_empty
from tests.replica.test_kv_swap_engine import _engine as swap_engine
from tests.replica.test_kv_swap_engine import _prompts as swap_prompts
from tests.replica.test_slo_engine import hooked
from tests.replica.tp_harness import beside_rank_1

pytestmark = pytest.mark.timeout(120)  # a hung collective fails its test instead of the run

_rng = random.Random(26)
PROMPTS = [[_rng.randrange(256) for _ in range(length)] for length in (5, 40, 90, 17, 60)]
SHARED_PREFIX = PROMPTS[2][:48]
PROMPTS += [SHARED_PREFIX + [7, 8, 9], SHARED_PREFIX + [1] * 30]  # prefix-cache hits
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
# Small chunks, a pool too small for every sequence at once (preemption), prefix caching on;
# max_model_len unset, so every rank decides it from the pool (39 blocks x 4: 156 tokens).
TIGHT = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, enable_prefix_caching=True)


def make_engine(model="builtin", tensor_parallel_size=1, **overrides) -> LLMEngine:
    return LLMEngine(make_engine_config(**{**TIGHT, "tensor_parallel_size": tensor_parallel_size, **overrides}),
                     str(model), device="cpu")


def run(engine: LLMEngine, prompts, params: SamplingParams = GREEDY) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt to completion, admitted together; tokens and logprobs per prompt."""
    requests = []
    logprobs = {}
    for index, prompt in enumerate(prompts):
        request = engine.make_request(f"p{index}-{time.monotonic_ns()}", prompt, params)
        engine.add_request(request, detokenize=False)
        requests.append(request)
        logprobs[request.request_id] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            logprobs[output.request_id] += output.logprobs
        engine.scheduler.check_invariants()
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked KV blocks"
    return [r.output_token_ids for r in requests], [logprobs[r.request_id] for r in requests]


def assert_same_greedy_run(tp1: LLMEngine, tp2: LLMEngine, prompts) -> None:
    tokens1, logprobs1 = run(tp1, prompts)
    tokens2, logprobs2 = run(tp2, prompts)
    assert tokens2 == tokens1
    for ours, theirs in zip(logprobs2, logprobs1):
        assert ours == pytest.approx(theirs, abs=1e-4)
    for engine in (tp1, tp2):  # the run exercised what it claims to
        counters = engine.scheduler.counters
        assert counters.preemptions > 0, "no preemption happened"
        assert engine.scheduler.kv_cache.prefix_cache_hits > 0, "no prefix-cache hit happened"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Every rank on one intra-op thread (the workers take this process's count): on a busy
    2-core machine, threads that wait for each other at every op cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def builtin_tp1():
    engine = make_engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def builtin_tp2():
    """With async scheduling too (TP=1 runs without): neither may change a token."""
    engine = make_engine(tensor_parallel_size=2, async_scheduling=True)
    yield engine
    engine.shutdown()


def test_tp2_greedy_equals_tp1_with_kv_heads_divided(builtin_tp1, builtin_tp2):
    assert builtin_tp1.model_config.num_key_value_heads == 4
    assert builtin_tp2.model_config.num_key_value_heads == 2  # this rank's share
    assert builtin_tp2.runner.kv_caches[0][0].shape[2] == 2, "the KV cache holds this rank's heads only"
    assert builtin_tp2.config.max_model_len == builtin_tp1.config.max_model_len == 156
    assert_same_greedy_run(builtin_tp1, builtin_tp2, PROMPTS)
    # fcfs never votes: no control group, whose joining would wait for every rank at start.
    assert builtin_tp2.tp_workers.tp.control is None and builtin_tp2.tp_workers.tp.group is not None


def test_each_rank_freezes_its_startup_heap_as_the_engine_core_does(builtin_tp2):
    """A rank's full collection scanned the model and every module (~210 ms), and in the next
    collective every other rank waited for it: a worker rank runs the collector as rank 0's
    engine-core process does."""
    from replica.core.process import GC_GEN0_THRESHOLD

    stats = worker_stats(builtin_tp2)
    assert stats["gc_young_threshold"] == GC_GEN0_THRESHOLD
    assert stats["gc_frozen_objects"] > 50_000, stats["gc_frozen_objects"]  # torch and the model, at least


def test_the_load_report_counts_the_whole_replicas_kv_as_at_tp1(builtin_tp1, builtin_tp2):
    """Each rank holds its shard of every block, so a block in the load report is the whole
    replica's (every rank's heads of those tokens): the router sees the same blocks, headroom and
    usage as from the same pool at TP=1, never a rank's share nor N times the blocks."""
    assert worker_stats(builtin_tp2)["num_kv_blocks"] == builtin_tp2.runner.kv_caches[0][0].shape[0]
    fields = ("kv_blocks_total", "kv_blocks_free", "block_size", "kv_usage", "headroom_tokens")
    idle = [tuple(getattr(engine.load(), name) for name in fields) for engine in (builtin_tp1, builtin_tp2)]
    assert idle[1] == idle[0] and idle[0][0] == TIGHT["num_kv_blocks"] - 1  # less the null block
    busy = []
    for engine in (builtin_tp1, builtin_tp2):  # one request's prefill held: its blocks count once
        request = engine.make_request(f"load-{engine.config.tensor_parallel_size}", PROMPTS[2], GREEDY)
        engine.add_request(request, detokenize=False)
        engine.step()
        busy.append(tuple(getattr(engine.load(), name) for name in fields))
        engine.abort_request(request.request_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.load().kv_blocks_free == idle[0][1], "the aborted request's blocks were not freed"
    assert busy[1] == busy[0] and busy[0][1] < idle[0][1]


def test_tp2_constrained_rows_sampled_after_the_previous_steps_tokens_give_tp1s_output(builtin_tp1, builtin_tp2):
    """Under async scheduling a step with constrained rows samples once the previous step's
    tokens are taken in (ModelRunner.sample_tokens), the workers waiting in the token broadcast
    meanwhile; a constrained request beside a free one decodes as at TP=1, synchronous."""
    schema = StructuredOutput.json_schema({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"], "additionalProperties": False})
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=schema)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    outputs = [[builtin_tp1.tokenizer.decode(tokens) for tokens in engine.generate(prompts, params)]
               for engine in (builtin_tp1, builtin_tp2)]
    assert outputs[0] == outputs[1] and all(json.loads(text)["n"] in range(100) for text in outputs[0])


def test_block_table_changes_past_the_staged_capacity_reach_the_workers_too(builtin_tp1, builtin_tp2):
    """Rare on rank 0 (many long admissions at once), so forced here: one change fits the
    staged buffer, the rest go as the step's overflow copy, which the workers must apply too."""
    workers = builtin_tp2.tp_workers
    overflowed = []

    def send(message):
        if not isinstance(message, str):
            overflowed.append(len(message.overflow_changes))
        type(workers).send(workers, message)

    builtin_tp2.runner.block_change_capacity = 1
    workers.send = send
    try:
        tokens2, _ = run(builtin_tp2, PROMPTS[:3])
    finally:
        del workers.send
        builtin_tp2.runner.block_change_capacity = builtin_tp1.runner.block_change_capacity
    assert any(overflowed), "no step had changes past the staged capacity"
    tokens1, _ = run(builtin_tp1, PROMPTS[:3])
    assert tokens2 == tokens1


def test_decode_steps_padded_to_the_graph_ladder_on_every_rank_give_the_tp1_tokens(builtin_tp1, builtin_tp2):
    """What a captured decode graph replays (the padded pass: every row's logits gathered, the
    rows' inputs read on the device), run eagerly by both ranks: graphs are off on a CPU (gloo)
    on every rank. Both ranks pad to the one ladder the config gives, the worker each step to
    the size rank 0 padded that step to, which is what a single rank pads the batch to."""
    runner = builtin_tp2.runner
    runner.enable_decode_padding()
    before = worker_stats(builtin_tp2)
    ladder = capture_sizes(builtin_tp2.config.max_num_seqs, builtin_tp2.config.max_num_batched_tokens)
    assert runner.decode_sizes == before["decode_sizes"] == ladder
    assert (runner.graphs, before["cuda_graphs"]) == (None, False), "no CUDA graph exists on a CPU"
    steps = []  # rank 0's (sequences, padded size) of each step launched

    def run_recording(engine, prompts):
        requests = [engine.make_request(f"padded-{index}-{time.monotonic_ns()}", prompt, GREEDY)
                    for index, prompt in enumerate(prompts)]
        for request in requests:
            engine.add_request(request, detokenize=False)
        logprobs = {request.request_id: [] for request in requests}
        while engine.has_unfinished_requests():
            for output in engine.step():
                logprobs[output.request_id] += output.logprobs
            steps.append((engine.last_step.num_seqs, engine.last_step.graph_batch_size))
        return [r.output_token_ids for r in requests], [logprobs[r.request_id] for r in requests]

    tokens2, logprobs2 = run_recording(builtin_tp2, PROMPTS[:4])
    tokens1, logprobs1 = run(builtin_tp1, PROMPTS[:4])
    assert tokens2 == tokens1
    for ours, theirs in zip(logprobs2, logprobs1):
        assert ours == pytest.approx(theirs, abs=1e-4)
    padded = [(num_seqs, size) for num_seqs, size in steps if size is not None]
    assert len(padded) > 5, "no padded decode step ran"
    assert all(size == padded_batch_size(ladder, num_seqs) for num_seqs, size in padded)
    assert any(size > num_seqs for num_seqs, size in padded), "no step had padding rows"
    assert graph_sizes_since(before, worker_stats(builtin_tp2)) == [size for _, size in padded], \
        "the worker ran other padded sizes than rank 0"


def write_tiny_model(model_dir, num_key_value_heads: int, vocab_size: int):
    """A random Llama with biases everywhere, 4 heads and `num_key_value_heads`, the built-in tokenizer."""
    builtin = ensure_builtin_model()
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(builtin / name, model_dir / name)
    config = json.loads((builtin / "config.json").read_text())
    hidden, heads, head_dim, intermediate, vocab = 64, 4, 16, 96, vocab_size
    config.update(vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=num_key_value_heads,
                  head_dim=head_dim, intermediate_size=intermediate, num_hidden_layers=3, attention_bias=True,
                  mlp_bias=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(5)

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * 0.1

    kv = num_key_value_heads * head_dim
    weights = {"model.embed_tokens.weight": normal(vocab, hidden), "lm_head.weight": normal(vocab, hidden),
               "model.norm.weight": 1 + normal(hidden)}
    for layer in range(3):
        prefix = f"model.layers.{layer}"
        for name, (rows, cols) in {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv, hidden),
                                   "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
                                   "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
                                   "mlp.down_proj": (hidden, intermediate)}.items():
            weights[f"{prefix}.{name}.weight"] = normal(rows, cols)
            weights[f"{prefix}.{name}.bias"] = normal(rows)
        weights[f"{prefix}.input_layernorm.weight"] = 1 + normal(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = 1 + normal(hidden)
    save_file(weights, str(model_dir / "model.safetensors"))
    return model_dir


# Odd, so 2 ranks divide it only padded: each holds 161 rows of the LM head and embedding,
# rank 1's last one padding (a real case: Llama's 32,000 plus an added pad token).
TINY_VOCAB = 321


@pytest.fixture(scope="module")
def tiny_mqa(tmp_path_factory):
    """3 layers, 4 heads, 1 KV head: at TP=2 both ranks hold (replicate) the one KV head, and
    the odd vocabulary is padded."""
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "tiny-mqa", num_key_value_heads=1, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny_tp1(tiny_mqa):
    return make_engine(tiny_mqa)


@pytest.fixture(scope="module")
def tiny_tp2(tiny_mqa):
    engine = make_engine(tiny_mqa, tensor_parallel_size=2)
    yield engine
    engine.shutdown()


def test_tp2_greedy_equals_tp1_with_one_kv_head_replicated_and_the_vocabulary_padded(tiny_tp1, tiny_tp2):
    assert tiny_tp2.model_config.num_key_value_heads == 1
    assert tiny_tp2.model.lm_head.out_features == 161 and tiny_tp2.model_config.vocab_size == TINY_VOCAB
    assert_same_greedy_run(tiny_tp1, tiny_tp2, PROMPTS)


def test_tp2_seeded_samples_and_logprobs_equal_tp1_over_the_padded_vocabulary(tiny_tp1, tiny_tp2):
    """The padding's columns never reach the sampler: a seeded draw over the 321 real columns
    is the same draw at TP=1 and TP=2 (its random numbers are drawn per column)."""
    seeded = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=26, ignore_eos=True, logprobs=True)
    tokens1, logprobs1 = run(tiny_tp1, PROMPTS[:4], seeded)
    tokens2, logprobs2 = run(tiny_tp2, PROMPTS[:4], seeded)
    assert tokens2 == tokens1
    assert max(token for tokens in tokens1 for token in tokens) >= 256, "never sampled past the bytes: a weak probe"
    for ours, theirs in zip(logprobs2, logprobs1):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_tp2_prompt_logprobs_and_penalties_equal_tp1(tiny_tp1, tiny_tp2):
    """The workers compute each piece of a chunk's prompt-logprob logits (gathers) and take
    nothing else of them; rank 0 alone keeps the penalties' token counts, on its device."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2,
                            repetition_penalty=1.3, frequency_penalty=0.4)
    gathered = []
    for engine in (tiny_tp1, tiny_tp2):
        requests = [engine.make_request(f"pl{index}-{time.monotonic_ns()}", prompt, params)
                    for index, prompt in enumerate(PROMPTS[:3])]
        outputs = {request.request_id: [] for request in requests}
        for request in requests:
            engine.add_request(request, detokenize=False)
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id].append(output)
        gathered.append(([request.output_token_ids for request in requests],
                         [outputs[request.request_id][0].prompt_logprobs for request in requests]))
    (tokens1, prompt1), (tokens2, prompt2) = gathered
    assert tokens2 == tokens1
    for ours, theirs in zip(prompt2, prompt1):
        assert ours.ranks == theirs.ranks and [top.token_ids for top in ours.top] == [top.token_ids for top in theirs.top]
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)


def test_a_structured_output_grammar_constrains_the_gathered_logits_at_tp2(tiny_tp1, tiny_tp2):
    """The grammar's bitmask is as wide as the vocabulary, not as a rank's block of the LM head."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True,
                            structured_output=StructuredOutput("regex", "[a-z]{3}-[0-9]{4}"))
    (text1,), _ = run(tiny_tp1, [PROMPTS[0]], params)
    (text2,), _ = run(tiny_tp2, [PROMPTS[0]], params)
    assert text2 == text1
    assert re.fullmatch("[a-z]{3}-[0-9]{4}", tiny_tp2.tokenizer.decode(text2))


def test_each_rank_loads_only_its_slices_of_the_checkpoint(tiny_mqa):
    model_dir = tiny_mqa
    whole, _ = load_model(model_dir)
    # Loading needs no collective: rank 1 of 2 builds and fills its shard alone.
    shard, shard_cfg = load_model(model_dir, tp=TensorParallel(rank=1, size=2))
    assert (shard_cfg.num_attention_heads, shard_cfg.num_key_value_heads, shard_cfg.intermediate_size) == (2, 1, 48)
    params, whole_params = dict(shard.named_parameters()), dict(whole.named_parameters())
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    q, k, v = whole_params[f"{attn}.qkv_proj.weight"].split([64, 16, 16])
    assert torch.equal(params[f"{attn}.qkv_proj.weight"], torch.cat([q[32:], k, v]))  # q heads 2-3, the one KV head
    assert torch.equal(params[f"{attn}.o_proj.weight"], whole_params[f"{attn}.o_proj.weight"][:, 32:])
    assert torch.equal(params[f"{attn}.o_proj.bias"], whole_params[f"{attn}.o_proj.bias"])  # added once, after the sum
    gate, up = whole_params[f"{mlp}.gate_up_proj.weight"].split([96, 96])
    assert torch.equal(params[f"{mlp}.gate_up_proj.weight"], torch.cat([gate[48:], up[48:]]))
    assert torch.equal(params[f"{mlp}.down_proj.weight"], whole_params[f"{mlp}.down_proj.weight"][:, 48:])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # rows 161-320, then one padding row of zeros
        assert params[name].shape == (161, 64)
        assert torch.equal(params[name][:160], whole_params[name][161:]) and not params[name][160].any()
    shard_numel = sum(p.numel() for p in shard.parameters())
    assert shard_numel < 0.6 * sum(p.numel() for p in whole.parameters())


def test_smollm2_from_its_gguf_divides_among_three_ranks_not_two(smollm2_dir):
    """SmolLM2-135M: 9 heads and 3 KV heads, so TP=2 is refused and TP=3 gives each rank 3
    heads and one KV head; rank 2 of 3 loads exactly its slices of the converted GGUF."""
    cfg = read_model_config(smollm2_dir)
    with pytest.raises(TensorParallelConfigError,
                       match=r"^tensor_parallel_size: 2 does not divide the model's 9 attention heads, 3 KV heads"):
        check_divisible(cfg, 2)
    shard, shard_cfg = load_model(smollm2_dir, tp=TensorParallel(rank=2, size=3))
    assert (shard_cfg.num_attention_heads, shard_cfg.num_key_value_heads, shard_cfg.intermediate_size) == (3, 1, 512)
    whole, _ = load_model(smollm2_dir)
    q, k, v = dict(whole.named_parameters())["model.layers.5.self_attn.qkv_proj.weight"].split([576, 192, 192])
    ours = dict(shard.named_parameters())["model.layers.5.self_attn.qkv_proj.weight"]
    assert torch.equal(ours, torch.cat([q[384:], k[128:], v[128:]]))  # heads 6-8 and KV head 2
    # Tied embeddings: the LM head is the rank's block of the embedding's rows.
    assert torch.equal(shard.lm_head.weight, whole.model.embed_tokens.weight[2 * 16384:])


@pytest.mark.timeout(600)  # four SmolLM2 loads (TP=1, then three ranks) on a shared 2-core machine
def test_smollm2_greedy_at_tp3_equals_tp1_token_for_token(smollm2_dir):
    """The real default model sharded for real (3 heads and its 1 of 3 KV heads per rank, the
    49,152-token vocabulary in three blocks), prompts chunked into 32-token slices, one a prefix
    of another (a prefix-cache hit): greedy tokens and logprobs as at TP=1."""
    prompts = [PROMPTS[1], PROMPTS[1][:32] + [11, 12, 13]]
    prompts = [[1000 + 37 * token for token in prompt] for prompt in prompts]  # real words, not bytes
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    results = {}
    for size in (1, 3):
        engine = make_engine(smollm2_dir, tensor_parallel_size=size, num_kv_blocks=64)
        try:
            results[size] = run(engine, prompts, params)
            assert engine.scheduler.kv_cache.prefix_cache_hits > 0, "no prefix-cache hit happened"
        finally:
            engine.shutdown()
    assert results[3][0] == results[1][0]
    for ours, theirs in zip(results[3][1], results[1][1]):
        assert ours == pytest.approx(theirs, abs=1e-3)


def test_a_size_that_does_not_divide_the_heads_is_a_one_line_error_at_start():
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 3 does not divide the model's 8 attention heads"):
        make_engine(tensor_parallel_size=3)


# ---- the host KV tier -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def swapping_tp2():
    """test_kv_swap_engine's cramped pool (10 usable blocks of 4 tokens for six requests) at
    TP=2, swapping every victim, its preemption rates measured at start by both ranks."""
    engine = swap_engine(11, tensor_parallel_size=2, num_host_kv_blocks=64, preemption_mode="swap",
                         async_scheduling=True, preemption_recompute_s_per_token=None,
                         preemption_swap_bytes_per_s=None)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def roomy_tp1():
    engine = swap_engine(256)
    yield engine
    engine.shutdown()


def test_a_cramped_pool_swapping_at_tp2_gives_a_roomy_tp1_pools_tokens_every_rank_copying(swapping_tp2, roomy_tp1):
    engine = swapping_tp2
    assert engine.scheduler.preemption.costs != UNMEASURED_COSTS, "the ranks measured the rates together"
    assert engine.generate(swap_prompts(), SWAP_GREEDY) == roomy_tp1.generate(swap_prompts(), SWAP_GREEDY)
    counters = engine.scheduler.counters
    assert counters.swap_preemptions == counters.preemptions > 0, "the cramped pool must really swap"
    assert engine.scheduler.kv_cache.swapped_in_blocks > 0
    # Each rank copied its shard of exactly the blocks rank 0 did (its start-up probe's included).
    kv_swap = engine.runner.kv_swap
    stats = worker_stats(engine)
    assert (stats["swapped_out_blocks"], stats["swapped_in_blocks"]) == (kv_swap.swapped_out_blocks,
                                                                         kv_swap.swapped_in_blocks)
    # Each rank's host blocks hold its KV heads only; the swap metrics count the replica's bytes.
    assert kv_swap.host_cache.shape[4] == 2
    assert engine.scheduler.kv_block_bytes == 2 * kv_swap.bytes_per_block
    check_pools_empty(engine)


def test_a_prefix_spilled_to_every_ranks_host_shard_and_hit_there_gives_the_tp1_tokens(swapping_tp2, roomy_tp1):
    engine, kv_cache = swapping_tp2, swapping_tp2.scheduler.kv_cache
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(20)]  # five full blocks of 4
    filler = [rng.randrange(3, 250) for _ in range(30)]
    prompt = shared + [11, 12, 13]
    spilled, host_hits = kv_cache.spilled_blocks, kv_cache.host_hit_blocks
    engine.generate([shared], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.generate([filler], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert kv_cache.spilled_blocks > spilled, "the filler must evict the prefix to the host"
    assert engine.generate([prompt], SWAP_GREEDY) == roomy_tp1.generate([prompt], SWAP_GREEDY)
    assert kv_cache.host_hit_blocks > host_hits, "the prefix must have been copied back from the host"
    check_pools_empty(engine)


def test_host_kv_bytes_is_the_whole_replicas_tier_all_ranks_shards_together(tiny_mqa):
    shard, shard_cfg = load_model(tiny_mqa, tp=TensorParallel(rank=1, size=2))
    shard_block_bytes = kv_cache_bytes_per_block(shard_cfg, 4, torch.float32)  # 3 layers x K/V x 4 x 1 head x 16
    assert shard_block_bytes == 1536
    config = resolve_rank_config(make_engine_config(block_size=4, num_kv_blocks=40, host_kv_bytes=30_720), shard,
                                 shard_cfg, torch.device("cpu"), TensorParallel(rank=1, size=2))
    assert config.num_host_kv_blocks == 10  # 30,720 bytes / (2 ranks x 1,536)
    # `headroom serve` checks the tier before Ray starts, torch-free, from the whole model's config: the same bytes.
    assert host_kv_block_bytes(read_model_config(tiny_mqa), 4, DTYPE_BYTES["float32"], 2) == 2 * shard_block_bytes


# ---- the KV pool a profiled GPU holds --------------------------------------------------------

GIB = 2**30


def rank_profile(rank: int) -> MemoryProfile:
    """80 GiB GPUs, 2 GiB of weights and 3 GiB of peak activations per rank; rank 1's GPU also
    holds 10 GiB of another process, so it has room for 40 fewer quarter-GiB blocks."""
    free = 72 * GIB if rank == 0 else 62 * GIB
    return MemoryProfile(total=80 * GIB, free=free, reserved=int(5.5 * GIB), weights=2 * GIB,
                         peak_activations=3 * GIB)


def pool_over_ranks(tp: TensorParallel, min_blocks: int):
    """What this rank's engine would size its pool to, or the error it would start with."""
    try:
        return rank_profile(tp.rank).num_kv_blocks(0.9, GIB // 4, min_blocks, tp)
    except ConfigError as error:
        return str(error)


def _rank_1_sizes_its_pool(rendezvous: str, results) -> None:
    tp = join_group(rendezvous_store(2, rendezvous), 1, 2, torch.device("cpu"), 30.0)
    for min_blocks in (2, 240):
        results.put(pool_over_ranks(tp, min_blocks))


def test_the_ranks_size_the_kv_pool_to_the_tightest_gpu_and_fail_together_when_it_is_too_small():
    """A real 2-rank gloo group; the per-rank budgets differ (258 vs 218 blocks fit). One
    scheduler plans for both, so both build 218; when one max_model_len sequence needs 240,
    both fail the start with the field named, and neither waits for the other in vain."""
    assert rank_profile(0).num_kv_blocks(0.9, GIB // 4, 2) == 258
    assert rank_profile(1).num_kv_blocks(0.9, GIB // 4, 2) == 218
    with beside_rank_1(_rank_1_sizes_its_pool) as (tp, results):
        assert pool_over_ranks(tp, 2) == 218
        assert results.get(timeout=60) == 218
        ours, theirs = pool_over_ranks(tp, 240), results.get(timeout=60)
        assert re.match(r"gpu_memory_utilization: .* 258 blocks \(another tensor-parallel rank holds only 218 "
                        r"blocks: see its log; this rank, 0\), but one max_model_len sequence needs 240$", ours)
        assert re.match(r"gpu_memory_utilization: 0.9 of 80.0 GiB .*: 218 blocks, but .* needs 240$", theirs)


# ---- the vote ------------------------------------------------------------------------------

LONG_PROMPT = [_rng.randrange(256) for _ in range(160)]  # five 32-token chunks


@pytest.fixture(scope="module")
def slo_tp2(tiny_mqa):
    engine = make_engine(tiny_mqa, tensor_parallel_size=2, scheduling_policy="slo", max_model_len=256,
                         num_kv_blocks=80, slo_abort_max_layer_fraction=0.7)  # 3 layers: aborts up to layer 2
    engine.slo_monitor.stop()  # the tests post the orders themselves, at chosen layers
    yield engine
    engine.shutdown()


def worker_stats(engine: LLMEngine) -> dict:
    (stats,) = engine.tp_workers.call("stats")
    return stats


def graph_sizes_since(before: dict, after: dict) -> list[int]:
    """The padded size of each padded decode step the worker ran between two of its stats."""
    count = after["padded_decode_steps"] - before["padded_decode_steps"]
    return after["graph_sizes"][len(after["graph_sizes"]) - count:]


def start_long(engine: LLMEngine, request_id: str):
    """A fresh long prompt (its first token differs per request: no prefix-cache hit) that runs
    its first 32-token chunk in the next step."""
    prompt = [sum(map(ord, request_id)) % 256] + LONG_PROMPT[1:]
    request = engine.make_request(request_id, prompt, GREEDY, ttft_slo_ms=60_000.0)
    engine.add_request(request, detokenize=False)
    return request


def finish(engine: LLMEngine) -> None:
    hooked(engine, None)
    while engine.has_unfinished_requests():
        engine.step()
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked KV blocks"


def test_an_order_for_the_step_in_flight_fires_on_both_ranks_at_the_same_layer(slo_tp2):
    engine, monitor = slo_tp2, slo_tp2.slo_monitor
    before = worker_stats(engine)
    posted = []

    def order_at_layer_1(layer_index: int) -> None:
        if layer_index == 1 and not posted:
            posted.append(monitor.step_in_flight.step_id)
            monitor.abort_order = AbortOrder(posted[0], "long-a")

    long = start_long(engine, "long-a")
    hooked(engine, order_at_layer_1).step()
    counters = engine.scheduler.counters
    assert counters.slo_preemptions == 1 and long.status == RequestStatus.PREEMPTED
    # Posted after layer 1's vote: every rank unwinds before layer 2.
    assert counters.slo_discarded_layers == 2
    after = worker_stats(engine)
    assert after["aborts"][len(before["aborts"]):] == [(posted[0], 2)]
    assert after["votes"] - before["votes"] == 3  # before layers 0, 1 and 2: no rank skipped one
    finish(engine)


def test_a_rank_past_its_stubbornness_limit_vetoes_the_abort_for_every_rank(slo_tp2):
    engine, monitor = slo_tp2, slo_tp2.slo_monitor
    assert engine.tp_workers.tp.control is engine.tp_workers.tp.group  # on a CPU the vote shares the gloo group
    slo_abort = hooked(engine, None).runner.step_abort.inner  # under the vote (and no hook) sits rank 0's own
    slo_abort.max_abort_layer = 0  # rank 0 alone turns stubborn after layer 0
    before = worker_stats(engine)
    try:
        long = start_long(engine, "long-b")
        preemptions = engine.scheduler.counters.slo_preemptions

        def order_at_layer_0(layer_index: int) -> None:
            if layer_index == 0:
                monitor.abort_order = AbortOrder(monitor.step_in_flight.step_id, "long-b")

        hooked(engine, order_at_layer_0).step()
        assert engine.scheduler.counters.slo_preemptions == preemptions
        assert long.status == RequestStatus.RUNNING and long.num_computed_tokens == 32
        after = worker_stats(engine)
        assert after["aborts"] == before["aborts"], "the worker, below its own limit, must not unwind alone"
        assert after["steps"] - before["steps"] == 1 and after["votes"] - before["votes"] == 3
    finally:
        slo_abort.max_abort_layer = 2
    finish(engine)


def test_a_stale_order_never_matches_on_any_rank(slo_tp2):
    engine, monitor = slo_tp2, slo_tp2.slo_monitor
    before = worker_stats(engine)
    long = start_long(engine, "long-c")
    preemptions = engine.scheduler.counters.slo_preemptions

    def stale_order(layer_index: int) -> None:
        if layer_index == 0:  # decided for the previous step, landing in this one
            monitor.abort_order = AbortOrder(monitor.step_in_flight.step_id - 1, "long-c")

    hooked(engine, stale_order).step()
    hooked(engine, stale_order).step()
    assert engine.scheduler.counters.slo_preemptions == preemptions
    assert long.num_computed_tokens == 64
    assert worker_stats(engine)["aborts"] == before["aborts"]
    finish(engine)


def test_steps_without_a_prefill_cast_no_vote(slo_tp2):
    engine = slo_tp2
    before = worker_stats(engine)
    request = engine.make_request("short", PROMPTS[3], GREEDY, ttft_slo_ms=60_000.0)  # 17 tokens: one chunk
    engine.add_request(request, detokenize=False)
    finish(engine)
    after = worker_stats(engine)
    assert len(request.output_token_ids) == 10 and after["steps"] - before["steps"] == 10
    assert after["votes"] - before["votes"] == 3, "only the prefill step votes, once per layer"


def test_padded_decode_steps_the_graph_replays_cast_no_vote_and_a_prefill_is_never_padded(slo_tp2):
    """With decode padding on (graphs pad so; on a CPU it runs eagerly): the one step with a
    prefill votes at every layer on both ranks and runs unpadded; each decode step runs padded
    on both ranks, without a vote. (The later tests run this engine padded too.)"""
    engine = slo_tp2
    engine.runner.enable_decode_padding()
    before = worker_stats(engine)
    request = engine.make_request("short-padded", PROMPTS[3], GREEDY, ttft_slo_ms=60_000.0)
    engine.add_request(request, detokenize=False)
    padded = []
    hooked(engine, None)
    while engine.has_unfinished_requests():
        engine.step()
        padded.append(engine.last_step.graph_batch_size)
    after = worker_stats(engine)
    assert len(request.output_token_ids) == 10 and after["steps"] - before["steps"] == 10
    assert padded[0] is None and padded[1:] == [1] * 9, "the prefill step ran padded, or a decode step did not"
    assert graph_sizes_since(before, after) == [1] * 9
    assert after["votes"] - before["votes"] == 3, "only the prefill step votes, once per layer"


def test_a_thousand_random_orders_leave_no_hang_no_leak_and_the_tp1_tokens(slo_tp2, tiny_tp1):
    engine, monitor = slo_tp2, slo_tp2.slo_monitor
    rng = random.Random(1000)
    num_orders = 0

    def random_order(layer_index: int) -> None:
        """At every layer boundary of a pass with a prefill: an order for this step, a stale
        one or the next one, naming a prefill of this step or a request that left."""
        nonlocal num_orders
        step = monitor.step_in_flight
        victims = [view.request_id for view in step.prefills if view.preemptible] or ["gone"]
        monitor.abort_order = AbortOrder(step.step_id + rng.choice((0, 0, -1, -2, 1)), rng.choice(victims))
        num_orders += 1

    def run_under_orders(prompts, params) -> list:
        requests = [engine.make_request(f"r{num_orders}-{index}", prompt, params, ttft_slo_ms=60_000.0)
                    for index, prompt in enumerate(prompts)]
        for request in requests:
            engine.add_request(request, detokenize=False)
        hooked(engine, random_order)
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            engine.scheduler.check_invariants()
        else:
            raise AssertionError("a request is stuck")
        hooked(engine, None)
        return requests

    prompts = [LONG_PROMPT[:n] for n in (40, 100, 70)] + PROMPTS[:2]
    expected, _ = run(tiny_tp1, prompts)
    preemptions_before = engine.scheduler.counters.slo_preemptions
    requests = run_under_orders(prompts, GREEDY)
    assert [request.output_token_ids for request in requests] == expected
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    while num_orders < 1000:  # more passes with prefills, each a target at every boundary
        run_under_orders([[rng.randrange(256) for _ in range(rng.randrange(8, 60))] for _ in range(3)], one_token)
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked KV blocks"
    assert engine.scheduler.counters.slo_preemptions > preemptions_before + 50, "orders rarely fired"
    stats = worker_stats(engine)
    assert stats["votes"] >= num_orders, "a rank skipped a vote"


def test_with_the_real_monitor_an_urgent_arrival_aborts_the_long_prefill_on_both_ranks():
    """test_slo_engine's scenario at TP=2: the monitor thread, not the test, posts the order
    (mirrored to the workers' board); both ranks unwind; tokens are those of each prompt alone."""
    from tests.replica.test_slo_engine import (
        LONG_PROMPT as SLO_LONG, URGENT_PROMPT, hold_pass_for_the_monitor, run_alone, run_long_then_urgent,
    )

    slo_config = dict(max_model_len=512, num_kv_blocks=96, max_num_batched_tokens=64)
    reference = LLMEngine(make_engine_config(**slo_config, enable_prefix_caching=False), "builtin", device="cpu")
    alone = {name: run_alone(reference, f"alone-{name}", prompt)[0]
             for name, prompt in (("long", SLO_LONG), ("urgent", URGENT_PROMPT))}
    engine = LLMEngine(make_engine_config(**slo_config, scheduling_policy="slo", tensor_parallel_size=2),
                       "builtin", device="cpu")
    try:
        long, urgent, first_token_step = run_long_then_urgent(engine, hold_pass_for_the_monitor(engine))
        assert engine.scheduler.counters.slo_preemptions == 1
        assert first_token_step["urgent"] < first_token_step["long"]
        assert (long.output_token_ids, urgent.output_token_ids) == (alone["long"], alone["urgent"])
        (aborted,) = worker_stats(engine)["aborts"]
        assert aborted[1] == engine.scheduler.counters.slo_discarded_layers, "the ranks unwound at different layers"
    finally:
        engine.shutdown()


# 2 s: far above an 8-byte gloo all-reduce on a loaded machine, and the hung peer's case waits it out.
VOTE_TIMEOUT_S = 2.0


def _rank_1_votes_then_waits(rendezvous: str, results) -> None:
    """Rank 1 sees an order for step 7 (rank 0 does not) and may abort up to layer 5: it votes
    before layers 0 and 2 of step 7, reports, and casts no other vote (rank 0 kills or stops it)."""
    tp = join_group(rendezvous_store(2, rendezvous), 1, 2, torch.device("cpu"), VOTE_TIMEOUT_S, control="separate")
    vote = WorkerVote(tp, multiprocessing.RawValue("q", 7), max_abort_layer=5)
    results.put((os.getpid(), [vote.abort_now(7, layer) for layer in (0, 2)]))
    time.sleep(120)


@pytest.mark.parametrize("peer", ["killed", "hung"])
def test_the_vote_between_two_ranks_and_a_peer_killed_or_hung_in_it_failing_it_within_the_timeout(peer):
    """The vote's collective on its own, over a real 2-rank control group of its own (as beside
    NCCL; on a CPU the vote runs on the model's gloo group): rank 1's
    order aborts both ranks at layer 0, rank 0's stubbornness vetoes it for both at layer 2.
    Then rank 1 casts no more votes: killed, rank 0's next vote fails at once; stopped (hung),
    after the collective timeout; never a hang."""
    with beside_rank_1(_rank_1_votes_then_waits, timeout_s=VOTE_TIMEOUT_S, control="separate") as (tp, results):
        assert tp.control is not tp.group  # the group of its own a GPU's vote runs on, here on a CPU
        vote = WorkerVote(tp, multiprocessing.RawValue("q", -1), max_abort_layer=1)
        ours = [vote.abort_now(7, layer) for layer in (0, 2)]
        pid, theirs = results.get(timeout=60)
        assert ours == theirs == [UNKNOWN_VICTIM, None]
        assert vote.aborts == [(7, 0)] and vote.ballot.num_votes == 2
        os.kill(pid, signal.SIGKILL if peer == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(TensorParallelDead, match="rank 0: all_reduce on the host failed"):
                vote.abort_now(8, 0)
            elapsed = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGKILL)
    if peer == "killed":
        assert elapsed < VOTE_TIMEOUT_S, f"the vote failed {elapsed:.1f} s after the kill, not at once"
    else:
        assert VOTE_TIMEOUT_S <= elapsed < 30, f"the vote gave up after {elapsed:.1f} s"


# ---- a dead worker -------------------------------------------------------------------------


def tp_worker_pids(pid: int) -> list[int]:
    """The tensor-parallel workers among a process's children (not multiprocessing's resource tracker)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as file:
            children += [int(child) for child in file.read().split()]
    workers = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as file:
            cmdline = file.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            workers.append(child)
    return workers


def kill_the_worker(front: AsyncEngine) -> float:
    """SIGKILL a TP=2 front's worker rank; when (time.monotonic())."""
    (worker,) = tp_worker_pids(front.core.process.pid)
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    return killed_at


def assert_reported_dead(elapsed_s: float, dead, within_s: float) -> None:
    print(f"reported dead {elapsed_s:.2f} s after the kill")
    assert isinstance(dead, EngineDeadError)
    assert elapsed_s < within_s, f"the replica took {elapsed_s:.1f} s to report dead"


def test_a_killed_worker_takes_the_replica_down_as_engine_dead_not_a_hang():
    config = make_engine_config(**{**TIGHT, "tensor_parallel_size": 2, "max_model_len": 256, "num_kv_blocks": 80})

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu")
        try:
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = front.add_request(PROMPTS[1], long, request_id="long")
            first = await anext(stream.__aiter__())
            assert first.new_token_ids, "the replica served before the kill"
            killed_at = kill_the_worker(front)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            return time.monotonic() - killed_at, front.dead
        finally:
            await front.shutdown()

    assert_reported_dead(*asyncio.run(scenario()), within_s=10)


def test_a_hung_worker_fails_the_step_after_the_collective_timeout_not_never(tiny_mqa):
    # 4 s: far above a tiny model's collective on a loaded machine, and the whole wait is the test's time.
    engine = make_engine(tiny_mqa, tensor_parallel_size=2, tensor_parallel_timeout_s=4.0)
    (worker,) = engine.tp_workers.pids
    try:
        run(engine, PROMPTS[:1])  # the probe: both ranks serve before the worker hangs
        os.kill(worker, signal.SIGSTOP)
        engine.add_request(engine.make_request("after", PROMPTS[1], GREEDY), detokenize=False)
        started = time.monotonic()
        with pytest.raises(TensorParallelDead, match="rank 0: all_reduce failed"):
            engine.step()
        elapsed = time.monotonic() - started
        assert 4.0 <= elapsed < 60, f"rank 0 gave up after {elapsed:.1f} s"
    finally:
        os.kill(worker, signal.SIGKILL)
        engine.shutdown()


def test_a_worker_that_dies_before_joining_fails_the_start_at_once_naming_its_rank(monkeypatch):
    """Rank 0 waited out the 120 s rendezvous, then raised a raw store timeout. The worker is
    killed as it starts (an OOM kill; on CUDA, a device it cannot take)."""
    from replica.parallel import executor

    started = []
    real_start = executor.multiprocessing.context.SpawnProcess.start

    def start_then_kill(process):
        real_start(process)
        started.append(process.pid)
        os.kill(process.pid, signal.SIGKILL)

    monkeypatch.setattr(executor.multiprocessing.context.SpawnProcess, "start", start_then_kill)
    began = time.monotonic()
    with pytest.raises(TensorParallelDead, match=r"rank 1 \(pid \d+\) exited with code -9"):
        make_engine(tensor_parallel_size=2)
    assert started and time.monotonic() - began < 30
    # Nor is rank 0 left joining: a join begun beside the killed worker stayed blocked in torch
    # for the 120 s rendezvous, and returning into a finalizing interpreter it aborted the process.
    assert not [thread for thread in threading.enumerate() if thread.name == "tp-join"]


def test_the_ranks_meet_in_a_private_directory_gone_once_the_engine_stops(tiny_mqa, monkeypatch):
    """Not a TCP store: it listened on every interface, unauthenticated, whatever host it was given."""
    from replica.parallel import executor

    paths = []
    real_path = executor.rendezvous_path
    monkeypatch.setattr(executor, "rendezvous_path", lambda: paths.append(real_path()) or paths[-1])
    engine = make_engine(tiny_mqa, tensor_parallel_size=2)
    try:
        (path,) = paths
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        run(engine, PROMPTS[:1])
    finally:
        engine.shutdown()
    assert not os.path.exists(os.path.dirname(path))


def test_ranks_take_the_gpus_from_rank_0s_and_more_ranks_than_gpus_are_refused_at_start():
    from replica.parallel.executor import rank_device, start_tensor_parallel

    assert [str(rank_device(torch.device("cuda", 2), rank)) for rank in range(2)] == ["cuda:2", "cuda:3"]
    assert str(rank_device(torch.device("cuda"), 1)) == "cuda:1" and str(rank_device(torch.device("cpu"), 1)) == "cpu"
    config = make_engine_config(**{**TIGHT, "tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 2 ranks from cuda:1 need up to cuda:2; this host "
                                          rf"shows {torch.cuda.device_count()} CUDA devices$"):
        start_tensor_parallel(config, ensure_builtin_model(), torch.device("cuda", 1), None, "torch")


def test_a_step_failing_on_rank_0_mid_step_ends_the_engine_at_once_not_after_the_timeout(tiny_mqa):
    """The engine core recovers from a failed step and serves on; under TP a failure on rank 0
    after the workers started the step (its sampler, or logprobs only rank 0 computes) leaves
    them in the sampled ids' broadcast, where the next step met them out of step and waited out
    the collective timeout. It is TensorParallelDead at once; a failure before the step is
    shipped still recovers."""
    engine = make_engine(tiny_mqa, tensor_parallel_size=2, tensor_parallel_timeout_s=30.0)
    sampler = engine.runner.sampler
    real_sample = sampler.sample
    try:
        run(engine, PROMPTS[:1])  # both ranks serve first

        def failing_sample(*args, **kwargs):
            raise RuntimeError("injected sampler failure")

        sampler.sample = failing_sample
        sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3)  # greedy rows skip the sampler
        engine.add_request(engine.make_request("victim", PROMPTS[1], sampled), detokenize=False)
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(20):  # past the prompt's chunks, to its first sampled token
                engine.step()
        assert engine.runner.workers_mid_step  # the probe: the worker waits in the broadcast
        engine.abort_request("victim")
        started = time.monotonic()
        with pytest.raises(TensorParallelDead, match="out of step"):
            engine.recover_from_failed_step()
        assert time.monotonic() - started < 5.0
        started = time.monotonic()
        engine.shutdown()  # the worker, stuck in the broadcast, is killed: it would never take the stop
        assert time.monotonic() - started < 5.0
    finally:
        sampler.sample = real_sample
        engine.shutdown()


def test_a_killed_engine_core_leaves_no_worker_behind():
    """The other way round: rank 0's process dies (SIGKILL, no shutdown); its worker notices
    (its pipe closes, or its collective fails) and exits instead of holding its device."""
    config = make_engine_config(**{**TIGHT, "tensor_parallel_size": 2})

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu")
        try:
            (worker,) = tp_worker_pids(front.core.process.pid)
            os.kill(front.core.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in front.add_request(PROMPTS[1], GREEDY, request_id="after"):
                    pass
            return worker
        finally:
            await front.shutdown()

    worker = asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while not process_gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(worker), "the worker outlived its engine core by 10 s"


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_hung_worker_fails_a_step_larger_than_its_pipe_buffer_after_the_timeout_not_never(tiny_mqa):
    """The test above ships a 32-token step, which fits the pipe's buffer. A step past it (here
    four prompts of 2,000 tokens in one 16,384-token budget) blocked rank 0 in write() to the
    stopped worker for good, before any collective could time out: every write to a worker now
    gives up after the collective timeout too, naming the rank."""
    ours, theirs = socket.socketpair()  # the buffer a worker's pipe has (multiprocessing's Pipe)
    pipe_buffer = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    ours.close()
    theirs.close()
    engine = make_engine(tiny_mqa, tensor_parallel_size=2, tensor_parallel_timeout_s=4.0, block_size=16,
                         num_kv_blocks=600, max_num_batched_tokens=16384)
    (worker,) = engine.tp_workers.pids
    try:
        run(engine, PROMPTS[:1])  # the probe: both ranks serve before the worker hangs
        os.kill(worker, signal.SIGSTOP)
        rng = random.Random(2000)
        for index in range(4):
            prompt = [rng.randrange(TINY_VOCAB) for _ in range(2000)]
            engine.add_request(engine.make_request(f"long-{index}", prompt, GREEDY), detokenize=False)
        started = time.monotonic()
        with pytest.raises(TensorParallelDead, match=r"rank 1 \(pid \d+\) took no message for 4 s"):
            engine.step()
        elapsed = time.monotonic() - started
        assert engine.runner.staged.last_sent().nbytes > pipe_buffer, "the step's message fit the pipe's buffer"
        assert 4.0 <= elapsed < 10, f"rank 0 gave up after {elapsed:.1f} s"
    finally:
        os.kill(worker, signal.SIGKILL)
        engine.shutdown()


def test_a_worker_killed_while_the_replica_is_idle_takes_it_down_without_a_request():
    """The idle core waited on its inbox alone, and only a step checked the workers: the front
    (and the health check, the load stream) saw a live replica until the next request."""
    config = make_engine_config(**{**TIGHT, "tensor_parallel_size": 2})

    async def scenario():
        front = await AsyncEngine.launch(config, "builtin", device="cpu")
        try:
            killed_at = kill_the_worker(front)
            while front.dead is None and time.monotonic() - killed_at < 30:
                await asyncio.sleep(0.05)
            return time.monotonic() - killed_at, front.dead
        finally:
            await front.shutdown()

    assert_reported_dead(*asyncio.run(scenario()), within_s=5)
