"""Structured outputs in the engine core: constraints compile, once per compiler (or are refused
naming the field, unimplemented schema keywords too) beside the step loop, which a compile in
progress never stalls, the sampler's batched bitmask forbids exactly what the grammar forbids,
every output under a constraint matches it (on the built-in random model, which left alone would
never write JSON), EOS comes only where the grammar may end (even with EOS pushed by a bias),
max_tokens still ends a request with `length`, and constrained greedy output does not depend on
the pool (preemption, probed) or on overlapped scheduling, under which a constrained request
runs every step (its mask built once the step before's token is taken in); with the real
SmolLM2, greedy output under a constraint that admits the unconstrained answer is that answer;
and every output under bench_structured's 64 agent-style JSON schemas that the grammar lets end
parses and validates (`jsonschema`), at temperature 0 and 1, on the random model and, one schema
per family, on SmolLM2."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import threading
import time

import jsonschema
import pytest
import torch

from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.errors import InvalidRequestError, QueueFullError
from replica.core.structured_output import (
    GrammarCompiler, GrammarMask, StructuredOutput, apply_grammar_bitmask, closed_schema, lark_grammar,
)
from bench.bench_structured import schema_set  # bench/ is a namespace package under the repository root

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
}, "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def builtin_engine() -> LLMEngine:
    # Room for bench_structured's 64 schemas at two temperatures in one batch, each up to 140 tokens.
    engine = LLMEngine(make_engine_config(max_model_len=160, num_kv_blocks=128 * 10 + 32, max_num_seqs=128),
                       "builtin", device="cpu")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_dir) -> LLMEngine:
    engine = LLMEngine(make_engine_config(max_model_len=512, num_kv_blocks=192), str(smollm2_dir), device="cpu")
    yield engine
    engine.shutdown()


def _compiler(engine: LLMEngine) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)


def _hold_compile_threads(compiler: GrammarCompiler) -> tuple[threading.Event, list]:
    """Every compile thread held until the event is set: compiles queue behind them."""
    release = threading.Event()
    return release, [compiler._submit(release.wait, 60) for _ in range(compiler.num_workers)]


def _release(release: threading.Event, holding: list) -> None:
    release.set()
    for held in holding:
        held.result()


def _run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list:
    requests = [engine.make_request(f"so-{index}-{id(params)}", engine.tokenizer.encode(prompt), param)
                for index, (prompt, param) in enumerate(zip(prompts, params))]
    for request in requests:
        engine.add_request(request, detokenize=False)
    finish = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finish[output.request_id] = output.finish_reason
    return [(engine.tokenizer.decode(request.output_token_ids), finish[request.request_id], request)
            for request in requests]


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutput("json", '{"type": "frobnicate"}'), "frobnicate"),
    # Valid JSON Schema that llguidance does not implement: refused, not silently ignored.
    (StructuredOutput.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "Unimplemented keys: [\"uniqueItems\"]"),
    (StructuredOutput.json_schema({"not": {"type": "string"}}), "Unimplemented keys: [\"not\"]"),
    # The regex's own error, not the Lark grammar it is wrapped in (`at 1(8): ... start: /a(b/`).
    (StructuredOutput("regex", "a(b"), "response_format: invalid regex 'a(b': unclosed group, at character 2"),
    (StructuredOutput.json_schema({"type": "string", "pattern": "a(b"}), "invalid regex 'a(b': unclosed group"),
    (StructuredOutput("grammar", "start: foo bar baz ("), ""),
    (StructuredOutput("choice", ()), "empty"),
    (StructuredOutput("choice", ("yes", "")), "non-empty"),
    # Nothing can be written under these (not even EOS): said so, not llguidance's parser dump.
    (StructuredOutput("regex", "[^\\s\\S]"), "no output can match it"),
    (StructuredOutput.json_schema({"$ref": "#"}), "no output can match it"),
    (StructuredOutput.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                   "$ref": "#/$defs/a"}), "no output can match it"),
])
def test_a_bad_constraint_is_refused_naming_the_parameter(builtin_engine, constraint, message):
    compiler = _compiler(builtin_engine)
    with pytest.raises(InvalidRequestError) as raised:
        compiler.check(constraint, "response_format")
    assert raised.value.field == "response_format"
    assert message in str(raised.value)


def test_the_boolean_schemas_true_admits_any_json_and_false_is_refused_by_name(builtin_engine):
    # true was refused with llguidance's "Expecting object schema to apply options".
    assert StructuredOutput.json_schema(True) == StructuredOutput.json_schema({})
    assert StructuredOutput.json_schema("true") == StructuredOutput.json_schema({})
    _compiler(builtin_engine).check(StructuredOutput.json_schema(True), "guided_json")
    with pytest.raises(InvalidRequestError, match="admits no value") as raised:
        StructuredOutput.of("json", False, "guided_json")
    assert raised.value.field == "guided_json"


def test_an_object_schema_admits_only_its_properties_unless_it_says_more(builtin_engine):
    """JSON Schema's default admits any other key, and SmolLM2 filled tool arguments with keys the
    function does not take ({"tz": ..., "tzmaya": ...}); as vLLM's default backend and OpenAI's
    strict schemas, an object that lists its properties is closed to them (closed_schema), and
    additionalProperties, when given, decides."""
    compiler = _compiler(builtin_engine)

    def accepts(schema: dict, text: str) -> bool:
        matcher = compiler.matcher(StructuredOutput.json_schema(schema)).matcher
        return matcher.consume_tokens(builtin_engine.tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    try:
        city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        assert accepts(city, '{"city": "Paris"}')
        assert not accepts(city, '{"city": "Paris", "country": "France"}')
        assert accepts({**city, "additionalProperties": True}, '{"city": "Paris", "country": "France"}')
        nested = {"type": "object", "properties": {"place": city}, "required": ["place"]}
        assert not accepts(nested, '{"place": {"city": "Paris", "x": 1}}')
        assert accepts({"type": "object"}, '{"anything": 1}')  # no properties listed: any object
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("schema", [
    # OpenAPI-style inheritance: the definition an allOf refers to describes part of one object
    {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
     "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}, "required": ["name"]}]},
    # anyOf members beside the object's own properties
    {"properties": {"kind": {}}, "required": ["kind"], "anyOf": [{"properties": {"a": {}}, "required": ["a"]}]},
    # a $ref beside properties
    {"$defs": {"B": {"properties": {"a": {}}}}, "$ref": "#/$defs/B", "properties": {"b": {}}, "required": ["a", "b"]},
    # a required key the properties do not list; a tuple whose minItems passes its items
    {"properties": {"a": {}}, "required": ["a", "b"]},
    {"prefixItems": [{"type": "integer"}], "minItems": 2},
])
def test_closing_objects_never_takes_away_what_a_schema_admits(schema):
    """Each shape stays as given (closing it would leave no value: {"id": 1, "name": "x"} and the
    like); a review found each refused as unsatisfiable after the first version closed them."""
    assert closed_schema(schema) == schema
    assert json.loads(StructuredOutput.json_schema(schema).spec) == schema


def test_alternatives_and_definitions_of_their_own_are_closed():
    union = {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert [member["additionalProperties"] for member in closed_schema(union)["anyOf"]] == [False, False]
    nested = {"$defs": {"P": {"type": "object", "properties": {"x": {}}}}, "type": "object",
              "properties": {"p": {"$ref": "#/$defs/P"}}}
    assert closed_schema(nested)["$defs"]["P"]["additionalProperties"] is False


def test_lark_with_a_prefixed_start_rule_stays_lark():
    """`?start:` opens Lark's own calculator example; llguidance's detector took it for GBNF."""
    assert lark_grammar('?start: "a" | "b"', "guided_grammar") == '?start: "a" | "b"'
    assert lark_grammar("start.2: NAME\nNAME: /[a-z]+/", "guided_grammar").startswith("start.2:")
    assert "start" in lark_grammar('root ::= "yes"', "guided_grammar")  # GBNF: converted


def test_a_gbnf_grammar_as_vllms_docs_write_it_is_served_and_a_broken_one_refused_by_name(builtin_engine):
    """vLLM's guided_grammar examples are GBNF/EBNF (root ::= ...); they were refused as bad Lark."""
    compiler = _compiler(builtin_engine)
    try:
        constraint = StructuredOutput.of("grammar", 'root ::= answer\nanswer ::= "yes" | "no"', "guided_grammar")
        compiler.check(constraint, "guided_grammar")
        matcher = compiler.matcher(constraint).matcher
        assert matcher.consume_tokens(builtin_engine.tokenizer.encode("no", add_special_tokens=False))
        assert matcher.is_accepting()
    finally:
        compiler.shutdown()
    with pytest.raises(InvalidRequestError, match=r"not a GBNF grammar") as raised:
        StructuredOutput.of("grammar", 'root ::= ( "a"', "guided_grammar")
    assert raised.value.field == "guided_grammar"


@pytest.mark.parametrize("gbnf, accepted, refused", [
    ('root ::= "n" ([0-9]+)? "."', ["n.", "n42."], ["n4", "n-."]),  # an optional run, a common GBNF idiom
    ('root ::= (("ab")+)+ "c"', ["abc", "ababc"], ["c", "abac"]),
    ('root ::= (("x"){2})+ (("y")+){2}', ["xxyy", "xxxxyyy"], ["xyy", "xxy"]),
    ('root ::= item ("," ws item)*\nitem ::= [a-z]+\nws ::= ([ \\t]+)?', ["a,b", "ab, c"], ["a,", ",a"]),
    # an item zero times, which llguidance refuses as a range ending at 0: the empty string
    ('root ::= "a"{0} "b" ("c"+){0,0} x{0}\nx ::= "q"', ["b"], ["ab", "bc", "bq"]),
    # a GBNF rule named `start`, not Lark's start rule
    ('root ::= start " " name\nstart ::= "hi"\nname ::= [a-z]+', ["hi bob"], ["hi", "bob"]),
])
def test_gbnf_quantifiers_llguidances_lark_refuses_are_served(builtin_engine, gbnf, accepted, refused):
    """llguidance's GBNF converter drops the parentheses around a one-item group, so `([0-9]+)?`
    became Lark's `/[0-9]/+?`, which its own parser refused ("Expected value"): each stacked
    quantifier gets its group back (helper-45's fuzzing). And `x{0}` is served as the empty
    string it means."""
    compiler = _compiler(builtin_engine)
    try:
        constraint = StructuredOutput.of("grammar", gbnf, "guided_grammar")
        compiler.check(constraint, "guided_grammar")
        for text, expected in [(text, True) for text in accepted] + [(text, False) for text in refused]:
            matcher = compiler.matcher(constraint).matcher
            tokens = builtin_engine.tokenizer.encode(text, add_special_tokens=False)
            assert (matcher.consume_tokens(tokens) and matcher.is_accepting()) == expected, text
    finally:
        compiler.shutdown()


def test_a_huge_choice_list_compiles_within_the_bound(builtin_engine):
    """100,000 choices (2.3 MB, under the HTTP body limit): one alternative per grammar rule took
    llguidance 19 s (quadratic) and then failed; as one terminal it takes about half a second."""
    compiler = _compiler(builtin_engine)
    try:
        choices = tuple(f"choice number {index}" for index in range(100_000))
        compiler.check(StructuredOutput("choice", choices), "guided_choice")  # default bound: 10 s
        matcher = compiler.matcher(StructuredOutput("choice", choices))
        assert matcher.matcher.consume_tokens(builtin_engine.tokenizer.encode("choice number 99999", add_special_tokens=False))
        assert matcher.matcher.is_accepting()
    finally:
        compiler.shutdown()


def test_a_grammar_of_rules_nested_thousands_deep_compiles_and_is_served(builtin_engine, tmp_path):
    """llguidance builds a grammar by recursion: rules nested 3,000 deep (60 KB) overflowed the
    compile thread's default 8 MB stack and killed the process (SIGSEGV), the ingress's or the
    engine core's. Compile threads have room for the deepest grammar the size bound admits;
    the matcher then advances on the step loop's own stack."""
    depth = 4000
    deep = StructuredOutput("grammar", "start: r0\n" + "\n".join(f'r{index}: "x" r{index + 1} | "y"' for index in range(depth))
                            + f'\nr{depth}: "z"')
    # As the edges compile it, first in a process of its own: a regression is this test's
    # failure, not a crash of the test run.
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text(builtin_engine.tokenizer.fast_tokenizer_json())
    script = ("import sys, pathlib; from replica.core.structured_output import GrammarCompiler, StructuredOutput; "
              "GrammarCompiler(pathlib.Path(sys.argv[1]).read_text(), int(sys.argv[2]), [int(sys.argv[3])])"
              ".check(StructuredOutput('grammar', sys.stdin.read()), 'guided_grammar'); print('compiled')")
    compiled = subprocess.run([sys.executable, "-c", script, str(tokenizer_json), str(builtin_engine.model_config.vocab_size),
                               str(builtin_engine.eos_token_ids[0])], input=deep.spec, capture_output=True, text=True,
                              timeout=120, cwd=REPOSITORY)
    assert (compiled.returncode, compiled.stdout.strip()) == (0, "compiled"), compiled.stderr[-2000:]
    (text, reason, _), = _run(builtin_engine, ["go"], [SamplingParams(max_tokens=12, temperature=0.0,
                                                                      structured_output=deep)])
    assert reason in ("stop", "length") and re.fullmatch("x*y?", text), (text, reason)


def test_a_grammar_past_the_size_bound_is_refused_by_name_before_it_compiles(builtin_engine):
    """A started compile cannot be stopped, and a Lark grammar's build grows with the square of
    a rule's alternatives (100,000: 20 s on the compile thread, then an assertion failed): one
    over 128 KiB is refused before it is queued, pointing at a choice."""
    compiler = _compiler(builtin_engine)
    try:
        grammar = StructuredOutput("grammar", "start: " + " | ".join(json.dumps(f"rule choice {index}")
                                                                     for index in range(100_000)))
        with pytest.raises(InvalidRequestError, match=r"^guided_grammar: a grammar may be at most 128 KiB \(this one "
                                                      r"is 2,\d{3},\d{3} bytes, over 131,072\); to choose among many strings, use a choice"):
            compiler.check(grammar, "guided_grammar")
        assert not compiler._compiled, "refused before it was queued"
    finally:
        compiler.shutdown()


def test_a_compile_holding_one_compile_thread_delays_no_other_compile(builtin_engine):
    compiler = GrammarCompiler(builtin_engine.tokenizer.fast_tokenizer_json(), builtin_engine.model_config.vocab_size,
                               builtin_engine.eos_token_ids, timeout_s=5.0)
    release = threading.Event()
    holding = [compiler._submit(release.wait, 60)]  # one slow compile in progress
    try:
        compiler.check(StructuredOutput("regex", "[a-z]{4}"), "guided_regex")
        assert not holding[0].done()
    finally:
        _release(release, holding)
        compiler.shutdown()


def test_compiles_given_up_or_abandoned_leave_the_compile_queue(builtin_engine, monkeypatch):
    """Behind a compile that holds the compile thread, compiles whose checks give up waiting for
    a thread (a backlog: to retry, not the constraint's fault), and those of parked requests
    that are aborted or time out, leave the queue instead of piling up."""
    import replica.core.structured_output as structured_output

    monkeypatch.setattr(structured_output, "MIN_QUEUED_COMPILE_WAIT_S", 0.05)
    compiler = GrammarCompiler(builtin_engine.tokenizer.fast_tokenizer_json(), builtin_engine.model_config.vocab_size,
                               builtin_engine.eos_token_ids, timeout_s=0.05)
    release, holding = _hold_compile_threads(compiler)
    try:
        futures = []
        for index in range(5):
            constraint = StructuredOutput("regex", f"[a-z]{{{index + 1}}}")
            with pytest.raises(QueueFullError, match="guided_regex: the structured-output compiles are backed up"):
                compiler.check(constraint, "guided_regex")
            futures.append(compiler.compile(constraint))  # compiled afresh: the given-up one is not cached
        assert compiler.num_queued == 5
        for index, future in enumerate(futures):
            assert compiler.cancel_queued(StructuredOutput("regex", f"[a-z]{{{index + 1}}}"), future)
        assert compiler.num_queued == 0 and all(future.cancelled() for future in futures)
    finally:
        _release(release, holding)
        compiler.shutdown()
    # The engine core: an aborted parked request's compile leaves the queue, unless another waits for it.
    engine = builtin_engine
    engine.generate([[1]], SamplingParams(max_tokens=1, structured_output=StructuredOutput("regex", "a")))
    release, holding = _hold_compile_threads(engine.grammar_compiler)
    try:
        shared = StructuredOutput("regex", "[0-9]{7}")
        for name, constraint in (("parked-1", shared), ("parked-2", shared),
                                 ("parked-3", StructuredOutput("regex", "[0-9]{8}"))):
            engine.add_request(engine.make_request(name, [1, 2], SamplingParams(max_tokens=2, structured_output=constraint)),
                               detokenize=False)
        assert engine.grammar_compiler.num_queued == 2
        engine.abort_request("parked-1")  # parked-2 still waits for the same compile
        engine.abort_request("parked-3")
        assert engine.grammar_compiler.num_queued == 1
        engine.abort_request("parked-2")
        assert engine.grammar_compiler.num_queued == 0 and not engine.has_unfinished_requests()
    finally:
        _release(release, holding)


# A regex whose lexer blows up: its first mask builds on llguidance's build budget, consuming
# its first byte then exceeds a step's lexer budget ("too many expressions constructed").
BLOWUP = "(a{1000}){1000}"
# The same blow-up three bytes into its lexeme, behind a choice of byte: the edge's probe masks
# after the "q" (an `a` or a `b` may come: nothing is forced further), the engine builds the
# blow-up once the output reaches the "x" (every byte after it is forced).
LATE_BLOWUP = "q[ab]x(a{1000}){1000}"


@pytest.mark.parametrize("constraint, field, says", [
    (StructuredOutput("regex", BLOWUP), "structured_outputs.regex", "it is too complex for the grammar engine"),
    # The pattern of a property the output reaches only after another: probed as a regex of its own.
    (StructuredOutput.json_schema({"type": "object", "properties": {
        "id": {"type": "string", "maxLength": 8}, "code": {"type": "string", "pattern": f"^{BLOWUP}$"}},
        "required": ["id", "code"]}), "response_format", f'its pattern "^{BLOWUP}$" is too complex'),
    # A Lark terminal the output reaches only after two others, and a regex written in a rule
    # there: each probed as a lexeme of its own (a probe of all of them at once masks after
    # each first byte, where this one's cost shows).
    (StructuredOutput("grammar", f'start: "pick" /[0-9]/ LATE\nLATE: /{BLOWUP}/'), "guided_grammar",
     "its terminal LATE is too complex"),
    (StructuredOutput("grammar", f'start: "pick" /[0-9]/ /{BLOWUP}/'), "guided_grammar",
     f'its regex "/{BLOWUP}/" is too complex'),
    # Directives, a rule over two lines, an inlined rule, a comment between definitions: the
    # probes keep every line that is not a rule's.
    (StructuredOutput("grammar", f'%llguidance {{}}\nstart: "x" item\n    | "y" item\n?item: WS? LATE\n// late\n'
                                 f'LATE: /{BLOWUP}/\n%ignore WS\nWS: /[ ]+/'), "guided_grammar",
     "its terminal LATE is too complex"),
    # An alternative continued at the line's first column, as Lark allows.
    (StructuredOutput("grammar", f'start: "pick" /[0-9]/ LATE\n| "other"\nLATE: /{BLOWUP}/'), "guided_grammar",
     "its terminal LATE is too complex"),
])
def test_a_constraint_whose_lexer_blows_up_on_its_first_token_is_refused_at_the_edge_by_name(builtin_engine,
                                                                                         constraint, field, says):
    """It passed the edge and its request ended in the engine after one token (abort), a
    ~0.2 s step spent on its mask; now the edge's compile consumes the first mask's tokens on a
    copy of the matcher and refuses it naming the field, and in-process callers that skip the
    edge get their request ended before any step."""
    with pytest.raises(InvalidRequestError) as raised:
        _compiler(builtin_engine).check(constraint, field)
    assert raised.value.field == field and says in raised.value.message, raised.value
    assert "lexer error: too many expressions constructed" in raised.value.message
    free_blocks = builtin_engine.load().kv_blocks_free
    (text, reason, request), = _run(builtin_engine, ["blow up"], [SamplingParams(max_tokens=4, temperature=0.0,
                                                                               structured_output=constraint)])
    assert (reason, request.num_output_tokens) == ("abort", 0), text
    assert builtin_engine.load().kv_blocks_free == free_blocks and not builtin_engine.has_unfinished_requests()


def test_large_and_attributed_grammars_pass_the_edges_probes(builtin_engine):
    """The probes of a grammar's lexemes go in groups, halved only where a group is over a limit:
    probed one by one after a failed probe of all, each probe compiling every terminal again,
    3,000 terminals took past the 10 s compile bound and were refused. A lexeme with llguidance's
    max_tokens, stop or lazy attributes cannot be rolled back: the first-token probe consumed
    each first byte on the matcher and rolled it back, and refused these ("rollback not
    supported", or a panic).
    A regex in a comment is no lexeme."""
    terminals = [f"T{index}: /t{index}_[a-z]{{2,6}}/" for index in range(3000)]
    groups = [f"g{start}: " + " | ".join(f"T{index}" for index in range(start, start + 100)) for start in range(0, 3000, 100)]
    large = "start: " + " ".join(f"g{start}" for start in range(0, 3000, 100)) + "\n" + "\n".join(groups + terminals)
    compiler = _compiler(builtin_engine)
    try:
        started = time.monotonic()
        compiler.check(StructuredOutput("grammar", large), "guided_grammar")
        assert time.monotonic() - started < 5.0
        for grammar in ('start: a\na[max_tokens=5]: /[a-z]+/', 'start: text\ntext[stop=""]: /[a-z ]+/',
                        'start: text\ntext[lazy]: /(.|\\n)*/',
                        f'start: "a" // not /{BLOWUP}/'):
            compiler.check(StructuredOutput("grammar", grammar), "guided_grammar")
    finally:
        compiler.shutdown()


def test_a_rule_of_more_alternatives_than_llguidance_allows_is_refused_at_the_edge_by_name(builtin_engine):
    """3,000 alternatives compile and mask their first token, then exceed llguidance's 2,000
    items per row consuming it: that request ended in the engine after one token; the edge's
    probe now says so, its first line (not llguidance's parser dump)."""
    grammar = StructuredOutput("grammar", "start: " + " | ".join(json.dumps(f"rule choice {index}")
                                                                  for index in range(3000)))
    with pytest.raises(InvalidRequestError) as raised:
        _compiler(builtin_engine).check(grammar, "guided_grammar")
    assert raised.value.field == "guided_grammar"
    assert "Current row has 3001 items; max is 2000" in raised.value.message and "<state>" not in raised.value.message


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_that_fails_mid_output_ends_its_request_instead_of_going_on_unconstrained(async_scheduling):
    """A Lark terminal whose lexeme blows up llguidance's lexer a few bytes into it (LATE_BLOWUP:
    past a choice of byte, which stops llguidance building the forced bytes that follow) and that
    comes only after other terminals is built when the output reaches it, past what the edge's
    probes see (each terminal alone, to the mask after its first byte): the matcher fails there,
    in the engine. The request went on unconstrained to max_tokens (finish_reason length,
    text no grammar allows); it ends there (abort), its blocks free, a request beside it runs
    on, and the next request under that grammar is served as it was."""
    engine = LLMEngine(make_engine_config(max_model_len=128, num_kv_blocks=32, async_scheduling=async_scheduling),
                       "builtin", device="cpu")
    try:
        grammar = StructuredOutput("grammar", f'start: "pick" /[0-9]/ LATE\nLATE: /{LATE_BLOWUP}/')
        _compiler(engine).check(grammar, "guided_grammar")  # the edge lets it through
        free_blocks = engine.load().kv_blocks_free
        (text, reason, request), (_, beside_reason, beside) = _run(
            engine, ["pick one", "go on"], [SamplingParams(max_tokens=12, temperature=0.0, structured_output=grammar),
                                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)])
        assert reason == "abort" and request.num_output_tokens < 12 and re.fullmatch("pick[0-9]q[ab]x?", text), text
        assert (beside_reason, beside.num_output_tokens) == ("length", 12)
        assert engine.load().kv_blocks_free == free_blocks and not engine.has_unfinished_requests()
        # The copies of one compiled matcher share its lexer, which stays broken: the next
        # request under the same grammar failed on its first token ("p", abort). The failure
        # drops the compiled matcher, so the next request runs as the first did.
        (again, again_reason, _), = _run(engine, ["pick one"], [SamplingParams(max_tokens=12, temperature=0.0,
                                                                             structured_output=grammar)])
        assert (again, again_reason) == (text, "abort")
        assert engine.load().kv_blocks_free == free_blocks and not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_a_constraint_whose_masks_are_slow_is_refused_at_the_edge_by_name(builtin_engine):
    """Each step builds its constrained rows' masks before it samples: a constraint whose every
    mask takes ~9 ms (`(a{200}){200}`) held the whole batch back by that each step. The edge
    times the mask after the first token against structured_output_max_mask_ms (2 ms here) and
    refuses it naming the field; an ordinary constraint passes under the same limit."""
    compiler = GrammarCompiler.for_tokenizer(builtin_engine.tokenizer, builtin_engine.model_config.vocab_size,
                                             builtin_engine.eos_token_ids,
                                             make_engine_config(structured_output_max_mask_ms=2.0))
    try:
        with pytest.raises(InvalidRequestError) as raised:
            compiler.check(StructuredOutput("regex", "(a{200}){200}"), "guided_regex")
        assert raised.value.field == "guided_regex", raised.value
        assert re.search(r"too costly to follow: each token's mask takes [\d.]+ ms to compute, over the limit of 2 ms "
                         r"\(structured_output_max_mask_ms\)", raised.value.message), raised.value.message
        compiler.check(StructuredOutput.json_schema(PERSON), "response_format")
        compiler.check(StructuredOutput("regex", "(a{20}){20}"), "guided_regex")
        # A terminal no rule uses costs every mask too (llguidance's lexer holds all of them).
        with pytest.raises(InvalidRequestError, match="too costly to follow"):
            compiler.check(StructuredOutput("grammar", 'start: "a" | "b"\nUNUSED: /(a{200}){200}/'), "guided_grammar")
    finally:
        compiler.shutdown()


def test_busy_python_threads_beside_the_edge_refuse_no_ordinary_constraint(builtin_engine):
    """A mask's time is its thread's CPU time: measured as wall time, an ordinary mask
    (microseconds here) took ~5 ms per busy Python thread beside it, waiting for the GIL, and
    with two spinning threads ordinary constraints were refused at a 2 ms limit (and the refusal
    cached). Each constraint here is new to the compiler, so each is timed."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(2)]
    compiler = GrammarCompiler.for_tokenizer(builtin_engine.tokenizer, builtin_engine.model_config.vocab_size,
                                             builtin_engine.eos_token_ids,
                                             make_engine_config(structured_output_max_mask_ms=2.0))
    try:
        for spinner in spinners:
            spinner.start()
        for index in range(8):
            compiler.check(StructuredOutput.json_schema({**PERSON, "title": f"person {index}"}), "response_format")
            compiler.check(StructuredOutput("regex", f"[a-z]{{{index + 1},12}}@[a-z]{{2,8}}\\.com"), "guided_regex")
        with pytest.raises(InvalidRequestError, match="too costly to follow"):  # a slow one still is refused
            compiler.check(StructuredOutput("regex", "(a{200}){200}"), "guided_regex")
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()
        compiler.shutdown()


def test_the_engine_core_builds_its_grammar_compiler_before_any_request(smollm2_dir):
    """llguidance's view of SmolLM2's tokenizer takes ~0.23 s with the GIL held: built by the
    first constrained request, inside a step, it stalled every running request that long. The
    engine core process builds it before it reports ready (prepare_structured_outputs); an
    in-process engine still builds it on first use."""
    engine = LLMEngine(make_engine_config(max_model_len=64, num_kv_blocks=16), str(smollm2_dir), device="cpu")
    try:
        assert engine.grammar_compiler is None
        engine.prepare_structured_outputs()
        compiler = engine.grammar_compiler
        assert compiler is not None and compiler.vocab_size == engine.model_config.vocab_size
        engine.prepare_structured_outputs()  # once
        assert engine.grammar_compiler is compiler
    finally:
        engine.shutdown()
    # The engine core process: tests/replica/test_engine_core.py asks a fresh core.


def test_a_constraint_that_turns_slow_mid_output_ends_its_request_and_its_batch_goes_on():
    """A Lark terminal whose masks take ~9 ms each once past its first bytes (`(a{200}){200}`
    after "q[ab]x", as LATE_BLOWUP), reached only after other terminals, passes the edge's
    probe; in the engine each of those masks is over the limit (2 ms here), and once three of
    them were, the request ends (abort; the engine core sends
    the front an InvalidRequestError naming structured_output). It went on to max_tokens, every
    step of the batch beside it waiting for its mask. A request beside it runs on to max_tokens,
    and no block is left behind."""
    engine = LLMEngine(make_engine_config(max_model_len=128, num_kv_blocks=32, structured_output_max_mask_ms=2.0),
                       "builtin", device="cpu")
    try:
        grammar = StructuredOutput("grammar", 'start: "pick" /[0-9]/ LATE\nLATE: /q[ab]x(a{200}){200}/')
        _compiler(engine).check(grammar, "guided_grammar")  # the edge lets it through
        free_blocks = engine.load().kv_blocks_free
        engine.collect_failures()
        (text, reason, request), (_, beside_reason, beside) = _run(
            engine, ["pick one", "go on"], [SamplingParams(max_tokens=40, temperature=0.0, structured_output=grammar),
                                            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)])
        (failed_id, error), = engine.take_failed()
        # Ended on the third slow mask: "pick", a digit, "q", a or b, then the masks after the
        # "x" and two "a"s.
        assert reason == "abort" and re.fullmatch("pick[0-9]q[ab]xaa", text), text
        assert request.grammar.slow_steps == 3, request.grammar.slow_steps  # the probe: three slow steps happened
        assert failed_id == request.request_id and error.field == "structured_output"
        assert "over the limit of 2 ms (structured_output_max_mask_ms), for 3 of its tokens" in error.message, error
        assert (beside_reason, beside.num_output_tokens) == ("length", 40)
        assert engine.load().kv_blocks_free == free_blocks and not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_an_edge_check_whose_client_went_away_leaves_the_compile_queue(builtin_engine):
    """The edges (ingress, replica servicer) wait for a compile in the request's coroutine: a
    client that disconnects while a slow compile holds the thread cancels its wait, and its
    compile leaves the queue once no other request waits for it. They waited on a worker
    thread, which a disconnect does not stop: every such compile ran, one after another."""
    import asyncio

    compiler = _compiler(builtin_engine)
    release, holding = _hold_compile_threads(compiler)

    async def scenario():
        shared = StructuredOutput("regex", "[a-z]{9}")
        waits = [asyncio.ensure_future(compiler.check_async(constraint, "guided_regex"))
                 for constraint in (shared, shared, StructuredOutput("regex", "[a-z]{10}"))]
        await asyncio.sleep(0.05)
        assert compiler.num_queued == 2
        waits[0].cancel()  # the other request still waits for the shared compile
        waits[2].cancel()
        await asyncio.sleep(0.05)
        assert compiler.num_queued == 1
        waits[1].cancel()
        await asyncio.sleep(0.05)
        assert compiler.num_queued == 0
        for wait in waits:
            with pytest.raises(asyncio.CancelledError):
                await wait
        # A compile given up is compiled afresh for the next request, which gets its answer.
        release.set()
        await compiler.check_async(shared, "guided_regex")
        with pytest.raises(InvalidRequestError, match="^guided_regex: "):
            await compiler.check_async(StructuredOutput("regex", "a(b"), "guided_regex")

    try:
        asyncio.run(scenario())
    finally:
        _release(release, holding)
        compiler.shutdown()


def test_an_id_parked_for_its_compile_is_in_use(builtin_engine):
    """A constrained request waits for its grammar outside the scheduler, whose guard could not
    see its id: a second add of it was taken, and the first then failed at adoption (or was
    dropped, never to finish)."""
    constrained = SamplingParams(max_tokens=4, temperature=0.0, structured_output=StructuredOutput("choice", ("yes",)))
    for second in (SamplingParams(max_tokens=4), constrained):
        builtin_engine.add_request(builtin_engine.make_request("dup", [1, 2], constrained), detokenize=False)
        with pytest.raises(InvalidRequestError, match="^request_id: 'dup' is already in use$"):
            builtin_engine.add_request(builtin_engine.make_request("dup", [1, 2], second), detokenize=False)
        finished = []
        while builtin_engine.has_unfinished_requests():
            finished += [output for output in builtin_engine.step() if output.finished]
        assert [(output.request_id, output.finish_reason) for output in finished] == [("dup", "stop")]


def test_the_compile_bound_counts_the_compile_not_its_wait_for_a_thread(builtin_engine):
    """Twenty slow valid choices queued ahead made a trivial regex "took longer than 10 s to
    compile", a 400 naming the client's parameter, after 10.9 s in the queue."""
    import asyncio

    compiler = GrammarCompiler(builtin_engine.tokenizer.fast_tokenizer_json(), builtin_engine.model_config.vocab_size,
                               builtin_engine.eos_token_ids, timeout_s=0.2)
    release, holding = _hold_compile_threads(compiler)

    async def scenario() -> float:
        started = time.monotonic()
        waiting = asyncio.ensure_future(compiler.check_async(StructuredOutput("regex", "[a-z]{3}"), "guided_regex"))
        await asyncio.sleep(0.5)  # queued past its own bound, behind the held threads
        assert not waiting.done()
        release.set()
        await waiting  # compiled once a thread took it: no error
        return time.monotonic() - started

    try:
        assert asyncio.run(scenario()) >= 0.5
    finally:
        _release(release, holding)
        compiler.shutdown()


def test_requests_waiting_for_one_queued_compile_are_all_told_to_retry(builtin_engine, monkeypatch):
    """The first to give up waiting for a thread cancelled the shared compile: the others were
    told their constraint took too long to compile (a 400) instead of to retry."""
    import asyncio

    import replica.core.structured_output as structured_output

    monkeypatch.setattr(structured_output, "MIN_QUEUED_COMPILE_WAIT_S", 0.2)
    compiler = GrammarCompiler(builtin_engine.tokenizer.fast_tokenizer_json(), builtin_engine.model_config.vocab_size,
                               builtin_engine.eos_token_ids, timeout_s=0.1)
    release, holding = _hold_compile_threads(compiler)

    async def scenario() -> list:
        shared = StructuredOutput("regex", "[a-z]{4}")
        first = asyncio.ensure_future(compiler.check_async(shared, "guided_regex"))
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(compiler.check_async(shared, "guided_regex"))
        return await asyncio.gather(first, second, return_exceptions=True)

    try:
        errors = asyncio.run(scenario())
        assert [type(error) for error in errors] == [QueueFullError, QueueFullError], errors
    finally:
        _release(release, holding)
    compiler.check(StructuredOutput("regex", "[a-z]{4}"), "guided_regex")  # nothing failed stays cached
    compiler.shutdown()


def test_a_constraint_slower_to_compile_than_the_bound_is_refused_and_a_parked_request_ends(builtin_engine):
    big = StructuredOutput.json_schema({"type": "object", "properties": {
        f"field_{index}": {"type": "string", "pattern": f"^[a-z]{{{index % 7 + 1}}}[0-9]+$"} for index in range(300)},
        "required": [f"field_{index}" for index in range(300)]})
    compiler = GrammarCompiler(builtin_engine.tokenizer.fast_tokenizer_json(), builtin_engine.model_config.vocab_size,
                               builtin_engine.eos_token_ids, timeout_s=1e-4)
    with pytest.raises(InvalidRequestError, match="guided_json: took longer than 0.0001 s to compile"):
        compiler.check(big, "guided_json")
    compiler.shutdown()
    # In the engine core the same bound ends a request still waiting for its grammar, and the
    # engine keeps serving.
    slow = LLMEngine(make_engine_config(max_model_len=128, num_kv_blocks=32, structured_output_compile_timeout_s=1e-4),
                     "builtin", device="cpu")
    request = slow.make_request("slow", [1, 2, 3], SamplingParams(max_tokens=4, structured_output=big))
    slow.add_request(request, detokenize=False)
    slow.collect_failures()
    finished = [output for _ in range(100) for output in slow.step() if output.finished]
    assert [(output.request_id, output.finish_reason) for output in finished] == [("slow", "abort")]
    # What its client is told: the replica's compile backlog (the edge compiled it in time), a
    # retry worth making, not a fault of the constraint.
    (failed_id, error), = slow.take_failed()
    assert failed_id == "slow" and isinstance(error, QueueFullError), error
    assert "took longer than 0.0001 s to compile on this replica" in str(error), error
    assert not slow.has_unfinished_requests()
    (tokens,) = slow.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(tokens) == 3
    slow.shutdown()


def test_a_parked_request_takes_its_matcher_from_its_own_compile_not_the_cache(builtin_engine):
    """The cache may let a finished compile go before its request is adopted (256 newer
    constraints, or a failed matcher forgotten): looked up again, it was compiled afresh inside
    the step, behind the whole compile queue (a 1.1 s step)."""
    engine = builtin_engine
    constraint = StructuredOutput("regex", "[0-9]{5}-[a-z]{2}")
    request = engine.make_request("parked-evicted", [1, 2, 3], SamplingParams(
        max_tokens=8, temperature=0.0, structured_output=constraint))
    engine.add_request(request, detokenize=False)
    (_, future, _), = [entry for key, entry in engine._compiling.items() if key == "parked-evicted"]
    future.result(timeout=30)
    engine.grammar_compiler._forget(constraint, future)  # let go of by the cache meanwhile
    compiles = []
    real_compile = engine.grammar_compiler.compile
    engine.grammar_compiler.compile = lambda c: compiles.append(c) or real_compile(c)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.grammar_compiler.compile = real_compile
    assert compiles == [] and re.fullmatch(r"[0-9]{5}-[a-z]{2}", engine.tokenizer.decode(request.output_token_ids))


def test_a_compile_in_progress_never_stalls_the_step_loop_for_other_requests(builtin_engine):
    """Compiling off the step loop: while a constrained request's grammar cannot finish (the
    compiler's one thread held until the free request is done), a free request arriving with it
    runs to its end; the constrained one then compiles, starts and keeps to its constraint."""
    engine = builtin_engine
    engine.generate([[1]], SamplingParams(max_tokens=1, structured_output=StructuredOutput("regex", "a")))
    release, holding = _hold_compile_threads(engine.grammar_compiler)  # the compile queues behind them
    constrained = engine.make_request("held-grammar", [1, 2, 3], SamplingParams(
        max_tokens=8, temperature=0.0, structured_output=StructuredOutput("regex", "[0-9]{3}-[a-z]{3}")))
    free = engine.make_request("beside-it", [4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True))
    try:
        for request in (constrained, free):
            engine.add_request(request, detokenize=False)
        for _ in range(100):
            engine.step()
            if free.is_finished:
                break
        assert free.num_output_tokens == 6, "the free request waited for the compile"
        assert "held-grammar" in engine._compiling and constrained.num_output_tokens == 0
        load = engine.load()  # the parked request is queued work the router and autoscaler see
        assert (load.num_waiting, load.waiting_prefill_tokens) == (1, constrained.num_tokens)
    finally:
        _release(release, holding)
    while engine.has_unfinished_requests():
        engine.step()
    assert re.fullmatch("[0-9]{3}-[a-z]{3}", engine.tokenizer.decode(constrained.output_token_ids))


def test_a_constraint_whose_failed_compile_is_cached_still_ends_its_request(builtin_engine):
    # In-process callers reach the core without the edge's compile check. The first request
    # compiles on the compiler's thread and fails; the second finds that failure cached, done
    # at once, and must still be reported as its request's end, not dropped with no output.
    bad = StructuredOutput("regex", "a(b")
    for name in ("cached-failure-1", "cached-failure-2"):
        request = builtin_engine.make_request(name, [1, 2, 3], SamplingParams(max_tokens=4, structured_output=bad))
        builtin_engine.add_request(request, detokenize=False)
        finished = [(output.request_id, output.finish_reason)
                    for _ in range(50) for output in builtin_engine.step() if output.finished]
        assert finished == [(name, "abort")]
        assert not builtin_engine.has_unfinished_requests()


def test_a_constraint_compiles_once_per_compiler_and_each_request_gets_its_own_matcher(builtin_engine):
    """The cache: one compile per constraint for a tokenizer's compiler, whatever whitespace the
    schema's text had; each request's matcher is a fresh copy, so one request's tokens never
    move another's."""
    compiler = _compiler(builtin_engine)
    try:
        first = compiler.compile(StructuredOutput.json_schema('{"type": "object", "required": ["a"]}'))
        again = compiler.compile(StructuredOutput.json_schema('{ "type":"object","required":[ "a" ] }'))
        assert again is first
        assert compiler.compile(StructuredOutput.json_schema('{"type": "array"}')) is not first
        constraint = StructuredOutput("regex", "[a-z]{4}")
        one, two = compiler.matcher(constraint), compiler.matcher(constraint)
        assert one.matcher is not two.matcher
        assert one.accept(builtin_engine.tokenizer.encode("a", add_special_tokens=False)[0])
        assert (one.num_consumed, two.num_consumed) == (1, 0)
    finally:
        compiler.shutdown()


def test_eos_comes_only_where_the_grammar_can_end_even_when_the_model_pushes_it(builtin_engine):
    """A logit_bias of +100 on EOS makes the model stop at once (the probe); under a grammar it
    must still write the whole of what the grammar requires, and stop the first moment it may."""
    push_eos = tuple((token_id, 100.0) for token_id in builtin_engine.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(max_tokens=24, temperature=0.0, logit_bias=push_eos, structured_output=constraint)
              for constraint in (None, StructuredOutput("regex", "[a-z]{6}"), StructuredOutput.json_schema(schema))]
    (free, free_end, free_request), (code, code_end, _), (document, document_end, _) = _run(
        builtin_engine, ["eos?", "eos?", "eos?"], params)
    assert (free, free_end, free_request.num_output_tokens) == ("", "stop", 1), "the bias did not push EOS"
    assert re.fullmatch("[a-z]{6}", code) and code_end == "stop"
    assert isinstance(json.loads(document)["a"], int) and document_end == "stop"


def test_a_schema_given_as_text_that_is_not_json_is_refused():
    with pytest.raises(InvalidRequestError, match="json_schema: not valid JSON"):
        StructuredOutput.json_schema("{not json")


def test_the_bitmask_forbids_exactly_the_masked_tokens_of_exactly_the_masked_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    masked = apply_grammar_bitmask(logits, GrammarMask(bitmask, torch.tensor([1, 3]), torch.arange(32, dtype=torch.int32)))
    expected = logits.clone()
    for mask_row, logit_row in ((0, 1), (1, 3)):
        for token in range(70):
            if not (int(bitmask[mask_row, token // 32]) >> (token % 32)) & 1:
                expected[logit_row, token] = float("-inf")
    assert torch.equal(masked, expected)
    assert not torch.isinf(logits).any(), "the caller's logits are left as they were (raw logprobs read them)"


def test_a_mask_builds_cpu_time_is_its_own_threads_not_the_whole_processes(builtin_engine):
    """A parallel build's CPU time, shared out as its rows' predicted mask costs, was the
    process's: a grammar compile or the channel's sender busy meanwhile counted as mask time, and
    constrained rows waited for turns they did not need. Here a native thread (hashlib, without
    the GIL) burns a core while the build's caller waits 30 ms: none of it is the rows'."""
    import hashlib

    from replica.core.structured_output import GrammarBitmask

    compiler = builtin_engine._grammars()
    choice = StructuredOutput("choice", ("yes", "no"))
    grammars = [compiler.matcher(choice) for _ in range(2)]
    bitmask = GrammarBitmask(2, compiler.vocab_size, torch.device("cpu"), max_mask_ms=1000.0)  # no search for slow rows
    executor, burning, stop = bitmask._executor, threading.Event(), threading.Event()

    class CallerWaits:  # the build, then the calling thread waits while another thread works
        def unsafe_compute_mask_ptr(self, *args):
            executor.unsafe_compute_mask_ptr(*args)
            burning.set()
            time.sleep(0.03)

    def burn():
        data = b"x" * (1 << 20)
        burning.wait()
        while not stop.is_set():
            hashlib.sha256(data).digest()

    burner = threading.Thread(target=burn)
    burner.start()
    bitmask._executor = CallerWaits()
    try:
        bitmask.build([0, 1], grammars)
    finally:
        stop.set()
        burner.join()
    assert sum(grammar.mask_s for grammar in grammars) < 0.01


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_constraint_on_a_model_that_would_never_write_it(builtin_engine, temperature):
    choices = ("yes", "no", "maybe not")
    params = [
        SamplingParams(max_tokens=120, temperature=temperature, seed=7,
                       structured_output=StructuredOutput.json_schema(PERSON)),
        SamplingParams(max_tokens=40, temperature=temperature, seed=8,
                       structured_output=StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(max_tokens=40, temperature=temperature, seed=9,
                       structured_output=StructuredOutput("choice", choices)),
        SamplingParams(max_tokens=16, temperature=temperature, seed=10),  # an unconstrained neighbour
    ]
    results = _run(builtin_engine, ["a person:", "a code:", "answer:", "free text"], params)
    (person, person_end, _), (code, code_end, _), (choice, choice_end, _), (_, free_end, _) = results
    jsonschema.validate(json.loads(person), PERSON)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", code)
    assert choice in choices
    # EOS came where each grammar could end (the random model says EOS only when made to).
    assert (person_end, code_end, choice_end) == ("stop", "stop", "stop")
    assert free_end == "length"
    for _, _, request in results[:3]:
        assert request.grammar.num_consumed == request.num_output_tokens


def test_max_tokens_still_ends_a_constrained_request_with_length(builtin_engine):
    params = SamplingParams(max_tokens=5, temperature=0.0,
                            structured_output=StructuredOutput("regex", "[a-z]{20}"))
    ((text, finish, _),) = _run(builtin_engine, ["x"], [params])
    assert finish == "length"
    assert re.fullmatch("[a-z]+", text) and len(text) <= 20


def test_constrained_greedy_output_is_the_same_in_a_cramped_pool_that_preempts_and_with_async_scheduling():
    schema = StructuredOutput.json_schema(PERSON)
    prompts = [f"person {index}:" for index in range(6)]
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, structured_output=schema)] * 6
    outputs = {}
    for async_scheduling in (False, True):
        for name, blocks in (("roomy", 256), ("cramped", 24)):
            engine = LLMEngine(make_engine_config(block_size=4, max_model_len=80, num_kv_blocks=blocks, max_num_seqs=6,
                                                  max_num_batched_tokens=64, async_scheduling=async_scheduling),
                               "builtin", device="cpu")
            outputs[name, async_scheduling] = [text for text, _, _ in _run(engine, prompts, params)]
            preemptions = engine.scheduler.counters.preemptions
            engine.shutdown()
            if name == "cramped":
                assert preemptions > 0, "the cramped pool must really preempt"
    assert all(texts == outputs["roomy", False] for texts in outputs.values()), outputs
    assert all(text.startswith('{"name": "') for text in outputs["roomy", False])  # constrained, cut at max_tokens


def test_penalties_beside_a_grammar_count_each_token_once_with_async_scheduling():
    """A step with constrained rows samples after the step before's tokens are appended: the
    frequency penalty must not count those tokens again as still in flight. On four letters the
    random model's choices turn on a penalty counted once or twice."""
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=penalty,
                             structured_output=StructuredOutput("regex", "[a-d]{40}")) for penalty in (0.02, 0.05, 0.1)]
    params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=0.5))
    outputs = {}
    for async_scheduling in (False, True):
        engine = LLMEngine(make_engine_config(max_model_len=64, num_kv_blocks=64, async_scheduling=async_scheduling),
                           "builtin", device="cpu")
        requests = [engine.make_request(f"pen-{index}", [1, 2, 3 + index], param) for index, param in enumerate(params)]
        for request in requests:
            engine.add_request(request, detokenize=False)
        while engine.has_unfinished_requests():
            engine.step()
        outputs[async_scheduling] = [request.output_token_ids for request in requests]
        engine.shutdown()
    assert outputs[True] == outputs[False]


def test_under_async_scheduling_a_constrained_request_runs_every_step_its_mask_built_on_its_latest_token():
    """The overlap: step N+1 is launched before step N's tokens are taken in, and its constrained
    rows are sampled after, from matchers that have consumed every token up to N's."""
    engine = LLMEngine(make_engine_config(max_model_len=128, num_kv_blocks=64, max_num_seqs=4, async_scheduling=True),
                       "builtin", device="cpu")
    constrained = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                  structured_output=StructuredOutput("regex", "[a-z]{30}"))] * 2
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # Compiled and cached first, so the requests below all join the first step.
    engine.generate([[1]], SamplingParams(max_tokens=1, structured_output=constrained[0].structured_output))
    requests = [engine.make_request(f"overlap-{index}", [1, 2, 3 + index], param)
                for index, param in enumerate(constrained + [free])]
    behind = []  # per constrained row and mask build: output tokens its matcher had not consumed
    sample_tokens = engine.runner.sample_tokens

    def checked_sample_tokens(in_flight):
        for request in requests[:2]:
            if request.num_output_tokens < 16:
                behind.append(request.num_output_tokens - request.grammar.num_consumed)
        return sample_tokens(in_flight)

    engine.runner.sample_tokens = checked_sample_tokens
    for request in requests:
        engine.add_request(request, detokenize=False)
    batch_sizes = []  # sequences launched per step
    while engine.has_unfinished_requests():
        engine.step()
        batch_sizes.append(engine.last_step.num_seqs)
    engine.shutdown()
    assert [request.num_output_tokens for request in requests] == [16, 16, 16]
    # One prefill and 15 decodes, all three requests in each: no step skipped for a mask.
    assert [size for size in batch_sizes if size] == [3] * 16
    assert len(behind) == 2 * 16 and set(behind) == {0}
    for request in requests[:2]:
        assert re.fullmatch("[a-z]{16}", engine.tokenizer.decode(request.output_token_ids))


def _char_class(text: str) -> str:
    return "[" + "".join(f"\\x{{{ord(char):x}}}" for char in sorted(set(text))) + "]*"


def test_smollm2_greedy_under_a_constraint_that_admits_its_answer_is_its_answer(smollm2_engine):
    engine = smollm2_engine
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    (free,) = engine.generate([prompt_ids], greedy)
    text = engine.tokenizer.decode(free)
    # Constraints wider than the answer: any string of its characters; it or another choice.
    for constraint in (StructuredOutput("regex", _char_class(text)), StructuredOutput("choice", (text, "no idea"))):
        (constrained,) = engine.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0.0,
                                                                      structured_output=constraint))
        assert engine.tokenizer.decode(constrained) == text


def _validate_schema_set(engine: LLMEngine, schemas: list[dict], prompts: list[str], max_tokens: int) -> dict:
    """Every schema at temperature 0 and at 1 (seeded), in one batch: every output that ended
    parses and validates, and every one cut by max_tokens still stands inside its grammar.
    Returns how many ended, per temperature."""
    cases = [(temperature, index) for temperature in (0.0, 1.0) for index in range(len(schemas))]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=index,
                             structured_output=StructuredOutput.json_schema(schemas[index]))
              for temperature, index in cases]
    results = _run(engine, [prompts[index] for _, index in cases], params)
    ended = {0.0: 0, 1.0: 0}
    for (text, finish, request), (temperature, index) in zip(results, cases):
        assert not request.grammar.is_error
        if finish == "stop":
            jsonschema.validate(json.loads(text), schemas[index])
            ended[temperature] += 1
        else:
            assert finish == "length" and request.num_output_tokens == max_tokens
    return ended


def test_outputs_under_64_agent_style_schemas_parse_and_validate(builtin_engine):
    """bench_structured's schema set (nested objects, arrays, enums, required and optional
    fields, bounded numbers, anyOf, const, patterns) on the built-in random model: what the
    grammar lets end is valid. Sampled, the random model ends every one; greedy, it may loop
    where a schema leaves a length open (the digits of a number), which max_tokens cuts."""
    ended = _validate_schema_set(builtin_engine, schema_set(64), [f"schema {index}:" for index in range(64)],
                                 max_tokens=140)
    assert ended[1.0] == 64 and ended[0.0] >= 62, ended


def test_smollm2_outputs_under_one_schema_of_each_family_parse_and_validate(smollm2_engine):
    engine = smollm2_engine
    schemas = schema_set(8)  # the set cycles through its 8 families
    # Short prompts (the grammar, not the prompt, holds the output to its schema): the prefill is cheap.
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Record {index} as JSON."}])
               for index in range(len(schemas))]
    assert _validate_schema_set(engine, schemas, prompts, max_tokens=64) == {0.0: 8, 1.0: 8}


def test_tool_calls_forced_by_required_or_by_name_keep_each_tools_own_schema(builtin_engine):
    """Under `required` each tool's parameters sit inside an array of calls: their "#" and
    "#/$defs/..." references (pydantic writes both) must still mean the tool's own root and
    definitions. Parameters with no `type` are an object (forced, any JSON value was allowed)."""
    from cluster.openai_api import ChatCompletionRequest, parse_body

    compiler = _compiler(builtin_engine)

    def constraint(tools: list, choice) -> StructuredOutput:
        body = parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                      "tool_choice": choice}).encode(), ChatCompletionRequest)
        built = body.output_constraint()
        compiler.check(built.constraint, built.param)
        return built.constraint

    def accepts(structured: StructuredOutput, text: str) -> bool:
        matcher = compiler.matcher(structured).matcher
        return matcher.consume_tokens(builtin_engine.tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    def tool(name: str, parameters: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    weather = tool("weather", {"$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
                               "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
                               "required": ["city", "unit"], "type": "object"})
    tree = tool("tree", {"type": "object", "properties": {"label": {"type": "string"},
                                                         "children": {"type": "array", "items": {"$ref": "#"}}},
                         "required": ["label"]})
    untyped = tool("city", {"properties": {"city": {"type": "string"}}, "required": ["city"]})
    # The same definition's name in another tool, an anchor, a property named like a keyword,
    # and a schema with an $id of its own.
    other = tool("other", {"$id": "https://example.com/other.json", "type": "object",
                           "$defs": {"Unit": {"enum": ["k"], "type": "string", "$anchor": "unit"}},
                           "properties": {"default": {"$ref": "#unit"}}, "required": ["default"]})
    try:
        required = constraint([weather, tree, other], "required")
        assert accepts(required, '[{"name": "other", "arguments": {"default": "k"}}]')
        assert not accepts(required, '[{"name": "other", "arguments": {"default": "c"}}]')
        assert accepts(required, '[{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}]')
        assert not accepts(required, '[{"name": "weather", "arguments": {"city": "Paris", "unit": "k"}}]')
        assert accepts(required, '[{"name": "tree", "arguments": {"label": "a", "children": [{"label": "b"}]}}]')
        assert not accepts(required, '[{"name": "tree", "arguments": {"label": "a", "children": '
                                     '[[{"name": "tree", "arguments": {"label": "x"}}]]}}]')
        named = constraint([untyped], {"type": "function", "function": {"name": "city"}})
        assert accepts(named, '{"city": "Paris"}')
        assert not accepts(named, '7.5') and not accepts(named, '"Paris"')
        assert not accepts(constraint([untyped], "required"), '[{"name": "city", "arguments": 42}]')
    finally:
        compiler.shutdown()


def test_under_tool_choice_auto_a_tools_schema_is_checked_leniently(builtin_engine):
    """Nothing enforces a tool's schema under `auto`: pydantic's uniqueItems (a set) or an unknown
    format (SecretStr's password) got a 400, which OpenAI and vLLM serve. Enforced, they are
    still refused by name, and a schema that is not one is refused either way."""
    from cluster.openai_api import ChatCompletionRequest, parse_body

    compiler = _compiler(builtin_engine)
    login = {"type": "function", "function": {"name": "login", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "password": {"type": "string", "format": "password"}}}}}
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "properties": 5}}}

    def check(tools: list, choice) -> None:
        body = parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                      "tool_choice": choice}).encode(), ChatCompletionRequest)
        for built in body.tool_parameter_schemas() + [c for c in [body.output_constraint()] if c is not None]:
            compiler.check(built.constraint, built.param)

    try:
        check([login], "auto")
        with pytest.raises(InvalidRequestError, match="uniqueItems") as raised:
            check([login], "required")
        assert raised.value.field == "tools[0].function.parameters"
        with pytest.raises(InvalidRequestError) as raised:
            check([login, broken], "auto")
        assert raised.value.field == "tools[1].function.parameters"
    finally:
        compiler.shutdown()
