"""Drive a real Scheduler with a deterministic fake model: the next token is a function of
the request's whole token history, so a recompute after preemption that got any token
wrong would change every later token."""

from __future__ import annotations

from typing import Callable, Optional

from hypothesis import strategies as st

from replica.config import make_engine_config, resolve_max_model_len
from replica.core.request import Request, SamplingParams
from replica.core.scheduler import Scheduler, SchedulerOutput

FAKE_VOCAB = 1000
FAKE_CONTEXT = 2048  # the fake model's context: max_model_len where a test leaves it unset


def fake_next_token(token_ids: list[int]) -> int:
    return hash(tuple(token_ids)) % FAKE_VOCAB


# Prompts in property tests start with one of these, so the prefix cache gets hits.
SHARED_PREFIXES = [[7] * 8, list(range(20, 36)), []]


def draw_prompt(draw, max_model_len: int) -> tuple[list[int], int]:
    """(prompt, max_tokens) for a hypothesis-drawn request that fits max_model_len."""
    prefix = draw(st.sampled_from(SHARED_PREFIXES))
    suffix = draw(st.lists(st.integers(0, 999), min_size=1, max_size=20))
    prompt = (prefix + suffix)[: max_model_len - 2]
    return prompt, draw(st.integers(1, max_model_len - len(prompt)))


def make_scheduler(clock: Optional[Callable[[], float]] = None, **overrides) -> Scheduler:
    """A scheduler over the fake vocabulary and context; `clock` replaces the wall clock (tests of time)."""
    clocked = {} if clock is None else {"clock": clock}
    config = resolve_max_model_len(make_engine_config(**overrides), FAKE_CONTEXT)
    return Scheduler(config, **clocked)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 8, **kwargs) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kwargs.pop("ignore_eos", True))
    return Request(request_id, list(prompt), params, **kwargs)


def check_budgets(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Every step, overlapped or not: within the token budget and max_num_seqs, every
    scheduled entry with at least one token, and the output's total their sum."""
    config = scheduler.config
    assert all(entry.num_new_tokens >= 1 for entry in output.scheduled)
    assert output.num_scheduled_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run the model', update; checks the step invariants."""
    output = scheduler.schedule()
    check_budgets(scheduler, output)
    sampled = {}
    for entry in output.scheduled:
        request = entry.request
        # A request samples iff its computed tokens reach its length this step.
        assert entry.samples == (request.num_computed_tokens == request.num_tokens)
        assert request.num_computed_tokens <= request.num_tokens
        if entry.samples:
            sampled[request.request_id] = fake_next_token(request.all_token_ids)
    scheduler.update(output, sampled)
    scheduler.check_invariants()
    return output


def run_overlapped_step(scheduler: Scheduler, previous: Optional[tuple[SchedulerOutput, dict[str, int]]]
                        ) -> tuple[SchedulerOutput, dict[str, int]]:
    """One step with async scheduling: step N+1 is scheduled while step N's tokens are still
    pending, "runs" with those tokens taken from N's samples (as the runner takes them from
    the device), then N's tokens are appended. Returns N+1 and its samples."""
    output = scheduler.schedule()
    check_budgets(scheduler, output)
    pending = previous[1] if previous is not None else {}
    sampled = {}
    for entry in output.scheduled:
        request = entry.request
        history = list(request.all_token_ids)
        end = entry.start_pos + entry.num_new_tokens
        if end > len(history):
            # Only the one token the previous step samples may be missing, and only to a decode.
            assert entry.num_new_tokens == 1 and entry.start_pos == len(history), "input beyond the pending token"
            history.append(pending[request.request_id])
        assert entry.samples == (end == len(history))
        if entry.samples:
            sampled[request.request_id] = fake_next_token(history)
    if previous is not None:
        scheduler.update(*previous)
    scheduler.check_invariants()
    return output, sampled


def run_to_completion(
    scheduler: Scheduler,
    requests: list[Request],
    max_steps: int = 20_000,
    on_step: Optional[Callable[[int, SchedulerOutput], None]] = None,
) -> dict[str, list[int]]:
    for request in requests:
        scheduler.add_request(request)
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        output = run_step(scheduler)
        if on_step is not None:
            on_step(step, output)
    else:
        raise AssertionError("requests did not finish: a request is stuck")
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_usable_blocks, "leaked KV blocks"
    assert scheduler.kv_cache.num_free_host_blocks == scheduler.kv_cache.num_host_blocks, "leaked host KV blocks"
    return {r.request_id: list(r.output_token_ids) for r in requests}


def reference_outputs(requests: list[Request]) -> dict[str, list[int]]:
    """What each request must produce, computed one request at a time without an engine."""
    outputs = {}
    for request in requests:
        tokens = list(request.prompt_token_ids)
        out = []
        while len(out) < request.sampling_params.max_tokens:
            token = fake_next_token(tokens)
            tokens.append(token)
            out.append(token)
        outputs[request.request_id] = out
    return outputs
