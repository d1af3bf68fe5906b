"""Tool calls out of a chat completion's text, per model family, as vLLM's `--tool-call-parser`:

- `hermes` (Qwen 2.5+, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, after optional content;
- `llama3_json` (Llama 3.1+): the whole reply is `{"name": ..., "parameters": {...}}` (several
  separated by `;`), optionally after `<|python_tag|>`.

`ToolCallOutput` turns one choice's text into the assistant message's `content` and
`tool_calls` (whole responses), or its stream of text deltas into `delta.content` and
`delta.tool_calls` chunks (streaming): content streams as it comes until a tool call may be
starting; calls go out whole (their argument fragments concatenate to valid JSON) when the
text ends, except a named function's, whose arguments stream as the model writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.openai_structured import ToolCalling, new_tool_call_id



@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: Optional[str]
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """One model family's tool-call syntax."""

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def held_from(self, text: str, sent: int = 0) -> int:
        """Where in the text so far a tool call may be starting: content before it may stream.
        `sent`: how much of the text already went out as content (no call starts before it)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Parsed:
        start = text.find(self.START)
        if start < 0:
            return Parsed(text)
        calls = []
        rest = text[start:]
        while rest.startswith(self.START):
            body, _, rest = rest[len(self.START):].partition(self.END)
            call = _call(body, "arguments")
            if call is None:
                return Parsed(text)  # not a well-formed call: the model said it as text
            calls.append(call)
            rest = rest.lstrip()
        content = text[:start].strip() or None
        if rest:  # text after the calls is content too
            content = f"{content}\n{rest}" if content else rest
        return Parsed(content, calls)

    def held_from(self, text: str, sent: int = 0) -> int:
        start = text.find(self.START, sent)  # from what is unsent: each chunk scans only its new text
        if start >= 0:
            return start
        # A suffix that could still grow into the start tag is held back.
        for length in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-length:]):
                return len(text) - length
        return len(text)


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return Parsed(text)
        calls = []
        decoder = json.JSONDecoder()
        index = 0
        while index < len(body):
            try:
                value, end = decoder.raw_decode(body, index)
            except json.JSONDecodeError:
                return Parsed(text)
            call = _call_of(value, "parameters")
            if call is None:
                return Parsed(text)
            calls.append(call)
            index = end
            while index < len(body) and body[index] in " \n\t;":
                index += 1
        return Parsed(None, calls)

    def held_from(self, text: str, sent: int = 0) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self.PYTHON_TAG.startswith(stripped[:len(self.PYTHON_TAG)]):
            return 0  # a reply that opens (or may open) with a call is held whole
        return len(text)


def _call(body: str, arguments_key: str) -> Optional[ParsedCall]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of(value, arguments_key)


def _call_of(value: Any, arguments_key: str) -> Optional[ParsedCall]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ParsedCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def make_tool_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(PARSERS)}") from None


def parse_required_calls(text: str) -> Optional[list[ParsedCall]]:
    """`tool_choice: required`'s output, a JSON array of {name, arguments}; None when cut short."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call_of(value, "arguments") for value in values] if isinstance(values, list) else [None]
    return None if any(call is None for call in calls) else calls


def tool_call_json(call: ParsedCall, index: Optional[int] = None, call_id: Optional[str] = None) -> dict[str, Any]:
    body = {"id": call_id or new_tool_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def _calls_finish_reason(finish_reason: Optional[str]) -> Optional[str]:
    """A reply that ends in tool calls finishes with `tool_calls`, unless max_tokens cut it."""
    return "tool_calls" if finish_reason not in (None, "length") else finish_reason


class ToolCallOutput:
    """One chat choice's text as the assistant's content and tool calls."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.parser = make_tool_parser(calling.parser) if calling.mode == "auto" else None
        self.text = ""
        self._sent = 0  # characters of text already out as content
        self._named_id: Optional[str] = None

    # ---- whole responses ------------------------------------------------------------------
    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """The assistant message and the finish reason: `tool_calls` when calls came out whole."""
        content, calls = self._parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
            return message, _calls_finish_reason(finish_reason)
        return message, finish_reason

    def _parse(self, text: str) -> tuple[Optional[str], list[ParsedCall]]:
        mode = self.calling.mode
        if mode == "named":  # the arguments as written (cut short where max_tokens ended them)
            return None, [ParsedCall(self.calling.function_name, text)]
        if mode == "required":  # cut short, they do not parse: the text comes back as content
            calls = parse_required_calls(text)
            return (None, calls) if calls else (text, [])
        parsed = self.parser.parse(text)
        return parsed.content, parsed.calls

    # ---- streaming ------------------------------------------------------------------------
    def feed(self, text: str, finish_reason: Optional[str]) -> tuple[str, list[dict[str, Any]], Optional[str]]:
        """One engine delta in: the content to stream now, the tool-call deltas, the finish reason."""
        self.text += text
        if self.calling.mode == "named":
            return "", self._named_delta(text), _calls_finish_reason(finish_reason)
        if finish_reason is None:
            if self.parser is None:  # required: the calls are one JSON array, sent once whole
                return "", [], None
            held = self.parser.held_from(self.text, self._sent)
            content, self._sent = self.text[self._sent:held], max(self._sent, held)
            return content, [], None
        _, calls = self._parse(self.text)
        if not calls:
            rest, self._sent = self.text[self._sent:], len(self.text)
            return rest, [], finish_reason
        # Content before the calls that has not gone out yet goes now.
        held = self.parser.held_from(self.text, self._sent) if self.parser is not None else 0
        unsent = self.text[self._sent:held].rstrip() if held > self._sent else ""
        return unsent, [tool_call_json(call, index) for index, call in enumerate(calls)], _calls_finish_reason(finish_reason)

    def _named_delta(self, text: str) -> list[dict[str, Any]]:
        if self._named_id is None:
            self._named_id = new_tool_call_id()
            return [{"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.calling.function_name, "arguments": text}}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []
