"""Property tests: random request mixes, budgets, pool sizes, policies, admission modes and aborts never break
the engine's invariants, never leak a block, and never change a request's output, with
steps run one after the other or overlapped (step N+1 scheduled before N's tokens land)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st
from sched_harness import (draw_prompt, make_request, make_scheduler, reference_outputs, run_overlapped_step,
                           run_step)

from replica.core.request import RequestStatus

MAX_MODEL_LEN = 48


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    min_blocks = -(-MAX_MODEL_LEN // block_size) + 1
    num_kv_blocks = draw(st.integers(min_blocks, min_blocks * 2))  # tight: preemptions happen
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 64)) if chunked else draw(st.integers(MAX_MODEL_LEN, 96))
    config = dict(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 10])),
        enable_prefix_caching=draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        victim_policy=draw(st.sampled_from([None, "fcfs", "priority", "cheapest"])),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
        reserve_full_sequence=draw(st.booleans()),
        admission_mode=draw(st.sampled_from(["optimistic", "reserve_max_tokens", "reserve_expected"])),
        # Unbounded holds, or holds that are always over (the wall clock must not decide an example).
        admission_max_hold_ms=draw(st.sampled_from([None, 1e-9])),
    )
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prompt, max_tokens = draw_prompt(draw, MAX_MODEL_LEN)
        arrival_step = draw(st.integers(0, 15))
        abort_step = draw(st.one_of(st.none(), st.integers(0, 40)))
        requests.append((f"r{i}", prompt, max_tokens, draw(st.integers(0, 3)), arrival_step, abort_step))
    return config, requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
def test_random_workloads_keep_every_invariant_and_every_output(scenario, overlapped):
    config, specs = scenario
    scheduler = make_scheduler(**config)
    requests = {}
    in_flight = None
    for step in range(5000):
        for request_id, prompt, max_tokens, priority, arrival_step, abort_step in specs:
            if arrival_step == step:
                request = make_request(request_id, prompt, max_tokens, priority=priority, arrival_time=float(step))
                scheduler.add_request(request)
                requests[request_id] = (request, abort_step)
            if abort_step == step and request_id in requests:
                scheduler.abort_request(request_id)
                scheduler.check_invariants()
        if len(requests) == len(specs) and not scheduler.has_unfinished_requests():
            break
        if overlapped:  # asserts the inputs it needs are known or pending, budget and block invariants
            in_flight = run_overlapped_step(scheduler, in_flight)
        else:
            run_step(scheduler)  # asserts budget, max_num_seqs, sampling rule and block invariants
    else:
        raise AssertionError("a request is stuck")
    if in_flight is not None:  # the last overlapped step only held finished requests
        assert not scheduler.update(*in_flight)
    assert all(request.num_pending_tokens == 0 for request, _ in requests.values())

    target(float(scheduler.counters.preemptions), label="preemptions")  # steer towards memory pressure
    kv_cache = scheduler.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks, "leaked KV blocks"
    for request, abort_step in requests.values():
        assert request.is_finished
        if request.status != RequestStatus.FINISHED_ABORTED:
            expected = reference_outputs([make_request("x", request.prompt_token_ids, request.sampling_params.max_tokens)])
            assert request.output_token_ids == expected["x"]
