"""Tool calls out of a chat completion's text without a cluster: each parser finds the calls
of its model family (and leaves text that only looks like one as content), streamed deltas
hold back what may be a call and, concatenated, equal the whole response's calls, and the
request side turns tool_choice into the schema the output must match."""

from __future__ import annotations

import json

import pytest

from cluster.openai_api import ChatCompletionRequest, parse_body
from cluster.openai_structured import ToolCalling
from cluster.tool_parsers import HermesToolParser, Llama3JsonToolParser, ToolCallOutput

HERMES_REPLY = ('Let me look that up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def test_hermes_finds_every_call_and_the_content_before_them():
    parsed = HermesToolParser().parse(HERMES_REPLY)
    assert parsed.content == "Let me look that up."
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("text", ["no call here", "<tool_call> {not json} </tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_text_that_is_no_well_formed_call_stays_content(text):
    for parser in (HermesToolParser(), Llama3JsonToolParser()):
        parsed = parser.parse(text)
        assert parsed.content == text and not parsed.calls


def test_llama3_json_reads_calls_separated_by_semicolons_after_the_python_tag():
    parsed = Llama3JsonToolParser().parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", '
                                          '"parameters": {}}')
    assert parsed.content is None
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [("a", {"x": 1}), ("b", {})]


@pytest.mark.parametrize("parser, text", [("hermes", HERMES_REPLY),
                                          ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
                                          ("hermes", "plain answer, <tool_ no call after all")])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_auto_deltas_hold_back_a_call_and_assemble_into_the_whole_message(parser, text, piece):
    calling = ToolCalling("auto", parser=parser)
    message, finish_reason = ToolCallOutput(calling).message(text, "stop")
    stream = ToolCallOutput(calling)
    content, calls, reasons = "", {}, []
    pieces = [text[start:start + piece] for start in range(0, len(text), piece)]
    for index, delta_text in enumerate(pieces):
        delta_content, deltas, reason = stream.feed(delta_text, "stop" if index == len(pieces) - 1 else None)
        content += delta_content
        reasons.append(reason)
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"].get("arguments", "")
        assert "<tool_call>" not in content and "{" not in content.lstrip()[:1], "a call leaked out as content"
    assert reasons[-1] == finish_reason and all(reason is None for reason in reasons[:-1])
    expected = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                for call in message.get("tool_calls", [])]
    assert [calls[index] for index in sorted(calls)] == expected
    assert content.strip() == (message["content"] or "").strip()


def test_named_function_arguments_stream_as_the_model_writes_them():
    stream = ToolCallOutput(ToolCalling("named", function_name="f"))
    first = stream.feed('{"a"', None)
    last = stream.feed(': 1}', "stop")
    assert first[1][0]["id"].startswith("call_") and first[1][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert last == ("", [{"index": 0, "function": {"arguments": ": 1}"}}], "tool_calls")


def test_required_output_cut_by_max_tokens_is_content_with_finish_reason_length():
    message, finish_reason = ToolCallOutput(ToolCalling("required")).message('[{"name": "f", "argu', "length")
    assert message == {"role": "assistant", "content": '[{"name": "f", "argu'} and finish_reason == "length"


def test_tools_reach_the_template_in_hugging_faces_form_and_none_offers_none():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    request = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert request.template_tools() == [tool]
    request = parse_body(json.dumps({**body, "tool_choice": "none"}).encode(), ChatCompletionRequest)
    assert request.template_tools() is None and request.output_constraint() is None


def test_the_configs_parser_names_are_the_parsers_implemented():
    from cluster.config import TOOL_CALL_PARSERS
    from cluster.tool_parsers import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
