"""The OpenAI wire format without a cluster: bodies parse with errors that name the parameter,
what cannot be honoured is refused by name, choices get vLLM's seeds, streams never carry an
empty delta mid-stream, logprobs take each API's shape and best_of keeps the likeliest."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest
from fastapi.responses import StreamingResponse
from ray.exceptions import TaskCancelledError

from cluster.openai_api import (
    ChatCompletionRequest, CompletionRequest, OpenAIError, choice_sampling_params, parse_body,
)
from cluster.openai_responses import ChoiceResult, CompletionBodies, TokenText, best_choices, usage
from cluster.serve_logging import ClientErrorLogFilter, DisconnectWhenReceiveIsCancelled
from replica.core.outputs import RequestOutput, TopLogprobs
from replica.core.structured_output import StructuredOutput
from replica.errors import InvalidRequestError


def parsed(model, **fields):
    return parse_body(json.dumps({"model": "m", **fields}).encode(), model)


def refused(model, raw: bytes) -> OpenAIError:
    with pytest.raises(OpenAIError) as raised:
        parse_body(raw, model)
    return raised.value


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "hi", "stop": 123}, "stop"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "seed": 2 ** 63}, "seed"),  # vLLM's range: 2**64 - 1 seeded what -1 seeds
])
def test_completion_body_errors_name_the_parameter_not_a_pydantic_location(fields, param):
    error = refused(CompletionRequest, json.dumps({"model": "m", **fields}).encode())
    assert error.status == 400 and error.body["error"]["param"] == param
    assert error.body["error"]["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("model, fields, param, says", [
    (CompletionRequest, {"prompt": "hi", "guided_json": 5}, "guided_json", "a valid dictionary"),
    (CompletionRequest, {"prompt": "hi", "guided_json": 1}, "guided_json", "a valid boolean"),  # 1 is no schema
    (CompletionRequest, {"prompt": "hi", "structured_outputs": {"json": [1]}}, "structured_outputs.json", "dictionary"),
    (CompletionRequest, {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": "object"}}}, "response_format.json_schema.schema", "a valid dictionary"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"},
     "tool_choice", "'none', 'auto' or 'required'"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function"}},
     "tool_choice.function", "Field required"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                             "tool_choice": {"type": "function", "function": {"name": 5}}},
     "tool_choice.function.name", "a valid string"),
])
def test_a_union_fields_error_names_the_parameter_not_the_member_type(model, fields, param, says):
    """A field that takes one of several types failed in each; the error named pydantic's member
    (`guided_json.str`, `response_format.json_schema.schema.dict[str,any]`,
    `tool_choice.literal['none','auto','required']`), a parameter no body has."""
    error = refused(model, json.dumps({"model": "m", **fields}).encode()).body["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    assert says in error["message"], error


@pytest.mark.parametrize("model, fields, param", [
    (CompletionRequest, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (CompletionRequest, {"prompt": "hi", "temperature": False}, "temperature"),
    (CompletionRequest, {"prompt": "hi", "stop_token_ids": [2, True]}, "stop_token_ids[1]"),
    (CompletionRequest, {"prompt": "hi", "logit_bias": {"5": True}}, "logit_bias.5"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": True},
     "top_logprobs"),
])
def test_a_boolean_for_a_number_is_400_naming_it_not_read_as_one(model, fields, param):
    """pydantic's lax mode read `"max_tokens": true` as 1 (OpenAI's API refuses it); a numeric
    string still reads as its number, as vLLM's server takes it."""
    error = refused(model, json.dumps({"model": "m", **fields}).encode())
    assert error.status == 400 and error.body["error"]["param"] == param
    assert error.body["error"]["message"] == f"{param}: Input should be a number, not the boolean " + (
        "false" if fields.get("temperature") is False else "true")
    assert parsed(CompletionRequest, prompt="hi", max_tokens="5").max_tokens == 5


CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("model, fields, param", [
    (CompletionRequest, {"prompt": "hi", "stream": "yes"}, "stream"),
    (CompletionRequest, {"prompt": "hi", "echo": 1}, "echo"),
    (ChatCompletionRequest, {**CHAT, "logprobs": "true"}, "logprobs"),
    (CompletionRequest, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "strict": "no"}}}, "response_format.json_schema.strict"),
    (CompletionRequest, {"prompt": "hi", "structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
    (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": "false"}}]},
     "tools[0].function.strict"),
])
def test_anything_but_true_or_false_for_a_boolean_is_400_naming_it(model, fields, param):
    """Lax parsing read "yes", 1 and "false" as booleans (OpenAI's API answers 400), nested too;
    completions' logprobs, a number, takes its number."""
    error = refused(model, json.dumps({"model": "m", **fields}).encode())
    assert error.status == 400 and error.body["error"]["param"] == param, error.body
    assert parsed(CompletionRequest, prompt="hi", logprobs=2).logprobs == 2


def test_chat_body_errors_name_the_message_and_field():
    body = {"model": "m", "messages": [{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}]}
    assert refused(ChatCompletionRequest, json.dumps(body).encode()).body["error"]["param"] == "messages[1].role"
    image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    error = refused(ChatCompletionRequest, json.dumps(image).encode()).body["error"]
    assert error["param"] == "messages[0].content" and "text parts only" in error["message"]


def test_malformed_and_non_utf8_bodies_are_400_about_the_body():
    assert refused(CompletionRequest, b'{"model": "m", "prompt":').body["error"]["message"].startswith(
        "body: invalid JSON at line 1")
    assert refused(CompletionRequest, b'{"model": "\xff"}').body["error"]["message"].startswith("body: not UTF-8")
    assert refused(CompletionRequest, b"[1]").body["error"]["param"] is None


def test_json_nested_too_deep_is_400_where_it_enters_and_a_deep_tool_history_renders_as_text():
    """Python's json raises RecursionError near 1,000 levels (no JSONDecodeError: it was a 500),
    and what reads a deep document after it recurses too: a body is refused past 64 levels,
    as is a schema given as text; a history call's arguments that deep reach the template as
    the text they were, as arguments that do not parse do."""
    too_deep = "nested more than 64 levels deep"
    deep = lambda levels: "[" * levels + "]" * levels  # noqa: E731
    for levels in (65, 5_000):
        error = refused(CompletionRequest, b'{"model": "m", "prompt": ' + deep(levels).encode() + b"}").body["error"]
        assert error["message"] == f"body: {too_deep}" and error["param"] is None, error
    assert parse_body(json.dumps({"model": "m", "prompt": "hi", "guided_json": {"type": "object"}}).encode(),
                      CompletionRequest).guided_json == {"type": "object"}
    with pytest.raises(InvalidRequestError, match=f"^guided_json: {too_deep}$"):
        StructuredOutput.of("json", deep(5_000), "guided_json")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep(5_000)}}
    chat = parse_body(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]}).encode(), ChatCompletionRequest)
    assert chat.messages[1].template_message()["tool_calls"][0]["function"]["arguments"] == deep(5_000)


def test_unhonourable_parameters_are_refused_by_name_and_neutral_values_pass():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for fields, param in (({"functions": [{"name": "f"}]}, "functions"),
                          ({"function_call": "auto"}, "function_call"),
                          ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
                          ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(InvalidRequestError) as raised:
            parsed(ChatCompletionRequest, **chat, **fields).check_supported(max_choices=8)
        assert raised.value.field == param
    neutral = parsed(ChatCompletionRequest, **chat, tools=[], tool_choice="none", response_format={"type": "text"},
                     user="u", metadata={"a": "b"}, parallel_tool_calls=True)
    neutral.check_supported(max_choices=8)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for fields, param in (({"tools": [tool]}, "tools"), ({"tool_choice": "auto"}, "tool_choice")):
        with pytest.raises(InvalidRequestError, match="chat/completions") as raised:
            parsed(CompletionRequest, prompt="hi", **fields).check_supported(max_choices=8)
        assert raised.value.field == param
    parsed(CompletionRequest, prompt="hi", tools=[], tool_choice="none").check_supported(max_choices=8)


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "content": "18 C"}], "messages[2].tool_call_id"),
])
def test_a_message_missing_what_openai_requires_is_refused_by_name(messages, param):
    """A user message without content rendered as an empty turn, and a tool result without
    tool_call_id reached the template unattributed; OpenAI's API answers 400 to both. An
    assistant turn of tool calls alone stays valid."""
    with pytest.raises(InvalidRequestError) as raised:
        parsed(ChatCompletionRequest, messages=messages).check_supported(max_choices=8)
    assert raised.value.field == param
    messages[-1] = {**messages[-1], "content": "x", "tool_call_id": "c"}
    if messages[0].get("content") is None:
        messages[0]["content"] = "x"
    parsed(ChatCompletionRequest, messages=messages).check_supported(max_choices=8)


def test_null_for_a_field_whose_null_means_nothing_else_is_its_default():
    """OpenAI's reference marks stream, echo and logprobs nullable and vLLM takes them as
    Optional: `"stream": null` was a 400. A null max_tokens keeps its own meaning."""
    completion = parsed(CompletionRequest, prompt="hi", stream=None, echo=None, stop_token_ids=None, ignore_eos=None,
                        include_stop_str_in_output=None, add_special_tokens=None, max_tokens=None)
    assert (completion.stream, completion.echo, completion.stop_token_ids, completion.ignore_eos) == (False, False, [], False)
    assert completion.add_special_tokens is True and completion.max_tokens is None
    chat = parsed(ChatCompletionRequest, messages=[{"role": "user", "content": "hi"}], logprobs=None, echo=None)
    assert chat.logprobs is False and chat.echo is False
    assert refused(ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                      "stream": "yes"}).encode()).body["error"]["param"] == "stream"


def test_list_of_parts_content_is_its_text_parts_joined():
    request = parsed(ChatCompletionRequest, messages=[{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}])
    assert request.messages[0].text == "one\ntwo"


def test_a_developer_message_reaches_the_template_as_the_system_message():
    # Templates know "system" only; Qwen2.5's dropped the developer's instructions silently.
    request = parsed(ChatCompletionRequest, messages=[{"role": "developer", "content": "Be brief."},
                                                      {"role": "user", "content": "hi"}])
    assert [message.template_message()["role"] for message in request.messages] == ["system", "user"]


def test_batched_prompts_and_best_of_rules():
    assert parsed(CompletionRequest, prompt=["a", "b"]).prompts == ["a", "b"]
    assert parsed(CompletionRequest, prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    assert parsed(CompletionRequest, prompt=[1, 2]).prompts == [[1, 2]]
    for fields, param in (({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
                          ({"n": 9}, "n"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):
        with pytest.raises(InvalidRequestError) as raised:
            parsed(CompletionRequest, prompt="p", **fields).check_supported(max_choices=8)
        assert raised.value.field == param


def test_each_choice_gets_vllms_seed_and_best_of_candidates_their_logprobs():
    request = parsed(CompletionRequest, prompt="p", seed=10, n=1, best_of=3)
    base = request.base_sampling_params(max_tokens=4, num_logprobs=request.num_logprobs)
    assert base.logprobs  # ranking candidates needs them, asked for or not
    assert [choice_sampling_params(base, index).seed for index in range(3)] == [10, 11, 12]
    unseeded = parsed(CompletionRequest, prompt="p", n=2).base_sampling_params(4, None)
    assert choice_sampling_params(unseeded, 1) is unseeded and not unseeded.logprobs


def chunk(text: str, token_ids: list[int], finish: str | None = None, logprobs=None, top=None) -> RequestOutput:
    return RequestOutput("r", token_ids, text, finish, 3, len(token_ids), 0, logprobs, top,
                         "STOP" if finish == "stop" else None)


def bodies(kind: str, num_logprobs=None, echo=("",)) -> CompletionBodies:
    return CompletionBodies(kind, "id", "m", TokenText(lambda ids: "".join(chr(65 + i) for i in ids)),
                            num_logprobs, list(echo))


def test_chat_stream_never_sends_an_empty_delta_mid_stream_and_keeps_held_tokens_logprobs():
    stream = bodies("chat", num_logprobs=0)
    assert stream.chunk(0, 0, chunk("", [1], logprobs=[-1.0])) is None  # text held back
    sent = stream.chunk(0, 0, chunk("BC", [2], logprobs=[-2.0]))
    assert sent["choices"][0]["delta"] == {"content": "BC"}
    assert [entry["token"] for entry in sent["choices"][0]["logprobs"]["content"]] == ["B", "C"]
    last = stream.chunk(0, 0, chunk("", [3], "stop", logprobs=[-3.0]))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["stop_reason"] == "STOP"


def test_a_chat_stream_opens_with_its_first_token_not_before_it():
    """The role chunk (and echoed text) waits for the first engine output, as vLLM's does: sent
    when the response started, it was what a client timed as the first token (~0 s); an error
    before any output is the stream's only event."""
    from cluster.ingress import _sse_stream
    from cluster.openai_api import Choice
    from replica.core.request import SamplingParams

    async def run(outputs, fail: bool = False) -> list[str]:
        first_token = asyncio.Event()
        choice = Choice(0, 0, [1], SamplingParams(max_tokens=2))

        async def engine():
            await first_token.wait()
            if fail:
                raise InvalidRequestError("prompt", "gone")
            for output in outputs:
                yield choice, output

        events: list[str] = []

        async def consume():
            async for event in _sse_stream(engine(), bodies("chat", echo=("Sure: ",)), [choice], False, {}):
                events.append(event)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        assert events == []  # nothing while the first token is not out
        first_token.set()
        await task
        return events

    events = asyncio.run(run([chunk("B", [1]), chunk("C", [2], "length")]))
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Sure: "}
    assert [payload["choices"][0]["delta"].get("content") for payload in payloads[1:]] == ["B", "C"]
    assert events[-1].strip() == "data: [DONE]"
    failed = asyncio.run(run([], fail=True))
    assert len(failed) == 2 and "gone" in failed[0] and "role" not in failed[0]


def test_completion_logprobs_have_tokens_offsets_and_top_dicts_with_the_sampled_token():
    result = ChoiceResult(0, 0)
    result.add(chunk("BD", [1, 3], "length", logprobs=[-0.5, -2.0],
                     top=[TopLogprobs([1, 2], [-0.5, -1.0]), TopLogprobs([2, 4], [-0.1, -1.5])]))
    body = bodies("completion", num_logprobs=2, echo=("xy",)).response([result], [result])
    choice = body["choices"][0]
    assert choice["text"] == "xyBD"
    assert choice["logprobs"]["tokens"] == ["B", "D"] and choice["logprobs"]["text_offset"] == [2, 3]
    assert choice["logprobs"]["top_logprobs"][1] == {"C": -0.1, "E": -1.5, "D": -2.0}  # top 2 and the sampled


def test_chat_logprobs_bytes_are_each_tokens_own_bytes_so_a_client_rebuilds_the_text():
    """é in two byte-level tokens: each decoded alone is U+FFFD, and its three bytes were sent
    as each token's `bytes`, so joining them gave "\ufffd\ufffd" where the content is "é"."""
    from replica.model.registry import resolve_model_path
    from replica.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model_path("builtin"))
    token_ids = tokenizer.encode("é", add_special_tokens=False)
    result = ChoiceResult(0, 0)
    result.add(chunk("é", token_ids, "length", logprobs=[-0.5] * len(token_ids)))
    token_text = TokenText(lambda ids: tokenizer.decode(ids, skip_special_tokens=False), tokenizer.token_bytes)
    body = CompletionBodies("chat", "id", "m", token_text, 0, [""]).response([result], [result])
    entries = body["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in entries] == ["\ufffd", "\ufffd"]
    assert bytes(byte for entry in entries for byte in entry["bytes"]).decode() == body["choices"][0]["message"]["content"]


def test_best_of_keeps_the_n_candidates_with_the_highest_cumulative_logprob_per_prompt():
    results = []
    for index, (prompt_index, logprob) in enumerate([(0, -3.0), (0, -1.0), (1, -5.0), (1, -4.0)]):
        result = ChoiceResult(index, prompt_index)
        result.add(chunk("x", [1], "length", logprobs=[logprob]))
        results.append(result)
    chosen = best_choices(results, num_candidates=2, n=1)
    assert [(result.index, result.cumulative_logprob) for result in chosen] == [(0, -1.0), (1, -4.0)]
    assert usage(results)["completion_tokens"] == 4  # every candidate generated


def test_client_errors_through_serve_log_one_line():
    record = logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", None,
                               (InvalidRequestError, InvalidRequestError("max_tokens", "must be >= 1"), None))
    assert ClientErrorLogFilter().filter(record)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == "request refused: InvalidRequestError: max_tokens: must be >= 1"
    proxy = logging.LogRecord("ray.serve", logging.WARNING, __file__, 1,
                              "Request failed: Traceback ...\n  File x\nray.serve.exceptions.gRPCStatusError: prompt: bad",
                              None, None)
    ClientErrorLogFilter().filter(proxy)
    assert "\n" not in proxy.getMessage() and proxy.getMessage().endswith("gRPCStatusError: prompt: bad")


def test_a_stream_whose_receive_is_cancelled_ends_as_a_disconnect_not_an_error():
    """Serve's replica sometimes reports a client that closed its stream by raising
    TaskCancelledError from `receive()`; Starlette's StreamingResponse would fail the request
    (the traceback Serve logs). Behind the middleware it is a disconnect that ends the stream."""
    closed = []

    async def endless():
        try:
            while True:
                yield "data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.append(True)

    async def app(scope, receive, send):
        await StreamingResponse(endless(), media_type="text/event-stream")(scope, receive, send)

    async def serve_one(asgi_app) -> list[dict]:
        messages = iter([{"type": "http.request", "body": b"", "more_body": False}])
        sent = []

        async def receive():
            message = next(messages, None)
            if message is not None:
                return message
            await asyncio.sleep(0.05)  # the client reads a few chunks, then leaves
            raise TaskCancelledError()

        async def send(message):
            sent.append(message)

        # Serve's scope names no spec_version, so Starlette listens for the disconnect.
        scope = {"type": "http", "asgi": {"version": "3.0"}, "method": "POST",
                 "path": "/v1/completions", "headers": []}
        await asgi_app(scope, receive, send)
        return sent

    with pytest.raises(TaskCancelledError):  # the failure the middleware exists for
        asyncio.run(serve_one(app))
    closed.clear()
    sent = asyncio.run(serve_one(DisconnectWhenReceiveIsCancelled(app)))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert sum(message.get("body", b"").startswith(b"data:") for message in sent) >= 2
    assert closed == [True]  # the generator (in the ingress: the replica's stream) was closed


class RecordingTokenizer:
    """The built-in model's tokenizer, noting the thread each encode and render ran on."""

    def __init__(self):
        from replica.model.registry import resolve_model_path
        from replica.text.tokenizer import Tokenizer

        self.real = Tokenizer.from_pretrained(resolve_model_path("builtin"))
        self.threads = []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread())
        return self.real.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, tools=None, **options):
        self.threads.append(threading.current_thread())
        return self.real.apply_chat_template(messages, tools, **options)


def ingress_methods(tokenizer):
    """An object with the ingress's methods and `tokenizer`, without Serve."""
    from cluster.ingress import Ingress
    from replica.server.request_limits import RequestLimits

    class Methods(Ingress.func_or_class):
        def __del__(self) -> None:
            pass

    ingress = object.__new__(Methods)
    ingress.tokenizer, ingress.limits = tokenizer, RequestLimits()
    return ingress


def test_a_long_batch_of_short_prompts_is_tokenized_off_the_event_loop():
    """Each prompt up to 4,096 characters was tokenized on the event loop, so a batch of them
    was too: max_num_seqs (256 by default) such prompts, a 1 MB body, held every stream for
    0.34 s. A batch longer than that in all is tokenized on a worker thread; a short one inline."""
    from replica.server.request_limits import INLINE_TOKENIZE_MAX_CHARS

    tokenizer = RecordingTokenizer()
    ingress = ingress_methods(tokenizer)
    long_batch = parsed(CompletionRequest, prompt=["word " * (INLINE_TOKENIZE_MAX_CHARS // 5)] * 16)
    token_ids = asyncio.run(ingress._prompts(long_batch))
    assert token_ids == [tokenizer.real.encode(prompt) for prompt in long_batch.prompt]
    assert len(tokenizer.threads) == 16 and threading.main_thread() not in tokenizer.threads
    tokenizer.threads.clear()
    assert asyncio.run(ingress._prompts(parsed(CompletionRequest, prompt=["a", "b"]))) == [
        tokenizer.real.encode("a"), tokenizer.real.encode("b")]
    assert tokenizer.threads == [threading.main_thread()] * 2


def test_a_large_conversation_of_few_messages_is_rendered_off_the_event_loop():
    """Up to 256 messages were gathered and rendered on the event loop whatever their size: an
    earlier tool call's 2.5 MB of arguments (parsed as JSON for the template) held it 0.4 s,
    every stream's. A conversation from a body over 64 KiB is rendered on a worker thread."""
    from cluster.ingress import INLINE_PARSE_MAX_BYTES

    arguments = json.dumps([[1]] * 50_000)
    raw = json.dumps({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c", "content": "done"}]}).encode()
    assert len(raw) > INLINE_PARSE_MAX_BYTES
    body = parse_body(raw, ChatCompletionRequest)
    tokenizer = RecordingTokenizer()
    ingress = ingress_methods(tokenizer)
    [token_ids] = asyncio.run(ingress._prompts(body, len(raw)))
    expected = tokenizer.real.apply_chat_template([message.template_message() for message in body.messages])
    assert token_ids == tokenizer.real.encode(expected, add_special_tokens=False)
    assert tokenizer.threads[0] is not threading.main_thread()  # the render (the encode: by its length)


def test_health_calls_share_one_lookup_of_serves_controller(monkeypatch):
    """Each /health call (open to anyone) asked Serve's controller for the whole Serve's
    details; concurrent and repeated calls within HEALTH_CACHE_S now share one lookup, and
    a lookup that failed is not kept."""
    import time

    lookups = []

    def running_replicas(app_name):
        lookups.append(app_name)
        time.sleep(0.05)
        if len(lookups) == 2:
            raise RuntimeError("the controller is restarting")
        return [] if len(lookups) > 2 else [(app_name, {"state": "RUNNING"})]

    ingress = ingress_methods(RecordingTokenizer())
    ingress.app_name = "builtin"
    # The names the methods see: Serve's ingress decorator keeps a copy of the class's globals.
    method_globals = type(ingress).health.__globals__
    monkeypatch.setitem(method_globals, "running_replicas", running_replicas)

    async def calls(count):
        return [response.status_code for response in await asyncio.gather(*(ingress.health() for _ in range(count)))]

    assert asyncio.run(calls(50)) == [200] * 50 and lookups == ["builtin"]
    assert asyncio.run(calls(5)) == [200] * 5 and len(lookups) == 1  # within HEALTH_CACHE_S
    monkeypatch.setitem(method_globals, "HEALTH_CACHE_S", 0.0)
    with pytest.raises(RuntimeError):
        asyncio.run(calls(1))
    assert asyncio.run(calls(3)) == [503] * 3 and len(lookups) == 3  # the failure was not kept


def test_an_error_no_route_handles_is_a_500_in_openais_shape():
    """Starlette answered an unhandled error with plain text ("Internal Server Error"), which an
    OpenAI client cannot parse; it is OpenAI's error shape, type server_error."""
    from fastapi.testclient import TestClient

    from cluster.ingress import api

    async def broken():
        raise RuntimeError("a bug")

    api.add_api_route("/v1/broken-for-this-test", broken)
    try:
        response = TestClient(api, raise_server_exceptions=False).get("/v1/broken-for-this-test")
    finally:
        api.router.routes[:] = [route for route in api.router.routes
                                if getattr(route, "path", None) != "/v1/broken-for-this-test"]
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error" and "a bug" in response.json()["error"]["message"]


def test_a_constrained_request_cancelled_while_the_grammar_compiler_builds_leaves_it_to_the_others():
    """The ingress builds its grammar compiler once, at start, and constrained requests await
    that build. A request cancelled while it waited (its client went away) cancelled the build
    itself, and every later constrained request got CancelledError: the wait is shielded now."""
    from cluster.openai_structured import OutputConstraint
    from protos import headroom_pb2 as pb
    from replica.config import make_engine_config
    from replica.model.builtin import EOS_TOKEN_ID
    from replica.model.registry import resolve_model_path
    from replica.text.tokenizer import Tokenizer

    ingress = ingress_methods(Tokenizer.from_pretrained(resolve_model_path("builtin")))
    ingress.engine_config = make_engine_config()
    ingress._model_info = pb.ModelInfo(vocab_size=320, eos_token_id=EOS_TOKEN_ID)
    constraint = OutputConstraint(StructuredOutput("regex", "[a-z]{3}"), "guided_regex")
    bad = OutputConstraint(StructuredOutput("regex", "a(b"), "guided_regex")

    async def scenario():
        ingress._grammars = asyncio.ensure_future(ingress._make_grammars())
        gone = asyncio.ensure_future(ingress.check_constraint(constraint))
        await asyncio.sleep(0)  # waiting for the build, on a worker thread
        assert not ingress._grammars.done()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not ingress._grammars.cancelled()  # the probe: the shared build went on
        await ingress.check_constraint(constraint)
        with pytest.raises(InvalidRequestError, match="^guided_regex: "):
            await ingress.check_constraint(bad)

    asyncio.run(scenario())


def completing_ingress(replica_stream, sampling_defaults=None):
    """The ingress's methods for `_complete` on the built-in model, each choice's replica stream
    `replica_stream(request)` (an async generator of RequestOutput) in place of Serve's; what
    requests leave unset takes `sampling_defaults` (SamplingParams' own unless given)."""
    from cluster.config import ClusterConfig
    from protos import headroom_pb2 as pb
    from replica.core.request import SamplingDefaults

    config = ClusterConfig(model="builtin")
    tokenizer = RecordingTokenizer().real
    ingress = ingress_methods(tokenizer)
    ingress.model_id, ingress.max_num_seqs = config.served_model_id, config.engine.max_num_seqs
    ingress.engine_config, ingress.tool_call_parser = config.engine, config.tool_call_parser
    ingress.sampling_defaults = sampling_defaults or SamplingDefaults()
    ingress.token_text = TokenText(lambda ids: tokenizer.decode(ids, skip_special_tokens=False), tokenizer.token_bytes)
    ingress.vocab_size, ingress.started_at = tokenizer.vocab_size, 1_700_000_000
    # What a replica said, as the ingress keeps it.
    ingress._model_info = pb.ModelInfo(max_model_len=256, vocab_size=tokenizer.vocab_size, block_size=16)

    async def model_info():
        return ingress._model_info

    async def stream(request):
        async for output in replica_stream(request):
            yield "replica-0", output

    ingress.model_info, ingress.stream = model_info, stream
    return ingress


def post(ingress, path: str, body: dict):
    """`_complete` on a real Starlette request carrying `body`."""
    from starlette.requests import Request

    from cluster.openai_api import ChatCompletionRequest as Chat

    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # the client stays connected
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}, receive)
    return ingress._complete(request, Chat if path.endswith("chat/completions") else CompletionRequest)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_refused_before_its_first_token_answers_with_the_refusals_status(path):
    """A full queue (or a lost replica, a first-token deadline) refused a streamed request with
    a 200 and then an error event: the openai client raised a bare APIError with no status, so
    its retries and backoff for 429 never ran. Now the status is the refusal's, as unstreamed;
    a stream that got its first token still answers 200 and carries what follows."""
    from replica.errors import QueueFullError

    async def full_queue(request):
        raise QueueFullError("the waiting queue is full (64 requests)")
        yield  # an async generator

    closed = []

    async def two_tokens(request):
        try:
            yield chunk("a", [65])
            yield chunk("b", [66], "length")
        finally:
            closed.append(request.request_id)

    body = {"stream": True, "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]}
                                               if "chat" in path else {"prompt": "hi"})}

    async def run(replica_stream):
        response = await post(completing_ingress(replica_stream), path, body)
        events = ([part async for part in response.body_iterator] if isinstance(response, StreamingResponse)
                  else [])
        return response, events

    refused, events = asyncio.run(run(full_queue))
    assert refused.status_code == 429 and not isinstance(refused, StreamingResponse)
    assert json.loads(refused.body)["error"]["code"] == "queue_full"
    served, events = asyncio.run(run(two_tokens))
    assert served.status_code == 200 and isinstance(served, StreamingResponse)
    assert events[-1].strip() == "data: [DONE]" and any('"b"' in event for event in events)
    assert len(closed) == 1  # the replica's stream was closed once read


def test_more_tools_than_openais_bound_are_refused_before_any_is_validated():
    from cluster.openai_structured import MAX_TOOLS

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    error = refused(ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                       "tools": [tool] * (MAX_TOOLS + 1)}).encode())
    assert error.status == 400 and error.body["error"]["param"] == "tools"
    assert f"at most {MAX_TOOLS} tools" in error.body["error"]["message"]
    assert len(parsed(ChatCompletionRequest, messages=[{"role": "user", "content": "hi"}],
                      tools=[tool] * MAX_TOOLS).tools) == MAX_TOOLS


def test_schemas_are_compiled_only_for_a_request_the_cheap_checks_pass_and_built_off_the_loop_when_large(monkeypatch):
    """30,000 tools took the ingress 40 s of schema building and compiling before it refused
    the request for its max_tokens; a 4 MB response_format schema held the loop 2 s."""
    compiled, asked = [], []

    async def replica(request):
        asked.append(request.request_id)
        yield chunk("[]", [65], "stop")

    ingress = completing_ingress(replica)

    async def check_constraint(constraint):
        compiled.append(constraint.param)

    ingress.check_constraint = check_constraint
    tools = [{"type": "function", "function": {"name": f"f{index}", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": "d" * 1000}}}}} for index in range(100)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    refused_response = asyncio.run(post(ingress, "/v1/chat/completions", {**body, "max_tokens": 10**6}))
    assert refused_response.status_code == 400 and json.loads(refused_response.body)["error"]["param"] == "max_tokens"
    assert compiled == [] and asked == []
    built_on = building_threads(monkeypatch)
    response = asyncio.run(post(ingress, "/v1/chat/completions", {**body, "max_tokens": 2, "stream": True}))
    assert response.status_code == 200 and len(asked) == 1
    assert compiled == [f"tools[{index}].function.parameters" for index in range(100)] + ["tools"]
    assert built_on and threading.main_thread() not in built_on


def building_threads(monkeypatch) -> list:
    """The threads a chat body's constraints are built on, from now to the test's end."""
    threads = []
    original = ChatCompletionRequest.output_constraint

    def recording(self):
        threads.append(threading.current_thread())
        return original(self)

    monkeypatch.setattr(ChatCompletionRequest, "output_constraint", recording)
    return threads


def test_a_small_body_with_a_schema_builds_it_off_the_loop_and_one_without_on_it(monkeypatch):
    """Checking a schema is llguidance's work: 60 KB of date-time properties held the loop 0.6 s."""
    async def replica(request):
        yield chunk("{}", [65], "stop")

    async def check_constraint(constraint):  # the compile: not what this test watches
        pass

    built_on = building_threads(monkeypatch)
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}, {}):
        ingress = completing_ingress(replica)
        ingress.check_constraint = check_constraint
        response = asyncio.run(post(ingress, "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}))
        assert isinstance(response, dict), response.body  # the completion (an error: a JSONResponse)
    assert built_on[0] is not threading.main_thread() and built_on[1] is threading.main_thread()


@pytest.mark.parametrize("field, value", [("stop_token_ids", [1] * 200_000), ("logit_bias", {str(i): 1 for i in range(200_000)}),
                                          ("stop", ["x"] * 200_000), ("stop", "x" * 200_000)])
def test_per_token_lists_over_their_bound_are_refused_before_the_model_validates_them(monkeypatch, field, value):
    """pydantic validated a million stop_token_ids (holding the GIL, and so the event loop,
    though a large body is parsed on a worker thread) before the bound refused them."""
    from replica.server.request_limits import RequestLimits

    validated = []
    original = CompletionRequest.model_validate.__func__

    def recording(cls, document, *args, **kwargs):
        validated.append(document)
        return original(cls, document, *args, **kwargs)

    monkeypatch.setattr(CompletionRequest, "model_validate", classmethod(recording))
    with pytest.raises(OpenAIError) as raised:
        parse_body(json.dumps({"prompt": "hi", field: value}).encode(), CompletionRequest, RequestLimits())
    assert raised.value.status == 400 and raised.value.body["error"]["param"] == field
    assert "exceeds the limit" in raised.value.body["error"]["message"] and validated == []
    assert parse_body(json.dumps({"prompt": "hi", "stop_token_ids": [1, 2]}).encode(), CompletionRequest,
                      RequestLimits()).stop_token_ids == [1, 2]


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk():
    """vLLM's stream_options.continuous_usage_stats was silently ignored (the one extension
    field accepted without being honoured): with include_usage, every chunk carries it."""
    async def replica(request):
        yield chunk("a", [65])
        yield RequestOutput("r", [66], "b", "length", 3, 2, 0, None, None, None)  # counts are the request's so far

    async def events(stream_options, n=1, path="/v1/completions"):
        body = {"stream": True, "max_tokens": 2, "stream_options": stream_options, "n": n,
                **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})}
        response = await post(completing_ingress(replica), path, body)
        return [json.loads(event.removeprefix("data: ")) async for event in response.body_iterator
                if event.strip() != "data: [DONE]"]

    continuous = asyncio.run(events({"include_usage": True, "continuous_usage_stats": True}))
    assert [body["usage"]["completion_tokens"] for body in continuous] == [1, 2, 2]
    assert continuous[-1]["choices"] == []  # the last: include_usage's own chunk
    plain = asyncio.run(events({"include_usage": True}))
    assert ["usage" in body for body in plain] == [False, False, True]
    # As vLLM's: each chunk its own choice's usage (n=2: 1, 2 for each), a role chunk none yet.
    chat = asyncio.run(events({"include_usage": True, "continuous_usage_stats": True}, n=2, path="/v1/chat/completions"))
    per_choice = {}
    for body in chat[:-1]:
        per_choice.setdefault(body["choices"][0]["index"], []).append(body["usage"]["completion_tokens"])
    assert per_choice == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert chat[-1]["usage"]["completion_tokens"] == 4 and len({body["usage"]["prompt_tokens"] for body in chat[:-1]}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_its_replica_ended_unfinished_is_a_503_not_a_whole_answer(stream):
    """A replica shut down past its drain time ends its streams with `abort`, which OpenAI's API
    does not have: the text so far came back as a 200, read as the whole answer."""
    async def replica(request):
        yield chunk("a", [65])
        yield chunk("", [], "abort")

    async def run():
        body = {"stream": stream, "max_tokens": 4, "prompt": "hi"}
        response = await post(completing_ingress(replica), "/v1/completions", body)
        events = [event async for event in response.body_iterator] if stream else []
        return response, events

    response, events = asyncio.run(run())
    if stream:  # the status went out with the first token: an error event, then [DONE]
        assert response.status_code == 200 and '"replica_unavailable"' in events[-2]
        assert events[-1].strip() == "data: [DONE]"
    else:
        assert response.status_code == 503
        assert json.loads(response.body)["error"]["code"] == "replica_unavailable"


def test_an_error_quoting_the_engines_field_names_the_bodys_parameter_throughout():
    # max_completion_tokens past the context: its param was right, its message said max_tokens;
    # it is OpenAI's context_length_exceeded now, in OpenAI's words, which name no field.
    async def never(request):
        raise AssertionError("no replica is asked")
        yield

    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
    response = asyncio.run(post(completing_ingress(never), "/v1/chat/completions", body))
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == "max_completion_tokens"
    assert error["code"] == "context_length_exceeded" and "5000 in the completion" in error["message"]
    assert "max_tokens" not in error["message"]


def test_chat_with_a_model_that_has_no_chat_template_is_400_naming_messages_and_the_flag(tmp_path):
    """A base model (no chat template) was given an invented "<|role|>" format, which it was
    never trained on, and answered nonsense with a 200. Chat is now refused, as transformers
    and vLLM refuse it, and a template given to the server serves it."""
    from replica.model.registry import resolve_model_path
    from replica.text.tokenizer import Tokenizer, resolve_chat_template
    from tests.replica.test_tokenizer import without_chat_template

    base = without_chat_template(resolve_model_path("builtin"), tmp_path / "base")
    served = []

    async def one_token(request):
        served.append(list(request.prompt_token_ids))
        yield chunk("a", [65], "length")

    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    ingress = completing_ingress(one_token)
    ingress.tokenizer = Tokenizer.from_pretrained(base)
    refusal = asyncio.run(post(ingress, "/v1/chat/completions", body))
    error = json.loads(refusal.body)["error"]
    assert refusal.status_code == 400 and error["param"] == "messages" and "--chat-template" in error["message"]
    assert not served  # refused before any replica
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ingress.tokenizer = Tokenizer.from_pretrained(base, chat_template=resolve_chat_template(template))
    answer = asyncio.run(post(ingress, "/v1/chat/completions", body))
    assert answer["choices"][0]["finish_reason"] == "length"  # a 200's body
    assert served == [ingress.tokenizer.encode("hi", add_special_tokens=False)]
