"""The scheduler and KV cache manager, specified with a deterministic fake model."""

from __future__ import annotations

import pytest
from sched_harness import (
    check_budgets,
    fake_next_token,
    make_request,
    make_scheduler,
    reference_outputs,
    run_step,
    run_to_completion,
)

from replica.config import ConfigError, make_engine_config, resolve_max_model_len
from replica.core.victim_policy import cheapest_victim, fcfs_victim
from replica.core.request import Request, RequestStatus, SamplingParams
from replica.errors import InvalidRequestError, QueueFullError


def two_long_decodes():
    return [make_request("a", [1, 2, 3, 4, 5, 6, 7, 8], 20), make_request("b", [9, 8, 7, 6, 5, 4, 3, 2], 20)]


def test_cramped_pool_preempts_yet_output_equals_roomy_pool():
    # 8 usable blocks of 4 tokens hold 32 tokens; two 8 + 20 token sequences need 56.
    cramped = make_scheduler(block_size=4, num_kv_blocks=9, max_model_len=32, max_num_batched_tokens=64)
    roomy = make_scheduler(block_size=4, num_kv_blocks=256, max_model_len=32, max_num_batched_tokens=64)
    cramped_requests, roomy_requests = two_long_decodes(), two_long_decodes()
    cramped_out = run_to_completion(cramped, cramped_requests)
    roomy_out = run_to_completion(roomy, roomy_requests)

    assert cramped.counters.preemptions > 0, "the cramped pool must really preempt"
    assert sum(r.num_preemptions for r in cramped_requests) == cramped.counters.preemptions
    assert cramped.counters.recomputed_tokens > 0
    assert roomy.counters.preemptions == 0
    assert cramped_out == roomy_out == reference_outputs(two_long_decodes())
    for request in cramped_requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == 20


@pytest.mark.parametrize("budget", [1, 3, 7, 16, 128])
@pytest.mark.parametrize("threshold", [0, 5])
def test_chunk_size_changes_timing_not_output(budget, threshold):
    requests = [
        make_request("long", list(range(1, 61)), 6),
        make_request("short", [5, 6, 7], 12),
        make_request("mid", list(range(30, 50)), 9),
    ]
    scheduler = make_scheduler(
        block_size=4, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )
    expected = reference_outputs(requests)
    assert run_to_completion(scheduler, requests) == expected


def test_long_prompt_is_sliced_to_the_budget_while_a_decode_gets_a_token_every_step():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=16)
    decode = make_request("decode", [1, 2, 3, 4], 60)
    scheduler.add_request(decode)
    run_step(scheduler)  # prefill of the decode request
    scheduler.add_request(make_request("long", list(range(100)), 2))

    chunk_sizes = []
    for _ in range(7):
        before = decode.num_output_tokens
        output = run_step(scheduler)
        assert decode.num_output_tokens == before + 1, "the decode must get a token every step"
        sizes = {s.request.request_id: s.num_new_tokens for s in output.scheduled}
        assert output.num_scheduled_tokens == min(16, 1 + 100 - 15 * len(chunk_sizes))
        chunk_sizes.append(sizes["long"])
    # 100 prompt tokens in slices of 15 (budget 16 minus the decode's token).
    assert chunk_sizes == [15, 15, 15, 15, 15, 15, 10]


def test_without_chunking_the_long_prompt_runs_whole_in_one_big_step():
    scheduler = make_scheduler(
        block_size=4, num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=128,
        enable_chunked_prefill=False,
    )
    decode = make_request("decode", [1, 2, 3, 4], 60)
    scheduler.add_request(decode)
    run_step(scheduler)
    scheduler.add_request(make_request("long", list(range(100)), 2))
    output = run_step(scheduler)
    assert output.num_scheduled_tokens == 101  # the decode's token waits behind all 100


def test_without_chunking_a_prompt_that_does_not_fit_waits_and_nothing_skips_ahead():
    scheduler = make_scheduler(
        block_size=4, num_kv_blocks=128, max_model_len=64, max_num_batched_tokens=64,
        enable_chunked_prefill=False,
    )
    for i in range(5):
        scheduler.add_request(make_request(f"d{i}", [i + 1], 30))
    run_step(scheduler)
    scheduler.add_request(make_request("big", list(range(62)), 1))  # 62 > 64 - 5 decodes
    scheduler.add_request(make_request("small", [1, 2, 3], 1))
    output = run_step(scheduler)
    assert {s.request.request_id for s in output.scheduled} == {f"d{i}" for i in range(5)}
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]


def test_prefix_caching_saves_exactly_the_shared_full_blocks():
    block_size, shared_blocks, followers = 4, 3, 5
    prefix = list(range(40, 40 + shared_blocks * block_size))

    def requests():
        return [make_request(f"r{i}", prefix + [i, i + 1, i + 2, i + 3, i + 4], 6) for i in range(followers + 1)]

    with_cache = make_scheduler(block_size=block_size, num_kv_blocks=256, max_model_len=64, max_num_batched_tokens=256)
    without = make_scheduler(
        block_size=block_size, num_kv_blocks=256, max_model_len=64, max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    out_with = run_to_completion(with_cache, requests())
    out_without = run_to_completion(without, requests())
    assert out_with == out_without == reference_outputs(requests())
    saved = without.counters.scheduled_tokens - with_cache.counters.scheduled_tokens
    assert saved == followers * shared_blocks * block_size
    assert with_cache.kv_cache.prefix_cache_hits == followers * shared_blocks * block_size


def test_prefix_cache_hit_always_leaves_one_token_to_compute():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=64, max_model_len=32, max_num_batched_tokens=64)
    run_to_completion(scheduler, [make_request("first", list(range(8)), 1)])
    again = make_request("again", list(range(8)), 1)
    scheduler.add_request(again)
    output = run_step(scheduler)
    # Both blocks are cached, but the last token must run to produce logits.
    assert output.scheduled[0].start_pos == 4 and output.scheduled[0].num_new_tokens == 4


def test_cache_salt_isolates_prefix_cache_entries():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=64, max_model_len=32, max_num_batched_tokens=64)
    run_to_completion(scheduler, [make_request("t1", list(range(9)), 1, cache_salt="tenant-1")])
    other = make_request("t2", list(range(9)), 1, cache_salt="tenant-2")
    same = make_request("t1b", list(range(9)), 1, cache_salt="tenant-1")
    run_to_completion(scheduler, [other])
    assert other.num_cached_tokens == 0
    run_to_completion(scheduler, [same])
    assert same.num_cached_tokens == 8


def _admits_second_request(**config) -> bool:
    scheduler = make_scheduler(block_size=4, num_kv_blocks=11, max_model_len=40, max_num_batched_tokens=64, **config)
    first = make_request("first", list(range(12)), 20)  # 13 tokens after step 2: 4 of 10 blocks
    scheduler.add_request(first)
    run_step(scheduler)
    second = make_request("second", list(range(100, 124)), 1)  # needs 6 blocks; 6 are free
    scheduler.add_request(second)
    run_step(scheduler)
    return second.status != RequestStatus.WAITING


def test_watermark_holds_back_an_admission_that_would_eat_the_reserve():
    assert _admits_second_request(watermark=0.0)
    assert not _admits_second_request(watermark=0.2)  # 6 + 2 reserved > 6 free


def test_watermark_does_not_apply_while_nothing_runs():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=11, max_model_len=40, max_num_batched_tokens=64, watermark=0.2)
    whole_pool = make_request("whole", list(range(36)), 1)  # 9 blocks + 2 reserved > 10 usable
    scheduler.add_request(whole_pool)
    run_step(scheduler)
    assert whole_pool.status != RequestStatus.WAITING


def _admits_long_prompt_first_chunk(reserve_full_sequence: bool) -> bool:
    scheduler = make_scheduler(
        block_size=4, num_kv_blocks=11, max_model_len=40, max_num_batched_tokens=8,
        reserve_full_sequence=reserve_full_sequence,
    )
    scheduler.add_request(make_request("running", list(range(8)), 20))  # 2 blocks, grows
    run_step(scheduler)
    run_step(scheduler)
    long_prompt = make_request("long", list(range(100, 136)), 1)  # 9 blocks; its first chunk needs 2
    scheduler.add_request(long_prompt)
    run_step(scheduler)
    return long_prompt.status == RequestStatus.RUNNING


def test_full_sequence_check_admits_only_prompts_that_fit_whole():
    assert _admits_long_prompt_first_chunk(reserve_full_sequence=False)
    assert not _admits_long_prompt_first_chunk(reserve_full_sequence=True)


def test_priority_policy_admits_the_most_urgent_first():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.add_request(make_request("low", [1, 2], 2, priority=5))
    scheduler.add_request(make_request("high", [3, 4], 2, priority=0))
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["high"]


def _first_victim(**config) -> str:
    # 12 usable blocks of 4; three 4-token prompts growing to 24 tokens (6 blocks each).
    scheduler = make_scheduler(block_size=4, num_kv_blocks=13, max_model_len=32, max_num_batched_tokens=64, **config)
    requests = [make_request("p2", [1, 2, 3, 4], 20, priority=2)]
    scheduler.add_request(requests[0])
    run_step(scheduler)
    requests += [make_request("p0", [5, 6, 7, 8], 20, priority=0), make_request("p1", [9, 10, 11, 12], 20, priority=1)]
    victims = []
    outputs = run_to_completion(
        scheduler, requests[1:], on_step=lambda step, out: victims.extend(out.preempted_req_ids)
    )
    assert victims, "the pool is too small for all three: someone must be preempted"
    outputs["p2"] = requests[0].output_token_ids
    assert outputs == reference_outputs(
        [make_request("p2", [1, 2, 3, 4], 20), make_request("p0", [5, 6, 7, 8], 20), make_request("p1", [9, 10, 11, 12], 20)]
    )
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    return victims[0]


def test_priority_victim_is_the_lowest_priority_not_the_latest_admitted():
    assert _first_victim(scheduling_policy="priority") == "p2"
    assert _first_victim(scheduling_policy="priority", victim_policy="fcfs") == "p1"
    assert _first_victim(scheduling_policy="fcfs") == "p1"


def test_cheapest_victim_is_the_request_with_least_unshared_computed_work():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=256)
    shared = list(range(100, 116))  # 4 full blocks
    requests = [
        make_request("unique", list(range(20)), 10),
        make_request("shares_a", shared + [1, 2, 3, 4, 5, 6, 7, 8], 10),
        make_request("shares_b", shared + [9, 9, 9, 9], 10),
        make_request("newest", list(range(50, 62)), 10),
    ]
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler)
    costs = {r.request_id: scheduler.kv_cache.rebuild_cost(r) for r in scheduler.running}
    assert costs == {"unique": 20, "shares_a": 8, "shares_b": 4, "newest": 12}
    assert scheduler.running[cheapest_victim(scheduler.running, scheduler.preemption.cost)].request_id == "shares_b"
    assert scheduler.running[fcfs_victim(scheduler.running, scheduler.preemption.cost)].request_id == "newest"


def test_abort_frees_blocks_at_once_and_leaves_others_running():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=64)
    keep, drop, queued = make_request("keep", [1, 2, 3], 10), make_request("drop", list(range(20)), 10), make_request("q", [4], 3)
    for request in (keep, drop):
        scheduler.add_request(request)
    run_step(scheduler)
    scheduler.add_request(queued)
    free_before = scheduler.kv_cache.num_free_blocks
    scheduler.abort_request("drop")
    scheduler.check_invariants()
    assert drop.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.num_free_blocks == free_before + 5  # 20 tokens in blocks of 4
    scheduler.abort_request("q")  # aborting a waiting request works too
    assert scheduler.abort_request("unknown") is None
    outputs = run_to_completion(scheduler, [])
    assert keep.output_token_ids == reference_outputs([make_request("keep", [1, 2, 3], 10)])["keep"]
    assert outputs == {}


def test_stop_token_and_eos_finish_a_request():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    first_token = reference_outputs([make_request("x", [7, 7, 7], 1)])["x"][0]
    eos = make_request("eos", [7, 7, 7], 10, eos_token_ids=(first_token,), ignore_eos=False)
    ignored = make_request("ignored", [7, 7, 7], 10, eos_token_ids=(first_token,), ignore_eos=True)
    stop = make_request("stop", [7, 7, 7], 10)
    stop.sampling_params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(first_token,))
    run_to_completion(scheduler, [eos, ignored, stop])
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.num_output_tokens == 1
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.num_output_tokens == 1
    assert ignored.status == RequestStatus.FINISHED_LENGTH and ignored.num_output_tokens == 10


@pytest.mark.parametrize(
    "prompt, max_tokens, field",
    [
        ([], 1, "prompt"),
        (list(range(60)), 1, "prompt"),
        ([1, 2], 63, "max_tokens"),
    ],
)
def test_a_request_the_block_tables_cannot_hold_is_refused_without_disturbing_running_work(prompt, max_tokens, field):
    # The scheduler's own guard, whoever validated the request: its length must fit max_model_len.
    scheduler = make_scheduler(max_model_len=60, max_num_batched_tokens=64)
    running = make_request("running", [1, 2, 3], 5)
    scheduler.add_request(running)
    run_step(scheduler)

    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_request(Request("bad", prompt, SamplingParams(max_tokens=max_tokens)))
    assert error.value.field == field and field in str(error.value)
    scheduler.check_invariants()
    run_to_completion(scheduler, [])
    assert running.output_token_ids == reference_outputs([make_request("running", [1, 2, 3], 5)])["running"]


def test_the_scheduler_trusts_the_edge_with_every_field_that_does_not_touch_memory():
    # validate_request refuses this where it enters (tests/replica/test_engine.py); inside, nobody checks again.
    scheduler = make_scheduler(max_model_len=60)
    trusted = Request("trusted", [1, 2], SamplingParams(max_tokens=4, temperature=-1.0, top_p=0.0, stop_token_ids=(5000,)))
    scheduler.add_request(trusted)
    assert scheduler.requests["trusted"] is trusted and trusted.status == RequestStatus.WAITING


def test_duplicate_request_id_and_full_queue_are_refused():
    scheduler = make_scheduler(max_waiting_requests=2)
    scheduler.add_request(make_request("a", [1], 1))
    with pytest.raises(InvalidRequestError, match="request_id"):
        scheduler.add_request(make_request("a", [2], 1))
    scheduler.add_request(make_request("b", [1], 1))
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("c", [1], 1))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_kv_blocks=8, block_size=16, max_model_len=2048), "num_kv_blocks"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(watermark=1.0), "watermark"),
        (dict(watermark=-0.1), "watermark"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=2048), "max_num_batched_tokens"),
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
        (dict(block_size=0), "block_size"),
        (dict(blocks=3), "blocks"),
    ],
)
def test_impossible_config_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        make_engine_config(**overrides)


def test_unset_max_model_len_follows_the_models_context_when_the_pool_holds_it():
    # The default pool, 2,047 blocks of 16 tokens, holds SmolLM2's 8,192.
    assert resolve_max_model_len(make_engine_config(), 8192).max_model_len == 8192


@pytest.mark.parametrize(
    "overrides, bound, resolved",
    [
        (dict(num_kv_blocks=257), "KV pool", 256 * 16),  # 256 usable blocks
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=3000), "max_num_batched_tokens", 3000),
    ],
)
def test_unset_max_model_len_is_as_long_as_the_pool_or_unchunked_budget_allows_and_says_so(overrides, bound, resolved,
                                                                                          caplog):
    config = resolve_max_model_len(make_engine_config(**overrides), 8192)
    assert config.max_model_len == resolved
    assert f"max_model_len: {resolved}, not the model's 8192" in caplog.text and bound in caplog.text


def test_explicit_max_model_len_is_kept_and_must_fit_the_model():
    assert resolve_max_model_len(make_engine_config(max_model_len=1024), 8192).max_model_len == 1024
    with pytest.raises(ConfigError, match="^max_model_len: 16384 exceeds the model's 8192"):
        resolve_max_model_len(make_engine_config(max_model_len=16384, num_kv_blocks=2048), 8192)


def test_load_snapshot_tracks_admission_and_release():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=33, max_model_len=64, max_num_batched_tokens=8)
    idle = scheduler.load()
    assert (idle.kv_blocks_total, idle.kv_blocks_free, idle.headroom_tokens, idle.kv_usage) == (32, 32, 128, 0.0)
    scheduler.add_request(make_request("a", list(range(20)), 4))
    scheduler.add_request(make_request("b", list(range(5)), 4))
    assert scheduler.load().waiting_prefill_tokens == 25 and scheduler.load().num_waiting == 2
    run_step(scheduler)
    busy = scheduler.load()
    assert busy.num_running == 1 and busy.num_waiting == 1 and busy.kv_blocks_free == 30  # 8-token chunk
    assert busy.headroom_tokens == 30 * 4 and busy.waiting_prefill_tokens == 5
    run_to_completion(scheduler, [])
    done = scheduler.load()
    assert done.kv_blocks_free == 32 and done.num_running == 0 and done.generation_tokens_total == 8


def test_committed_tokens_are_the_growth_live_requests_are_owed_up_to_max_tokens():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=33, max_model_len=64, max_num_batched_tokens=8)
    assert scheduler.load().kv_committed_tokens == 0
    scheduler.add_request(make_request("a", list(range(20)), 4))  # 24 tokens at the end: 6 blocks
    scheduler.add_request(make_request("b", list(range(5)), 4))  # 9 tokens: 3 blocks
    assert scheduler.load().kv_committed_tokens == (6 + 3) * 4  # waiting requests owe everything
    run_step(scheduler)  # "a" takes an 8-token chunk: 2 blocks held, 4 still owed
    load = scheduler.load()
    assert load.kv_committed_tokens == (4 + 3) * 4
    # Free blocks alone overstate the room: 30 are free, but 7 of them are already promised.
    assert load.headroom_tokens - load.kv_committed_tokens == (30 - 7) * 4
    run_to_completion(scheduler, [])
    assert scheduler.load().kv_committed_tokens == 0


def test_committed_tokens_survive_preemption_and_abort():
    # Two 8 + 20 token sequences (7 blocks each) in 8 usable blocks: they preempt each other.
    scheduler = make_scheduler(block_size=4, num_kv_blocks=9, max_model_len=32, max_num_batched_tokens=64)
    for request in two_long_decodes():
        scheduler.add_request(request)
    while scheduler.counters.preemptions == 0:
        run_step(scheduler)  # run_step checks the invariants, committed tokens included
    load = scheduler.load()
    # Whatever was preempted, the two still end at 14 blocks; they hold what is not free.
    assert load.kv_committed_tokens == (14 - (8 - load.kv_blocks_free)) * 4
    scheduler.abort_request("a")
    scheduler.abort_request("b")
    scheduler.check_invariants()
    assert scheduler.load().kv_committed_tokens == 0


def test_headroom_leaves_out_the_watermark_only_while_something_runs():
    scheduler = make_scheduler(block_size=4, num_kv_blocks=11, max_model_len=40, max_num_batched_tokens=64, watermark=0.2)
    assert scheduler.load().headroom_tokens == 10 * 4  # idle: an admission may take the whole pool
    scheduler.add_request(make_request("first", list(range(12)), 20))
    run_step(scheduler)  # its 12-token prompt: 3 blocks held, 7 free, 2 of them the admission reserve
    assert scheduler.load().headroom_tokens == (7 - 2) * 4


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_a_stream_preempted_mid_output_resumes_under_a_steady_stream_of_arrivals(policy):
    """Under `slo` a preempted request that had streamed output kept its spent TTFT deadline,
    ranked as doomed below every new arrival, and under a steady stream of short requests
    (one every 2 steps, each with a 100 ms SLO) never resumed; fcfs puts it back at the head."""
    from replica.core.request import RequestStatus as Status

    now = [0.0]
    slo = {"default_ttft_slo_ms": 100.0} if policy == "slo" else {}
    scheduler = make_scheduler(clock=lambda: now[0], block_size=4, num_kv_blocks=13, max_model_len=48,
                               max_num_batched_tokens=64, max_num_seqs=3, scheduling_policy=policy, **slo)
    streaming = make_request("A", list(range(11, 19)), 30, arrival_time=0.0)
    scheduler.add_request(make_request("B", list(range(1, 9)), 30, arrival_time=0.0))
    scheduler.add_request(streaming)
    preempted_at = None
    for step in range(200):
        now[0] = step * 0.01
        if step >= 5 and step % 2 == 0:
            scheduler.add_request(make_request(f"s{step}", [100 + step % 50, 7, 7, 7], 6, arrival_time=now[0]))
        output = scheduler.schedule()
        check_budgets(scheduler, output)
        if "A" in output.preempted_req_ids and preempted_at is None:
            preempted_at = step
            assert streaming.num_output_tokens > 0  # it had streamed: the case at stake
        scheduler.update(output, {entry.request.request_id: fake_next_token(entry.request.all_token_ids)
                                  for entry in output.scheduled if entry.samples})
        scheduler.check_invariants()
        if preempted_at is not None and streaming.status == Status.RUNNING:
            break
    assert preempted_at is not None and streaming.status == Status.RUNNING
    assert step - preempted_at <= 20, f"resumed {step - preempted_at} steps after its preemption"


def test_async_scheduling_never_preempts_a_request_whose_token_in_flight_is_its_last():
    """Its blocks come back when that step is appended; preempted, its one sampled token was
    thrown away and its whole prompt recomputed. The step waits for its blocks instead."""
    scheduler = make_scheduler(block_size=4, num_kv_blocks=9, max_model_len=32, max_num_batched_tokens=64,
                               max_num_seqs=4)
    scheduler.add_request(make_request("old", list(range(1, 5)), 28))
    one = make_request("one", list(range(40, 57)), 1)
    in_flight = None
    preempted_with_last_token = []
    for step in range(100):
        if step == 8:
            scheduler.add_request(one)
        output = scheduler.schedule()
        check_budgets(scheduler, output)
        if "one" in output.preempted_req_ids and one.num_pending_tokens:
            preempted_with_last_token.append(step)
        sampled = {}
        for entry in output.scheduled:  # the token the step samples, from what it will have then
            tokens = list(entry.request.all_token_ids)
            if entry.start_pos + entry.num_new_tokens > len(tokens):
                tokens.append(in_flight[1][entry.request.request_id])
            if entry.samples:
                sampled[entry.request.request_id] = fake_next_token(tokens)
        if in_flight is not None:
            scheduler.update(*in_flight)
        in_flight = (output, sampled)
        scheduler.check_invariants()
        if step > 8 and not scheduler.has_unfinished_requests():
            break
    scheduler.update(*in_flight)
    assert preempted_with_last_token == [] and one.num_preemptions == 0
    assert one.status == RequestStatus.FINISHED_LENGTH and len(one.output_token_ids) == 1


def test_the_priority_queue_skips_removed_requests_and_a_burst_of_removals_stays_cheap(monkeypatch):
    import replica.core.request_queue as request_queue

    heapified = []
    real_heapify = request_queue.heapq.heapify
    monkeypatch.setattr(request_queue.heapq, "heapify", lambda heap: heapified.append(len(heap)) or real_heapify(heap))
    queue = request_queue.PriorityQueue()
    requests = [make_request(f"r{i}", [1, 2], 4, priority=i % 3) for i in range(5000)]
    for request in requests:
        queue.add(request)
    for request in requests[:4990]:
        queue.remove(request)
    # Re-heapified per removal, 4,096 aborts held the busy loop 0.6 s: now a rebuild each time
    # most of the heap is removed entries, its sizes halving.
    assert len(heapified) < 20 and sum(heapified) < 3 * 5000
    left = requests[4990:]
    assert len(queue) == 10 and list(queue) == sorted(left, key=lambda r: (r.priority, r.arrival_time))
    queue.add(requests[0])  # removed, then back
    assert queue.peek() is min(left + [requests[0]], key=lambda r: (r.priority, r.arrival_time))
    popped = [queue.pop() for _ in range(11)]
    assert popped == sorted(left + [requests[0]], key=lambda r: (r.priority, r.arrival_time)) and len(queue) == 0
    with pytest.raises(ValueError):
        queue.remove(requests[1])


def test_may_schedule_prefill_says_no_while_the_blocked_head_still_cannot_fit():
    """LLMEngine._step takes the step in flight in first when the next may hold a prefill (a
    paced launch would hold its outputs back): a head that cannot fit, with no more free
    blocks than when it was refused, must not cost every decode step its overlap."""
    scheduler = make_scheduler(block_size=4, num_kv_blocks=9, max_model_len=32, max_num_batched_tokens=64,
                               scheduling_policy="slo")
    scheduler.add_request(make_request("big", list(range(1, 25)), 4))  # 6 of the 8 usable blocks
    assert scheduler.may_schedule_prefill()  # a waiter before its first token, nothing blocked
    run_step(scheduler)
    scheduler.add_request(make_request("late", list(range(30, 50)), 4))  # 5 more blocks: no room
    assert scheduler.may_schedule_prefill()  # not yet refused
    output = run_step(scheduler)
    assert [entry.request.request_id for entry in output.scheduled] == ["big"]  # a decode; "late" refused
    assert not scheduler.may_schedule_prefill()  # the same head, no more room: no prefill next step
    scheduler.abort_request("big")  # its blocks come back: the head may fit now
    assert scheduler.may_schedule_prefill()
    output = run_step(scheduler)
    assert [entry.request.request_id for entry in output.scheduled] == ["late"]
