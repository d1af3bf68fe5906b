"""The model runner's replay machinery on the CPU: the CUDA-graph size ladder and padding
choice, the staged-input buffer and its single copy, device block tables kept by
incremental changes, the rows' sampling parameters reused across steps, the staged inputs
of real scheduler steps against a plain flattening, and the memory profile that sizes the
KV pool."""

from __future__ import annotations

import random

import attention_harness  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.model.registry import resolve_model_path
from replica.config import ConfigError, make_engine_config, resolve_max_model_len
from replica.executor.block_table import BlockTables
from replica.executor.cuda_graphs import capture_sizes, padded_batch_size, use_cuda_graphs
from replica.executor.memory_profile import MemoryProfile, kv_cache_bytes_per_block, profile_run
from replica.executor.model_runner import ModelRunner
from replica.executor.rank_config import resolve_rank_config
from replica.executor.request_rows import RequestRows
from replica.executor.staging import FIELD_ALIGNMENT, StagedField, StagedInputs
from replica.model import load_model
from replica.core.request import Request, SamplingParams
from replica.core.scheduler import Scheduler
from replica.parallel.group import NO_TENSOR_PARALLEL


@pytest.fixture(scope="module")
def builtin_model():
    return load_model(resolve_model_path("builtin"), device="cpu")


# ---- the graph ladder ------------------------------------------------------------------
@pytest.mark.parametrize("max_num_seqs, budget, expected", [
    (256, 2048, [1, 2, 4] + list(range(8, 257, 8))),
    (20, 2048, [1, 2, 4, 8, 16, 20]),
    (256, 12, [1, 2, 4, 8, 12]),
    (1, 2048, [1]),
    (4096, 8192, [1, 2, 4] + list(range(8, 513, 8))),
])
def test_capture_ladder_is_1_2_4_then_multiples_of_8_up_to_the_largest_decode_batch(max_num_seqs, budget, expected):
    assert capture_sizes(max_num_seqs, budget) == expected


def test_a_decode_batch_pads_to_the_smallest_captured_size_that_holds_it():
    sizes = capture_sizes(20, 2048)
    assert [padded_batch_size(sizes, n) for n in (1, 3, 4, 5, 9, 16, 17, 20, 21)] == [1, 4, 4, 8, 16, 16, 20, 20, None]


# ---- staged inputs -----------------------------------------------------------------------
def test_staged_fields_are_aligned_typed_views_and_a_send_copies_only_what_it_is_told():
    staged = StagedInputs([StagedField("ids", torch.int64, 5), StagedField("lens", torch.int32, 3),
                           StagedField("temps", torch.float32, 4)], torch.device("cpu"))
    assert all(offset % FIELD_ALIGNMENT == 0 for offset in staged.offsets.values())
    views = staged.host_views()
    views["ids"][:] = [1, 2, 3, 4, 5]
    views["lens"][:] = [7, 8, 9]
    views["temps"][:] = 0.5
    staged.send(staged.end_of("lens", 2))  # the ids and two of the lens; not the temps
    device = staged.device_views
    assert device["ids"].tolist() == [1, 2, 3, 4, 5] and device["lens"].tolist() == [7, 8, 0]
    assert device["temps"].tolist() == [0.0] * 4 and device["temps"].dtype == torch.float32
    # The next step fills the other host buffer; the first one's contents stay as sent.
    other = staged.host_views()
    assert other["ids"].tolist() == [0] * 5 and views["ids"].tolist() == [1, 2, 3, 4, 5]


# ---- device block tables ------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "append"]), st.integers(0, 3), st.integers(0, 4)),
                min_size=1, max_size=30))
def test_device_block_tables_kept_by_changes_equal_tables_rebuilt_from_scratch(operations):
    tables = BlockTables(num_rows=4, max_blocks_per_row=12, device=torch.device("cpu"))
    expected = {row: [] for row in range(4)}
    next_block = iter(range(1, 10_000))
    for operation, row, count in operations:
        blocks = [next(next_block) for _ in range(count)]
        if operation == "set":
            expected[row] = blocks
            tables.set_row(row, blocks)
        elif len(expected[row]) + count <= 12:
            expected[row] += blocks
            tables.append(row, blocks)
        if random.Random(len(blocks)).random() < 0.5:  # ship changes every few operations
            tables.apply_on_device(*map(torch.from_numpy, tables.take_changes()))
    tables.apply_on_device(*map(torch.from_numpy, tables.take_changes()))
    for row, blocks in expected.items():
        assert tables.device[row, :len(blocks)].tolist() == blocks
        assert tables.host[row, :len(blocks)].tolist() == blocks
    assert not tables.device[tables.null_row].any(), "the padding row must stay on the null block"


# ---- the rows' sampling parameters, reused while a step samples the same rows -------------
def test_rows_sampling_is_reused_for_the_same_rows_and_rebuilt_when_a_row_gets_a_new_request():
    rows = RequestRows(4, 8, 320, torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0)
    rows.add(Request("a", [1, 2], greedy), [1])
    rows.add(Request("b", [1, 2], greedy), [2])
    first = rows.sampling_of(np.array([0, 1]))
    assert first.facts["all_greedy"] and first.wants_logprobs == [False, False]
    assert rows.sampling_of(np.array([0, 1])) is first  # the next decode step: nothing rebuilt
    assert rows.sampling_of(np.array([1])).facts["num_rows"] == 1  # other rows: rebuilt
    rows.remove("a")
    rows.add(Request("c", [1, 2], SamplingParams(temperature=0.7, seed=3, logprobs=True)), [3])  # row 0 again
    again = rows.sampling_of(np.array([0, 1]))
    assert not again.facts["all_greedy"] and again.facts["num_seeded"] == 1
    assert again.wants_logprobs == [True, False] and again.seeded.tolist() == [0]


# ---- the staged inputs of real steps -------------------------------------------------------
def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(length)]


@pytest.mark.parametrize("block_change_capacity", [None, 2])
def test_staged_inputs_of_real_steps_equal_a_plain_flattening_of_the_scheduler_output(builtin_model,
                                                                                      block_change_capacity):
    # A cramped pool (preemptions, re-admissions), chunked prefill, prefix-cache hits and
    # seeded rows; with capacity 2 most block-table changes take the overflow copy.
    model, model_config = builtin_model
    config = make_engine_config(block_size=4, num_kv_blocks=17, max_model_len=64, max_num_batched_tokens=24,
                                max_num_seqs=4)
    scheduler = Scheduler(config)
    runner = ModelRunner(model, model_config, config, torch.device("cpu"))
    if block_change_capacity is not None:
        runner.block_change_capacity = block_change_capacity
    rng = random.Random(0)
    shared = _prompt(rng, 12)
    for index in range(6):
        prompt = shared + _prompt(rng, rng.randint(1, 20)) if index % 2 else _prompt(rng, rng.randint(1, 30))
        params = SamplingParams(max_tokens=rng.randint(6, 16), seed=index if index % 3 else None, ignore_eos=True)
        scheduler.add_request(Request(f"r{index}", prompt, params))
    checked_steps = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        runner_output = runner.execute(output)
        if output.scheduled:
            _assert_staged_inputs_match(runner, scheduler, output)
            checked_steps += 1
        assert set(runner_output.sampled_token_ids) == {e.request.request_id for e in output.scheduled if e.samples}
        scheduler.update(output, runner_output.sampled_token_ids)
    assert checked_steps > 10 and scheduler.counters.preemptions > 0 and scheduler.kv_cache.prefix_cache_hits > 0


def _assert_staged_inputs_match(runner: ModelRunner, scheduler: Scheduler, output) -> None:
    block_size = runner.block_size
    input_ids, positions, slots, seq_lens, query_lens = [], [], [], [], []
    for entry in output.scheduled:
        table = scheduler.kv_cache.get_block_ids(entry.request.request_id)
        seq_positions = list(range(entry.start_pos, entry.start_pos + entry.num_new_tokens))
        input_ids += entry.token_ids
        positions += seq_positions
        slots += [table[p // block_size] * block_size + p % block_size for p in seq_positions]
        seq_lens.append(entry.start_pos + entry.num_new_tokens)
        query_lens.append(entry.num_new_tokens)
    num_tokens, num_seqs = len(input_ids), len(seq_lens)
    device = runner.staged.device_views
    assert device["input_ids"][:num_tokens].tolist() == input_ids
    assert device["positions"][:num_tokens].tolist() == positions
    assert device["slot_mapping"][:num_tokens].tolist() == slots
    assert device["seq_lens"][:num_seqs].tolist() == seq_lens
    assert device["query_start_loc"][:num_seqs + 1].tolist() == np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    for row, entry in enumerate(output.scheduled):
        table = scheduler.kv_cache.get_block_ids(entry.request.request_id)
        assert runner.batch_block_tables[row, :len(table)].tolist() == table


def test_block_tables_are_a_multiple_of_16_columns_wide_so_a_cut_max_model_len_keeps_the_kernels_variant(builtin_model):
    """60 tokens in blocks of 4 need 15 columns; the runner's tables (and warm_up's,
    test_attention_warm_up.py) are 16 wide, as they are for 64 tokens."""
    model, model_config = builtin_model
    for max_model_len in (60, 64):
        config = make_engine_config(block_size=4, num_kv_blocks=64, max_model_len=max_model_len,
                                    max_num_batched_tokens=64, max_num_seqs=8)
        runner = ModelRunner(model, model_config, config, torch.device("cpu"))
        assert runner.batch_block_tables.shape[1] == runner.rows.block_tables.device.shape[1] == 16
        assert runner.batch_block_tables.stride(0) == 16


def test_padded_decode_steps_sample_what_unpadded_steps_sample(builtin_model):
    model, model_config = builtin_model
    config = make_engine_config(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=64,
                                max_num_seqs=8)
    runs = []
    for padded in (False, True):
        scheduler = Scheduler(config)
        runner = ModelRunner(model, model_config, config, torch.device("cpu"))
        if padded:
            runner.enable_decode_padding()
            outputs = (runner.decode_logits, runner.decode_greedy)
            # Again, as a test does to an engine whose graphs already turned it on: captured
            # graphs write these very tensors, so a second call must keep them (on CUDA it once
            # swapped them, and every graph-replayed token read back as 0).
            runner.enable_decode_padding()
            assert runner.decode_logits is outputs[0] and runner.decode_greedy is outputs[1]
        rng = random.Random(1)
        requests = [Request(f"r{index}", _prompt(rng, 3 + 5 * index), SamplingParams(max_tokens=4, temperature=0.0))
                    for index in range(5)]  # five decodes pad to a batch of 8
        for request in requests:
            scheduler.add_request(request)
        padded_sizes = set()
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            in_flight = runner.launch(output)
            padded_sizes.add(in_flight.graph_batch_size)
            scheduler.update(output, in_flight.result().sampled_token_ids)
        runs.append(([request.output_token_ids for request in requests], padded_sizes))
    (unpadded_outputs, unpadded_sizes), (padded_outputs, padded_sizes) = runs
    assert padded_outputs == unpadded_outputs
    assert unpadded_sizes == {None} and 8 in padded_sizes


def test_decode_steps_use_graphs_only_on_cuda_unless_eager_and_only_with_the_triton_backend():
    from replica.attention.torch_ref import TorchAttentionBackend
    from replica.attention.triton_backend import TritonAttentionBackend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton, reference = TritonAttentionBackend.supports_cuda_graphs, TorchAttentionBackend.supports_cuda_graphs
    assert triton and not reference  # the reference reads sequence lengths on the host
    assert use_cuda_graphs(cuda, False, triton)
    assert not use_cuda_graphs(cuda, True, triton)  # enforce_eager
    assert not use_cuda_graphs(cuda, False, reference)
    assert not use_cuda_graphs(cpu, False, triton)


# ---- the memory profile ---------------------------------------------------------------------
def test_gpu_memory_utilization_is_a_fraction_in_0_1_and_the_error_names_it():
    assert make_engine_config(gpu_memory_utilization=0.9).gpu_memory_utilization == 0.9
    assert make_engine_config().gpu_memory_utilization is None  # num_kv_blocks stays in charge
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="^gpu_memory_utilization: "):
            make_engine_config(gpu_memory_utilization=bad)


def test_the_kv_pool_gets_the_engines_share_minus_weights_peak_activations_and_memory_outside_torch():
    gib = 2**30
    # 80 GiB device, 0.9 of it ours; 2 GiB weights, 3 GiB peak; 8 GiB used but only 5.5 GiB
    # reserved by torch: 2.5 GiB is the CUDA context and others.
    profile = MemoryProfile(total=80 * gib, free=72 * gib, reserved=int(5.5 * gib), weights=2 * gib,
                            peak_activations=3 * gib)
    assert profile.non_torch == int(2.5 * gib)
    assert profile.kv_cache_bytes(0.9) == int(72 * gib - 2 * gib - 3 * gib - 2.5 * gib)
    assert profile.num_kv_blocks(0.9, bytes_per_block=gib // 4, min_blocks=2) == int(64.5 * 4)
    with pytest.raises(ConfigError, match="gpu_memory_utilization: 0.1 of 80.0 GiB .* needs 129"):
        profile.num_kv_blocks(0.1, bytes_per_block=gib // 4, min_blocks=129)


def test_a_pool_that_profiling_will_size_does_not_bound_max_model_len_before_it_exists(builtin_model):
    # With gpu_memory_utilization, CUDA sizes the pool by a profiling run after max_model_len is
    # decided: the default num_kv_blocks (2,047 usable blocks, 32,752 tokens) must not cap a
    # 128k-context model, nor refuse an explicit max_model_len the profiled pool may hold.
    config = make_engine_config(gpu_memory_utilization=0.9)
    assert resolve_max_model_len(config, 131072, pool_sized_later=True).max_model_len == 131072
    assert resolve_max_model_len(config, 131072).max_model_len == 32752  # a pool that is not profiled bounds it
    assert make_engine_config(max_model_len=65536, gpu_memory_utilization=0.9).max_model_len == 65536
    with pytest.raises(ConfigError, match="^num_kv_blocks: 2048 blocks .* max_model_len=65536"):
        make_engine_config(max_model_len=65536)
    # Where nothing profiles (here, the CPU: gpu_memory_utilization is CUDA's), the rank's config
    # holds max_model_len to num_kv_blocks as validation would have.
    model, model_config = builtin_model
    too_long = make_engine_config(max_model_len=model_config.max_model_len, num_kv_blocks=9, gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match=f"^num_kv_blocks: 9 blocks .* max_model_len={model_config.max_model_len}"):
        resolve_rank_config(too_long, model, model_config, torch.device("cpu"), NO_TENSOR_PARALLEL)
    follows = make_engine_config(num_kv_blocks=9, gpu_memory_utilization=0.9)
    assert resolve_rank_config(follows, model, model_config, torch.device("cpu"), NO_TENSOR_PARALLEL).max_model_len == 128


def test_a_cuda_rank_sizes_its_pool_by_profiling_through_resolve_rank_config(builtin_model, monkeypatch):
    # The profiled path runs only on CUDA: here the device memory API is an 80 GiB ledger and the
    # profile run itself runs on the CPU, but the call from resolve_rank_config is the real one
    # (a signature that drifted from its caller once crashed every CUDA engine at start).
    import inspect

    from replica.executor import memory_profile, rank_config

    model, model_config = builtin_model
    gib = 2**30
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ledger = {"total": 80 * gib, "peak": weights + 2 * gib, "outside": gib}
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: weights)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: ledger["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: weights)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (
        ledger["total"] - weights - ledger["outside"], ledger["total"]))
    monkeypatch.setattr(model.attn_backend, "warm_up", lambda *args: None)
    real = memory_profile.profile_num_kv_blocks
    calls = []

    def on_the_cpu(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)  # TypeError if the caller drifted
        assert bound.arguments["device"].type == "cuda"
        bound.arguments["device"] = torch.device("cpu")
        calls.append(bound.arguments["min_tokens"])
        return real(*bound.args, **bound.kwargs)

    monkeypatch.setattr(rank_config, "profile_num_kv_blocks", on_the_cpu)
    config = make_engine_config(block_size=16, gpu_memory_utilization=0.5, max_num_batched_tokens=256)
    resolved = resolve_rank_config(config, model, model_config, torch.device("cuda"), NO_TENSOR_PARALLEL)
    assert calls == [16]  # max_model_len follows the model: the pool must hold one block
    scratch = profile_run(model, model_config, make_engine_config(**{**config.model_dump(), "max_model_len": 128}),
                          torch.device("cpu"))
    per_block = kv_cache_bytes_per_block(model_config, 16, torch.float32)
    budget = 40 * gib - weights - (2 * gib - scratch) - gib  # half the device, less weights, peak, outside torch
    assert resolved.num_kv_blocks == budget // per_block
    assert resolved.max_model_len == model_config.max_model_len


def test_the_profile_run_executes_the_largest_step_the_scheduler_can_form(builtin_model):
    model, model_config = builtin_model
    # A budget of 100 tokens over sequences of at most 48: three sequences (48, 48, 4).
    config = make_engine_config(block_size=16, num_kv_blocks=64, max_model_len=48, max_num_batched_tokens=100,
                                max_num_seqs=8)
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append((args[0].shape[0], args[3].num_seqs)))
    try:
        scratch_bytes = profile_run(model, model_config, config, torch.device("cpu"))
    finally:
        handle.remove()
    assert seen == [(100, 3)]
    # Blocks 1..3, 1..3 and 1 of the three sequences, plus the null block.
    assert scratch_bytes == 8 * kv_cache_bytes_per_block(model_config, 16, torch.float32)


# ---- padded decode through the Triton kernel ------------------------------------------------
def test_padded_decode_through_the_triton_split_kv_kernel_equals_the_torch_reference(tmp_path):
    """Graph-style padding rows (slot -1, length 1 on the null block, max_seq_len =
    max_model_len as the bound) through the split-KV kernel, run by Triton's interpreter."""
    import transformers

    from replica.attention import launch_plan

    from replica.model.builtin import build_byte_level_tokenizer
    from replica.core.engine import LLMEngine

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=320, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():  # spread the weights so greedy argmax has clear winners
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(tmp_path)
    build_byte_level_tokenizer().save(str(tmp_path / "tokenizer.json"))
    rng = random.Random(3)
    prompts = [_prompt(rng, length) for length in (17, 20, 23)]  # three decodes pad to a batch of 4
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    config = make_engine_config(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=256,
                                max_num_seqs=4, async_scheduling=True)
    reference = LLMEngine(config, str(tmp_path), device="cpu", dtype="float32", attention_backend="torch")
    engine = LLMEngine(config, str(tmp_path), device="cpu", dtype="float32", attention_backend="triton")
    engine.runner.enable_decode_padding()
    backend = next(module.attn_backend for module in engine.model.modules() if hasattr(module, "attn_backend"))
    tiny = launch_plan.KernelConfig(key_tile=16, num_warps=4, num_stages=2)
    backend.tuning = launch_plan.AttentionTuning(decode_configs={16: tiny, 32: tiny}, prefill_configs={16: tiny, 32: tiny},
                                                 segment_min_keys=16)
    backend.num_sms = 64  # plan as on a GPU: decodes split their contexts into segments
    plans, plan = [], backend.plan  # (the bounds the plan saw, the plan)
    backend.plan = lambda query, key_cache, meta: plans.append(
        ((meta.num_seqs, meta.max_query_len, meta.max_seq_len), plan(query, key_cache, meta))) or plans[-1][1]
    padded_sizes = set()
    requests = [engine.make_request(f"t{index}", prompt, params) for index, prompt in enumerate(prompts)]
    for request in requests:
        engine.add_request(request, detokenize=False)
    plans_of_padded_steps = []
    while engine.has_unfinished_requests():
        planned_before = len(plans)
        engine.step()
        padded_sizes.add(engine.last_step.graph_batch_size)
        if engine.last_step.graph_batch_size is not None:
            plans_of_padded_steps += plans[planned_before:]
    assert [request.output_token_ids for request in requests] == reference.generate(prompts, params)
    # Padded decodes planned from the graph's pinned shape only (4 rows, query 1, max_model_len),
    # never from the real lengths, and that shape splits the contexts. (The prefill step's last
    # layer attends its 3 sampling rows as one-token queries, planned from their real lengths.)
    padded_plans = [p for bounds, p in plans_of_padded_steps if bounds == (4, 1, 64)]
    assert 4 in padded_sizes and padded_plans, "padded split-KV decodes must have run"
    assert all(p.is_split for p in padded_plans) and len(set(padded_plans)) == 1
    assert all(bounds == (4, 1, 64) for bounds, _ in plans_of_padded_steps), "a decode planned from real lengths"


class _MadeCurrent(Exception):
    """Stops the engine's start once it has made its device current (nothing more runs here)."""


@pytest.mark.parametrize("asked", [None, "cuda", "cuda:1"])
def test_an_engine_on_cuda_without_an_index_makes_the_current_device_current_by_its_index(monkeypatch, asked):
    """`headroom replica` without --device, `--device cuda` and bench_gpu.py's "cuda" give the
    engine a device without an index, which torch.cuda.set_device refuses (ValueError): every
    GPU engine died at its start that way (756485c, found by a desk review). Here torch.cuda says
    it has two devices, the current one cuda:1, and set_device checks its argument as torch
    does, then stops the start."""
    from torch.cuda._utils import _get_device_index

    from replica.core.engine import LLMEngine

    made_current = []

    def set_device(device) -> None:
        made_current.append(torch.device("cuda", _get_device_index(device)))  # torch's own check
        raise _MadeCurrent

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(_MadeCurrent):
        LLMEngine(make_engine_config(max_model_len=64, num_kv_blocks=16), "builtin", device=asked)
    assert made_current == [torch.device("cuda", 1)]
