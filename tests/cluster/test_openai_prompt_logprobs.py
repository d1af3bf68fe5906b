"""Prompt log-probabilities through the ingress's own route methods (no Ray), each choice served
by a real in-process engine on the built-in model: OpenAI's legacy completions scoring a prompt
(`echo: true, logprobs: k, max_tokens: 0` or 1, as lm-evaluation-harness's local-completions
loglikelihood tasks send it), streamed too, and vLLM's `prompt_logprobs` on completions and chat,
each in its API's shape, the values the engine's."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.responses import StreamingResponse

from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from tests.cluster.test_openai_api import completing_ingress, post


@pytest.fixture(scope="module")
def llm() -> LLMEngine:
    # Chunks of 8 tokens: the prompts' logprobs are gathered over several steps.
    return LLMEngine(make_engine_config(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=8),
                     "builtin", device="cpu")


def served_by(llm: LLMEngine, served: list):
    """Each choice's replica stream: the request run to its end on the in-process engine."""

    async def replica(request):
        served.append(request.sampling)
        llm.add_request(llm.make_request(request.request_id, request.prompt_token_ids, request.sampling))
        finished = False
        while not finished:
            for output in llm.step():
                if output.request_id == request.request_id:
                    finished = output.finished
                    yield output
        kv_cache = llm.scheduler.kv_cache
        assert kv_cache.num_free_blocks == kv_cache.num_usable_blocks

    return replica


def complete(llm: LLMEngine, path: str, body: dict, served: list | None = None) -> tuple[int, dict | list[dict]]:
    """The route's status and JSON body, or a stream's events."""
    ingress = completing_ingress(served_by(llm, served if served is not None else []))

    async def run():
        response = await post(ingress, path, body)
        if isinstance(response, StreamingResponse):
            return response.status_code, [json.loads(event.removeprefix("data: ")) async for event in
                                          response.body_iterator if event.strip() != "data: [DONE]"]
        if isinstance(response, dict):  # a route's whole answer, as a plain dict
            return 200, response
        return response.status_code, json.loads(response.body)

    return asyncio.run(run())


def scored_alone(llm: LLMEngine, prompt: list[int], top: int):
    """The engine's prompt logprobs of `prompt`, asked for directly."""
    from replica.core.request import SamplingParams

    request = llm.make_request("alone", prompt, SamplingParams(max_tokens=1, prompt_logprobs=top))
    llm.add_request(request, detokenize=False)
    first = None
    while llm.has_unfinished_requests():
        for output in llm.step():
            first = first or output
    return first.prompt_logprobs


def check_legacy_logprobs(logprobs: dict, num_tokens: int, top: int) -> None:
    """OpenAI's legacy completions logprobs object: four parallel lists, a token's top_logprobs
    holding at most top + 1 entries (the top and the token itself) with the token's own logprob."""
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(logprobs[key]) == num_tokens for key in logprobs)
    assert all(isinstance(token, str) for token in logprobs["tokens"])
    offsets = logprobs["text_offset"]
    assert offsets == [sum(map(len, logprobs["tokens"][:index])) for index in range(num_tokens)]
    for token, logprob, tops in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        if logprob is None:
            assert tops is None
            continue
        assert isinstance(logprob, float) and logprob <= 0 and 1 <= len(tops) <= top + 1
        assert tops[token] == logprob and max(tops.values()) >= logprob


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_as_legacy_completions_do(llm, max_tokens):
    """lm-evaluation-harness's loglikelihood request: a batch of token-id prompts, echo,
    logprobs 1, max_tokens 0 (or 1, the last token then dropped by the harness). It was a 400
    (echo with logprobs, max_tokens 0); the prompt's tokens now open each choice's logprobs,
    the first null, each later one its logprob given the tokens before it."""
    prompts = [[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100], [84, 104, 101, 32, 99, 97, 116]]
    served = []
    status, body = complete(llm, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                                     "max_tokens": max_tokens, "temperature": 0}, served)
    assert status == 200, body
    assert [sampling.max_tokens for sampling in served] == [1, 1]  # 0: one token generated, never shown
    assert [sampling.prompt_logprobs for sampling in served] == [1, 1]
    for choice, prompt in zip(body["choices"], prompts):
        logprobs = choice["logprobs"]
        check_legacy_logprobs(logprobs, len(prompt) + max_tokens, top=1)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = scored_alone(llm, prompt, 1)
        assert logprobs["token_logprobs"][1:len(prompt)] == pytest.approx(expected.logprobs, abs=1e-6)
        assert logprobs["tokens"][:len(prompt)] == [bytes([token]).decode() for token in prompt]
        assert choice["text"].startswith(bytes(prompt).decode())
        assert choice["finish_reason"] == "length"
        assert "prompt_logprobs" not in choice  # vLLM's field only where asked for
    if max_tokens == 0:
        assert [choice["text"] for choice in body["choices"]] == [bytes(prompt).decode() for prompt in prompts]
        assert body["usage"]["completion_tokens"] == 0
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_a_streamed_echo_with_logprobs_opens_with_the_prompt_and_its_logprobs(llm):
    status, events = complete(llm, "/v1/completions", {"prompt": "Hi there", "echo": True, "logprobs": 2,
                                                       "max_tokens": 3, "temperature": 0, "stream": True})
    assert status == 200
    first = events[0]["choices"][0]
    prompt = llm.tokenizer.encode("Hi there")
    assert first["text"].startswith("Hi there")
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) >= len(prompt) + 1  # the prompt, then the first generated token
    streamed = [token for event in events for token in event["choices"][0]["logprobs"]["tokens"]]
    whole_status, whole = complete(llm, "/v1/completions", {"prompt": "Hi there", "echo": True, "logprobs": 2,
                                                            "max_tokens": 3, "temperature": 0})
    assert whole_status == 200
    assert streamed == whole["choices"][0]["logprobs"]["tokens"]
    assert "".join(event["choices"][0]["text"] for event in events) == whole["choices"][0]["text"]
    offsets = [offset for event in events for offset in event["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllms_prompt_logprobs_come_in_vllms_shape(llm, path):
    chat = path.endswith("chat/completions")
    request = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Hello"}
    status, body = complete(llm, path, {**request, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    prompt_logprobs = body["prompt_logprobs"] if chat else body["choices"][0]["prompt_logprobs"]
    prompt = (llm.tokenizer.encode(llm.tokenizer.apply_chat_template(request["messages"]), add_special_tokens=False)
              if chat else llm.tokenizer.encode("Hello"))
    expected = scored_alone(llm, prompt, 2)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for token_id, entry, logprob, rank, top in zip(prompt[1:], prompt_logprobs[1:], expected.logprobs, expected.ranks,
                                                   expected.top):
        assert entry[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-6)
        assert entry[str(token_id)]["rank"] == rank
        assert entry[str(token_id)]["decoded_token"] == llm.tokenizer.decode([token_id], skip_special_tokens=False)
        assert [entry[str(top_id)]["rank"] for top_id in top.token_ids] == [1, 2]
        assert len(entry) == 2 + (str(token_id) not in {str(top_id) for top_id in top.token_ids})


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
])
def test_what_cannot_be_served_is_a_400_naming_it(llm, body, param):
    status, reply = complete(llm, "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply
