"""Structured outputs: one constraint per request (a JSON schema, any JSON object, a regex, a
Lark grammar or a choice among strings), compiled by llguidance into a token matcher.

`StructuredOutput` is the constraint as it travels (plain, frozen, picklable: front -> core).
`GrammarCompiler` holds one tokenizer's llguidance view and compiles constraints on a worker
thread, cached by constraint, with a time bound; the edge (ingress, replica front) uses it to
refuse bad input by name, the engine core to get each request's matcher without stalling the
step loop. `RequestGrammar` is one request's matcher, advanced with every token the request
appends (so it always stands at the request's output: a preempted request recomputes its
KV but keeps its output, and so keeps its matcher's state). `GrammarBitmask` fills one step's
masks for the constrained rows, and `apply_grammar_bitmask` applies them to those rows'
logits in one batched operation on the logits' device.

llguidance rather than xgrammar: no dependencies (xgrammar pulls transformers and triton into
the base install), the mask is computed lazily per step in microseconds (no precompilation of
the whole token trie per schema), and it speaks JSON schema, regex and Lark directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import numpy as np

from replica.config import EngineConfig
from replica.errors import InvalidRequestError, QueueFullError

if TYPE_CHECKING:
    import llguidance
    import torch  # imported where masks are built, so the ingress compiles grammars without torch

logger = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "grammar", "choice")
# Compact JSON: no free whitespace between tokens. A small model left free whitespace may
# fill max_tokens with newlines; separators as json.dumps writes them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_COMPILE_TIMEOUT_S = EngineConfig.model_fields["structured_output_compile_timeout_s"].default
QUEUED_COMPILE_POLL_S = 0.02  # how often a waiter looks whether its queued compile has started
MIN_QUEUED_COMPILE_WAIT_S = 1.0  # a compile may wait this long for a thread, whatever its own bound
_CACHE_SIZE = 256
# llguidance builds a grammar by recursion over its rules' nesting: a Lark grammar whose rules
# nest 3,000 deep (60 KB of text) overflowed a thread's default 8 MB stack and killed the
# process (SIGSEGV), the ingress's or the engine core's. Compile threads get 256 MB (address
# space, committed only as used): the deepest grammar MAX_GRAMMAR_BYTES holds, a chain of 13,371
# rules, needs between 32 and 64 MB.
COMPILE_THREAD_STACK_BYTES = 256 << 20
_stack_size_lock = threading.Lock()
# A started compile cannot be stopped, so what one may cost is bounded before it starts. JSON
# schemas and regexes are bounded by llguidance's own limits (a 2 MB regex or enum is refused in
# about a second); a Lark grammar is not: its build grows with the square of a rule's
# alternatives (60,000: 7 s; 100,000: 20 s, then refused by an assertion). 128 KiB of the
# densest grammar builds in about a second on a slow CPU; a choice among many strings is a
# `choice` constraint, which has no such cost.
MAX_GRAMMAR_BYTES = 128 << 10
# JSON that arrives as text (a request body, a schema given as a string) is refused past this
# nesting depth: Python's json module raises RecursionError near 1,000 levels (not a
# JSONDecodeError: it surfaced as a server error), and whatever reads the document after it
# (json.dumps, pydantic, a chat template's tojson, llguidance) recurses too. A request body's
# own nesting is 3-4 levels; OpenAI's strict schemas allow 10 levels of objects (20 here).
MAX_JSON_DEPTH = 64
# Compiles run beside the step loop (llguidance releases the GIL). Two, so that one slow
# compile never holds every other request's behind it; vLLM runs (CPUs + 1) // 2.
DEFAULT_COMPILE_WORKERS = 2
# What one row's mask may cost a step. llguidance's fuel bounds how much of a lexer it builds per
# token, not what a mask costs once built: `(a{500}){500}` is within every one of its limits and
# takes ~70 ms a mask (lowering step_lexer_fuel to a tenth does not change that), while ordinary
# constraints take at most ~3 ms (bench_structured.py --sections mask-costs). A step's masks are
# built before it samples, so one such row would hold every request in the batch back by that
# much each step. The edge refuses a constraint
# whose second mask (after its first token) is over the limit; one that turns slow later ends
# once SLOW_MASK_STEPS of its masks were over the limit with fewer than SLOW_MASK_STEPS within it
# in a row between them. A mask's time is its thread's CPU time (time.thread_time: llguidance
# builds one matcher's mask on the calling thread), so waiting for the GIL or for a core, which
# an ordinary constraint does on a busy host, never counts against it.
DEFAULT_MAX_MASK_MS = EngineConfig.model_fields["structured_output_max_mask_ms"].default
SLOW_MASK_STEPS = 3
# Builds of a probe's mask past the first, while each is over the limit (the lowest counts).
MASK_REMEASURES = 3


# A grammar in llguidance's Lark: a `start` rule (`?start:` / `!start:` / `start.2:` too) or the
# %llguidance directive; llguidance's own is_lark_syntax misses the prefixed forms.
# (GBNF's `start ::= ...` is a rule of that name, not Lark's start.)
_LARK_START = re.compile(r"(?m)^\s*(%llguidance\b|[?!]?start(\.-?\d+)?\s*:(?!:=))")


def lark_grammar(text: str, field: str) -> str:
    """A grammar as llguidance's Lark: Lark as given, GBNF / EBNF (llama.cpp's `root ::= ...`,
    what vLLM's docs and its default backend take) converted by llguidance's own converter, its
    errors naming `field`; text that is neither stays as given, for Lark's errors to name."""
    if _LARK_START.search(text) or "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return _group_stacked_quantifiers(gbnf_to_lark(_renamed_start_rule(text)))
    except Exception as error:  # noqa: BLE001 - any failure of the converter is the grammar's fault, by name
        raise InvalidRequestError(field, f"not a GBNF grammar (root ::= ...) llguidance can convert: {error}") from None


# GBNF in tokens: a string literal, a character class, a comment, a rule name, anything else.
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*|(?P<name>[A-Za-z][A-Za-z0-9_-]*)|.', re.S)


def _renamed_start_rule(gbnf: str) -> str:
    """A GBNF rule named `start` renamed (the converter's Lark has a `start` rule of its own):
    every use of the name outside literals, classes and comments."""
    if not re.search(r"(?m)^\s*start\s*::=", gbnf):
        return gbnf
    taken = {match["name"] for match in _GBNF_TOKEN.finditer(gbnf) if match["name"]}
    renamed = next(f"start{suffix}" for suffix in itertools.count(1) if f"start{suffix}" not in taken)
    return "".join(renamed if match["name"] == "start" else match.group() for match in _GBNF_TOKEN.finditer(gbnf))


# The Lark that llguidance's GBNF converter writes, in tokens: a directive line, a string or
# regex literal (escapes and flags included), a name, a quantifier, a bracket, anything else.
_LARK_TOKEN = re.compile(r"""(?P<directive>%[^\n]*)|(?P<atom>"(?:[^"\\]|\\.)*"i?|/(?:[^/\\\n]|\\.)*/[imslux]*|[A-Za-z_][A-Za-z0-9_]*)"""
                         r"""|(?P<quantifier>[+*?]|\{\s*\d+\s*(?:,\s*\d*\s*)?\})|(?P<open>[(\[])|(?P<close>[)\]])|(?P<space>\s+)|(?P<other>.)""")


_NONE_OF = re.compile(r"\{\s*0\s*(?:,\s*0\s*)?\}")  # {0}, {0,0}: the item zero times


def _group_stacked_quantifiers(lark: str) -> str:
    """The converter drops the parentheses around a one-item group, so GBNF's `([0-9]+)?` (a
    common way to write an optional run) became `/[0-9]/+?`, which llguidance's Lark parser
    refuses ("Expected value"): each quantifier after the first gets its group back,
    `(/[0-9]/+)?`. An item repeated zero times (`x{0}`, `x{0,0}`: llguidance refuses a range
    ending at 0) is the empty string it means. One pass over the tokens (a grammar may hold
    thousands of them)."""
    texts: list[str] = []
    opens: dict[int, int] = {}  # index in texts -> the "(" to write before it
    brackets: list[int] = []  # where each open bracket's group starts
    item: Optional[int] = None  # where the item the latest quantifier quantifies starts
    previous = None  # the kind of the latest token that is not space
    for match in _LARK_TOKEN.finditer(lark):
        kind = match.lastgroup
        if kind == "quantifier" and item is not None and _NONE_OF.fullmatch(match.group()):
            del texts[item:]
            opens = {index: count for index, count in opens.items() if index < item}
            texts.append('""')
            previous = "atom"
            continue
        if kind == "quantifier" and previous == "quantifier" and item is not None:
            opens[item] = opens.get(item, 0) + 1
            texts.append(")")
        elif kind == "atom":
            item = len(texts)
        elif kind == "open":
            brackets.append(len(texts))
        elif kind == "close":
            item = brackets.pop() if brackets else None
        elif kind not in ("quantifier", "space"):
            item = None
        texts.append(match.group())
        if kind != "space":
            previous = kind
    return "".join("(" * opens.get(index, 0) + text for index, text in enumerate(texts))


# Keywords whose values are schemas, and those whose values are lists or maps of schemas.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Beside these an object's properties are not all it may hold (another schema adds its own), so
# it stays open; likewise a tuple beside these.
_COMBINING = frozenset(("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependentRequired"))


def closed_schema(schema: object) -> object:
    """`schema` with every object that lists its `properties` closed to them and every tuple
    (`prefixItems`) to its items, where the schema says nothing of more (no additionalProperties /
    unevaluatedProperties, no items / unevaluatedItems): what vLLM's default backend (xgrammar's
    strict mode) and OpenAI's strict schemas generate. JSON Schema's own default admits any
    other key, and a model fills them: a tool's arguments with keys its function does not take.

    Only where closing cannot take away a value the schema admits: an object beside allOf /
    anyOf / oneOf / $ref / if (another schema adds properties), a member of an allOf and a
    definition an allOf refers to (each lists part of one object), an object that requires a key
    it does not list, a tuple whose minItems passes its items, and `{"type": "object"}` with no
    properties all stay open. StructuredOutput.json_schema keeps the schema as given where
    closing it still made it unsatisfiable."""
    open_refs = set()

    def shared_refs(node: object, inside: bool) -> None:
        """The definitions a $ref applies to an object some other schema describes too."""
        if isinstance(node, list):
            for item in node:
                shared_refs(item, inside)
        elif isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and (inside or _SHARES_ITS_OBJECT & node.keys()):
                open_refs.add(node["$ref"])
            for key, value in node.items():
                shared_refs(value, inside or key == "allOf" or (key in ("anyOf", "oneOf") and _shares(node)))

    shared_refs(schema, False)
    return _closed(schema, open_refs, keep_open=False, path="#")


# Keywords that describe an object's keys: beside a $ref or around anyOf / oneOf members, the
# members and the definition describe the same object.
_SHARES_ITS_OBJECT = frozenset(("properties", "required", "patternProperties", "additionalProperties", "allOf",
                                "anyOf", "oneOf", "dependentRequired", "dependentSchemas", "if"))


def _shares(node: dict) -> bool:
    """Whether `node`'s anyOf / oneOf members describe an object that node describes too."""
    return bool((_SHARES_ITS_OBJECT - {"anyOf", "oneOf"}) & node.keys()) or ("anyOf" in node and "oneOf" in node)


def _closed(schema: object, open_refs: set, keep_open: bool, path: str) -> object:
    if isinstance(schema, list):
        return [_closed(item, open_refs, keep_open, path) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA:
            closed[key] = _closed(value, open_refs, False, f"{path}/{key}")
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            members_open = keep_open or (key != "prefixItems" and _shares(schema))
            closed[key] = [_closed(item, open_refs, members_open, f"{path}/{key}") for item in value]
        elif key == "allOf" and isinstance(value, list):
            closed[key] = [_closed(item, open_refs, True, f"{path}/{key}") for item in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _closed(item, open_refs, f"{path}/{key}/{name}" in open_refs, f"{path}/{key}/{name}")
                           for name, item in value.items()}
        else:
            closed[key] = value
    if keep_open or _COMBINING & schema.keys():
        return closed
    properties = schema.get("properties")
    required = schema.get("required", [])
    if (isinstance(properties, dict) and not {"additionalProperties", "unevaluatedProperties"} & schema.keys()
            and isinstance(required, list) and set(required) <= properties.keys()):
        closed["additionalProperties"] = False
    prefix_items = schema.get("prefixItems")
    if (isinstance(prefix_items, list) and not {"items", "unevaluatedItems", "additionalItems"} & schema.keys()
            and isinstance(schema.get("minItems", 0), int) and schema.get("minItems", 0) <= len(prefix_items)):
        closed["items"] = False
    return closed


# A schema that is only checked, never enforced (a tool's parameters under tool_choice auto):
# keywords llguidance does not implement (uniqueItems, not, if/then, an unknown format, ...)
# are warnings, as OpenAI and vLLM take such tools; a schema that is not one still fails.
LENIENT_JSON_OPTIONS = {**JSON_OPTIONS, "lenient": True}


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _satisfiable(schema_text: str, lenient: bool = False) -> bool:
    """Whether llguidance compiles a JSON schema (as text) to a grammar with no error (no
    tokenizer needed; ~0.3 ms for an agent's schema, once per schema: requests repeat theirs)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema_text, overrides=LENIENT_JSON_OPTIONS if lenient else JSON_OPTIONS)
        is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RuntimeError):
        return False
    return not is_error


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output. spec: the JSON schema as JSON text (json), the
    regex (regex), the Lark grammar (grammar), the strings (choice); unused for json_object."""

    kind: str
    spec: Union[str, tuple[str, ...]] = ""
    lenient: bool = False  # a JSON schema checked, not enforced: what llguidance cannot do is let be

    @classmethod
    def json_schema(cls, schema: Union[str, dict, bool], lenient: bool = False) -> "StructuredOutput":
        """From a schema as a dict or JSON text, kept in its key order: a JSON object's keys
        come out in the order the schema's properties name them."""
        if isinstance(schema, str):
            schema = loads_json(schema, "json_schema")
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("json_schema", f"must be a JSON object, got {type(schema).__name__}")
        # The boolean schemas: true admits any JSON value (as {} does), false none.
        if schema is False:
            raise InvalidRequestError("json_schema", "the schema false admits no value")
        if schema is True:
            schema = {}
        closed = closed_schema(schema)
        text = json.dumps(closed, separators=(",", ":"))
        if closed != schema and not _satisfiable(text, lenient):
            given = json.dumps(schema, separators=(",", ":"))
            if _satisfiable(given, lenient):
                text = given  # a shape closed_schema misjudged: as given rather than refused
        return cls("json", text, lenient)

    @classmethod
    def of(cls, kind: str, value: object, field: str, lenient: bool = False) -> "StructuredOutput":
        """The constraint one API field asks for: a JSON schema (kind "json" or "json_schema",
        its errors naming `field`), any JSON object ("json_object"; value unused), a choice among
        strings, or a regex / grammar. The OpenAI API and the gRPC servicer both map through it."""
        if kind in ("json", "json_schema"):
            try:
                return cls.json_schema(value, lenient)
            except InvalidRequestError as error:
                raise InvalidRequestError(field, error.message) from None
        if kind == "json_object":
            return cls("json_object")
        if kind == "grammar" and isinstance(value, str):
            return cls("grammar", lark_grammar(value, field))
        if kind == "choice":
            return cls("choice", tuple(value))
        return cls(kind, value)

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (nothing is checked here)."""
        import llguidance

        matcher = llguidance.LLMatcher
        if self.kind == "json":
            return matcher.grammar_from_json_schema(self.spec, overrides=LENIENT_JSON_OPTIONS if self.lenient
                                                    else JSON_OPTIONS)
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            return matcher.grammar_from_lark(self.spec)
        if self.kind == "choice":
            # One terminal (a lexer-level alternation), not one rule per string: the rule form
            # compiles in time quadratic in the strings (40,000: 2 s; 100,000: 19 s, then refused),
            # the terminal in 0.5 s for 100,000. Lark string literals take JSON's escapes.
            return matcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice)
                                                                                for choice in self.spec))
        raise ValueError(f"unknown structured output kind {self.kind!r}")

    def check_shape(self, field_name: str) -> None:
        """Raise InvalidRequestError for what needs no compiler to refuse."""
        if self.kind not in KINDS:
            raise InvalidRequestError(field_name, f"unknown constraint {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "choice":
            if not self.spec:
                raise InvalidRequestError(field_name, "the choice list must not be empty")
            if any(not isinstance(choice, str) or not choice for choice in self.spec):
                raise InvalidRequestError(field_name, "every choice must be a non-empty string")
        elif self.kind in ("regex", "grammar", "json") and not self.spec:
            raise InvalidRequestError(field_name, "must not be empty")
        elif self.kind == "grammar" and (size := len(self.spec.encode("utf-8", "surrogatepass"))) > MAX_GRAMMAR_BYTES:
            # In bytes: a grammar a byte over the bound read "at most 128 KiB (this one is 128 KiB)".
            raise InvalidRequestError(field_name, f"a grammar may be at most {MAX_GRAMMAR_BYTES >> 10} KiB (this one is "
                                                  f"{size:,} bytes, over {MAX_GRAMMAR_BYTES:,}); to choose among many "
                                                  f"strings, use a choice")


def loads_json(text: Union[str, bytes], field_name: str) -> object:
    """`text` parsed as JSON; InvalidRequestError naming `field_name` where it is not JSON or is
    nested deeper than MAX_JSON_DEPTH."""
    too_deep = f"nested more than {MAX_JSON_DEPTH} levels deep"
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(field_name, f"not valid JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:
        raise InvalidRequestError(field_name, too_deep) from None
    if nested_deeper_than(document, MAX_JSON_DEPTH):
        raise InvalidRequestError(field_name, too_deep)
    return document


def nested_deeper_than(document: object, limit: int) -> bool:
    """Whether `document` (parsed JSON) has containers nested more than `limit` deep; without
    recursion, whatever its depth."""
    level, depth = [document], 0
    while level:
        containers = [node for node in level if isinstance(node, (dict, list))]
        if not containers:
            return False
        depth += 1
        if depth > limit:
            return True
        level = [child for node in containers for child in (node.values() if isinstance(node, dict) else node)]
    return False


class GrammarCompiler:
    """llguidance for one tokenizer: constraints compiled on worker threads (bounded), each
    compiled once (LRU), each request given its own copy of the compiled matcher."""

    def __init__(self, fast_tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, max_workers: int = DEFAULT_COMPILE_WORKERS,
                 max_mask_ms: float = DEFAULT_MAX_MASK_MS):
        import llguidance

        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_mask_ms = max_mask_ms
        self.ll_tokenizer = llguidance.LLTokenizer(fast_tokenizer_json, n_vocab=vocab_size,
                                                   eos_token=list(eos_token_ids) or None)
        self._eos_ids = frozenset(self.ll_tokenizer.eos_tokens)
        # The tokens that are one byte each (at most 256), which _first_token_error feeds a first mask.
        byte_tokens = {}
        for byte in range(256):
            token_ids = self.ll_tokenizer.tokenize_bytes(bytes([byte]))
            if len(token_ids) == 1 and token_ids[0] < vocab_size and token_ids[0] not in self._eos_ids:
                byte_tokens.setdefault(token_ids[0], None)
        self._byte_token_ids = np.array(sorted(byte_tokens), dtype=np.int64)
        self.num_workers = max_workers
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[StructuredOutput, concurrent.futures.Future] = OrderedDict()
        self._waiters: dict[concurrent.futures.Future, int] = {}  # check_async calls waiting on each
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                      config: Optional[EngineConfig] = None) -> "GrammarCompiler":
        """From a replica.text.tokenizer.Tokenizer (its fast tokenizer's JSON), with the compile
        time bound and mask time limit of `config` (the defaults without one)."""
        if config is None:
            return cls(tokenizer.fast_tokenizer_json(), vocab_size, eos_token_ids)
        return cls(tokenizer.fast_tokenizer_json(), vocab_size, eos_token_ids,
                   config.structured_output_compile_timeout_s,
                   max_mask_ms=config.structured_output_max_mask_ms)

    def compile(self, constraint: StructuredOutput) -> concurrent.futures.Future:
        """A future of the CompiledGrammar (its matcher a template: take copies with `matcher`);
        the future raises InvalidRequestError (field "structured_output") when it does not compile."""
        with self._lock:
            future = self._compiled.get(constraint)
            if future is not None:
                self._compiled.move_to_end(constraint)
                return future
            future = self._submit(self._compile, constraint)
            future.add_done_callback(_stamp_done)
            self._compiled[constraint] = future
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
            return future

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        """fn(*args) on a compile thread. The pool starts its threads inside submit, and
        threading.stack_size applies to threads started while it is set (another thread
        started in that instant gets the large stack too, which costs it nothing)."""
        with _stack_size_lock:
            previous = threading.stack_size(COMPILE_THREAD_STACK_BYTES)
            try:
                return self._pool.submit(fn, *args)
            finally:
                threading.stack_size(previous)

    def _compile(self, constraint: StructuredOutput) -> "CompiledGrammar":
        import llguidance

        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as error:  # a JSON schema llguidance refuses to translate
            raise InvalidRequestError("structured_output", _one_line(str(error))) from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError("structured_output", _compile_error(constraint, matcher.get_error()))
        # The first mask builds the lexer, the costly part of a large schema: here, not in a step.
        mask = np.empty((1, words_per_mask(self.vocab_size)), dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error() and matcher.get_error().startswith("NoExtensionBias"):
            # Nothing may be written, not even EOS; llguidance's error is a dump of its parser's state.
            raise InvalidRequestError("structured_output", "no output can match it (not even an empty one): "
                                                           "it admits nothing, or only by an endless recursion")
        if matcher.is_error():
            raise InvalidRequestError("structured_output", _one_line(matcher.get_error()))
        error, first_masks_s = self._first_token_error(matcher, mask)
        if error:  # its first line: the rest is a dump of llguidance's parser state
            raise InvalidRequestError("structured_output", _too_complex_message("", error) if _too_complex(error)
                                      else _one_line(error.splitlines()[0]))
        # A lexeme that only a later part of the output reaches (a JSON schema's pattern, a Lark
        # terminal or a regex written in a rule) is built then: a costly one would fail the
        # request mid-output. Each is probed here as a constraint of its own.
        if constraint.kind == "json":
            patterns = _schema_patterns(json.loads(constraint.spec))
            found = self._costly_lexeme(
                [(f"its pattern {_excerpt(pattern)}", _unanchored(pattern)) for pattern in patterns],
                lambda regexes: llguidance.LLMatcher.grammar_from_regex("|".join(f"(?:{regex})" for regex in regexes)),
                mask)
        elif constraint.kind == "grammar":
            lexemes, definitions = _lark_lexemes(constraint.spec)
            found = self._costly_lexeme(
                list(lexemes.items()),
                lambda group: llguidance.LLMatcher.grammar_from_lark(f"{definitions}\nstart: {' | '.join(group)}\n"),
                mask)
        else:
            found = None
        if found is not None:
            raise InvalidRequestError("structured_output", _too_complex_message(f"{found[0]} ", found[1]))
        return CompiledGrammar(matcher, first_masks_s)

    def _costly_lexeme(self, lexemes: list[tuple[str, str]], grammar_of: Callable[[list[str]], str],
                       mask: np.ndarray) -> Optional[tuple[str, str]]:
        """(what, error) of one of `lexemes` ((what, lexeme) pairs) that is too complex or too
        costly on its own, else None. They are probed LEXEME_PROBE_GROUP at a time as one
        constraint (`grammar_of(group)`), and a group whose probe is over a limit is halved until
        the lexeme is found: about log2(n) probes per costly lexeme, where one by one took n
        probes that each compile the whole grammar's terminals again. A probe that does not
        compile is no finding, and what LEXEME_PROBE_BUDGET_S leaves unprobed is left to the
        runner's limits."""
        deadline = time.monotonic() + LEXEME_PROBE_BUDGET_S
        groups = [lexemes[start:start + LEXEME_PROBE_GROUP] for start in range(0, len(lexemes), LEXEME_PROBE_GROUP)]
        groups.reverse()
        while groups:
            if time.monotonic() > deadline:
                logger.info("structured outputs: %d of a constraint's lexemes left unprobed after %.1f s",
                            sum(map(len, groups)), LEXEME_PROBE_BUDGET_S)
                return None
            group = groups.pop()
            error = self._probe_error(lambda: grammar_of([lexeme for _, lexeme in group]), mask)
            if error is None or not _too_complex(error):
                continue
            if len(group) == 1:
                return group[0][0], error
            half = len(group) // 2
            groups += [group[half:], group[:half]]  # the first half next
        return None

    def _probe_error(self, grammar: Callable[[], str], mask: np.ndarray) -> Optional[str]:
        """llguidance's error compiling `grammar()` (which may itself refuse: a bad regex) as a
        constraint of its own, masking its first token or after a first byte
        (_first_token_error); None where there is none."""
        import llguidance

        try:
            probe = llguidance.LLMatcher(self.ll_tokenizer, grammar(), log_level=0)
        except (ValueError, TypeError) as error:
            return str(error) or "not a grammar"
        if not probe.is_error():
            probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return probe.get_error() if probe.is_error() else self._first_token_error(probe, mask)[0]

    def _first_token_error(self, matcher: "llguidance.LLMatcher", mask: np.ndarray) -> tuple[Optional[str], float]:
        """llguidance's error where a constraint's lexer blows up on its first byte, or a mask
        after it that takes longer than the limit, else None; and the slowest mask after a first
        byte, in seconds (what the scheduler first predicts a request's masks cost).
        The first mask (in `mask`) builds a large lexeme with llguidance's build budget
        (initial_lexer_fuel, a million units), but each token consumed after that has a step's
        (step_lexer_fuel, 200,000): a regex such as `(a{1000}){1000}` masks its first token, then
        fails consuming it, in the engine, after a step of ~0.2 s. A copy of the matcher consumes
        each one-byte token its first mask allows (the lowest allowed id where none is one
        byte), each on a fresh copy (a grammar with max_tokens, stop or lazy lexemes cannot roll
        back), here on the compile thread, and times the mask after each: a costly lexeme among several (a union of probes, a grammar whose first token may
        start any of its terminals) shows only after its own first byte. An ordinary constraint
        pays about a millisecond (SmolLM2's 49k ids, 170 first bytes allowed)."""
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        probes = self._byte_token_ids[allowed[self._byte_token_ids]]
        if not len(probes):
            probes = [token_id for token_id in np.flatnonzero(allowed)[:len(self._eos_ids) + 1]
                      if int(token_id) not in self._eos_ids][:1]
        if not len(probes):  # only EOS may come: nothing more to build
            return None, 0.0
        slowest_ms = 0.0
        for token_id in probes:
            probe = matcher.deep_copy()
            if not probe.consume_token(int(token_id)) or probe.is_error():
                return probe.get_error() or "the matcher refused a token its first mask allows", slowest_ms / 1e3
            # The mask after it: what a step pays for this constraint from here on.
            mask_ms = self._mask_ms(probe, mask)
            for _ in range(MASK_REMEASURES):
                if mask_ms <= self.max_mask_ms or probe.is_error():
                    break
                # Built again, the lowest time counts: the first build may include lexer states
                # built once, and a thread's CPU clock on a busy host also charges it interrupts
                # and page faults (a tight loop here saw single reads ~7 ms apart); a constraint
                # that is slow is slow every time.
                mask_ms = min(mask_ms, self._mask_ms(probe, mask))
            if probe.is_error():
                return probe.get_error(), slowest_ms / 1e3
            if mask_ms > self.max_mask_ms:
                return _slow_mask_error(mask_ms, self.max_mask_ms), mask_ms / 1e3
            slowest_ms = max(slowest_ms, mask_ms)
        return None, slowest_ms / 1e3

    @staticmethod
    def _mask_ms(matcher: "llguidance.LLMatcher", mask: np.ndarray) -> float:
        start = time.thread_time()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return (time.thread_time() - start) * 1e3

    def check(self, constraint: StructuredOutput, field_name: str) -> None:
        """check_async for a caller without an event loop (tests, scripts)."""
        asyncio.run(self.check_async(constraint, field_name))

    async def check_async(self, constraint: StructuredOutput, field_name: str) -> None:
        """Compile (or find compiled) within the time bound; raise InvalidRequestError naming
        `field_name` when the constraint is malformed, unsupported or too slow to compile, and
        QueueFullError when it waited as long for a compile thread (others ahead of it). The
        wait is the caller's coroutine (the edges'), so a client that goes away (its request's
        task cancelled) stops waiting at once, and its compile leaves the queue when nobody else
        waits for it and it has not started: clients that disconnect while a slow compile holds
        the thread leave no compiles behind it."""
        constraint.check_shape(field_name)
        future = self.compile(constraint)
        with self._lock:
            self._waiters[future] = self._waiters.get(future, 0) + 1
        gone = False
        loop = asyncio.get_running_loop()
        compiled = asyncio.shield(asyncio.wrap_future(future))
        try:
            # The bound is the compile's own time: a backlog of other compiles queued ahead of
            # it is the server's, not this constraint's (a valid schema was refused, naming the
            # client's parameter, behind twenty slow ones). Waiting as long again for a thread
            # is a full queue, to retry.
            queued_until = loop.time() + max(self.timeout_s, MIN_QUEUED_COMPILE_WAIT_S)
            backed_up = QueueFullError(f"{field_name}: the structured-output compiles are backed up; retry later")
            while not future.running() and not future.done():
                if loop.time() >= queued_until:
                    with self._lock:
                        alone = self._waiters.get(future, 0) <= 1
                    if alone:  # others waiting for the same compile keep it queued
                        self.abandon(constraint, future)
                    raise backed_up
                await asyncio.wait({compiled}, timeout=QUEUED_COMPILE_POLL_S)
            if future.cancelled():  # another waiter gave it up while it was still queued
                raise backed_up
            await asyncio.wait_for(compiled, self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as error:
            if isinstance(error, asyncio.CancelledError) and not future.cancelled():
                gone = True  # this caller was cancelled, not the compile
                raise
            # Timed out, or another waiter gave the same compile up: the same bound.
            self.abandon(constraint, future)
            raise InvalidRequestError(field_name, f"took longer than {self.timeout_s:g} s to compile") from None
        except InvalidRequestError as error:
            raise InvalidRequestError(field_name, error.message) from None
        finally:
            with self._lock:
                left = self._waiters.pop(future) - 1
                if left:
                    self._waiters[future] = left
            if gone and not left:
                self.cancel_queued(constraint, future)

    def _forget(self, constraint: StructuredOutput, future: concurrent.futures.Future) -> None:
        with self._lock:
            if self._compiled.get(constraint) is future:
                del self._compiled[constraint]

    def abandon(self, constraint: StructuredOutput, future: concurrent.futures.Future) -> None:
        """Give up a compile that took too long: out of the cache (a later request compiles it
        afresh), and out of the queue if it has not started."""
        self._forget(constraint, future)
        future.cancel()

    def cancel_queued(self, constraint: StructuredOutput, future: concurrent.futures.Future) -> bool:
        """Drop a compile that no request waits for any more, if it has not started: so that
        compiles given up behind a slow one (timed out, their requests aborted) never pile up
        on the compile threads. A started one runs to its end and stays cached."""
        if not future.cancel():
            return False
        self._forget(constraint, future)
        return True

    @property
    def num_queued(self) -> int:
        """Compiles waiting for a compile thread (neither started nor given up)."""
        with self._lock:
            return sum(1 for future in self._compiled.values() if not future.running() and not future.done())

    def matcher(self, constraint: StructuredOutput,
                future: Optional[concurrent.futures.Future] = None) -> "RequestGrammar":
        """A fresh matcher for one request from its compile, `future` (from `compile`; blocks
        until it is done), or from the cache's (a compile of its own if it has none). The engine
        passes the future its request waited for: looked up again, a compile the cache had let
        go of meanwhile (256 newer constraints, or a failed matcher forgotten) started afresh
        and blocked the step behind the whole compile queue."""
        future = self.compile(constraint) if future is None else future
        compiled = future.result()
        return RequestGrammar(compiled.matcher.deep_copy(), lambda: self._forget(constraint, future),
                              compiled.first_masks_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _stamp_done(future: concurrent.futures.Future) -> None:
    future.done_at = time.monotonic()  # read by compiled_in_time


def compiled_in_time(future: concurrent.futures.Future, deadline: float) -> bool:
    """Whether `future` (from GrammarCompiler.compile) finished by `deadline` (time.monotonic):
    a compile that finished late is late however soon after it is looked at."""
    if not future.done():
        return False
    done_at = getattr(future, "done_at", None)  # None: it finished this instant, its callback not yet run
    return (time.monotonic() if done_at is None else done_at) <= deadline


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled: the matcher every request under it copies, and the slowest mask the
    compile's probe timed after a first byte (seconds; 0 where none was timed)."""

    matcher: "llguidance.LLMatcher"
    first_masks_s: float


class RequestGrammar:
    """One request's matcher; it has consumed exactly the request's output tokens."""

    __slots__ = ("matcher", "num_consumed", "on_failure", "slow_steps", "fast_steps", "too_slow", "mask_s",
                 "masked_at_step")

    def __init__(self, matcher: "llguidance.LLMatcher", on_failure=None, mask_s: float = 0.0):
        self.matcher = matcher
        self.num_consumed = 0
        # What its next mask is predicted to cost (CPU seconds): its latest mask's share of the
        # step's build (GrammarBitmask), at first the compile's probe. The scheduler keeps a
        # step's sum within structured_output_step_mask_ms, and lets the requests whose masks
        # were built longest ago (masked_at_step, a scheduler step id) go first.
        self.mask_s = mask_s
        self.masked_at_step = -1
        # Its masks over the time limit (GrammarBitmask), counted until SLOW_MASK_STEPS masks
        # in a row were within it (fast_steps); at SLOW_MASK_STEPS, why the request must end.
        self.slow_steps = 0
        self.fast_steps = 0
        self.too_slow: Optional[str] = None
        # Called once when a token fails: the copies of one compiled matcher share its lexer,
        # and a lexer that exceeded its budget stays broken, so every later request under the
        # same constraint failed on its first token; the compiler forgets that matcher (the
        # next request compiles afresh).
        self.on_failure = on_failure

    def accept(self, token_id: int) -> bool:
        """Advance by one appended token; False when the grammar did not allow it (the matcher
        is then in error and masks nothing more)."""
        self.num_consumed += 1
        if self.matcher.is_stopped():  # past the grammar's end: only EOS was left, nothing to track
            return True
        if self.matcher.consume_token(token_id):
            return True
        if self.on_failure is not None:
            self.on_failure()
            self.on_failure = None
        return False

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()


def words_per_mask(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class GrammarMask:
    """One step's masks on the logits' device: int32 [rows, words] bitmasks of allowed tokens,
    and which sampling rows they belong to (int64 [rows])."""

    bitmask: torch.Tensor
    rows: torch.Tensor
    shifts: torch.Tensor  # int32 [32] on the same device: 0..31, to unpack the bits


class GrammarBitmask:
    """Fills the masks of a step's constrained rows on the host, in parallel over the rows
    (llguidance's executor threads release the GIL), into a reused buffer; and keeps each row's
    mask within max_mask_ms: a request whose mask is over it SLOW_MASK_STEPS times (with fewer
    than SLOW_MASK_STEPS within it in a row between them) is marked `too_slow` (the engine ends it).

    Each row's mask time is kept as its grammar's `mask_s`, the scheduler's prediction of its
    next (structured_output_step_mask_ms bounds a step's sum): a row built alone, its own; a row
    of the parallel build, its share of that build's CPU time (_share_build_time).

    The executor builds a step's masks at once, on its own threads (one mask alone on the calling
    thread), and times none of them, so the step's whole build is timed (wall time): when it is
    within the limit, so was every row. Its CPU time, shared out among the rows, is the CPU time
    of the executor's threads and this one (BuildClock), not the process's: that counted every
    other thread too (grammar compiles, the channel's sender), so constrained rows seemed to cost
    more than they did and waited for turns they did not need.
    When it is not, each row's mask is built again on its own, timed by this thread's CPU time
    (no wait for the GIL or a core counts), to find the slow ones. That search costs the step
    about the sum of its rows' masks (up to the build times the executor's threads), so while
    rows that are merely many keep the build over the limit it is not repeated until a build
    twice as long, or RETIME_AFTER_STEPS steps later. A row found slow is built alone, timed,
    until SLOW_MASK_STEPS of its masks in a row were within the limit, or it ends."""

    RETIME_AFTER_STEPS = 64

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device,
                 max_mask_ms: float = DEFAULT_MAX_MASK_MS):
        import llguidance
        import torch

        from replica.executor import cuda_runtime

        self.device = device
        self.max_mask_s = max_mask_ms / 1e3
        # A build slower than this looks for its slow rows (raised after a search finds none).
        self._search_above_s = self.max_mask_s
        self._search_again_at = 0
        self._clock = BuildClock(llguidance.LLExecutor)
        self._executor = self._clock.executor
        # Two buffers alternate: with overlapped scheduling a step's copy may still be queued
        # on the device while the next step's masks are filled.
        self._host = [torch.empty((max_rows, words_per_mask(vocab_size)), dtype=torch.int32,
                                  pin_memory=cuda_runtime.pins_host_memory(device)) for _ in range(2)]
        self._num_built = 0
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def build(self, rows: Sequence[int], grammars: Sequence[RequestGrammar]) -> GrammarMask:
        """The masks of these sampling rows, whose grammars stand at the rows' tokens."""
        import torch

        from replica.executor import cuda_runtime

        count = len(rows)
        host = self._host[self._num_built % 2][:count]
        self._num_built += 1
        live, suspects = [], []
        for index, grammar in enumerate(grammars):
            if grammar.is_error or grammar.too_slow is not None:
                # A matcher that lost track constrains nothing (logged when it did); one too slow
                # to follow is ending (a step launched before the engine ended it still has it).
                host[index].fill_(-1)
                grammar.mask_s = 0.0
            elif grammar.slow_steps:
                suspects.append((grammar, index))
            else:
                live.append((grammar.matcher, index))
        if live:
            start, cpu_start = time.perf_counter(), self._clock.cpu_s()
            self._executor.unsafe_compute_mask_ptr(live, host.data_ptr(), host.shape[1] * 4, count)
            elapsed = time.perf_counter() - start
            _share_build_time(self._clock.cpu_s() - cpu_start, [grammars[index] for _, index in live])
            # Within the limit, so was every row. Over it: find the slow rows, unless a search
            # found none lately and this build is not much slower than that one.
            if elapsed > self.max_mask_s and (elapsed > self._search_above_s
                                              or self._num_built >= self._search_again_at):
                found = False
                for _, index in live:
                    found |= self._build_one(grammars[index], host, index)
                if not found:  # many honest rows: search again only for a build much slower
                    self._search_above_s = 2 * elapsed
                    self._search_again_at = self._num_built + self.RETIME_AFTER_STEPS
        for grammar, index in suspects:
            self._build_one(grammar, host, index)
        row_index = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        if cuda_runtime.pins_host_memory(self.device):  # pinned, so the copy never waits for the step in flight
            row_index = row_index.pin_memory()
        return GrammarMask(host.to(self.device, non_blocking=True), row_index.to(self.device, non_blocking=True),
                           self._shifts)

    def _build_one(self, grammar: RequestGrammar, host: torch.Tensor, index: int) -> bool:
        """Build row `index`'s mask alone, timed, and count the step against its grammar when it
        is over the limit; whether it was."""
        start = time.thread_time()
        grammar.matcher.unsafe_compute_mask_ptr(host[index].data_ptr(), host.shape[1] * 4)
        elapsed = grammar.mask_s = time.thread_time() - start
        if elapsed <= self.max_mask_s:
            grammar.fast_steps += 1
            if grammar.fast_steps >= SLOW_MASK_STEPS:
                grammar.slow_steps = 0
            return False
        grammar.slow_steps += 1
        grammar.fast_steps = 0
        if grammar.slow_steps >= SLOW_MASK_STEPS and grammar.too_slow is None:
            grammar.too_slow = _slow_mask_error(elapsed * 1e3, self.max_mask_s * 1e3) + \
                f", for {grammar.slow_steps} of its tokens"
        return True


# What a mask never timed weighs when a parallel build's time is shared out: an ordinary mask
# (medians 6-34 us on SmolLM2's 49k ids, bench_structured.py --sections mask-costs).
PRESUMED_MASK_S = 20e-6


class BuildClock:
    """The CPU time of a mask build: the calling thread's (llguidance builds a lone mask on it)
    and the executor's own threads' (it builds several at once there), each thread's own clock,
    so that no other thread of the process counts. Its threads are those that making the
    executor started, less any Python thread (one started meanwhile elsewhere). Where threads'
    clocks cannot be read (no /proc, not Linux), the process's CPU time, as before."""

    def __init__(self, make_executor: Callable[[], Any]):
        before = _thread_ids()
        self.executor = make_executor()
        after = _thread_ids()
        self._clocks: Optional[list[int]] = None
        if before is not None and after is not None:
            python_threads = {thread.native_id for thread in threading.enumerate()}
            # Linux's clock id of a thread's CPU time (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)).
            self._clocks = [(~tid << 3) | 6 for tid in sorted(after - before - python_threads)]

    def cpu_s(self) -> float:
        if self._clocks is not None:
            try:
                return time.thread_time() + sum(time.clock_gettime(clock) for clock in self._clocks)
            except OSError:  # a thread of the executor's gone: the process's from now on
                self._clocks = None
        return time.process_time()


def _thread_ids() -> Optional[set[int]]:
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except (OSError, ValueError):
        return None


def _share_build_time(cpu_s: float, grammars: Sequence[RequestGrammar]) -> None:
    """Each row's share of a parallel build's CPU time (BuildClock's: the executor's threads and
    the caller's; llguidance times no single row of it) as its `mask_s`: in proportion to what each was
    predicted to cost, so a row timed alone before (a search, a slow row) keeps its weight beside
    cheap ones, and the shares add up to what the build cost."""
    weights = [grammar.mask_s + PRESUMED_MASK_S for grammar in grammars]
    scale = cpu_s / sum(weights)
    for grammar, weight in zip(grammars, weights):
        grammar.mask_s = weight * scale


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """A copy of logits [rows, vocab] with the disallowed tokens of the masked rows at -inf:
    one gather, one unpack of the bits, one masked fill, one scatter back (no per-row loop)."""
    vocab_size = logits.shape[-1]
    allowed = ((mask.bitmask.unsqueeze(-1) >> mask.shifts) & 1).view(mask.bitmask.shape[0], -1)[:, :vocab_size]
    rows = logits.index_select(0, mask.rows)
    rows.masked_fill_(allowed == 0, float("-inf"))
    return logits.index_copy(0, mask.rows, rows)


def _schema_patterns(schema: object) -> list[str]:
    """The distinct regexes a JSON schema's string `pattern`s and `patternProperties` name, in
    the order met (without recursion: a schema is at most MAX_JSON_DEPTH deep, but may be wide)."""
    found, stack = {}, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                found.setdefault(pattern, None)
            properties = node.get("patternProperties")
            if isinstance(properties, dict):
                for key in properties:
                    found.setdefault(key, None)
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
    return list(found)


# A top-level Lark definition, at a line's first column: a rule (`name:`, `?name:`, `!name:`) or
# a terminal (`NAME:`, `_NAME:`, with a priority `.N`), either with llguidance's `[attributes]`.
_LARK_DEFINITION = re.compile(r"[?!]?(?P<name>_?[A-Za-z][A-Za-z_0-9]*)(?:\.-?\d+)?(?:\[[^\]\n]*\])?\s*:")
# What a rule's text holds that may contain a slash, scanned left to right: a string, a comment,
# a regex literal (/.../ and its flags). Only the last is a lexeme.
_LARK_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|(?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)')
# Probes of a constraint's lexemes: at most this many in one (llguidance allows 2,000 items in a
# row), and at most this long for all of them.
LEXEME_PROBE_GROUP = 256
LEXEME_PROBE_BUDGET_S = 1.0


def _lark_lexemes(grammar: str) -> tuple[dict[str, str], str]:
    """The lexemes of a Lark grammar that a probe builds ({what: lexeme}: each terminal, by
    name, used or not (llguidance's lexer holds every one); each regex written in a rule), and
    the grammar without its rules (terminal definitions, directives), to which a probe's
    `start: ...` is appended. A definition starts at a line's first column with its name (a
    terminal's is upper case); an indented line or one starting with `|` continues it, and
    comments and blank lines leave it open. No more parsing than that: a probe that does not
    compile is no finding."""
    definitions: list[list] = []  # [name, text] or [None, text] (a directive, comment or blank line)
    current: Optional[list] = None
    for line in grammar.splitlines(keepends=True):
        stripped = line.strip()
        match = _LARK_DEFINITION.match(line)
        if match:
            current = [match.group("name"), line]
            definitions.append(current)
        elif current is not None and (line[:1] in (" ", "\t") or stripped.startswith("|")) and stripped:
            current[1] += line
        else:
            definitions.append([None, line])
            if stripped and not stripped.startswith("//"):
                current = None  # a directive ends the definition before it

    def is_terminal(name: Optional[str]) -> bool:
        return name is not None and name.lstrip("_")[:1].isupper()

    rules = "".join(text for name, text in definitions if name is not None and not is_terminal(name))
    kept = [(name, text) for name, text in definitions if name is None or is_terminal(name)]
    lexemes = {f"its terminal {name}": name for name, _ in kept if is_terminal(name)}
    for token in _LARK_TOKENS.finditer(rules):
        if token.group("regex"):
            lexemes[f"its regex {_excerpt(token.group('regex'))}"] = token.group("regex")
    return lexemes, "".join(text for _, text in kept)


def _unanchored(pattern: str) -> str:
    """A JSON schema pattern without its leading ^ and trailing $ (a regex constraint matches
    the whole output); probing its cost needs no more."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    return body[:-1] if body.endswith("$") and not body.endswith("\\$") else body


def _too_complex(error: str) -> bool:
    """Whether llguidance's error is one of its lexer's limits (step fuel, states) or a mask over
    the time limit (_slow_mask_error), not a syntax error."""
    return ("too many expressions constructed" in error or "too many states" in error or "LexerTooComplex" in error
            or error.startswith(_SLOW_MASK))


_SLOW_MASK = "each token's mask takes"


def _slow_mask_error(mask_ms: float, max_mask_ms: float) -> str:
    return (f"{_SLOW_MASK} {mask_ms:.1f} ms to compute, over the limit of {max_mask_ms:g} ms "
            f"(structured_output_max_mask_ms)")


def _too_complex_message(what: str, error: str) -> str:
    """`what`: "" for the whole constraint, else the part of it (ending in a space) that blew up."""
    first_line = error.splitlines()[0] if error else ""
    if first_line.startswith(_SLOW_MASK):
        return f"{what or 'it '}is too costly to follow: {first_line}; use fewer or smaller nested repetitions"
    return (f"{what or 'it '}is too complex for the grammar engine: its lexer exceeds llguidance's per-token "
            f"budget ({_one_line(first_line)[:120]}); use fewer or smaller nested repetitions")


def _excerpt(text: str) -> str:
    return json.dumps(text if len(text) <= 60 else text[:57] + "...")


_REGEX_PARSE_ERROR = re.compile(r"regex parse error:\n {4}(?P<regex>[^\n]*)\n {4}(?P<caret> *\^+)\nerror: (?P<error>[^\n]*)")


def _compile_error(constraint: StructuredOutput, message: str) -> str:
    """llguidance's error for a constraint, on one line. A regex's or a schema pattern's parse
    error without the Lark grammar a regex constraint is wrapped in (`at 1(8): ... 1 | start:
    /(/`: a grammar the client never wrote): `invalid regex '(': unclosed group, at character 1`."""
    match = _REGEX_PARSE_ERROR.search(message) if constraint.kind in ("regex", "json") else None
    if match is None:
        return _one_line(message)
    column = len(match["caret"]) - len(match["caret"].lstrip(" ")) + 1
    return _one_line(f"invalid regex {match['regex']!r}: {match['error']}, at character {column}")


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]
