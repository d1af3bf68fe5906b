"""Tool calls out of a chat completion's text without a cluster: each parser finds the calls
of its model family (and leaves text that only looks like one as content), streamed deltas
hold back what may be a call, name each call on its first delta and stream its arguments as
written, and, however the reply is cut, assemble into the whole response's message; and the
request side turns tool_choice into the schema the output must match."""

from __future__ import annotations

import json
from typing import Optional

import pytest
from hypothesis import given, settings, strategies as st

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


@pytest.mark.parametrize("parser, text", [
    # a markdown-minded escape JSON lacks, and a raw tab: a name that is no JSON string
    ("hermes", '<tool_call>{"name": "get\\_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    ("llama3_json", '{"name": "get\tweather", "parameters": {}}'),
])
@pytest.mark.parametrize("piece", [1, 1000])
def test_a_call_named_by_no_json_string_is_content_not_a_server_error(parser, text, piece):
    calling = _calling("auto", parser)
    assert whole(calling, text) == (text, [], "stop")
    content, calls, _ = assemble(calling, [text[start:start + piece] for start in range(0, len(text), piece)])
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("text, arguments", [
    # Half a surrogate pair has no UTF-8 form: decoded, no response body could carry it.
    ('<tool_call>{"arguments": {"s": "\\ud83d"}, "name": "f"}</tool_call>', '{"s": "\\ud83d"}'),
    ('<tool_call>{"arguments": "\\ud83d", "name": "f"}</tool_call>', None),
    ('<tool_call>{"name": "f\\ud83d", "arguments": {}}</tool_call>', None),
])
def test_half_a_surrogate_pair_in_a_call_never_reaches_the_response_undecodable(text, arguments):
    calling = _calling("auto", "hermes")
    message, _ = ToolCallOutput(calling).message(text, "stop")
    json.dumps(message, ensure_ascii=False).encode("utf-8")  # what the HTTP response renders
    if arguments is None:  # no call: its text is content, as in the stream
        assert message["content"] == text and "tool_calls" not in message
    else:
        (call,) = message["tool_calls"]
        assert call["function"]["arguments"] == arguments
    content, calls, _ = assemble(calling, list(text))
    assert (content or None, [call["arguments"] for call in calls]) == (
        message["content"], [call["function"]["arguments"] for call in message.get("tool_calls", [])])


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_a_quoted_start_tag_is_content_and_the_real_call_after_it_is_read(piece):
    """Prose quoting `<tool_call>` opened a 'call' that was read up to the next end tag: the real
    call after it was swallowed into content (helper-42's fuzzing)."""
    text = 'Use the literal "<tool_call>" tag. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    calling = _calling("auto", "hermes")
    expected = ('Use the literal "<tool_call>" tag.', [{"name": "get_time", "arguments": "{}"}], "tool_calls")
    assert whole(calling, text) == expected
    content, calls, reasons = assemble(calling, [text[start:start + piece] for start in range(0, len(text), piece)])
    assert (content, [{key: call[key] for key in ("name", "arguments")} for call in calls], reasons[-1]) == expected


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_text_after_the_calls_object_inside_its_tags_is_content_not_lost(piece):
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '{"name": "get_time", "arguments": {}}</tool_call>')
    calling = _calling("auto", "hermes")
    expected = ('{"name": "get_time", "arguments": {}}', [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
                "tool_calls")
    assert whole(calling, text) == expected
    content, calls, reasons = assemble(calling, [text[start:start + piece] for start in range(0, len(text), piece)])
    assert (content, [{key: call[key] for key in ("name", "arguments")} for call in calls], reasons[-1]) == expected


def test_llama3_json_takes_an_object_naming_no_arguments_as_an_answer_not_a_call():
    """Without tags, `{"name": "Bob", "age": 42}` was a call to `Bob` with arguments {}."""
    answer = '{"name": "Bob", "age": 42, "city": "Paris"}'
    assert whole(_calling("auto", "llama3_json"), answer) == (answer, [], "stop")
    parsed = Llama3JsonToolParser().parse('{"name": "get_time", "parameters": {}}')
    assert [(call.name, call.arguments) for call in parsed.calls] == [("get_time", "{}")]


def test_arguments_holding_nan_are_no_call_to_make():
    """Python's json reads NaN and Infinity; a client's JSON.parse does not: finish stop, as
    for any arguments that do not parse."""
    _, calls, reason = whole(_calling("auto", "hermes"), '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>')
    assert [call["name"] for call in calls] == ["f"] and reason == "stop"


def test_echo_opens_a_tool_calling_replys_content_whole_as_streamed():
    """With tools the whole response rebuilt the message from the reply alone, dropping the
    echoed text the stream's first chunk sent."""
    from cluster.openai_responses import ChoiceResult, CompletionBodies, TokenText
    from replica.core.outputs import RequestOutput

    bodies = CompletionBodies("chat", "id", "m", TokenText(lambda ids: "x"), None, ["Partial answer: "],
                              ToolCalling("auto", parser="hermes"))
    result = ChoiceResult(0, 0)
    result.add(RequestOutput("r", [1], "It is sunny.", "stop", 3, 1, 0, None))
    assert bodies.response([result], [result])["choices"][0]["message"]["content"] == "Partial answer: It is sunny."
    assert bodies.first_chunks([(0, 0)])[0]["choices"][0]["delta"]["content"] == "Partial answer: "


def test_llama3_json_reads_calls_separated_by_semicolons_after_the_python_tag():
    parsed = Llama3JsonToolParser().parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", '
                                          '"parameters": {}}')
    assert parsed.content is None
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [("a", {"x": 1}), ("b", {})]


REPLIES = [  # (mode, parser, reply), whole replies the streams below are cut from
    ("auto", "hermes", HERMES_REPLY),
    ("auto", "hermes", "plain answer, <tool_ no call after all"),
    ("auto", "hermes", "<tool_call> {not json} </tool_call> then text"),
    ("auto", "hermes", 'A <tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>\nB <tool_call>\n'
                       '{"arguments": {"x": 1}, "name": "g"}</tool_call> <tool_call>{"name": "h", "arguments": '
                       '{"s": "a } ] \\" {", "n": [1, {"m": null}]}}</tool_call>'),
    ("auto", "hermes", 'cut <tool_call>{"name": "f", "arguments": {"city": "Par'),
    ("auto", "llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("auto", "llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "parameters": {}}'),
    ("auto", "llama3_json", "It is noon."),
    ("required", None, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'),
    ("required", None, '[{"name": "f", "argu'),
]


def assemble(calling: ToolCalling, pieces: list[str], finish_reason: str = "stop") -> tuple[str, list[dict], list]:
    """A streamed choice as the openai client assembles it: content, calls, finish reasons;
    checking each delta's shape on the way (a call's first delta names it, later ones carry
    argument text only, calls are numbered 0, 1, ... in order)."""
    stream = ToolCallOutput(calling)
    content, calls, reasons = "", [], []
    for number, piece in enumerate(pieces):
        delta_content, deltas, reason = stream.feed(piece, finish_reason if number == len(pieces) - 1 else None)
        content += delta_content
        reasons.append(reason)
        for delta in deltas:
            if delta["index"] == len(calls):
                assert delta["id"].startswith("call_") and delta["type"] == "function" and delta["function"]["name"]
                calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
            else:
                assert delta["index"] == len(calls) - 1 and set(delta) == {"index", "function"}
                assert set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    assert stream.decided == len(stream.text), "at the end every character is settled"
    return content, calls, reasons


def whole(calling: ToolCalling, text: str, finish_reason: str = "stop") -> tuple[Optional[str], list[dict], str]:
    message, reason = ToolCallOutput(calling).message(text, finish_reason)
    calls = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
             for call in message.get("tool_calls", [])]
    return message["content"], calls, reason


def _calling(mode: str, parser: Optional[str]) -> ToolCalling:
    return ToolCalling(mode, parser=parser)


@pytest.mark.parametrize("mode, parser, text", REPLIES)
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_deltas_assemble_into_the_whole_message(mode, parser, text, piece):
    calling = _calling(mode, parser)
    content, calls, reason = whole(calling, text)
    pieces = [text[start:start + piece] for start in range(0, len(text), piece)]
    streamed_content, streamed_calls, reasons = assemble(calling, pieces)
    assert [{"name": call["name"], "arguments": call["arguments"]} for call in streamed_calls] == calls
    assert streamed_content == (content or "")
    assert reasons[-1] == reason and all(reason is None for reason in reasons[:-1])


@settings(max_examples=60, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_every_chunking_of_a_reply_assembles_into_the_same_message(reply, cuts):
    mode, parser, text = reply
    calling = _calling(mode, parser)
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:])] or [""]
    content, calls, reason = whole(calling, text)
    streamed_content, streamed_calls, reasons = assemble(calling, pieces)
    assert [{"name": call["name"], "arguments": call["arguments"]} for call in streamed_calls] == calls
    assert streamed_content == (content or "") and reasons[-1] == reason


def test_a_call_streams_as_it_is_written_name_first_then_argument_fragments():
    stream = ToolCallOutput(ToolCalling("auto", parser="hermes"))
    assert stream.feed("Sure. <tool_call>\n{\"name\": \"get_weather\", ", None) == ("Sure.", [], None)
    _, (first,), _ = stream.feed('"arguments": {"city": "Pa', None)
    assert first["index"] == 0 and first["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    assert stream.feed('ris"}}\n</tool', None)[1] == [{"index": 0, "function": {"arguments": 'ris"}'}}]
    _, (second,), _ = stream.feed('_call>\n<tool_call>{"name": "get_time", "arguments": {', None)
    assert second["index"] == 1 and second["id"] != first["id"] and second["function"]["name"] == "get_time"
    assert stream.feed('}}</tool_call>', "stop") == ("", [{"index": 1, "function": {"arguments": "}"}}], "tool_calls")


def test_parallel_tool_calls_false_returns_the_first_call_alone_whole_and_streamed():
    """`auto` reads what the model wrote: two calls under parallel_tool_calls false (a QA pass
    got both back) come back as the first, whole and streamed alike."""
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    single = ToolCalling("auto", parser="hermes", single_call=True)
    assert whole(single, text) == (None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}], "tool_calls")
    assert len(whole(ToolCalling("auto", parser="hermes"), text)[1]) == 2
    content, calls, reasons = assemble(single, [text[start:start + 5] for start in range(0, len(text), 5)])
    assert [call["name"] for call in calls] == ["get_weather"] and reasons[-1] == "tool_calls"


def test_required_calls_stream_as_the_grammar_writes_them():
    stream = ToolCallOutput(ToolCalling("required"))
    assert stream.feed('[{"name": "f", "arguments": {"a"', None)[1][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert stream.feed(': 1}}]', "stop") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}], "tool_calls")


def test_a_call_cut_by_max_tokens_keeps_the_arguments_written_and_finishes_with_length():
    assert whole(ToolCalling("required"), '[{"name": "f", "arguments": {"a": [1', "length") == (
        None, [{"name": "f", "arguments": '{"a": [1'}], "length")


@pytest.mark.parametrize("calling, text", [
    (ToolCalling("required"), '[{"name": "f", "arguments": {"'),
    (ToolCalling("named", function_name="f"), '{"city": "Pa'),
    (ToolCalling("auto", parser="hermes"), '<tool_call>{"name": "f", "arguments": {"a": '),
])
@pytest.mark.parametrize("piece", [1, 1000])
def test_a_call_cut_by_a_stop_string_finishes_with_stop_not_tool_calls(calling, text, piece):
    """A stop string (or stop token) that ends the reply mid-arguments leaves no call to make:
    finish_reason stays `stop` (it said `tool_calls` with arguments `{"`), streamed and whole."""
    _, calls, reason = whole(calling, text, "stop")
    assert calls and reason == "stop"
    _, streamed_calls, reasons = assemble(calling, [text[start:start + piece] for start in range(0, len(text), piece)])
    assert [call["arguments"] for call in streamed_calls] == [call["arguments"] for call in calls]
    assert reasons[-1] == "stop"
    # The same call closed finishes with tool_calls, but a named function's forced call with
    # stop, as OpenAI's API and vLLM finish it.
    closed = {"required": text + '": 1}}]', "named": text + 'ris"}', "auto": text + "1}}</tool_call>"}[calling.mode]
    assert whole(calling, closed, "stop")[2] == ("stop" if calling.mode == "named" else "tool_calls")
    assert assemble(calling, [closed])[2][-1] == whole(calling, closed, "stop")[2]


def test_a_reply_nested_past_jsons_recursion_limit_is_parsed_without_raising():
    """Python's json raises RecursionError (no JSONDecodeError) near 1,000 levels: a reply
    nested 3,000 deep ended the response in a server error. Arguments first, it is no call;
    name first, the call streams as written but, its arguments past what parses, finishes
    with stop, not tool_calls."""
    deep = "[" * 3000 + "]" * 3000
    calling = ToolCalling("auto", parser="hermes")
    text = '<tool_call>{"arguments": ' + deep + ', "name": "f"}</tool_call>'
    assert whole(calling, text) == (text, [], "stop")
    content, calls, reason = whole(calling, '<tool_call>{"name": "f", "arguments": ' + deep + '}</tool_call>')
    assert [call["arguments"] for call in calls] == [deep] and reason == "stop"


def test_required_output_cut_by_max_tokens_is_content_with_finish_reason_length():
    message, finish_reason = ToolCallOutput(ToolCalling("required")).message('[{"name": "f", "argu', "length")
    assert message == {"role": "assistant", "content": '[{"name": "f", "argu'} and finish_reason == "length"


def test_tools_reach_the_template_in_hugging_faces_form_under_none_too_which_reads_no_calls():
    # As OpenAI's API and vLLM by default: "none" keeps the tools in context (they dropped out
    # of the prompt here), and the reply is content, never parsed for calls nor constrained.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    request = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert request.template_tools() == [tool]
    request = parse_body(json.dumps({**body, "tool_choice": "none"}).encode(), ChatCompletionRequest)
    assert request.template_tools() == [tool] and request.output_constraint() is None
    assert request.tool_calling("hermes") is None and request.tool_parameter_schemas() == []
    no_tools = parse_body(json.dumps({k: v for k, v in body.items() if k != "tools"}).encode(), ChatCompletionRequest)
    assert no_tools.template_tools() is None


@pytest.mark.parametrize("tool_choice", [None, "auto", "required", {"type": "function", "function": {"name": "g"}}])
def test_each_offered_tools_parameters_are_checked_under_its_own_name(tool_choice):
    """The ingress compiles each offered tool's parameters schema on its own, so a bad one is
    refused as tools[i].function.parameters, under `auto` too (it went to the template
    unchecked), not as the `tools` / `tool_choice` schema built from all of them."""
    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
                 "a": {"type": "frobnicate"}}}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            **({"tool_choice": tool_choice} if tool_choice else {})}
    request = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    schemas = request.tool_parameter_schemas()
    assert [schema.param for schema in schemas] == ["tools[0].function.parameters", "tools[1].function.parameters"]
    # Closed to the listed properties (closed_schema): a function without parameters takes {} only.
    assert json.loads(schemas[0].constraint.spec) == {"type": "object", "properties": {}, "additionalProperties": False}
    assert json.loads(schemas[1].constraint.spec) == {**tools[1]["function"]["parameters"], "additionalProperties": False}
    none = parse_body(json.dumps({**body, "tool_choice": "none"}).encode(), ChatCompletionRequest)
    assert none.tool_parameter_schemas() == []


def test_the_configs_parser_names_are_the_parsers_implemented():
    from cluster.config import TOOL_CALL_PARSERS
    from cluster.tool_parsers import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


def _stream_logprobs(text_pieces: list[str]) -> tuple[list[dict], list[float], list[float]]:
    """A hermes-parsed chat choice streamed one token per piece, token i with logprob -i: the
    chunks sent, the logprobs they carried in order, and the whole response's."""
    from cluster.openai_responses import ChoiceResult, CompletionBodies, TokenText
    from replica.core.outputs import RequestOutput

    def output(number: int, piece: str) -> RequestOutput:
        finish = "stop" if number == len(text_pieces) - 1 else None
        return RequestOutput("r", [number], piece, finish, 3, number + 1, 0, [-float(number)])

    def make_bodies() -> CompletionBodies:
        return CompletionBodies("chat", "id", "m", TokenText(lambda ids: str(ids[0])), 0, [""],
                                ToolCalling("auto", parser="hermes"))

    stream = make_bodies()
    sent = [body for number, piece in enumerate(text_pieces)
            if (body := stream.chunk(0, 0, output(number, piece))) is not None]
    streamed = [entry["logprob"] for body in sent for entry in body["choices"][0]["logprobs"]["content"]]
    result = ChoiceResult(0, 0)
    for number, piece in enumerate(text_pieces):
        result.add(output(number, piece))
    response = make_bodies().response([result], [result])
    return sent, streamed, [entry["logprob"] for entry in response["choices"][0]["logprobs"]["content"]]


def test_text_held_back_as_a_possible_call_keeps_its_logprobs_when_released_as_content():
    sent, streamed, whole_logprobs = _stream_logprobs(["Hi", " <", "tool", " no", "pe."])
    assert streamed == whole_logprobs == [0.0, -1.0, -2.0, -3.0, -4.0]
    # " <" and "tool" were held (a call may have been starting): their logprobs went out with
    # the text once it was released, never before it.
    contents = [(body["choices"][0]["delta"].get("content"),
                 [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]) for body in sent]
    assert contents == [("Hi", [0.0]), (" <tool no", [-1.0, -2.0, -3.0]), ("pe.", [-4.0])]


def test_a_calls_tokens_carry_their_logprobs_in_its_deltas_as_vllm_sends_them():
    pieces = ["Ok", " <tool_call>", '{"name": "f", ', '"arguments": {"a"', ": 1}}", "</tool_call>"]
    sent, streamed, whole_logprobs = _stream_logprobs(pieces)
    assert streamed == whole_logprobs == [-float(number) for number in range(len(pieces))]
    call_chunks = [body["choices"][0] for body in sent if body["choices"][0]["delta"].get("tool_calls")]
    assert [[entry["logprob"] for entry in choice["logprobs"]["content"]] for choice in call_chunks] == [
        [-1.0, -2.0, -3.0], [-4.0]]
    assert sent[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_an_empty_reply_offered_tools_has_empty_content_as_without_tools():
    for calling in (ToolCalling("auto", parser="hermes"), ToolCalling("auto", parser="llama3_json")):
        message, reason = ToolCallOutput(calling).message("", "stop")
        assert message == {"role": "assistant", "content": ""} and reason == "stop"
