"""What OpenAI's and vLLM's clients rely on beyond the bodies' fields, through the ingress's own
route methods on the built-in model (no Ray): OpenAI's context_length_exceeded, vLLM's
chat-template fields, tool tags that are special tokens, completions' top_logprobs agreeing
with token_logprobs, Retry-After on 429 / 503, and vLLM's /tokenize, /detokenize and /version."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from starlette.requests import Request

from cluster.openai_responses import ChoiceResult, CompletionBodies, TokenText
from replica.core.outputs import TopLogprobs
from tests.cluster.test_openai_api import chunk, completing_ingress, post

CHAT = [{"role": "user", "content": "hi"}]


def never_served(request):
    raise AssertionError("no replica is asked")


async def no_replica(request):
    never_served(request)
    yield


def answer(response) -> tuple[int, dict]:
    """A route's status and JSON body (a route may return its body as a plain dict)."""
    if isinstance(response, dict):
        return 200, response
    return response.status_code, json.loads(response.body)


# ---- 1. context length --------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5000}, "max_tokens",
     "However, you requested {total} tokens ({prompt} in the messages, 5000 in the completion). Please reduce the "
     "length of the messages or completion."),
    ("/v1/completions", {"prompt": [7] * 256, "max_tokens": 1}, "prompt",
     "However, your request has 256 input tokens"),
    ("/v1/completions", {"prompt": [[7], [7] * 300], "max_tokens": 1}, "prompt[1]",
     "However, your request has 300 input tokens"),
])
def test_a_request_past_the_context_is_openais_context_length_exceeded_in_its_words(path, body, param, says):
    """It was a 400 with code null and a sentence of our own: clients that trim a conversation
    and retry match OpenAI's code (and LiteLLM vLLM's "maximum context length")."""
    ingress = completing_ingress(no_replica)
    status, error = answer(asyncio.run(post(ingress, path, body)))
    error = error["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == param, error
    prompt = len(ingress.tokenizer.encode(ingress.tokenizer.apply_chat_template(CHAT), add_special_tokens=False))
    assert error["message"].startswith("This model's maximum context length is 256 tokens. ")
    assert says.format(total=prompt + 5000, prompt=prompt) in error["message"]


def test_grpc_refuses_a_request_past_the_context_in_the_same_sentence_naming_the_field():
    import grpc

    from replica.core.request import SamplingParams, validate_request
    from replica.errors import InvalidRequestError
    from replica.server.status import grpc_status

    with pytest.raises(InvalidRequestError) as raised:
        validate_request([7] * 10, SamplingParams(max_tokens=250), max_model_len=256)
    code, details = grpc_status(raised.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == ("sampling.max_tokens: This model's maximum context length is 256 tokens. However, you "
                       "requested 260 tokens (10 in the messages, 250 in the completion). Please reduce the length "
                       "of the messages or completion.")


# ---- 2. chat template fields ----------------------------------------------------------------
# A Qwen3-like template: a variable of its own (enable_thinking) and an end-of-turn tag.
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                     "not enable_thinking %}<think></think>{% endif %}{% endif %}")


def templated_ingress(served: list):
    from replica.model.registry import resolve_model_path
    from replica.text.tokenizer import Tokenizer

    async def one_token(request):
        served.append(list(request.prompt_token_ids))
        yield chunk("a", [65], "length")

    ingress = completing_ingress(one_token)
    ingress.tokenizer = Tokenizer.from_pretrained(resolve_model_path("builtin"), chat_template=THINKING_TEMPLATE)
    return ingress


@pytest.mark.parametrize("fields, prompt", [
    ({}, "<|user|>hi<|end|><|assistant|>"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "<|user|>hi<|end|><|assistant|><think></think>"),
    ({"add_generation_prompt": False}, "<|user|>hi<|end|>"),
    ({"add_generation_prompt": False, "continue_final_message": True,
      "messages": CHAT + [{"role": "assistant", "content": "Once upon "}]},
     "<|user|>hi<|end|><|assistant|>Once upon "),
])
def test_chat_template_fields_reach_the_template_as_vllm_passes_them(fields, prompt):
    """chat_template_kwargs (Qwen3's enable_thinking), add_generation_prompt false and
    continue_final_message were refused with a 400; they render as vLLM renders them."""
    served = []
    ingress = templated_ingress(served)
    body = {"messages": CHAT, "max_tokens": 1, **fields}
    status, reply = answer(asyncio.run(post(ingress, "/v1/chat/completions", body)))
    assert status == 200, reply
    assert ingress.tokenizer.decode(served[0], skip_special_tokens=False) == prompt


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs.eos_token"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"continue_final_message": True, "messages": CHAT + [{"role": "assistant", "content": "x"}]},
     "continue_final_message"),  # with the generation prompt, on by default
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # a user's last
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_chat_template_fields_the_server_cannot_honour_are_400_naming_them(fields, param):
    served = []
    status, error = answer(asyncio.run(post(templated_ingress(served), "/v1/chat/completions",
                                            {"messages": CHAT, "max_tokens": 1, **fields})))
    assert status == 400 and error["error"]["param"] == param, error
    assert not served


# ---- 3. tool tags that are special tokens -----------------------------------------------------
def tool_tags_special(model_dir, directory):
    """A copy of the built-in model whose <tool_call> and </tool_call> are special added
    tokens (two of its reserved ones renamed), as some checkpoints ship them."""
    shutil.copytree(model_dir, directory)
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    renames = {"<|reserved_0|>": "<tool_call>", "<|reserved_1|>": "</tool_call>"}
    for token in tokenizer["added_tokens"]:
        token["content"] = renames.get(token["content"], token["content"])
    vocab = tokenizer["model"]["vocab"]
    for old, new in renames.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(tokenizer))
    return directory


def front_detokenizing(tokenizer, generated, sent):
    """A replica whose front (OutputProcessor) detokenizes `generated` for each request."""
    from replica.core.request import Request as EngineRequest
    from replica.front.output_processor import OutputProcessor

    async def replica(request):
        sent.append(request.sampling)
        outputs = []

        class Stream:
            def put(self, item):
                outputs.append(item)

        stream = Stream()
        stream.request = EngineRequest("r", list(request.prompt_token_ids), request.sampling,
                                       eos_token_ids=(tokenizer.eos_token_id,))
        processor = OutputProcessor(tokenizer, lambda core_id: None)
        processor.track(stream)
        for index, token_id in enumerate(generated):
            finish = "stop" if index == len(generated) - 1 else None
            processor.process([("r", [token_id], finish, 0, None, None, None, None, None)])
        for output in outputs:
            yield output

    return replica


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_whose_tags_are_special_tokens_is_a_call_not_content(tmp_path, stream):
    """The replica decoded the output with special tokens skipped, so a checkpoint's special
    <tool_call> tags vanished and the call came back as content (vLLM's #25281). A tool-calling
    request's text keeps the parser's tags, and only them: not EOS, not another special token."""
    from replica.model.registry import resolve_model_path
    from replica.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(tool_tags_special(resolve_model_path("builtin"), tmp_path / "model"))
    start, end = tokenizer.special_token_ids(["<tool_call>", "</tool_call>"])
    other_special = tokenizer.special_token_ids(["<|reserved_5|>"])[0]
    call = tokenizer.encode('{"name": "get_weather", "arguments": {"city": "Paris"}}', add_special_tokens=False)
    generated = ([other_special] + tokenizer.encode("Sure.", add_special_tokens=False) + [start] + call + [end]
                 + [tokenizer.eos_token_id])
    sent = []
    ingress = completing_ingress(front_detokenizing(tokenizer, generated, sent))
    ingress.tokenizer = tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": CHAT, "tools": tools, "max_tokens": 100, "stream": stream}

    async def run(body):
        ingress._grammars = asyncio.ensure_future(ingress._make_grammars())  # the tools' schemas are compiled
        response = await post(ingress, "/v1/chat/completions", body)
        if not body["stream"]:
            return answer(response)[1]
        events = [json.loads(event.removeprefix("data: ")) async for event in response.body_iterator
                  if event.startswith("data: {")]
        return events

    reply = asyncio.run(run(body))
    assert sent[0].kept_special_token_ids == (start, end)
    if stream:
        content = "".join(event["choices"][0]["delta"].get("content") or "" for event in reply if event["choices"])
        calls = [call for event in reply if event["choices"] for call in event["choices"][0]["delta"].get(
            "tool_calls") or ()]
        name, arguments = calls[0]["function"]["name"], "".join(call["function"]["arguments"] for call in calls)
        finish = [event["choices"][0]["finish_reason"] for event in reply if event["choices"]][-1]
    else:
        message = reply["choices"][0]["message"]
        content, [call] = message["content"], message["tool_calls"]
        name, arguments, finish = call["function"]["name"], call["function"]["arguments"], \
            reply["choices"][0]["finish_reason"]
    assert (name, json.loads(arguments), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    assert content == "Sure."  # no other special token's text, no EOS's
    # tool_choice none reads no call: its text keeps no special token.
    asyncio.run(run({**body, "stream": False, "tool_choice": "none"}))
    assert sent[-1].kept_special_token_ids == ()


# ---- 4. completions' top_logprobs ---------------------------------------------------------------
def test_completion_top_logprobs_give_the_sampled_token_its_own_logprob_where_an_alternative_reads_the_same():
    """Two bytes of one character both read as U+FFFD: the alternative's logprob was kept under
    that text, so top_logprobs[i] contradicted token_logprobs[i]."""
    result = ChoiceResult(0, 0)
    result.add(chunk("\ufffd", [1], "length", logprobs=[-2.0], top=[TopLogprobs([2], [-0.5])]))
    bodies = CompletionBodies("completion", "id", "m", TokenText(lambda ids: "\ufffd"), 1, [""])
    logprobs = bodies.response([result], [result])["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-2.0] and logprobs["top_logprobs"] == [{"\ufffd": -2.0}]


# ---- 5. Retry-After ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error, status", [("queue", 429), ("lost", 503)])
def test_a_429_or_503_says_when_to_retry(error, status, stream):
    """The openai client waits what the server says before its retry; there was nothing
    (tests/cluster/test_ingress_without_replicas.py: the wait is drawn per refusal)."""
    from replica.errors import QueueFullError, ReplicaLostError

    async def refused(request):
        raise QueueFullError("the waiting queue is full") if error == "queue" else ReplicaLostError("lost")
        yield

    response = asyncio.run(post(completing_ingress(refused), "/v1/completions",
                                {"prompt": "hi", "max_tokens": 2, "stream": stream}))
    wait_ms = int(response.headers["retry-after-ms"])
    assert response.status_code == status and 500 <= wait_ms <= 2000
    assert response.headers["retry-after"] == str(-(-wait_ms // 1000))
    invalid = asyncio.run(post(completing_ingress(no_replica), "/v1/completions", {"prompt": "hi", "max_tokens": 0}))
    assert invalid.status_code == 400 and "retry-after" not in invalid.headers


# ---- 6. /tokenize, /detokenize, /version ------------------------------------------------------
def http_request(path: str, body) -> Request:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}, receive)


def test_tokenize_gives_a_prompts_or_a_conversations_ids_as_generation_would_and_detokenize_their_text():
    served = []
    ingress = templated_ingress(served)
    tokenizer = ingress.tokenizer
    status, reply = answer(asyncio.run(ingress.tokenize(http_request("/tokenize", {"prompt": "hello"}))))
    assert status == 200 and reply == {"count": 6, "max_model_len": 256, "tokens": tokenizer.encode("hello"),
                                       "token_strs": None}
    plain = answer(asyncio.run(ingress.tokenize(http_request("/tokenize", {"prompt": "hello",
                                                                            "add_special_tokens": False}))))[1]
    assert plain["tokens"] == tokenizer.encode("hello", add_special_tokens=False)
    chat = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    tokenized = answer(asyncio.run(ingress.tokenize(http_request("/tokenize", {**chat, "return_token_strs": True}))))[1]
    asyncio.run(post(ingress, "/v1/chat/completions", {**chat, "max_tokens": 1}))
    assert tokenized["tokens"] == served[0] and tokenized["count"] == len(served[0])
    assert tokenized["token_strs"] == tokenizer.token_strings(served[0])
    status, text = answer(asyncio.run(ingress.detokenize(http_request("/detokenize", {"tokens": served[0]}))))
    assert status == 200 and text == {"prompt": tokenizer.decode(served[0])}


@pytest.mark.parametrize("route, body, status, param", [
    ("tokenize", {}, 400, "prompt"),
    ("tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize", {"messages": CHAT, "chat_template_kwargs": {"bos_token": "x"}}, 400, "chat_template_kwargs.bos_token"),
    ("tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, 400, "chat_template"),  # refused by name, as chat's
    ("tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("tokenize", b"{", 400, None),
    ("detokenize", {"tokens": [1, 100_000]}, 400, "tokens"),
    ("detokenize", {"tokens": [1, True]}, 400, "tokens[1]"),
    ("detokenize", {}, 400, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_input_in_openais_shape(route, body, status, param):
    ingress = templated_ingress([])
    got, error = answer(asyncio.run(getattr(ingress, route)(http_request(f"/{route}", body))))
    assert got == status and error["error"]["param"] == param, error


def test_version_is_the_packages_and_tokenize_needs_the_api_key_as_v1_does():
    import importlib.metadata

    from cluster.ingress import _needs_api_key

    assert asyncio.run(completing_ingress(no_replica).version()) == {"version": importlib.metadata.version("headroom")}
    needs = {path: _needs_api_key({"path": path}) for path in ("/tokenize", "/detokenize", "/version", "/health",
                                                                "/v1/models")}
    assert needs == {"/tokenize": True, "/detokenize": True, "/version": False, "/health": False, "/v1/models": True}


def test_the_tokenizer_refuses_a_template_variable_it_sets_itself_and_cuts_a_continued_message_after_its_content():
    """In-process callers of Tokenizer.apply_chat_template (the HTTP edge refuses these first)."""
    from replica.model.registry import resolve_model_path
    from replica.text.tokenizer import ChatTemplateError, Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model_path("builtin"), chat_template=THINKING_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="'bos_token' is set by the renderer"):
        tokenizer.apply_chat_template(CHAT, template_kwargs={"bos_token": "x", "enable_thinking": True})
    # Trailing space the template trims: cut after the content trimmed, as transformers cuts it.
    trimming = Tokenizer.from_pretrained(resolve_model_path("builtin"), chat_template=(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}"))
    continued = CHAT + [{"role": "assistant", "content": "Once upon "}]
    assert trimming.apply_chat_template(continued, add_generation_prompt=False, continue_final_message=True) == (
        "<|user|>hi<|end|><|assistant|>Once upon")
    with pytest.raises(ChatTemplateError, match="nothing in the rendered conversation to continue"):
        trimming.apply_chat_template(CHAT + [{"role": "assistant", "content": ""}], add_generation_prompt=False,
                                     continue_final_message=True)
