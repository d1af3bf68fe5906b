"""The per-step mask budget (structured_output_step_mask_ms): a step builds its constrained rows'
masks on the host before it samples, and each mask is within structured_output_max_mask_ms, but
nothing bounded their sum: many constrained rows, each just under the limit, held every request of
the batch back by all of them together (63 parallel samples at ~9 ms a mask: 1.2 s steps). The
scheduler now predicts each row's mask from its own latest (at first the compile's probe) and
lets constrained rows into a step while the sum fits, those that waited longest first, at least
one; unconstrained rows never wait. Here on the built-in model, with bench_structured's slow-row
Lark terminal (fast until the output is past its `x`, then tens of ms a mask)."""

from __future__ import annotations

import re
import time

import pytest

from bench.bench_structured import SLOW_LATE_GRAMMAR
from replica.config import EngineConfig, make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.core.structured_output import GrammarBitmask, StructuredOutput

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
}, "required": ["name", "age"], "additionalProperties": False}


def _recorded_builds(monkeypatch) -> list[tuple[list, float, float]]:
    """Each mask build: its grammars, the mask time predicted for them (the scheduler's) and the
    CPU time the build took (the process's: llguidance's executor threads build in parallel)."""
    builds = []
    build = GrammarBitmask.build

    def recorded(self, rows, grammars):
        predicted = sum(grammar.mask_s for grammar in grammars)
        start = time.process_time()
        mask = build(self, rows, grammars)
        builds.append((list(grammars), predicted, time.process_time() - start))
        return mask

    monkeypatch.setattr(GrammarBitmask, "build", recorded)
    return builds


def test_a_steps_masks_stay_within_the_budget_and_an_unconstrained_request_beside_them_runs_every_step(monkeypatch):
    """Eight requests under the slow-row terminal (each mask past its `x` tens of ms, within the
    per-mask limit here): every step built all eight, several times the default budget of 50 ms
    each step, and the unconstrained request beside them waited for all of it. Now only the step
    where they all turn slow at once (nothing measured yet predicts it) is over; after it each
    step's masks take about the budget, every constrained request gets a mask at least every
    eighth step, all finish as their grammar says, and the unconstrained one samples every step."""
    budget_ms = EngineConfig.model_fields["structured_output_step_mask_ms"].default
    engine = LLMEngine(make_engine_config(max_model_len=128, num_kv_blocks=128, max_num_seqs=16,
                                          structured_output_max_mask_ms=1000.0), "builtin", device="cpu")
    builds = _recorded_builds(monkeypatch)
    try:
        grammar = StructuredOutput("grammar", SLOW_LATE_GRAMMAR)
        constrained = [engine.make_request(f"slow-{index}", engine.tokenizer.encode(f"pick {index}"),
                                           SamplingParams(max_tokens=12, temperature=0.0, structured_output=grammar))
                       for index in range(8)]
        free = engine.make_request("free", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        for request in constrained + [free]:
            engine.add_request(request, detokenize=False)
        free_tokens = []
        while engine.has_unfinished_requests():
            engine.step()
            free_tokens.append(free.num_output_tokens)
        # The unconstrained request sampled in every step until it finished.
        assert free_tokens[:free_tokens.index(100) + 1] == list(range(1, 101)), free_tokens
        for request in constrained:
            text = engine.tokenizer.decode(request.output_token_ids)
            assert request.num_output_tokens == 12 and re.fullmatch("pick[0-9]q[ab]xa+", text), text
        load = engine.load()
        assert load.kv_blocks_free == load.kv_blocks_total, "a block leaked"
        # The step where all eight turned slow; the budget binds after it.
        first_slow = next(index for index, (_, _, cpu_s) in enumerate(builds) if cpu_s > budget_ms / 1e3)
        after = builds[first_slow + 1:]
        # Measured (slack for a busy host; unbounded, each step was eight slow masks) and predicted.
        steps_ms = sorted(1e3 * cpu_s for _, _, cpu_s in after)
        assert steps_ms[len(steps_ms) // 2] <= budget_ms and steps_ms[-1] <= 2 * budget_ms, steps_ms
        for grammars, predicted_s, cpu_s in after:
            assert len(grammars) == 1 or predicted_s <= budget_ms / 1e3, (len(grammars), predicted_s)
        assert len(builds[first_slow][0]) == 8 and len(after) >= 8, [len(grammars) for grammars, _, _ in builds]
        # Fair turns: a constrained request with tokens to go waits at most seven steps for its mask.
        masked_at = {id(request.grammar): [] for request in constrained}
        for step, (grammars, _, _) in enumerate(after):
            for grammar in grammars:
                masked_at[id(grammar)].append(step)
        for steps in masked_at.values():
            assert all(later - earlier <= 8 for earlier, later in zip(steps, steps[1:])), steps
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_greedy_output_is_the_same_whether_the_budget_binds_or_not_with_preemption(async_scheduling):
    """A budget of 0.01 ms lets one constrained row sample per step (and defers an admitted
    constrained request's last prompt token to the next step when another samples): in a roomy
    pool and in a cramped one that preempts (recomputing the KV of requests that were waiting
    for their turn), greedy output is what it is with the budget never binding. Only the steps
    it takes change."""
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             structured_output=StructuredOutput.json_schema(PERSON))] * 3
    params += [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                              structured_output=StructuredOutput("regex", "[a-d]{3}-[0-9]{40}"))] * 2
    params += [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]
    outputs, steps = {}, {}
    for budget_ms in (1e6, 0.01):
        for name, blocks in (("roomy", 128), ("cramped", 14)):
            engine = LLMEngine(make_engine_config(block_size=4, max_model_len=48, num_kv_blocks=blocks, max_num_seqs=6,
                                                  max_num_batched_tokens=64, async_scheduling=async_scheduling,
                                                  structured_output_step_mask_ms=budget_ms), "builtin", device="cpu")
            try:
                requests = [engine.make_request(f"greedy-{index}", [5, 6, 7 + index], param)
                            for index, param in enumerate(params)]
                for request in requests:
                    engine.add_request(request, detokenize=False)
                steps[budget_ms, name] = 0
                while engine.has_unfinished_requests():
                    engine.step()
                    steps[budget_ms, name] += 1
                outputs[budget_ms, name] = [request.output_token_ids for request in requests]
                assert all(request.num_output_tokens == 24 for request in requests)
                load = engine.load()
                assert load.kv_blocks_free == load.kv_blocks_total, "a block leaked"
                if name == "cramped":
                    assert engine.scheduler.counters.preemptions > 0, "the cramped pool must really preempt"
            finally:
                engine.shutdown()
    assert all(tokens == outputs[1e6, "roomy"] for tokens in outputs.values())
    assert steps[0.01, "roomy"] > 2 * steps[1e6, "roomy"], steps  # the budget did bind
