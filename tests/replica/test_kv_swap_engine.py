"""The host KV tier through the whole engine on the built-in model: a cramped pool that
swaps, the same pool recomputing and a roomy pool that never preempts produce the same
tokens, greedy and seeded, with the real block copies between the device cache and host
memory; each paired with a probe that the swap happened, and no block of either pool leaks.
HEADROOM_TEST_DEVICE=cuda runs the engines on a GPU (pinned host blocks, the copy stream)."""

from __future__ import annotations

import os
import random

import pytest

from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.preemption_mode import UNMEASURED_COSTS
from replica.core.request import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, top_k=40, seed=7, ignore_eos=True)
# Rates given, so the engines skip the start-up measurement (one test measures them).
FIXED_COSTS = dict(preemption_recompute_s_per_token=1e-3, preemption_swap_bytes_per_s=1e9)
TEST_DEVICE = os.environ.get("HEADROOM_TEST_DEVICE", "cpu")


def _engine(num_kv_blocks: int, **overrides) -> LLMEngine:
    config = dict(block_size=4, max_model_len=40, max_num_batched_tokens=64, max_num_seqs=8,
                  num_kv_blocks=num_kv_blocks, **FIXED_COSTS)
    return LLMEngine(make_engine_config(**{**config, **overrides}), "builtin", device=TEST_DEVICE)


def _prompts(shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 250) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 250) for _ in range(n)] for n in (3, 5, 6, 9, 4, 7)]


def _check_pools_empty(engine: LLMEngine) -> None:
    kv_cache = engine.scheduler.kv_cache
    engine.scheduler.check_invariants()
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked device blocks"
    assert kv_cache.num_free_host_blocks == kv_cache.num_host_blocks, "leaked host blocks"


@pytest.fixture(scope="module")
def roomy():
    engine = _engine(256)
    outputs = {(params.seed, shared): engine.generate(_prompts(shared), params)
               for params in (GREEDY, SEEDED) for shared in (0, 12)}
    assert engine.scheduler.counters.preemptions == 0
    return outputs


@pytest.mark.parametrize("params, async_scheduling, prefetch",
                         [(GREEDY, False, False), (SEEDED, False, False), (GREEDY, True, False),
                          (GREEDY, False, True), (SEEDED, True, True)],
                         ids=["greedy", "seeded", "greedy-async", "greedy-prefetch", "seeded-async-prefetch"])
def test_cramped_swap_equals_cramped_recompute_equals_a_roomy_pool(roomy, params, async_scheduling, prefetch):
    # 10 usable blocks of 4 tokens for six requests growing to 19-25 tokens each.
    swap = _engine(11, num_host_kv_blocks=64, preemption_mode="swap", async_scheduling=async_scheduling)
    # The engine prefetches swap-ins where a copy stream overlaps them (CUDA); the CPU runs the
    # same copies in the same order, in turn.
    swap.scheduler.prefetch_swap_ins = prefetch
    recompute = _engine(11, preemption_mode="recompute", async_scheduling=async_scheduling)
    assert swap.generate(_prompts(), params) == recompute.generate(_prompts(), params) == roomy[(params.seed, 0)]
    counters = swap.scheduler.counters
    assert counters.swap_preemptions == counters.preemptions > 0, "the cramped pool must really swap"
    assert swap.scheduler.kv_cache.swapped_in_blocks > 0 and counters.recompute_tokens_avoided > 0
    prefetched = swap.scheduler.kv_cache.prefetched_blocks
    assert (prefetched > 0) == prefetch and swap.runner.kv_swap.prefetched_blocks == prefetched
    assert recompute.scheduler.counters.recomputed_tokens > 0 and recompute.scheduler.counters.swap_preemptions == 0
    _check_pools_empty(swap)
    _check_pools_empty(recompute)


def test_the_load_report_and_the_metrics_carry_what_the_executor_copied_and_when_the_steps_waited(roomy):
    from prometheus_client import generate_latest

    from replica.core.outputs import StepStats
    from replica.server.load_report import LoadReportBuilder
    from replica.server.metrics import ReplicaMetrics

    engine = _engine(11, num_host_kv_blocks=64, preemption_mode="swap")
    engine.scheduler.prefetch_swap_ins = True  # the engine prefetches on CUDA only
    assert engine.generate(_prompts(), GREEDY) == roomy[(None, 0)]
    load = engine.scheduler.load()
    report = LoadReportBuilder("r0", StepStats()).build(load)
    metrics = ReplicaMetrics("r0", "builtin")
    metrics.update(load, report)
    # The executor's own counts of what it copied: prefetched beside a step, and (swap-outs,
    # swap-ins, host hits) before one, which that step's forward pass waited for.
    swapper = engine.runner.kv_swap
    prefetched = swapper.prefetched_blocks
    waited = swapper.swapped_out_blocks + swapper.swapped_in_blocks - prefetched
    assert prefetched > 0 and waited > 0
    assert (report.prefetched_blocks_total, report.copy_wait_blocks_total) == (prefetched, waited)
    assert 0 < report.copy_wait_steps_total <= waited
    assert report.swap_preemptions_total == engine.scheduler.counters.swap_preemptions > 0
    labels = {"replica": "r0", "model": "builtin"}
    sample = lambda name: metrics.registry.get_sample_value(name, labels)  # noqa: E731
    assert sample("headroom_kv_prefetched_blocks_total") == prefetched
    assert sample("headroom_kv_copy_wait_blocks_total") == waited
    assert sample("headroom_kv_copy_wait_steps_total") == report.copy_wait_steps_total
    swapped_in = swapper.swapped_in_blocks - engine.scheduler.kv_cache.host_hit_blocks  # host hits counted apart
    assert sample("headroom_kv_swapped_in_blocks_total") == swapped_in
    assert sample("headroom_kv_swapped_in_bytes_total") == swapped_in * swapper.bytes_per_block
    assert sample("headroom_num_swap_preemptions_total") == report.swap_preemptions_total
    assert b"headroom_kv_prefetches_cancelled_total" in generate_latest(metrics.registry)
    _check_pools_empty(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_swapped_requests_sharing_prefix_blocks_resume_on_the_device_copy(roomy, params):
    # Six prompts share 12 tokens (three blocks of 4) through the prefix cache; 13 usable blocks.
    engine = _engine(14, num_host_kv_blocks=64, preemption_mode="swap")
    requests = [engine.make_request(f"r{i}", prompt, params) for i, prompt in enumerate(_prompts(12))]
    for request in requests:
        engine.add_request(request, detokenize=False)
    kv_cache = engine.scheduler.kv_cache
    # Requests swapped out with the shared prefix while a request on the device holds it too.
    swapped_sharing = set()
    while engine.has_unfinished_requests():
        engine.step()
        shared_hash = requests[0].block_hashes[0]
        if any(blocks[0].block_hash == shared_hash for blocks in kv_cache.req_to_blocks.values()):
            swapped_sharing |= {request_id for request_id, swapped in kv_cache.swapped.items()
                                if swapped.host_blocks[0].block_hash == shared_hash}
    recomputed = _engine(14, preemption_mode="recompute")
    assert [list(r.output_token_ids) for r in requests] == recomputed.generate(_prompts(12), params) == roomy[
        (params.seed, 12)]
    assert swapped_sharing, "a request holding the shared prefix blocks must have been swapped"
    assert kv_cache.prefix_cache_hits > 0 and recomputed.scheduler.counters.recomputed_tokens > 0
    # Resuming, they took the shared blocks from the device's prefix cache and copied back only
    # the rest: fewer blocks came back than went out (copied, or found on the host).
    assert 0 < kv_cache.swapped_in_blocks < kv_cache.swapped_out_blocks + kv_cache.swap_out_blocks_on_host
    _check_pools_empty(engine)
    _check_pools_empty(recomputed)


def test_a_request_aborted_on_the_host_frees_its_host_blocks_and_the_rest_are_unchanged(roomy):
    engine = _engine(11, num_host_kv_blocks=64, preemption_mode="swap")
    requests = [engine.make_request(f"r{i}", prompt, GREEDY) for i, prompt in enumerate(_prompts())]
    for request in requests:
        engine.add_request(request, detokenize=False)
    kv_cache = engine.scheduler.kv_cache
    while not kv_cache.swapped:
        engine.step()
    swapped_id = next(iter(kv_cache.swapped))
    engine.abort_request(swapped_id)
    assert not kv_cache.swapped and kv_cache.num_free_host_blocks == kv_cache.num_host_blocks
    while engine.has_unfinished_requests():
        engine.step()
    expected = roomy[(None, 0)]
    assert [r.output_token_ids for r in requests if r.request_id != swapped_id] == [
        tokens for r, tokens in zip(requests, expected) if r.request_id != swapped_id]
    _check_pools_empty(engine)


def test_a_full_host_pool_falls_back_to_recompute_with_the_same_tokens(roomy):
    engine = _engine(11, num_host_kv_blocks=4, preemption_mode="swap")
    assert engine.generate(_prompts(), GREEDY) == roomy[(None, 0)]
    counters = engine.scheduler.counters
    assert 0 < counters.swap_preemptions < counters.preemptions, "some victims swap, some find the host full"
    assert counters.recomputed_tokens > 0
    _check_pools_empty(engine)


def test_the_engine_measures_the_preemption_costs_it_is_not_given():
    engine = LLMEngine(make_engine_config(block_size=4, max_model_len=64, num_kv_blocks=32, num_host_kv_blocks=8),
                       "builtin", device=TEST_DEVICE)
    costs = engine.scheduler.preemption.costs
    assert costs != UNMEASURED_COSTS and costs.recompute_s_per_token > 0 and costs.swap_s_per_block > 0
    assert engine.scheduler.kv_block_bytes == engine.runner.kv_swap.bytes_per_block > 0
    given = _engine(32, num_host_kv_blocks=8)
    assert given.scheduler.preemption.costs.recompute_s_per_token == FIXED_COSTS["preemption_recompute_s_per_token"]


def test_a_prefix_spilled_to_the_host_and_hit_there_gives_a_roomy_pools_tokens():
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(20)]  # five full blocks of 4
    filler = [rng.randrange(3, 250) for _ in range(30)]
    prompt = shared + [11, 12, 13]  # 23 + 16 tokens: within max_model_len 40
    expected = _engine(256).generate([prompt], GREEDY)
    engine = _engine(11, num_host_kv_blocks=32)  # 10 usable device blocks: the filler evicts the prefix
    engine.generate([shared], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.generate([filler], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    kv_cache = engine.scheduler.kv_cache
    assert kv_cache.spilled_blocks > 0
    # Written through the step after each block filled, by the executor's copies beside the
    # forward pass; the filler's steps copied nothing before theirs.
    assert engine.runner.kv_swap.written_through_blocks == kv_cache.spilled_blocks
    assert engine.runner.kv_swap.swapped_out_blocks == 0
    assert engine.generate([prompt], GREEDY) == expected
    assert kv_cache.host_hit_blocks == 5, "the shared prefix must have been copied back from the host"
    _check_pools_empty(engine)


def test_usage_reports_the_prompts_first_cache_hit_whatever_preempted_it():
    """A readmission's hit covers the request's own output (and a swap-in restores, it does not
    hit): usage's cached prompt tokens are the first admission's, never more than the prompt."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 250) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 250) for _ in range(rng.randint(2, 6))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reports = {}
    engines = {"roomy": _engine(256, max_model_len=48),
               "recompute": _engine(14, max_model_len=48, preemption_mode="recompute"),
               "swap": _engine(14, max_model_len=48, num_host_kv_blocks=64, preemption_mode="swap")}
    for name, engine in engines.items():
        requests = [engine.make_request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
        engine.add_request(requests[0], detokenize=False)
        engine.step(), engine.step()  # r0's prompt is cached before the others arrive
        for request in requests[1:]:
            engine.add_request(request, detokenize=False)
        last = {}
        while engine.has_unfinished_requests():
            last.update((output.request_id, output) for output in engine.step())
        reports[name] = [last[request.request_id].num_cached_tokens for request in requests]
        if name != "roomy":
            assert sum(request.num_preemptions for request in requests) > 0, f"{name}: nothing was preempted"
        _check_pools_empty(engine)
    assert reports["recompute"] == reports["swap"] == reports["roomy"] == [0, 12, 12, 12, 12, 12]
