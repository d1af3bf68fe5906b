"""Cost and correctness of structured outputs (issue 22) on one engine, in one run.

    python bench/bench_structured.py [--model smollm2-135m] [--batch 64] [--max-tokens 32] [--repeat 2]
                                     [--validate-max-tokens 160] [--threads 2] [--device cpu]
                                     [--async-scheduling on|off] [--emulated-device]
                                     [--sections compile,throughput,validity,mask-costs,slow-row,slow-rows]

On a GPU: `python bench/bench_gpu.py --sections structured` runs it with --device cuda.

1. Schema set: 64 JSON schemas of the kinds agents send (flat records, enums, bounded numbers,
   arrays, nested objects, arrays of objects, optional fields, anyOf, consts, patterns), built
   from a seed. Each is compiled cold (a fresh compiler: llguidance's grammar, its lexer and the
   first mask) and its time reported (median, p90, max).
2. Throughput: a batch of `--batch` requests decoding exactly `--max-tokens` tokens each
   (ignore_eos, greedy), every request under one of the schemas against none, taken in turns
   (none, constrained, none, constrained, ...) so drift weighs on both; medians quoted.
   Ratio = constrained tok/s / unconstrained tok/s (target >= 0.9). Also the host time of the
   masks: per step, and per constrained row and step. --async-scheduling picks the engine's
   overlapped step (default: the engine's, on for CUDA only); --emulated-device runs the
   engine on bench/emulated_device.py's device (CPU only: a GPU's step time, the host's work
   overlapping it), where what the overlap of masks and forward pass saves shows.
3. Validity: every schema once at temperature 0 and once at temperature 1 (seeded), run to
   EOS (`--validate-max-tokens` bound): the share of outputs that parse and validate
   (`jsonschema`), and the share that ended on EOS rather than max_tokens.
4. Mask costs (`mask-costs`, not in the default run): each constraint's masks timed one by one
   along a seeded random walk of up to 60 tokens it allows (avoiding, within 8 tries per token,
   tokens after which the output could end, so that walks go deep): the 64 schemas and the heavy
   ordinary ones (a choice among 5,000 strings, an enum of 2,000, any JSON object, an e-mail
   regex, an arithmetic Lark grammar, 100 patterned properties), each one's slowest mask and
   the slowest of all against the engine's structured_output_max_mask_ms (the ratio: how far
   under the limit ordinary constraints stay); and what the edge says of three slow ones.
5. A slow row (`slow-row`, not in the default run): `--batch` - 1 unconstrained requests alone,
   then beside one request whose Lark terminal, reached after two others, takes ~21 ms a mask
   a few bytes into it, past the edge's probe (within llguidance's limits), with the mask time limit off and on (the default): the batch's
   tok/s beside it over its tok/s alone, in turns, medians quoted. Run it with
   `--emulated-device`: on the CPU a step of 64 rows takes most of a second and 20 ms hides in it.
6. Many slow rows (`slow-rows`, not in the default run): `--batch` - `--slow-rows` unconstrained
   requests alone, then beside `--slow-rows` requests whose masks each take several ms (a regex
   of nested repetitions the edge's probe admits; the per-mask limit lifted in the runner so none
   is ended on a loaded machine: each within the limit, together past a step's budget),
   without a per-step mask budget and with the default one (structured_output_step_mask_ms): the
   unconstrained requests' tok/s beside them over their tok/s alone, in turns, medians quoted,
   and the slow requests' tokens. With `--emulated-device`, as above.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

NAMES = ["id", "name", "title", "city", "status", "kind", "owner", "score", "count", "size", "label", "price",
         "email", "level", "active", "priority", "unit", "code", "notes", "rating"]  # not "tags": with_tags adds it


def schema_set(count: int = 64, seed: int = 0) -> list[dict]:
    """`count` schemas, cycling through the families agents send."""
    rng = random.Random(seed)

    def string():
        return {"type": "string", "maxLength": rng.choice([6, 10, 16])}

    def integer():
        low = rng.choice([0, 1, -10])
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([9, 99, 999])}

    def number():
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100])}

    def enum():
        return {"enum": rng.sample(["red", "green", "blue", "low", "high", "open", "closed", "C", "F"], 3)}

    scalars = [string, integer, number, enum, lambda: {"type": "boolean"}]

    def record(depth: int = 0, size: int = 0) -> dict:
        keys = rng.sample(NAMES, size or rng.randint(2, 4))
        properties = {key: rng.choice(scalars)() for key in keys}
        return {"type": "object", "properties": properties, "required": keys, "additionalProperties": False}

    def with_tags(base: dict) -> dict:
        base["properties"]["tags"] = {"type": "array", "items": enum(), "maxItems": 3}
        base["required"].append("tags")
        return base

    families = [
        lambda: record(),
        lambda: with_tags(record(size=2)),
        lambda: {"type": "object", "properties": {"user": record(size=2), "ok": {"type": "boolean"}},
                 "required": ["user", "ok"], "additionalProperties": False},
        lambda: {"type": "object", "properties": {"items": {"type": "array", "items": record(size=2), "minItems": 1,
                                                            "maxItems": 2}},
                 "required": ["items"], "additionalProperties": False},
        lambda: {**(r := record(size=3)), "required": r["required"][:1]},
        lambda: {"type": "object", "properties": {"value": {"anyOf": [integer(), enum()]}, "unit": enum()},
                 "required": ["value", "unit"], "additionalProperties": False},
        lambda: {"type": "object", "properties": {"version": {"const": 2}, "code": {"type": "string",
                                                                                   "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                 "required": ["version", "code"], "additionalProperties": False},
        lambda: {"type": "array", "items": integer(), "minItems": 1, "maxItems": 4},
    ]
    return [families[index % len(families)]() for index in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per side (median quoted)")
    parser.add_argument("--validate-max-tokens", type=int, default=160)
    parser.add_argument("--num-schemas", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--async-scheduling", choices=("on", "off"), default=None,
                        help="overlapped scheduling (default: the engine's, on for CUDA only)")
    parser.add_argument("--emulated-device", action="store_true",
                        help="bench/emulated_device.py's device instead of the model's forward pass (CPU)")
    parser.add_argument("--sections", default="compile,throughput,validity",
                        help="comma-separated: compile, throughput, validity, mask-costs, slow-row, slow-rows")
    parser.add_argument("--slow-rows", type=int, default=8, help="slow-masked requests in the slow-rows section")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    torch.set_num_threads(args.threads)

    import jsonschema

    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.core.request import SamplingParams
    from replica.core.structured_output import GrammarBitmask, GrammarCompiler, StructuredOutput
    from replica.model.registry import resolve_model_path

    schemas = schema_set(args.num_schemas)
    constraints = [StructuredOutput.json_schema(schema) for schema in schemas]
    async_scheduling = None if args.async_scheduling is None else args.async_scheduling == "on"
    config = make_engine_config(max_model_len=512, num_kv_blocks=args.batch * 16 + 64, max_num_seqs=args.batch,
                                async_scheduling=async_scheduling)
    engine = LLMEngine(config, str(resolve_model_path(args.model)), device=args.device)
    if args.emulated_device:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from bench.emulated_device import device_model, emulate_device

        emulate_device(engine, *device_model())
    print(f"engine: {args.model} on {args.device}{' (emulated device)' if args.emulated_device else ''}, "
          f"async scheduling {'on' if engine.async_scheduling else 'off'}")
    tokenizer = engine.tokenizer

    # 1. Cold compile times: one fresh compiler per schema, so nothing is cached.
    if "compile" in sections:
        compile_s = []
        for constraint in constraints:
            compiler = GrammarCompiler.for_tokenizer(tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
            start = time.perf_counter()
            compiler.compile(constraint).result()
            compile_s.append(time.perf_counter() - start)
            compiler.shutdown()
        compile_ms = sorted(1000 * value for value in compile_s)
        print(f"compile ({len(schemas)} schemas, cold): median {statistics.median(compile_ms):.2f} ms, "
              f"p90 {compile_ms[int(0.9 * len(compile_ms))]:.2f} ms, max {compile_ms[-1]:.2f} ms")

    def prompt_ids(schema: dict) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with JSON for this schema: "
                                                                          + json.dumps(schema)[:300]}])
        return tokenizer.encode(text, add_special_tokens=False)

    prompts = [prompt_ids(schemas[index % len(schemas)]) for index in range(args.batch)]

    # Mask build time, measured where the runner builds them.
    mask_times: list[tuple[float, int]] = []
    original_build = GrammarBitmask.build

    # Rows whose grammar already ended (the JSON is whole; ignore_eos keeps the request going,
    # its masks EOS alone and near free): the ratio is honest only while most rows are open.
    ended_rows: list[int] = []

    def timed_build(self, rows, grammars):
        ended_rows.append(sum(grammar.matcher.is_stopped() for grammar in grammars))
        start = time.perf_counter()
        mask = original_build(self, rows, grammars)
        mask_times.append((time.perf_counter() - start, len(rows)))
        return mask

    GrammarBitmask.build = timed_build

    def run(constrained: bool) -> float:
        requests = []
        for index, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                    structured_output=constraints[index % len(constraints)] if constrained else None)
            request = engine.make_request(f"bench-{constrained}-{index}-{time.monotonic_ns()}", prompt, params)
            engine.add_request(request, detokenize=False)
            requests.append(request)
        start = time.perf_counter()
        num_steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            engine.take_kv_events()
            num_steps += 1
        elapsed = time.perf_counter() - start
        assert all(request.num_output_tokens == args.max_tokens for request in requests)
        steps[constrained] = num_steps
        return len(requests) * args.max_tokens / elapsed

    steps = {}  # engine steps of the latest run of each side

    if "throughput" in sections:
        run(True)  # warm-up: the engine's compiler caches every schema, the allocator warms
        mask_times.clear()
        ended_rows.clear()
        rates = {False: [], True: []}
        for _ in range(args.repeat):
            for constrained in (False, True):
                rates[constrained].append(run(constrained))
        free, constrained = statistics.median(rates[False]), statistics.median(rates[True])
        num_masks = len(mask_times)
        per_step_ms = 1000 * sum(seconds for seconds, _ in mask_times) / max(num_masks, 1)
        per_row_us = 1e6 * sum(seconds for seconds, _ in mask_times) / max(sum(rows for _, rows in mask_times), 1)
        print(f"throughput, batch {args.batch} x {args.max_tokens} tokens: unconstrained {free:.1f} tok/s, "
              f"all constrained {constrained:.1f} tok/s, ratio {constrained / free:.3f} (target >= 0.9: "
              f"{'met' if constrained / free >= 0.9 else 'missed'}); engine steps per run: "
              f"unconstrained {steps[False]}, constrained {steps[True]}")
        num_rows = sum(rows for _, rows in mask_times)
        print(f"mask build: {per_step_ms:.2f} ms per step ({num_masks} steps), {per_row_us:.1f} us per constrained "
              f"row and step; {1 - sum(ended_rows) / max(num_rows, 1):.0%} of those rows' grammars still open "
              f"(the rest had ended: EOS alone, near free; a low share flatters the ratio)")

    # 3. Validity at temperature 0 and 1 (the emulated device has no model to write with).
    for temperature in ((0.0, 1.0) if "validity" in sections and not args.emulated_device else ()):
        requests = []
        for index, (schema, constraint) in enumerate(zip(schemas, constraints)):
            params = SamplingParams(max_tokens=args.validate_max_tokens, temperature=temperature, seed=index,
                                    structured_output=constraint)
            request = engine.make_request(f"valid-{temperature}-{index}", prompt_ids(schema), params)
            engine.add_request(request, detokenize=False)
            requests.append((request, schema))
        while engine.has_unfinished_requests():
            engine.step()
            engine.take_kv_events()
        valid = ended = 0
        for request, schema in requests:
            text = tokenizer.decode(request.output_token_ids)
            ended += request.num_output_tokens < args.validate_max_tokens
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as error:
                print(f"  invalid at T={temperature}: {text[:120]!r}: {str(error)[:80]}")
        print(f"validity at temperature {temperature:g}: {valid}/{len(requests)} parse and validate, "
              f"{ended}/{len(requests)} ended on EOS")
    if "mask-costs" in sections:
        mask_costs(engine, constraints)
    if "slow-row" in sections:
        slow_row(engine, prompts, args.max_tokens, args.repeat)
    if "slow-rows" in sections:
        slow_rows(engine, prompts, args.max_tokens, args.repeat, args.slow_rows)
    engine.shutdown()


def heavy_constraints() -> dict:
    """Ordinary constraints at the heavy end of what agents send."""
    from replica.core.structured_output import StructuredOutput

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(3, 30))) for _ in range(5000)]
    return {
        "choice among 5,000 strings": StructuredOutput("choice", tuple(words)),
        "enum of 2,000 strings": StructuredOutput.json_schema({"type": "object", "properties": {
            "pick": {"enum": words[:2000]}}, "required": ["pick"]}),
        "any JSON object": StructuredOutput("json_object"),
        "e-mail regex": StructuredOutput("regex", r"[a-z0-9._%+-]{1,40}@[a-z0-9.-]{1,30}\.[a-z]{2,6}"),
        "arithmetic Lark grammar": StructuredOutput("grammar", 'start: expr\n?expr: term (("+"|"-") term)*\n'
                                                    '?term: factor (("*"|"/") factor)*\n'
                                                    '?factor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,8}/'),
        "100 patterned properties": StructuredOutput.json_schema({"type": "object", "properties": {
            f"f{index}": {"type": "string", "pattern": f"^[a-z]{{{index % 7 + 1}}}[0-9]+$"} for index in range(100)}}),
    }


# Within llguidance's limits, yet slow every mask: the first at the top of a regex (its lexeme
# built on the first mask's budget, ~70 ms a mask after), the second a Lark terminal reached
# after two others whose slow part comes a few bytes into it (built on a step's budget, ~17 ms a
# mask), which the edge's probe (each terminal alone, to the mask after its first byte) cannot
# see; the same terminal slow from its first byte (SLOW_EARLY_GRAMMAR) it refuses.
SLOW_REGEX = "(a{500}){500}"
SLOW_LATE_GRAMMAR = 'start: "pick" /[0-9]/ LATE\nLATE: /q[ab]x(a{300}){300}/'
SLOW_EARLY_GRAMMAR = 'start: "pick" /[0-9]/ LATE\nLATE: /(a{300}){300}/'


def mask_costs(engine, constraints) -> None:
    import numpy as np

    from replica.core.structured_output import GrammarCompiler, StructuredOutput
    from replica.errors import InvalidRequestError

    limit_ms = engine.config.structured_output_max_mask_ms
    vocab_size = engine.model_config.vocab_size
    eos = set(engine.eos_token_ids)
    compiler = GrammarCompiler(engine.tokenizer.fast_tokenizer_json(), vocab_size, engine.eos_token_ids,
                               max_mask_ms=1e9)  # no limit: these walks time every mask themselves
    rng = random.Random(0)
    mask = np.empty((1, (vocab_size + 31) // 32), dtype=np.int32)
    named = {f"schema {index}": constraint for index, constraint in enumerate(constraints)}
    named.update(heavy_constraints())
    slowest = {}
    for name, constraint in named.items():
        grammar = compiler.matcher(constraint)
        times = []
        for _ in range(60):
            start = time.perf_counter()
            grammar.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            times.append(1000 * (time.perf_counter() - start))
            allowed = [int(token) for token in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")
                                                              [:vocab_size]) if int(token) not in eos]
            if not allowed or grammar.matcher.is_stopped():
                break
            matcher = grammar.matcher
            for attempt in range(8):  # a walk that keeps going: a token that could end the output is
                token = rng.choice(allowed)  # taken back while others are left to try
                matcher.consume_token(token)
                if attempt == 7 or not matcher.is_accepting() or len(allowed) == 1:
                    break
                matcher.rollback(1)
        slowest[name] = (max(times), statistics.median(times), len(times))
    compiler.shutdown()
    schema_max = max(value[0] for name, value in slowest.items() if name.startswith("schema "))
    schema_medians = sorted(value[1] for name, value in slowest.items() if name.startswith("schema "))
    print(f"mask costs, {len(constraints)} schemas: slowest mask {schema_max:.2f} ms, per-schema medians "
          f"{1000 * schema_medians[0]:.0f}-{1000 * schema_medians[-1]:.0f} us")
    for name in heavy_constraints():
        worst, median, count = slowest[name]
        print(f"  {name}: slowest {worst:.2f} ms, median {1000 * median:.0f} us ({count} masks)")
    worst = max(value[0] for value in slowest.values())
    print(f"slowest ordinary mask {worst:.2f} ms against the limit {limit_ms:g} ms "
          f"(structured_output_max_mask_ms): ratio {worst / limit_ms:.2f} (under 1: none would be refused or ended)")
    edge = GrammarCompiler.for_tokenizer(engine.tokenizer, vocab_size, engine.eos_token_ids, engine.config)
    for name, constraint in (("regex " + SLOW_REGEX, StructuredOutput("regex", SLOW_REGEX)),
                             ("Lark terminal after two others, slow from its first byte",
                              StructuredOutput("grammar", SLOW_EARLY_GRAMMAR)),
                             ("Lark terminal after two others, slow past its first bytes",
                              StructuredOutput("grammar", SLOW_LATE_GRAMMAR))):
        try:
            edge.check(constraint, "guided")
            print(f"  edge: {name}: admitted (its slow masks come after the probe)")
        except InvalidRequestError as error:
            print(f"  edge: {name}: refused: {error.message}")
    edge.shutdown()


def in_turns(run, repeat: int, sides: list[tuple[str, tuple]]) -> tuple[dict[str, float], dict]:
    """`run(*args)` -> (tok/s, something else) for each side in turns, `repeat` times after one
    warm-up of the last side (so drift weighs on every side): each side's median tok/s, and the
    other value of its last run."""
    run(*sides[-1][1])
    rates: dict[str, list[float]] = {name: [] for name, _ in sides}
    last = {}
    for _ in range(repeat):
        for name, args in sides:
            rate, last[name] = run(*args)
            rates[name].append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}, last


def print_beside(rates: dict[str, float], beside: str, sides: list[tuple[str, str, str]]) -> None:
    """One line per (side, label, what else) of `in_turns`' rates: its tok/s over the "alone" side's."""
    for side, label, rest in sides:
        print(f"  beside {beside}, {label}: {rates[side]:.0f} tok/s, ratio {rates[side] / rates['alone']:.3f}; {rest}")


def slow_row(engine, prompts, max_tokens: int, repeat: int) -> None:
    """The batch's tok/s beside one slow-masked request, over its tok/s alone."""
    from replica.core.request import SamplingParams
    from replica.core.structured_output import StructuredOutput

    default_ms = engine.config.structured_output_max_mask_ms
    runs = [0]
    prompts = prompts[:engine.config.max_num_seqs - 1]  # the slow request runs in the same steps

    def run(beside: bool, limit_ms: float) -> tuple[float, int]:
        engine.runner.max_mask_ms, engine.runner.grammar_bitmask = limit_ms, None  # the next step's build
        requests = []
        for index, prompt in enumerate(prompts):
            request = engine.make_request(f"batch-{index}-{time.monotonic_ns()}", prompt,
                                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            engine.add_request(request, detokenize=False)
            requests.append(request)
        if beside:
            # A grammar of its own each run: copies of one compiled matcher share its lexer, whose
            # states the runs before would have built (a later run's masks would be fast).
            runs[0] += 1
            slow = StructuredOutput("grammar", SLOW_LATE_GRAMMAR.replace("a{300}", f"a{{{300 + runs[0]}}}"))
            slow_request = engine.make_request(f"slow-{time.monotonic_ns()}", prompts[0], SamplingParams(
                max_tokens=max_tokens, temperature=0.0, structured_output=slow))
            engine.add_request(slow_request, detokenize=False)
        start = time.perf_counter()
        while any(not request.is_finished for request in requests):
            engine.step()
            engine.take_kv_events()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return len(requests) * max_tokens / elapsed, slow_request.num_output_tokens if beside else 0

    rates, slow_tokens = in_turns(run, repeat, [("alone", (False, default_ms)), ("beside, no limit", (True, 1e9)),
                                                ("beside, limit", (True, default_ms))])
    print(f"slow row, batch {len(prompts)} x {max_tokens} tokens: alone {rates['alone']:.0f} tok/s")
    print_beside(rates, "one slow-masked request", [
        ("beside, no limit", "no mask time limit (before)",
         f"the slow request wrote {slow_tokens['beside, no limit']} tokens"),
        ("beside, limit", f"limit {default_ms:g} ms (structured_output_max_mask_ms)",
         f"the slow request wrote {slow_tokens['beside, limit']} tokens")])


# A regex whose every mask takes several ms on the 2-core VM, from the first token on, each within
# structured_output_max_mask_ms (its compile's probe admits it) and many together past a step's budget.
SLOW_ROWS_REGEX = "(a{150}){150}"


def slow_rows(engine, prompts, max_tokens: int, repeat: int, count: int) -> None:
    """The unconstrained requests' tok/s beside `count` slow-masked ones, over their tok/s alone,
    without a per-step mask budget and with the default one."""
    from replica.core.request import SamplingParams
    from replica.core.structured_output import StructuredOutput

    budget_ms = engine.config.structured_output_step_mask_ms
    default_config = engine.scheduler.config
    engine.runner.max_mask_ms, engine.runner.grammar_bitmask = 1e9, None  # each slow mask within "a limit"
    runs = [0]
    prompts = prompts[:engine.config.max_num_seqs - count]

    def run(slow: bool, step_budget_ms: float) -> tuple[float, int]:
        engine.scheduler.config = default_config.model_copy(update={"structured_output_step_mask_ms": step_budget_ms})
        requests, slow_requests = [], []
        for index in range(count if slow else 0):
            runs[0] += 1  # a grammar of its own each: a shared lexer would be warm (slow_row)
            constraint = StructuredOutput("regex", SLOW_ROWS_REGEX.replace("a{150}", f"a{{{150 + runs[0]}}}"))
            slow_request = engine.make_request(f"slow-{index}-{time.monotonic_ns()}", prompts[index], SamplingParams(
                max_tokens=4 * max_tokens, temperature=0.0, structured_output=constraint))
            engine.add_request(slow_request, detokenize=False)
            slow_requests.append(slow_request)
        # Compiled and decoding before the clock starts: what is timed is their masks, not compiles.
        while any(request.num_output_tokens == 0 and not request.is_finished for request in slow_requests):
            engine.step()
        before = sum(request.num_output_tokens for request in slow_requests)
        for index, prompt in enumerate(prompts):
            request = engine.make_request(f"batch-{index}-{time.monotonic_ns()}", prompt,
                                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            engine.add_request(request, detokenize=False)
            requests.append(request)
        start = time.perf_counter()
        while any(not request.is_finished for request in requests):
            engine.step()
            engine.take_kv_events()
        elapsed = time.perf_counter() - start
        written = sum(request.num_output_tokens for request in slow_requests) - before
        for request in slow_requests:
            engine.abort_request(request.request_id)
        while engine.has_unfinished_requests():
            engine.step()
        return len(requests) * max_tokens / elapsed, written

    try:
        rates, written = in_turns(run, repeat, [("alone", (False, budget_ms)), ("no budget", (True, 1e9)),
                                                ("budget", (True, budget_ms))])
    finally:
        engine.scheduler.config = default_config
    print(f"slow rows, {len(prompts)} unconstrained x {max_tokens} tokens: alone {rates['alone']:.0f} tok/s")
    print_beside(rates, f"{count} slow-masked requests", [
        ("no budget", "no step mask budget (before)", f"they wrote {written['no budget']} tokens meanwhile"),
        ("budget", f"step mask budget {budget_ms:g} ms (structured_output_step_mask_ms)",
         f"they wrote {written['budget']} tokens meanwhile")])


if __name__ == "__main__":
    main()
