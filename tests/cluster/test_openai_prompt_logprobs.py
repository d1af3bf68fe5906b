"""Prompt log-probabilities through the ingress's own route methods (no Ray), each choice served
by a real in-process engine on the built-in model: OpenAI's legacy completions scoring a prompt
(`echo: true, logprobs: k, max_tokens: 0` or 1, as lm-evaluation-harness's local-completions
loglikelihood tasks send it), streamed too, and vLLM's `prompt_logprobs` on completions and chat,
each in its API's shape, the values the engine's; and gRPC's sampling.prompt_logprobs through the
ingress's Generate."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import time

import pytest
from starlette.responses import StreamingResponse

import cluster.ingress
from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.outputs import PromptLogprobs, RequestOutput, TopLogprobs
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


def complete(llm: LLMEngine, path: str, body: dict, served: list | None = None,
             replica=served_by) -> tuple[int, dict | list[dict]]:
    """The route's status and JSON body, or a stream's events."""
    ingress = completing_ingress(replica(llm, served if served is not None else []))

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


def served_one_at_a_time(llm: LLMEngine, served: list):
    """served_by's replica, one request at a time (a request's stream steps the engine for its
    own outputs only): a prompt's later choices find its first choice's blocks in the cache."""
    replica, lock = served_by(llm, served), asyncio.Lock()

    async def serialized(request):
        async with lock:
            async for output in replica(request):
                yield output

    return serialized


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


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompts_choices_share_the_prompt_logprobs_its_first_choice_alone_computes(llm, stream):
    """n > 1 (or best_of) asked every choice's engine request for the prompt's logprobs: each
    repeated the whole prefill for them, none taking the prefix cache's blocks. Only a prompt's
    first choice asks now; its values reach every choice of that prompt."""
    prompts = [[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 32, 72, 105, 32, 116, 104, 101, 114, 101],
               [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]]
    request = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 2, "n": 3, "temperature": 1.0,
               "seed": 7, "stream": stream}
    if not stream:  # vLLM's field too (not with stream, as vLLM)
        request["prompt_logprobs"] = 1
    served, rows_before = [], llm.runner.num_prompt_logprob_rows
    hits_before = llm.scheduler.kv_cache.prefix_cache_hits
    status, body = complete(llm, "/v1/completions", request, served, replica=served_one_at_a_time)
    assert status == 200, body
    assert [sampling.prompt_logprobs for sampling in served] == [2, None, None] * 2
    assert llm.runner.num_prompt_logprob_rows - rows_before == sum(len(prompt) - 1 for prompt in prompts)
    # The first prompt's later choices took its first choice's full block (16 tokens) from the cache.
    assert llm.scheduler.kv_cache.prefix_cache_hits - hits_before == 2 * 16
    if stream:  # each choice's first chunk opens with its prompt and the prompt's logprobs
        firsts = {}
        for event in body:
            for choice in event["choices"]:
                firsts.setdefault(choice["index"], choice["logprobs"])
        by_choice = [firsts[index] for index in range(6)]
    else:
        by_choice = [choice["logprobs"] for choice in body["choices"]]
    for prompt_index, prompt in enumerate(prompts):
        expected = scored_alone(llm, prompt, 2)
        for logprobs in by_choice[prompt_index * 3:(prompt_index + 1) * 3]:
            assert logprobs["token_logprobs"][1:len(prompt)] == pytest.approx(expected.logprobs, abs=1e-6)
            assert logprobs["top_logprobs"][1:len(prompt)] == by_choice[prompt_index * 3]["top_logprobs"][1:len(prompt)]
        if not stream:
            fields = [choice["prompt_logprobs"] for choice in body["choices"][prompt_index * 3:(prompt_index + 1) * 3]]
            assert fields[0] == fields[1] == fields[2] and len(fields[0]) == len(prompt)


async def with_longest_loop_stall(work) -> tuple:
    """What `work()` returns, and the longest the event loop went meanwhile without running a
    task that asks to run every millisecond."""
    done, longest, last = False, 0.0, time.perf_counter()

    async def ticker():
        nonlocal longest, last
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        result = await work()
        return result, max(longest, time.perf_counter() - last)  # work that never let the ticker run too
    finally:
        done = True
        await ticking


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_prompts_logprobs_are_built_off_the_event_loop(monkeypatch, stream):
    """A body showing a long prompt's logprobs (echoed, and in vLLM's field) was built on the
    ingress's event loop, the first streamed chunk's too: 2 us or so an entry, a prompt token with
    its alternatives, so seconds for a 128k-token prompt with 20, every other stream and request
    held meanwhile. Past INLINE_LOGPROBS_MAX_ENTRIES it is built (and rendered) on a worker thread:
    the loop's longest stall is measured against the same body built inline."""
    rng = random.Random(0)
    vocab_size, top, num_prompt_tokens = 320, 20, 10000  # the built-in model's vocabulary
    prompt = [rng.randrange(vocab_size) for _ in range(num_prompt_tokens)]

    def alternatives() -> TopLogprobs:
        return TopLogprobs(rng.sample(range(vocab_size), top), sorted((-rng.random() * 9 for _ in range(top)),
                                                                      reverse=True))

    gathered = PromptLogprobs([-rng.random() * 9 for _ in prompt[1:]], [rng.randrange(1, 50) for _ in prompt[1:]],
                              [alternatives() for _ in prompt[1:]])
    generated = RequestOutput("r", [65], "A", "length", len(prompt), 1, 0, [-0.5], [alternatives()],
                              prompt_logprobs=gathered)

    async def replica(request):  # a synthetic engine output: the prompt's logprobs with its first token
        assert request.sampling.prompt_logprobs == top
        yield generated

    request = {"prompt": prompt, "echo": True, "logprobs": top, "max_tokens": 1, "stream": stream}
    if not stream:
        request["prompt_logprobs"] = top

    def run() -> tuple[list, float]:
        ingress = completing_ingress(replica)
        ingress._model_info.max_model_len = num_prompt_tokens + 16

        async def respond():  # what the route sends, decoded only after (a client's work, not the ingress's)
            response = await post(ingress, "/v1/completions", request)
            if isinstance(response, StreamingResponse):
                return [event async for event in response.body_iterator if event.strip() != "data: [DONE]"]
            return response

        # As a serving process does (freeze_startup_heap): a full collection, a stall of its own
        # whatever thread triggers it, then walks what the request made, not the test process's heap.
        gc.collect()
        gc.freeze()
        try:
            answer, longest = asyncio.run(with_longest_loop_stall(respond))
        finally:
            gc.unfreeze()
        if isinstance(answer, list):
            choices = [json.loads(event.removeprefix("data: "))["choices"] for event in answer]
        else:
            choices = (answer if isinstance(answer, dict) else json.loads(answer.body))["choices"]
        return json.dumps(choices), longest  # as one string: no more objects for a collection to walk

    with monkeypatch.context() as inline:  # the old way: everything on the loop
        # The stream's function reads the module's names, the route Serve's copy of them.
        for names in (vars(cluster.ingress), cluster.ingress.Ingress.func_or_class._complete.__globals__):
            inline.setitem(names, "INLINE_LOGPROBS_MAX_ENTRIES", math.inf)
        inline_choices, inline_stall = run()
    choices, stall = run()
    assert choices == inline_choices
    choice = json.loads(choices)[0]
    assert len((choice[0] if stream else choice)["logprobs"]["tokens"]) == num_prompt_tokens + 1
    assert stall < inline_stall / 4, f"the loop stalled {stall * 1e3:.0f} ms, {inline_stall * 1e3:.0f} ms inline"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
])
def test_what_cannot_be_served_is_a_400_naming_it(llm, body, param):
    status, reply = complete(llm, "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply


class ServeGrpcContext:
    """Ray Serve's gRPC context as the ingress's Generate uses it: metadata in, a status out."""

    def __init__(self):
        self.code = self.details = None

    def invocation_metadata(self) -> tuple:
        return ()

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def grpc_generate(ingress, request, context: ServeGrpcContext) -> list:
    from replica.server.auth import Credentials

    ingress.api_keys, ingress.app_name = Credentials(), "default"

    async def run():
        return [response async for response in ingress.Generate(request, context)]

    return asyncio.run(run())


def test_grpc_generate_through_the_ingress_carries_prompt_logprobs_and_skip_special_tokens(llm):
    from protos import headroom_pb2 as pb

    prompt = [5, 9, 17, 40, 3, 77, 120, 8, 31, 64]  # 10 tokens: two prefill chunks of 8
    served = []
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2, skip_special_tokens=False))
    responses = grpc_generate(completing_ingress(served_by(llm, served)), request, ServeGrpcContext())
    assert served[-1].prompt_logprobs == 2 and served[-1].skip_special_tokens is False
    assert len(responses) > 1 and not any(response.HasField("prompt_logprobs") for response in responses[1:])
    scored, expected = responses[0].prompt_logprobs, scored_alone(llm, prompt, 2)
    assert list(scored.logprobs) == pytest.approx(expected.logprobs, rel=1e-6)  # as 32-bit floats
    assert list(scored.ranks) == expected.ranks
    assert [list(top.token_ids) for top in scored.top_logprobs] == [top.token_ids for top in expected.top]
    plain = grpc_generate(completing_ingress(served_by(llm, served)), pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=2)), ServeGrpcContext())
    assert served[-1].prompt_logprobs is None and served[-1].skip_special_tokens is True
    assert not any(response.HasField("prompt_logprobs") for response in plain)


def test_grpc_generate_over_the_ingresss_byte_limit_is_invalid_argument_naming_request(llm):
    """The proxy bounds raw bytes by the largest application's limit; each ingress its own."""
    import grpc

    from protos import headroom_pb2 as pb
    from replica.errors import InvalidRequestError
    from replica.server.request_limits import RequestLimits

    served = []
    ingress = completing_ingress(served_by(llm, served))
    ingress.limits = RequestLimits(max_request_bytes=64)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 60))), sampling=pb.SamplingParams(max_tokens=1))
    context = ServeGrpcContext()
    with pytest.raises(InvalidRequestError):
        grpc_generate(ingress, request, context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and served == []
    assert context.details == f"request: {request.ByteSize()} bytes exceeds the limit of 64 bytes"
