"""Tool calls out of a chat completion's text, per model family, as vLLM's `--tool-call-parser`:

- `hermes` (Qwen 2.5+, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, with content before, between and after them;
- `llama3_json` (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}` (several separated
  by `;`), optionally after `<|python_tag|>`;
- tool_choice `required` (not a model family: the grammar writes it): `[{"name": ..., "arguments": {...}}, ...]`.

Each parser reads the reply as it is written, and a whole reply is read the same way in one
piece, so a streamed reply assembles into exactly the whole one. Content streams until a call
may be starting (a partial start tag, whitespace that may precede a call, are held). A call goes
out as soon as its name is written: a first delta with its index, id, type and name, then its
arguments as the model writes them, whose fragments concatenate to the arguments' JSON text
exactly (an object or array streams character by character; a call laid out otherwise is read
whole once its object closes). A call cut short by max_tokens keeps the arguments written; text
that opened like a call and turned out not to be one is content after all. A hermes end tag
always ends its call, even inside a JSON string (an argument quoting `</tool_call>` is cut
there): read as string text instead, a call broken mid-string swallowed every call after it.
`decided` says how
much of the text is settled (sent as content, read into a call or dropped as syntax): the
response layer sends each token's logprobs once its text is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.arg_types import is_utf8
from cluster.openai_structured import ToolCalling, new_tool_call_id

# A call's object as models (and the `required` grammar) write it: the name first, then the
# arguments. The name is a JSON string (no raw control character, no escape JSON lacks, such as
# a markdown-minded `get\_weather`): anything else is read whole, and is no call.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*")'
                     r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: Optional[str]
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class CallDelta:
    """A piece of one call: `name` on its first, then argument text."""

    index: int
    arguments: str
    name: Optional[str] = None


class _JsonScan:
    """Where a JSON value that opens with { or [ closes, read as it grows (strings and escapes
    respected); also counts the colons of the value's own level (keys written)."""

    __slots__ = ("depth", "in_string", "escape", "position", "top_colons")

    def __init__(self, position: int):
        self.depth = 0
        self.in_string = self.escape = False
        self.position = position  # next character to read
        self.top_colons = 0

    def close_of(self, text: str) -> Optional[int]:
        """The index just past the value's closing bracket, once written."""
        depth, in_string, escape = self.depth, self.in_string, self.escape
        index = self.position
        closed = None
        for index in range(self.position, len(text)):
            char = text[index]
            if in_string:
                if escape:
                    escape = False
                elif char == "\\":
                    escape = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    closed = index + 1
                    break
            elif char == ":" and depth == 1:
                self.top_colons += 1
        else:
            index = len(text) - 1
        self.depth, self.in_string, self.escape, self.position = depth, in_string, escape, index + 1
        return closed


class _CallBody:
    """One call's JSON object, fed as it is written (from just after whatever opens it). Once
    `{"name": "...", "arguments": ` (or "parameters") is written the call is known (`name`), and
    an object or array argument value streams as written; any other layout is read whole when
    the object closes. `failed`: the text is no call (its caller shows it as content)."""

    def __init__(self, needs_arguments: bool = False):
        self.needs_arguments = needs_arguments  # an object without arguments / parameters is no call
        self.text = ""
        self.name: Optional[str] = None
        self.arguments = ""  # the argument text handed out so far
        self.failed = False
        self.closed = False  # the object's closing brace is written
        self._object: Optional[_JsonScan] = None
        self._args_start: Optional[int] = None  # the argument value's first character, once known
        self._args: Optional[_JsonScan] = None  # streaming an object / array value
        self._args_done = False

    def feed(self, more: str) -> str:
        """More of the call's text; returns the argument text it adds."""
        self.text += more
        if self.failed or self.closed:
            return ""
        text = self.text
        if self._object is None:
            start = len(text) - len(text.lstrip())
            if start == len(text):
                return ""
            if text[start] != "{":
                self.failed = True
                return ""
            self._object = _JsonScan(start)
        end = self._object.close_of(text)
        added = ""
        if self.name is None and self._args_start is None:
            header = _HEADER.match(text)
            name = json.loads(header.group(1)) if header is not None else None
            if name is not None and is_utf8(name):
                self.name = name
                self._args_start = header.end()
            elif end is not None or self._object.top_colons >= 2:
                # Not written name first (or no call at all): read whole once it closes.
                self._args_start = -1
        if self._args_start is not None and self._args_start >= 0 and not self._args_done:
            added = self._stream_arguments(text)
        if end is not None:
            self.closed = True
            added += self._read_whole(text[:end])
        self.arguments += added
        return added

    def _stream_arguments(self, text: str) -> str:
        start = self._args_start
        if self._args is None:
            while start < len(text) and text[start].isspace():
                start += 1
            self._args_start = start
            if start == len(text):
                return ""
            if text[start] not in "{[":
                self._args_done = True  # a string or scalar: read whole
                return ""
            self._args = _JsonScan(start)
        end = self._args.close_of(text)
        if end is not None:
            self._args_done = True
            return text[start + len(self.arguments):end]
        return text[start + len(self.arguments):]

    def _read_whole(self, text: str) -> str:
        """The object closed: what streaming could not give (a call laid out otherwise, an
        argument that is no object or array)."""
        if self._args is not None:
            return ""
        try:
            call = _call_of(_strict_json(text), self.needs_arguments)
        except (ValueError, RecursionError):  # model output nested past json's limit is no call either
            call = None
        if self.name is None:
            if call is None:
                self.failed = True
                return ""
            self.name = call.name
            return call.arguments
        if call is not None:
            return call.arguments
        return text[self._args_start:-1].strip()  # broken JSON after a good header: as written

    def finish(self) -> str:
        """The call's text has ended (its end tag, or the reply's end) before its object closed:
        a call whose name was written keeps the arguments written (max_tokens cut them); one
        whose name was not is no call."""
        if self.closed or self.failed:
            return ""
        if self.name is None:
            self.failed = True
            return ""
        added = ""
        if self._args is None:  # a scalar value, cut short
            added = self.text[self._args_start:].strip()
        self.arguments += added
        return added


def _call_of(value: Any, needs_arguments: bool = False) -> Optional[ParsedCall]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not is_utf8(value["name"]):
        return None
    if needs_arguments and "arguments" not in value and "parameters" not in value:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        # Arguments given as a JSON string pass as written; one holding half a surrogate pair
        # (`"\ud83d"` decoded) has no UTF-8 form, so no response could carry it.
        return ParsedCall(value["name"], arguments) if is_utf8(arguments) else None
    text = json.dumps(arguments, ensure_ascii=False)
    # Half a surrogate pair inside stays escaped, as the model wrote it.
    return ParsedCall(value["name"], text if is_utf8(text) else json.dumps(arguments))




class ToolParser:
    """One layout of tool calls, read as the reply is written: `feed` takes the next piece of
    text and returns the content to send and the call deltas; `final` marks the reply's end."""

    # The tags it reads, which a checkpoint may make special tokens (Llama 3's <|python_tag|>):
    # the text of a request it reads keeps them (SamplingParams.kept_special_token_ids).
    TAGS: tuple[str, ...] = ()

    def __init__(self):
        self.text = ""
        self.calls: list[ParsedCall] = []  # every call begun, its arguments as written so far
        self.decided = 0  # characters of the text whose fate is settled
        self._content: list[str] = []
        self._deltas: list[CallDelta] = []
        self._body: Optional[_CallBody] = None

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.text += text
        self._advance(final)
        content, self._content = "".join(self._content), []
        deltas, self._deltas = self._deltas, []
        return content, deltas

    def parse(self, text: str) -> Parsed:
        """A whole reply: read as a stream that arrives in one piece."""
        content, _ = self.feed(text, final=True)
        return Parsed(content or None, self.calls)

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _feed_body(self, text: str) -> None:
        """More text of the call being read; a call whose name is now known is announced."""
        body = self._body
        was_known = body.name is not None
        added = body.feed(text)
        self._announce(body, was_known, added)

    def _finish_body(self) -> bool:
        """The call's text has ended; True when it was a call."""
        body = self._body
        was_known = body.name is not None
        added = body.finish()
        self._announce(body, was_known, added)
        self._body = None
        return not body.failed

    def _announce(self, body: _CallBody, was_known: bool, added: str) -> None:
        if body.name is None:
            return
        if not was_known:
            self.calls.append(ParsedCall(body.name, ""))
            self._deltas.append(CallDelta(len(self.calls) - 1, added, body.name))
        elif added:
            self._deltas.append(CallDelta(len(self.calls) - 1, added))
        self.calls[-1].arguments = body.arguments


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    TAGS = (START, END)

    def __init__(self):
        super().__init__()
        self._position = 0  # next character to read
        self._held_space = ""  # whitespace after content: dropped if a call follows
        self._call_start = 0  # where the call being read opened (before the whitespace held at it)

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self._body is None:
                start = text.find(self.START, self._position)
                if start >= 0:
                    end = start
                else:
                    end = len(text) if final else _before_partial(text, self._position, self.START)
                self._add_content(text[self._position:end])
                self._position = end
                if start < 0:
                    if final and not self.calls:
                        self._content.append(self._held_space)
                        self._held_space = ""
                    self.decided = self._position if final else self._position - len(self._held_space)
                    return
                self._call_start = start - len(self._held_space)
                self._body = _CallBody()
                self._position = start + len(self.START)
            end_tag = text.find(self.END, self._position)
            if end_tag >= 0:
                end = end_tag
            else:
                end = len(text) if final else _before_partial(text, self._position, self.END)
            self._feed_body(text[self._position:end])
            if self._body.failed:  # (only a body whose name never came fails)
                # The tag opens no call (prose quoting it, `"<tool_call>" tag`): it is content, and
                # the text after it is read afresh, where a real call may open (it was read up to
                # the next end tag, swallowing that call into content).
                opened_at = self._call_start + len(self._held_space)
                self._body = None
                self._content.append(self._held_space + self.START)
                self._held_space = ""
                self._position = self.decided = opened_at + len(self.START)
                continue
            self._position = end
            self.decided = end if self._body.name is not None else self._call_start
            if end_tag < 0 and not final:
                return
            call_end = end_tag + len(self.END) if end_tag >= 0 else len(text)
            body = self._body
            if self._finish_body():
                self._held_space = ""
                # Text after the call's object inside its tags (a second object, a remark) is
                # content: it was dropped, neither read into a call nor shown.
                leftover = body.text[_object_end(body.text):].strip() if body.closed else ""
                if leftover:
                    self._content.append(leftover)
            else:  # no call: its text, the whitespace before it too, is content
                self._content.append(self._held_space)
                self._content.append(text[self._call_start + len(self._held_space):call_end])
                self._held_space = ""
            self._position = self.decided = call_end

    def _add_content(self, text: str) -> None:
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept):]
        if kept:
            self._content.append(kept)


class _JsonCallList(ToolParser):
    """Calls written as JSON objects one after another, after an opening, with separators:
    llama3_json's `<|python_tag|>{...}; {...}` and tool_choice required's `[{...}, {...}]`.
    Text that is no call is content: the whole reply when the first is not, else from there on."""

    OPENING = ""
    OPENING_REQUIRED = False
    SEPARATORS = ""
    ARGUMENTS_REQUIRED = False

    def __init__(self):
        super().__init__()
        self._position: Optional[int] = None  # None: the reply's opening is not read yet
        self._call_start = 0
        self._as_content_from: Optional[int] = None  # the rest of the text, from here, is content

    def _advance(self, final: bool) -> None:
        text = self.text
        if self._as_content_from is None and self._position is None:
            self._position = self._opening(text, final)
            if self._position is None:
                return
        while self._as_content_from is None:
            if self._body is None:
                position = self._position
                while position < len(text) and (text[position].isspace() or text[position] in self.SEPARATORS):
                    position += 1
                if position == len(text):
                    self.decided = position if self.calls else 0
                    if final and not self.calls:
                        self._as_content_from = 0
                    break
                if text[position] != "{":
                    self._as_content_from = position if self.calls else 0
                    break
                self._call_start = position
                self._body = _CallBody(self.ARGUMENTS_REQUIRED)
                self._position = position
            self._feed_body(text[self._position:])
            self._position = len(text)
            body = self._body
            if not body.closed and not body.failed and not final:
                self.decided = len(text) if body.name is not None else (self._call_start if self.calls else 0)
                return
            end = self._call_start + len(body.text.rstrip()) if not body.closed else None
            if body.closed:  # the object ended inside the text fed: read on after it
                end = self._call_start + _object_end(body.text)
            if not self._finish_body():
                self._as_content_from = self._call_start if self.calls else 0
                break
            self._position = self.decided = end
        if self._as_content_from is not None:
            self._content.append(text[max(self._as_content_from, self.decided):])
            self._as_content_from = self.decided = len(text)

    def _opening(self, text: str, final: bool) -> Optional[int]:
        """Where the calls begin, past the opening; None while the text may still open with it
        (or with a call); the reply is content when it cannot."""
        body = text.lstrip()
        start = len(text) - len(body)
        if self.OPENING and body.startswith(self.OPENING):
            return start + len(self.OPENING)
        if not final and (not body or (self.OPENING and self.OPENING.startswith(body))):
            return None
        if self.OPENING_REQUIRED or not body.startswith("{"):
            self._as_content_from = 0
            return len(text)
        return start


class Llama3JsonToolParser(_JsonCallList):
    OPENING = "<|python_tag|>"
    TAGS = (OPENING,)
    SEPARATORS = ";"
    # Without tags a reply that is a JSON object with a "name" (`{"name": "Bob", "age": 42}`)
    # is an answer, not a call to make: a call names its parameters.
    ARGUMENTS_REQUIRED = True


class RequiredToolCalls(_JsonCallList):
    """tool_choice `required`'s output: the JSON array of {name, arguments} its grammar enforces."""

    OPENING = "["
    OPENING_REQUIRED = True
    SEPARATORS = ",]"


def _before_partial(text: str, start: int, tag: str) -> int:
    """Where a suffix of text[start:] that could still grow into `tag` begins (len(text): none)."""
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-length:]):
            return len(text) - length
    return len(text)


def _object_end(text: str) -> int:
    """The index just past the first JSON object written in text (which holds a closed one)."""
    scan = _JsonScan(len(text) - len(text.lstrip()))
    return scan.close_of(text)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def make_tool_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(PARSERS)}") from None


def tool_call_json(call: ParsedCall, index: Optional[int] = None, call_id: Optional[str] = None) -> dict[str, Any]:
    body = {"id": call_id or new_tool_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def _calls_finish_reason(finish_reason: Optional[str], calls: list[ParsedCall]) -> Optional[str]:
    """A reply that ends in tool calls finishes with `tool_calls`, unless one was cut short:
    by max_tokens (`length`), or by a stop string or stop token before its arguments closed
    (`stop`, as the engine said: arguments that do not parse are no call to make)."""
    if finish_reason != "stop" or not all(_is_json(call.arguments) for call in calls):
        return finish_reason
    return "tool_calls"


def _strict_json(text: str) -> Any:
    """RFC 8259 JSON: Python's json also reads NaN and Infinity, which strict parsers (a
    client's JSON.parse) refuse, so arguments holding them are no call to make."""
    return json.loads(text, parse_constant=_no_constant)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_json(text: str) -> bool:
    try:
        _strict_json(text)
    except (ValueError, RecursionError):
        return False
    return True


class ToolCallOutput:
    """One chat choice's text as the assistant's content and tool calls, whole or streamed."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        mode = calling.mode
        self.parser: Optional[ToolParser] = (make_tool_parser(calling.parser) if mode == "auto"
                                             else RequiredToolCalls() if mode == "required" else None)
        self.text = ""
        self._named_id: Optional[str] = None

    @property
    def decided(self) -> int:
        """Characters of the text streamed so far whose fate is settled (content sent, read into
        a call, or dropped): the logprobs of the tokens that wrote them may go out."""
        return self.parser.decided if self.parser is not None else len(self.text)

    # ---- whole responses ------------------------------------------------------------------
    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """The assistant message and the finish reason: `tool_calls` when the reply made calls
        under `auto` or `required`; a named function's call keeps the engine's (`stop`), as
        OpenAI's API and vLLM answer a forced call."""
        if self.parser is None:  # named: the arguments as written (cut short where max_tokens ended them)
            content, calls = None, [ParsedCall(self.calling.function_name, text)]
        else:
            parsed = self.parser.parse(text)
            content, calls = parsed.content, self._allowed(parsed.calls)
        # No calls: the text, "" when empty, as without tools (null read as "no text" crashed
        # clients calling .strip() on it); with calls, null when they are all there is.
        message: dict[str, Any] = {"role": "assistant", "content": content if calls else content or ""}
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
            return message, finish_reason if self.parser is None else _calls_finish_reason(finish_reason, calls)
        return message, finish_reason

    # ---- streaming ------------------------------------------------------------------------
    def feed(self, text: str, finish_reason: Optional[str]) -> tuple[str, list[dict[str, Any]], Optional[str]]:
        """One engine delta in: the content to stream now, the tool-call deltas, the finish reason."""
        self.text += text
        if self.parser is None:  # named: the engine's finish reason, as message() keeps it
            return "", self._named_delta(text), finish_reason
        content, deltas = self.parser.feed(text, final=finish_reason is not None)
        if self.parser.calls:
            finish_reason = _calls_finish_reason(finish_reason, self._allowed(self.parser.calls))
        return content, [self._delta_json(delta) for delta in deltas
                         if not (self.calling.single_call and delta.index > 0)], finish_reason

    def _allowed(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        """The calls the reply returns: the first alone under parallel_tool_calls false (as
        vLLM's server keeps; `required` is held to one by its schema)."""
        return calls[:1] if self.calling.single_call else calls

    def _delta_json(self, delta: CallDelta) -> dict[str, Any]:
        if delta.name is None:
            return {"index": delta.index, "function": {"arguments": delta.arguments}}
        return {"index": delta.index, "id": new_tool_call_id(), "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}

    def _named_delta(self, text: str) -> list[dict[str, Any]]:
        if self._named_id is None:
            self._named_id = new_tool_call_id()
            return [{"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.calling.function_name, "arguments": text}}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []
