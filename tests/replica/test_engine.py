"""The whole engine against the correctness oracle: greedy output equals HF transformers'
generate() on the same checkpoint, and stays equal under chunking, a cramped pool
(preemption, probed), prefix caching, decode batches padded as CUDA graphs pad them and
overlapped (async) scheduling; sampling and abort behave.

HEADROOM_TEST_DEVICE=cuda runs the engine on a GPU (Triton attention, CUDA graphs and async
scheduling on by default) against HF on the CPU.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import transformers

from replica.model.builtin import build_byte_level_tokenizer
from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.errors import InvalidRequestError

VOCAB = 320  # the byte-level test tokenizer's size
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
TEST_DEVICE = os.environ.get("HEADROOM_TEST_DEVICE", "cpu")
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


def _engine(path, *, padded_decode: bool = False, **overrides) -> LLMEngine:
    """padded_decode: pad decode steps to the CUDA-graph ladder even where no graph runs."""
    # max_num_seqs 8 (the 7 prompts fit): on CUDA, 4 decode graphs to capture per engine, not 35.
    config = dict(block_size=4, num_kv_blocks=256, max_model_len=64, max_num_batched_tokens=256, max_num_seqs=8)
    config.update(overrides)
    engine = LLMEngine(make_engine_config(**config), str(path), device=TEST_DEVICE, dtype="float32")
    if padded_decode:
        engine.runner.enable_decode_padding()
    return engine


def test_max_model_len_left_unset_follows_the_checkpoints_context(checkpoint):
    # config.json says 256 positions; the pool (255 usable blocks of 4) holds them.
    engine = _engine(checkpoint[0], max_model_len=None)
    assert engine.config.max_model_len == SHAPE["max_position_embeddings"]
    assert engine.runner.max_model_len == engine.config.max_model_len


def test_the_last_layer_runs_past_its_kv_write_only_for_rows_that_sample(checkpoint):
    # A 30-token prompt prefilled in chunks of at most 16 tokens beside a 5-token one, 3 tokens each:
    # every computed token passes the first layer, only the 6 sampled ones the last layer's MLP.
    # Eager: on CUDA a graph-replayed decode step runs no Python, so the hooks would miss its rows
    # (36 and 3 counted instead of 39 and 6).
    engine = _engine(checkpoint[0], max_num_batched_tokens=16, enforce_eager=True)
    layers = engine.model.model.layers
    rows = {"first": 0, "last": 0}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        layer.mlp.register_forward_hook(lambda module, inputs, output, name=name: rows.update(
            {name: rows[name] + len(inputs[0])}))
    prompts = [list(range(1, 31)), list(range(40, 45))]
    engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert rows == {"first": 30 + 5 + 2 * 2, "last": 2 * 3}


def test_greedy_matches_hf_generate_for_a_mixed_batch(checkpoint, hf_outputs):
    engine = _engine(checkpoint[0])
    assert engine.generate(_prompts(), GREEDY) == hf_outputs
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_usable_blocks


@pytest.mark.parametrize("async_scheduling, padded_decode", [(True, False), (False, True), (True, True)])
def test_greedy_matches_hf_with_overlapped_steps_and_padded_decode_batches(checkpoint, hf_outputs,
                                                                           async_scheduling, padded_decode):
    # The ladder is 1, 2, 4, 8: the 7 prompts decode together in a batch padded to 8.
    engine = _engine(checkpoint[0], padded_decode=padded_decode, async_scheduling=async_scheduling)
    steps = []
    outputs = _generate(engine, _prompts(), GREEDY, on_step=lambda: steps.append(
        (engine.last_step.num_seqs, engine.last_step.graph_batch_size)))
    assert outputs == hf_outputs
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_usable_blocks
    padded = [(num_seqs, size) for num_seqs, size in steps if size is not None]
    # CUDA graphs (on by default on CUDA) pad every decode step, as padded_decode does anywhere.
    if padded_decode or engine.runner.graphs is not None:  # probe: decode steps ran padded, with padding rows
        assert (7, 8) in padded
    else:
        assert not padded


def _generate(engine: LLMEngine, prompts, params: SamplingParams, on_step=None) -> list[list[int]]:
    requests = [engine.make_request(f"g{index}", prompt, params) for index, prompt in enumerate(prompts)]
    for request in requests:
        engine.add_request(request, detokenize=False)
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
        if on_step is not None:
            on_step()
    return [list(request.output_token_ids) for request in requests]


def test_engine_builds_its_model_with_the_fused_ops_its_config_names(checkpoint):
    # "compile" differs from auto's choice on every device; torch.compile only compiles on the first call.
    engine = _engine(checkpoint[0], fused_ops="compile")
    assert {module.ops.name for module in engine.model.modules() if hasattr(module, "ops")} == {"compile"}


@pytest.mark.parametrize("budget, threshold", [(5, 0), (16, 7)])
def test_greedy_matches_hf_with_chunked_prefill(checkpoint, hf_outputs, budget, threshold):
    engine = _engine(checkpoint[0], max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    assert engine.generate(_prompts(), GREEDY) == hf_outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_matches_hf_in_a_cramped_pool_that_preempts(checkpoint, hf_outputs, async_scheduling):
    # 16 usable blocks of 4 tokens: far less than the batch's ~290 tokens.
    engine = _engine(checkpoint[0], num_kv_blocks=17, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    assert _generate(engine, _prompts(), GREEDY) == hf_outputs
    assert engine.scheduler.counters.preemptions > 0, "the cramped pool must really preempt"


def test_greedy_matches_hf_with_prefix_cache_hits(checkpoint, hf_outputs):
    engine = _engine(checkpoint[0], enable_prefix_caching=True)
    prompts = _prompts()
    engine.generate(prompts[5:6], GREEDY)  # warms the cache with the shared prefix
    assert engine.generate(prompts, GREEDY) == hf_outputs
    assert engine.scheduler.kv_cache.prefix_cache_hits >= 16, "the shared prefix must be served from cache"
    uncached = _engine(checkpoint[0], enable_prefix_caching=False)
    assert uncached.generate(prompts, GREEDY) == hf_outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_sampling_is_reproducible_and_independent_of_batch_neighbours(checkpoint, async_scheduling):
    engine = _engine(checkpoint[0], async_scheduling=async_scheduling)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], seeded)[0]
    in_batch = engine.generate([[1, 2], [5, 6, 7], [9] * 20], seeded)[1]
    other_seed = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert alone == in_batch
    assert alone != other_seed


def _decode_launch_copies(engine: LLMEngine, monkeypatch) -> dict:
    """Of the launches of decode-only steps: the largest host array any copied to the device,
    and how many ran padded (the padded pass, eagerly or as a CUDA graph replays it: a replay
    runs no Python, so the launch's graph_batch_size counts, not calls of _decode_pass)."""
    from replica.executor import logits_processors, model_runner

    seen = {"in_decode": False, "largest": 0, "padded": 0}
    for module in (logits_processors, model_runner):
        def probed(values, dtype, device, to_device=module.to_device):
            if seen["in_decode"]:
                seen["largest"] = max(seen["largest"], len(values))
            return to_device(values, dtype, device)
        monkeypatch.setattr(module, "to_device", probed)
    launch = engine.runner.launch

    def probed_launch(scheduler_output):
        seen["in_decode"] = bool(scheduler_output.scheduled) and all(
            entry.num_new_tokens == 1 and not entry.is_new for entry in scheduler_output.scheduled)
        try:
            in_flight = launch(scheduler_output)
        finally:
            seen["in_decode"] = False
        seen["padded"] += in_flight.graph_batch_size is not None
        return in_flight

    engine.runner.launch = probed_launch
    return seen


def test_penalties_logit_bias_and_top_logprobs_do_not_depend_on_overlapped_scheduling_or_padding(checkpoint,
                                                                                                 monkeypatch):
    # Under async scheduling a penalty's history lacks the token still being sampled; the
    # runner counts it on the device. A padded decode pass (as a CUDA graph runs it) leaves
    # logits for every row, which the sampler then reads. Each request's params differ.
    common = dict(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.4,
                             top_logprobs=3, **common),
              SamplingParams(temperature=0.0, logit_bias=((5, 2.0), (9, -50.0)), logprobs=True, **common),
              GREEDY,
              SamplingParams(temperature=0.9, seed=11, frequency_penalty=1.2, top_logprobs=2, **common)]
    prompts = _prompts()[:4]
    runs = []
    for async_scheduling, padded_decode in ((False, False), (True, False), (True, True)):
        engine = _engine(checkpoint[0], async_scheduling=async_scheduling, padded_decode=padded_decode)
        requests = [engine.make_request(f"x{index}", prompt, row_params)
                    for index, (prompt, row_params) in enumerate(zip(prompts, params))]
        tops: dict[str, list] = {request.request_id: [] for request in requests}
        for request in requests:
            engine.add_request(request, detokenize=False)
        copies = _decode_launch_copies(engine, monkeypatch)
        while engine.has_unfinished_requests():
            for output in engine.step():
                tops[output.request_id] += output.top_logprobs or []
        # A decode step's penalties read the rows' histories kept on the device since admission:
        # it copies per-row values at most, no token history (the prompts have 3-30 tokens).
        # (It rebuilt every penalized row's prompt and output counts from the host's lists.)
        assert copies["largest"] <= len(requests), copies
        # Penalties or not, the forward pads (CUDA graphs, on by default on CUDA, pad every decode step).
        assert (copies["padded"] > 0) == (padded_decode or engine.runner.graphs is not None)
        runs.append(([request.output_token_ids for request in requests],
                     [[top.token_ids for top in tops[r.request_id]] for r in requests],
                     [[value for top in tops[r.request_id] for value in top.logprobs] for r in requests]))
    (tokens, top_logprobs, values) = runs[0]
    for other_tokens, other_top_logprobs, other_values in runs[1:]:
        assert tokens == other_tokens and top_logprobs == other_top_logprobs
        assert values == [pytest.approx(row) for row in other_values]
    assert tokens[0] != _engine(checkpoint[0]).generate(prompts[:1], GREEDY)[0]  # the penalties did act
    assert 9 not in tokens[1]
    assert [len(rows) for rows in top_logprobs] == [MAX_NEW_TOKENS, 0, 0, MAX_NEW_TOKENS]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_mid_generation_returns_every_block(checkpoint, async_scheduling):
    engine = _engine(checkpoint[0], async_scheduling=async_scheduling)
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


def test_async_scheduling_plans_the_next_step_before_the_previous_token_lands(checkpoint):
    engine = _engine(checkpoint[0], async_scheduling=True)
    request = engine.make_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request(request, detokenize=False)
    assert engine.step() == []  # the prefill is launched; nothing has landed yet
    assert (request.num_output_tokens, request.num_pending_tokens) == (0, 1)
    outputs = engine.step()  # the first decode is launched with the token still on the device
    assert [output.new_token_ids for output in outputs] == [request.output_token_ids[:1]]
    assert (request.num_computed_tokens, request.num_pending_tokens) == (4, 1)
    while engine.has_unfinished_requests():
        engine.step()
    # max_tokens 3: the step that would compute a fourth token is never scheduled.
    assert request.num_output_tokens == 3 and request.num_computed_tokens == 5
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_usable_blocks


def test_a_request_stopping_under_async_scheduling_drops_its_extra_token_and_frees_its_blocks(checkpoint):
    engine = _engine(checkpoint[0], async_scheduling=True)
    greedy_run = engine.generate([[9] * 10], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_at = greedy_run[3]
    expected = greedy_run[: greedy_run.index(stop_at) + 1]
    request = engine.make_request("s", [9] * 10, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                   stop_token_ids=(stop_at,)))
    engine.add_request(request, detokenize=False)
    finish_reasons = []
    while engine.has_unfinished_requests():
        finish_reasons += [output.finish_reason for output in engine.step()]
        engine.scheduler.check_invariants()
    assert request.output_token_ids == expected and finish_reasons[-1] == "stop"
    assert request.num_pending_tokens == 0
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_usable_blocks


def test_streamed_text_deltas_concatenate_to_the_full_decode():
    # max_num_seqs 8 (one request runs): on CUDA 4 decode graphs to capture, not the default 35
    # (under tests/replica/cuda_emulation.py's interpreter those took past pytest's 600 s timeout).
    engine = LLMEngine(make_engine_config(max_model_len=256, num_kv_blocks=64, max_num_seqs=8), "builtin",
                       device=TEST_DEVICE)
    request = engine.make_request("t", engine.tokenizer.encode("héllo wörld ✓"), SamplingParams(max_tokens=40, seed=3))
    engine.add_request(request)
    text, finish = "", None
    while engine.has_unfinished_requests():
        for output in engine.step():
            text += output.text
            finish = output.finish_reason
    assert finish in ("stop", "length")
    assert text == engine.tokenizer.decode(request.output_token_ids)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        (list(range(60)), SamplingParams(max_tokens=1), "prompt"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=63), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 2], SamplingParams(top_k=-2), "top_k"),
        ([1, 5000], SamplingParams(), "prompt_token_ids"),
        # No schema checked these before the engine: a float seed failed the next step, the
        # running request's too, and a float token id was truncated.
        ([1, 2], SamplingParams(seed=1.5), "seed"),
        ([1, 2], SamplingParams(stop_token_ids=(2.5,)), "stop_token_ids"),
    ],
)
def test_bad_request_is_rejected_at_the_edge_without_disturbing_running_work(prompt, params, field):
    # LLMEngine.add_request is the in-process edge: it validates once (replica.core.request.validate_request).
    engine = LLMEngine(make_engine_config(max_model_len=60, max_num_batched_tokens=64, num_kv_blocks=32), "builtin",
                       device=TEST_DEVICE)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    running = engine.make_request("running", [1, 2, 3], greedy)
    engine.add_request(running, detokenize=False)
    engine.step()

    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(engine.make_request("bad", prompt, params))
    assert error.value.field == field and field in str(error.value)
    engine.scheduler.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert running.output_token_ids == engine.generate([[1, 2, 3]], greedy)[0]


def test_numpy_integers_in_sampling_params_are_the_ints_they_hold():
    import numpy as np

    params = SamplingParams(seed=np.int64(7), top_k=np.int32(5), stop_token_ids=(np.int64(3),),
                            logit_bias=((np.int64(4), 1.0),))
    assert params == SamplingParams(seed=7, top_k=5, stop_token_ids=(3,), logit_bias=((4, 1.0),))
    assert all(type(value) is int for value in (params.seed, params.top_k, *params.stop_token_ids,
                                                params.logit_bias[0][0]))


def _run_to_completion(engine: LLMEngine, prompt: str, params: SamplingParams):
    request = engine.make_request(f"r-{id(params)}", engine.tokenizer.encode(prompt), params)
    engine.add_request(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return request, outputs


@pytest.fixture(scope="module")
def builtin_engine() -> LLMEngine:
    return LLMEngine(make_engine_config(max_model_len=256, num_kv_blocks=64, max_num_seqs=8), "builtin", device="cpu")


def test_stop_token_id_is_reported_as_the_stop_reason_and_its_text_is_left_out(builtin_engine):
    """The text of the token it stopped on is left out of the deltas unless
    include_stop_str_in_output, as the front leaves it out (RequestOutput.text's rule; the
    in-process engine kept it: helper-45's fuzzing)."""
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    request, _ = _run_to_completion(builtin_engine, "abc", greedy)
    tokens, decode = request.output_token_ids, builtin_engine.tokenizer.decode
    # The first token past the start, new to the output, that adds text of its own.
    end = next(index for index in range(2, len(tokens))
               if tokens[index] not in tokens[:index] and decode(tokens[:index + 1]) != decode(tokens[:index]))
    for include in (False, True):
        stopped, outputs = _run_to_completion(builtin_engine, "abc", SamplingParams(
            max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(tokens[end],),
            include_stop_str_in_output=include))
        assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == tokens[end]
        assert stopped.output_token_ids == tokens[:end + 1]  # the id stays in the token ids
        assert "".join(output.text for output in outputs) == decode(tokens[:end + 1] if include else tokens[:end])


def test_top_logprobs_come_with_every_token_and_rank_the_greedy_choice_first(builtin_engine):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=4)
    request, outputs = _run_to_completion(builtin_engine, "hi", params)
    tops = [top for output in outputs for top in output.top_logprobs]
    assert len(tops) == 6 and all(len(top.token_ids) == 4 for top in tops)
    assert [top.token_ids[0] for top in tops] == request.output_token_ids
    assert all(top.logprobs == sorted(top.logprobs, reverse=True) for top in tops)
    logprobs = [logprob for output in outputs for logprob in output.logprobs]
    assert logprobs == pytest.approx([top.logprobs[0] for top in tops])


def test_the_engine_cores_rows_carry_what_the_outputs_carry():
    # step_rows() is step() as the engine core sends it: CoreOutput rows built in place of RequestOutputs.
    config = make_engine_config(max_model_len=256, num_kv_blocks=64, max_num_seqs=8)
    requests = [("logprobs", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True,
                                                         top_logprobs=2)),
                ("long", [8, 9], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))]
    steps_by_kind = {}
    for kind in ("outputs", "rows"):
        engine = LLMEngine(config, "builtin", device=TEST_DEVICE)
        for request_id, prompt, params in requests:
            engine.add_request(engine.make_request(request_id, prompt, params), detokenize=False)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step() if kind == "outputs" else engine.step_rows())
        steps_by_kind[kind] = steps
    output_steps, row_steps = steps_by_kind["outputs"], steps_by_kind["rows"]
    assert len(output_steps) == len(row_steps) >= 7
    for outputs, rows in zip(output_steps, row_steps):
        assert [row[:7] for row in rows] == [
            (output.request_id, output.new_token_ids, output.finish_reason, output.num_cached_tokens, output.logprobs,
             [tuple(top) for top in output.top_logprobs] if output.top_logprobs else None, output.stop_reason)
            for output in outputs]
        # The first admission rides on each request's first token only (the front's queue-time metric).
        assert all((row[7] is not None) == (output.num_output_tokens == 1) for row, output in zip(rows, outputs))
    assert sum(len(row[1]) for rows in row_steps for row in rows) == 12


def test_repetition_penalty_changes_greedy_output_and_penalty_free_requests_do_not_change(builtin_engine):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first, _ = _run_to_completion(builtin_engine, "la la la la", plain)
    penalized, _ = _run_to_completion(builtin_engine, "la la la la", SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.0))
    again, _ = _run_to_completion(builtin_engine, "la la la la", plain)
    assert penalized.output_token_ids != first.output_token_ids
    assert again.output_token_ids == first.output_token_ids
