"""The replica as a gRPC service, specified against a real grpc.aio server on loopback with
the built-in model: streaming, error statuses, cancellation, load reports, metrics, health."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc
from protos.not_serving import SHUTTING_DOWN, not_serving_reason
from replica.server.metrics import REPLICA_METRIC_NAMES
from replica.core.request import SamplingParams
from replica.server.auth import Credentials
from replica.server.request_limits import RequestLimits
from replica_harness import (
    MODEL_ID, REPLICA_ID, RunningReplica, collect_stream, load_reporter_calls, reflect, sampling, start_replicas,
)

MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
ROOMY_BLOCKS = 129  # 128 usable: 50 mid-length streams still preempt now and then
CRAMPED_BLOCKS = 24  # 23 usable: two long sequences fill it


@pytest.fixture(scope="module")
def replicas():
    """The module's replica, and test_without_generation_behind_a_token_...'s own (on the first
    free port from a base that is taken: (replica, base port)), started side by side; an idle
    replica takes no CPU from the tests beside it."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    base_port = taken.getsockname()[1]
    try:
        # A 2 ms limit on one request's token mask (default 10): the built-in model's 320-id masks
        # take microseconds; a terminal built to take ~9 ms trips it without a slow test.
        running = start_replicas(
            dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=ROOMY_BLOCKS,
                 structured_output_max_mask_ms=2.0),
            dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=ROOMY_BLOCKS,
                 server_options=dict(generation=False, credentials=Credentials(["cluster-secret"]),
                                     credential_name="cluster token"),
                 port=base_port, port_search=8))
        try:
            yield running[0], (running[1], base_port)
        finally:
            for replica in running:
                replica.close()
    finally:
        taken.close()


@pytest.fixture(scope="module")
def replica(replicas):
    return replicas[0]


@pytest.fixture
def fresh_replica():
    """A replica of its own, for tests that stop it or fill its queue."""
    replicas = []

    def make(**engine_config):
        config = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=ROOMY_BLOCKS)
        replicas.append(RunningReplica(**{**config, **engine_config}))
        return replicas[-1]

    yield make
    for running in replicas:
        running.close()


def generation_stub(channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


# ---- Generate ---------------------------------------------------------------------------
def test_streamed_text_deltas_concatenate_to_the_decoded_output(replica):
    prompt = "The quick brown fox"
    request = pb.GenerateRequest(request_id="fox-1", text=prompt, add_special_tokens=True,
                                 sampling=sampling(max_tokens=24, ignore_eos=True, logprobs=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            return await collect_stream(generation_stub(channel), request)

    responses = asyncio.run(run())
    tokenizer = replica.engine.tokenizer
    output_ids = [token_id for response in responses for token_id in response.token_ids]
    assert len(output_ids) == 24
    assert "".join(response.text for response in responses) == tokenizer.decode(output_ids)
    assert all(response.request_id == "fox-1" and response.replica_id == REPLICA_ID for response in responses)
    assert [response.finish_reason for response in responses[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(responses) - 1)
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    usage = responses[-1].usage
    assert usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=True))
    assert usage.completion_tokens == 24
    assert [response.usage.completion_tokens for response in responses] == sorted(
        response.usage.completion_tokens for response in responses)
    assert sum(len(response.logprobs) for response in responses) == 24


def test_token_id_prompt_with_greedy_sampling_is_deterministic(replica):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9]),
                                 sampling=sampling(max_tokens=10, temperature=0.0, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            return await asyncio.gather(collect_stream(stub, request), collect_stream(stub, request))

    first, second = asyncio.run(run())
    ids = lambda responses: [t for response in responses for t in response.token_ids]  # noqa: E731
    assert ids(first) == ids(second)
    assert first[-1].usage.prompt_tokens == 5 and first[-1].usage.completion_tokens == 10


def test_a_chat_prompt_is_the_models_chat_template_rendered_and_tokenized_on_the_replica(replica):
    messages = [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi!")]
    params = sampling(max_tokens=6, temperature=0.0, ignore_eos=True)
    chat_request = pb.GenerateRequest(chat=pb.ChatMessages(messages=messages), sampling=params)

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            # The built-in model has no template: the fallback format, spelled out here.
            rendered = "<s><|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
            tokenized = await stub.Tokenize(pb.TokenizeRequest(text=rendered))
            text_request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokenized.token_ids), sampling=params)
            return await collect_stream(stub, chat_request), await collect_stream(stub, text_request), tokenized

    chat, plain, tokenized = asyncio.run(run())
    assert chat[-1].usage.prompt_tokens == len(tokenized.token_ids)
    ids = lambda responses: [t for response in responses for t in response.token_ids]  # noqa: E731
    assert ids(chat) == ids(plain)


def test_stop_string_and_top_logprobs_come_back_in_the_responses(replica):
    def generate(**fields) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(text="hello", sampling=sampling(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                                     **fields))

        async def run():
            async with grpc.aio.insecure_channel(replica.address) as channel:
                return await collect_stream(generation_stub(channel), request)

        return asyncio.run(run())

    full = generate(top_logprobs=3)
    text = "".join(response.text for response in full)
    assert all(len(response.top_logprobs) == len(response.token_ids) for response in full)
    assert all(len(top.token_ids) == 3 and top.token_ids[0] == token_id
               for response in full for top, token_id in zip(response.top_logprobs, response.token_ids))
    cut = next(start for start in range(2, len(text) - 2)
               if text.index(text[start:start + 2]) == start and "\ufffd" not in text[start:start + 2])
    stopped = generate(stop=[text[cut:cut + 2]])
    assert "".join(response.text for response in stopped) == text[:cut]
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP and stopped[-1].stop_string == text[cut:cut + 2]
    assert replica.wait_until_idle().kv_blocks_free == ROOMY_BLOCKS - 1


def test_prompt_logprobs_come_once_on_the_first_response(replica):
    """sampling.prompt_logprobs: k, as the engine gathers them: entry i is prompt token i + 1's
    logprob, its rank and the k most likely there, on the first response and on no other."""
    prompt = [5, 9, 17, 40, 3, 77, 120]

    def generate(**fields) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling(
            max_tokens=4, temperature=0.0, ignore_eos=True, **fields))

        async def run():
            async with grpc.aio.insecure_channel(replica.address) as channel:
                return await collect_stream(generation_stub(channel), request)

        return asyncio.run(run())

    with_top, without_top, unasked = generate(prompt_logprobs=3), generate(prompt_logprobs=0), generate()
    assert len(with_top) > 1 and not any(response.HasField("prompt_logprobs") for response in with_top[1:])
    scored = with_top[0].prompt_logprobs
    assert len(scored.logprobs) == len(scored.ranks) == len(scored.top_logprobs) == len(prompt) - 1
    for token_id, logprob, rank, top in zip(prompt[1:], scored.logprobs, scored.ranks, scored.top_logprobs):
        assert len(top.token_ids) == 3 and list(top.logprobs) == sorted(top.logprobs, reverse=True)
        assert logprob <= top.logprobs[0] <= 0.0 and rank >= 1
        if token_id in top.token_ids:  # its place among the top is its rank
            assert rank == list(top.token_ids).index(token_id) + 1 and logprob == top.logprobs[rank - 1]
        else:
            assert rank > 3 and logprob <= top.logprobs[-1]
    alone = without_top[0].prompt_logprobs  # k = 0: each token's own, no alternatives
    assert list(alone.logprobs) == list(scored.logprobs) and list(alone.ranks) == list(scored.ranks)
    assert not alone.top_logprobs
    assert not any(response.HasField("prompt_logprobs") for response in unasked)
    assert replica.wait_until_idle().kv_blocks_free == ROOMY_BLOCKS - 1


def test_a_long_prompts_logprobs_come_in_parts_each_within_what_a_grpc_client_takes(replica, monkeypatch):
    """The top 20 of a prompt of ~29k tokens made one first response over 4 MiB, which a gRPC
    client refuses by default (RESOURCE_EXHAUSTED, the answer lost). Now past
    PROMPT_LOGPROBS_PART_BYTES they come in consecutive parts on responses of their own (no
    tokens), the last on the first token's: at the real bound a 40k-token prompt's messages are
    each under 4 MiB, and through the server (the bound made small) the parts, appended,
    are what one message carried."""
    from replica.core.outputs import PromptLogprobs, RequestOutput, TopLogprobs
    from replica.server import grpc_service

    positions = 40_000
    top = [TopLogprobs(list(range(100_000, 100_020)), [-0.5 - i / 7 for i in range(20)])] * positions
    huge = RequestOutput("r", [4], "a", None, positions + 1, 1, 0,
                         prompt_logprobs=PromptLogprobs([-1.25] * positions, [70_000] * positions, top))
    assert grpc_service.generate_response(huge, "replica-a").ByteSize() > 4 << 20  # one message would not do
    parts = grpc_service.generate_responses(huge, "replica-a")
    assert len(parts) > 1 and all(part.ByteSize() < 4 << 20 for part in parts)
    assert [part.prompt_logprobs.start for part in parts] == list(range(0, positions, len(parts[0].prompt_logprobs.logprobs)))
    assert sum(len(part.prompt_logprobs.top_logprobs) for part in parts) == positions
    assert [list(part.token_ids) for part in parts] == [[]] * (len(parts) - 1) + [[4]]

    prompt = list(range(3, 43))

    def generate() -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling(
            max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
        with grpc.insecure_channel(replica.address) as channel:
            return list(generation_stub(channel).Generate(request, timeout=60))

    whole = generate()
    monkeypatch.setattr(grpc_service, "PROMPT_LOGPROBS_PART_BYTES", 600)  # 13 positions of top 3
    split = generate()
    scored = [response for response in split if response.HasField("prompt_logprobs")]
    assert [response.prompt_logprobs.start for response in scored] == [0, 13, 26]
    # The parts carry no tokens but the last, which carries the first token (a stream whose
    # reader is behind merges later tokens into it, so only the concatenation is fixed).
    assert split[:3] == scored and [len(response.token_ids) for response in scored[:2]] == [0, 0]
    assert len(scored[2].token_ids) >= 1
    joined = pb.PromptLogprobs()
    for response in scored:
        joined.logprobs.extend(response.prompt_logprobs.logprobs)
        joined.ranks.extend(response.prompt_logprobs.ranks)
        joined.top_logprobs.extend(response.prompt_logprobs.top_logprobs)
    assert joined == whole[0].prompt_logprobs and len(joined.logprobs) == len(prompt) - 1
    def tokens(responses: list[pb.GenerateResponse]) -> list[int]:
        return [token for response in responses for token in response.token_ids]
    assert tokens(split) == tokens(whole) and len(tokens(whole)) == 3


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(replica):
    special = replica.engine.tokenizer.special_token_ids(["<|reserved_5|>"])[0]

    def text(**fields) -> str:
        request = pb.GenerateRequest(text="hi", sampling=sampling(
            max_tokens=2, temperature=0.0, ignore_eos=True, logit_bias={special: 100.0}, **fields))
        with grpc.insecure_channel(replica.address) as channel:
            responses = list(generation_stub(channel).Generate(request, timeout=60))
        assert [t for response in responses for t in response.token_ids] == [special, special]
        return "".join(response.text for response in responses)

    assert text(skip_special_tokens=False) == "<|reserved_5|>" * 2
    assert text() == text(skip_special_tokens=True) == ""


TOO_LONG_PROMPT = [1] * MAX_MODEL_LEN
BAD_REQUESTS = {
    "neither_text_nor_token_ids": (pb.GenerateRequest(sampling=sampling(max_tokens=4)), "prompt"),
    "empty_text": (pb.GenerateRequest(text="", sampling=sampling(max_tokens=4)), "prompt"),
    "empty_token_ids": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]), sampling=sampling(max_tokens=4)), "prompt"),
    "prompt_longer_than_max_model_len": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=TOO_LONG_PROMPT), sampling=sampling(max_tokens=4)), "prompt"),
    "max_tokens_zero": (pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=0)), "sampling.max_tokens"),
    # The replica schedules fcfs: a priority would be silently ignored (vLLM refuses it too).
    "priority_without_priority_scheduling": (pb.GenerateRequest(text="hi", priority=3, sampling=sampling(max_tokens=4)),
                                             "priority"),
    "max_tokens_past_max_model_len": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=MAX_MODEL_LEN)), "sampling.max_tokens"),
    "negative_temperature": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, temperature=-0.5)), "sampling.temperature"),
    "top_p_zero": (pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, top_p=0.0)), "sampling.top_p"),
    "top_p_above_one": (pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, top_p=1.5)), "sampling.top_p"),
    "top_k_below_minus_one": (pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, top_k=-2)), "sampling.top_k"),
    "token_id_past_vocabulary": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 320]), sampling=sampling(max_tokens=4)), "token_ids"),
    "negative_token_id": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1, 2]), sampling=sampling(max_tokens=4)), "token_ids"),
    "stop_token_id_past_vocabulary": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, stop_token_ids=[9999])), "sampling.stop_token_ids"),
    "negative_ttft_deadline": (
        pb.GenerateRequest(text="hi", ttft_deadline_ms=-1.0, sampling=sampling(max_tokens=4)), "ttft_deadline_ms"),
    "zero_ttft_slo": (pb.GenerateRequest(text="hi", ttft_slo_ms=0.0, sampling=sampling(max_tokens=4)), "ttft_slo_ms"),
    "chat_without_messages": (
        pb.GenerateRequest(chat=pb.ChatMessages(), sampling=sampling(max_tokens=4)), "chat.messages"),
    "chat_message_without_role": (
        pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(content="hi")]),
                           sampling=sampling(max_tokens=4)), "chat.messages[0].role"),
    # NaN passes every range check written as a comparison; infinities make logits NaN.
    "nan_temperature": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, temperature=float("nan"))), "sampling.temperature"),
    "infinite_temperature": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, temperature=float("inf"))), "sampling.temperature"),
    "nan_top_p": (pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, top_p=float("nan"))), "sampling.top_p"),
    "presence_penalty_above_two": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, presence_penalty=2.5)), "sampling.presence_penalty"),
    "nan_frequency_penalty": (pb.GenerateRequest(text="hi", sampling=sampling(
        max_tokens=4, frequency_penalty=float("nan"))), "sampling.frequency_penalty"),
    "zero_repetition_penalty": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, repetition_penalty=0.0)),
        "sampling.repetition_penalty"),
    "top_logprobs_above_20": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, top_logprobs=21)), "sampling.top_logprobs"),
    "prompt_logprobs_above_20": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, prompt_logprobs=21)), "sampling.prompt_logprobs"),
    "empty_stop_string": (pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, stop=["ok", ""])), "sampling.stop"),
    "logit_bias_past_vocabulary": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, logit_bias={999: 1.0})), "sampling.logit_bias"),
    "logit_bias_above_100": (
        pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, logit_bias={5: 101.0})), "sampling.logit_bias"),
    "json_schema_not_json": (pb.GenerateRequest(text="hi", json_schema="{nope", sampling=sampling(max_tokens=4)),
                             "json_schema"),
    "json_schema_unknown_type": (pb.GenerateRequest(text="hi", json_schema='{"type": "frobnicate"}',
                                                    sampling=sampling(max_tokens=4)), "json_schema"),
    "regex_unbalanced": (pb.GenerateRequest(text="hi", regex="a(b", sampling=sampling(max_tokens=4)), "regex"),
    "grammar_syntax_error": (pb.GenerateRequest(text="hi", grammar="start: (", sampling=sampling(max_tokens=4)),
                             "grammar"),
    "choice_empty": (pb.GenerateRequest(text="hi", choice=pb.Choices(), sampling=sampling(max_tokens=4)), "choice"),
    # Echoed in every step's output and every response: 3 MB slowed every other stream by a third.
    "request_id_over_256_characters": (pb.GenerateRequest(request_id="r" * 257, text="hi", sampling=sampling(
        max_tokens=4)), "request_id"),
    # Matched after every token on the event loop all streams share: 3,000 of 300 characters
    # (with logit_bias forcing text that keeps them pending) held other streams 3 s at a time.
    "more_than_64_stop_strings": (pb.GenerateRequest(text="hi", sampling=sampling(
        max_tokens=4, stop=[f"stop {index}" for index in range(65)])), "sampling.stop"),
    "stop_strings_over_4096_characters": (pb.GenerateRequest(text="hi", sampling=sampling(
        max_tokens=4, stop=["a" * 2048, "b" * 2049])), "sampling.stop"),
    # Looked up after every token in the core's step loop (700,000 stalled other streams).
    "more_than_1024_stop_token_ids": (pb.GenerateRequest(text="hi", sampling=sampling(
        max_tokens=4, stop_token_ids=[7] * 1025)), "sampling.stop_token_ids"),
}


def test_an_output_constraint_holds_on_the_replicas_own_grpc_server(replica):
    pattern = r"[0-9]{2}-[a-z]{3}"
    requests = [
        (pb.GenerateRequest(text="code", regex=pattern, sampling=sampling(max_tokens=16)),
         lambda text: re.fullmatch(pattern, text)),
        (pb.GenerateRequest(text="pick", choice=pb.Choices(choices=["left", "right"]), sampling=sampling(max_tokens=8)),
         lambda text: text in ("left", "right")),
        (pb.GenerateRequest(text="json", json_schema=json.dumps({"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}),
            sampling=sampling(max_tokens=16)), lambda text: json.loads(text)["n"] in range(10)),
    ]
    with grpc.insecure_channel(replica.address) as channel:
        for request, matches in requests:
            responses = list(generation_stub(channel).Generate(request, timeout=60))
            text = "".join(response.text for response in responses)
            assert matches(text), text
            assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


def test_a_constraint_whose_masks_turn_slow_mid_output_fails_its_stream_by_name_and_the_replica_serves_on(replica):
    """A grammar terminal whose every mask takes ~9 ms once past its first bytes, over the 2 ms
    limit, reached after the edge's probe: the engine core ends the request once three of its masks were over it, and
    the client gets what it was sent so far, then INVALID_ARGUMENT naming its field, `grammar`
    (not a stream that ends "abort" without a reason). A stream beside it is untouched."""
    grammar = 'start: "pick" /[0-9]/ LATE\nLATE: /q[ab]x(a{200}){200}/'
    with grpc.insecure_channel(replica.address) as channel:
        stub = generation_stub(channel)
        beside = stub.Generate(pb.GenerateRequest(text="go on", sampling=sampling(max_tokens=30, ignore_eos=True)),
                               timeout=60)
        texts = []
        with pytest.raises(grpc.RpcError) as raised:
            for response in stub.Generate(pb.GenerateRequest(text="pick", grammar=grammar,
                                                             sampling=sampling(max_tokens=40)), timeout=60):
                texts.append(response.text)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
        assert re.fullmatch(r"grammar: each token's mask takes [\d.]+ ms to compute, over the limit of 2 ms "
                            r"\(structured_output_max_mask_ms\), for 3 of its tokens", raised.value.details()), \
            raised.value.details()
        assert re.fullmatch("pick[0-9](q([ab](xa{0,2})?)?)?", "".join(texts)), texts
        assert list(beside)[-1].usage.completion_tokens == 30
    load = replica.wait_until_idle()
    assert load.kv_blocks_free == load.kv_blocks_total  # nothing left behind by the ended request


def test_a_constraint_slower_to_compile_than_the_bound_is_invalid_argument_and_the_replica_serves_on(fresh_replica):
    """structured_output_compile_timeout_s at the edge: refused naming the field, never queued."""
    running = fresh_replica(structured_output_compile_timeout_s=1e-4)
    schema = json.dumps({"type": "object", "properties": {
        f"field_{index}": {"type": "string", "pattern": f"^[a-z]{{{index % 7 + 1}}}[0-9]+$"} for index in range(300)},
        "required": [f"field_{index}" for index in range(300)]})
    with grpc.insecure_channel(running.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(generation_stub(channel).Generate(
                pb.GenerateRequest(text="slow", json_schema=schema, sampling=sampling(max_tokens=4)), timeout=60))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details() == "json_schema: took longer than 0.0001 s to compile"
        responses = list(generation_stub(channel).Generate(
            pb.GenerateRequest(text="next", sampling=sampling(max_tokens=3, ignore_eos=True)), timeout=60))
        assert responses[-1].usage.completion_tokens == 3
    # One request ended, the one served: the refused one never reached the engine (there a
    # compile past the bound ends a request with abort).

    def finished() -> dict[str, float]:
        return {dict(labels)["finish_reason"]: value for (name, labels), value in running.scrape().items()
                if name == "headroom_request_success_total"}

    deadline = time.monotonic() + 10
    while finished().get("length") != 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the metrics follow the engine's next published load
    assert sum(finished().values()) == 1 and finished()["length"] == 1, finished()


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field_and_leaves_other_streams_alone(replica, case):
    bad_request, field = BAD_REQUESTS[case]
    good_request = pb.GenerateRequest(text="steady", sampling=sampling(max_tokens=32, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            good = asyncio.ensure_future(collect_stream(stub, good_request))
            await asyncio.sleep(0.01)  # the good stream is in flight when the bad one arrives
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect_stream(stub, bad_request)
            return raised.value, await good

    error, good_responses = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}: "), error.details()
    assert good_responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert good_responses[-1].usage.completion_tokens == 32


def test_logit_bias_over_the_limit_is_refused_where_it_enters():
    # The built-in model's vocabulary (320) is below the default bound (1,024): a tighter one.
    from replica.server.grpc_service import prompt_token_ids_from_proto
    from replica.errors import InvalidRequestError

    request = pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=4, logit_bias={1: 1.0, 2: 1.0, 3: 1.0}))
    with pytest.raises(InvalidRequestError) as raised:
        asyncio.run(prompt_token_ids_from_proto(request, tokenizer=None, limits=RequestLimits(max_logit_bias=2)))
    assert raised.value.field == "logit_bias" and "3 entries exceeds the limit of 2" in raised.value.message


def test_token_ids_past_the_context_are_refused_before_they_are_copied_out_of_the_message(monkeypatch):
    """A 4 MiB message of ids (4 million): copying them into a list held the front's event loop,
    every stream's, ~0.2 s before validate_request refused the length. Refused on the count alone."""
    import replica.server.grpc_service as grpc_service
    from replica.errors import InvalidRequestError

    copied = []

    def watching_list(values):  # the branch's copy, seen: it must not happen for a refused prompt
        copied.append(len(values))
        return [*values]

    monkeypatch.setattr(grpc_service, "list", watching_list, raising=False)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 2048), sampling=sampling(max_tokens=4))
    with pytest.raises(InvalidRequestError) as raised:
        asyncio.run(grpc_service.prompt_token_ids_from_proto(request, None, RequestLimits(), max_model_len=2048))
    assert raised.value.field == "prompt" and copied == []
    assert "maximum context length is 2048 tokens. However, your request has 2048 input tokens" in raised.value.message
    shorter = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 2047), sampling=sampling(max_tokens=1))
    assert len(asyncio.run(grpc_service.prompt_token_ids_from_proto(shorter, None, RequestLimits(), 2048))) == 2047
    assert copied == [2047]


def test_request_bytes_that_do_not_parse_are_invalid_argument_and_the_replica_serves_on(replica):
    """A client that skips proto3's UTF-8 check (or sends a corrupt message) is told its
    request is bad, as the cluster's proxy tells it, not UNKNOWN as if the server had failed."""
    good = pb.GenerateRequest(text="AB", sampling=sampling(max_tokens=2)).SerializeToString()
    not_utf8 = good.replace(b"\x12\x02AB", b"\x12\x03\xed\xa0\x80")  # text: an encoded lone surrogate
    assert not_utf8 != good
    with grpc.insecure_channel(replica.address) as channel:
        raw_generate = channel.unary_stream("/headroom.v1.Generation/Generate", request_serializer=None,
                                            response_deserializer=pb.GenerateResponse.FromString)
        raw_tokenize = channel.unary_unary("/headroom.v1.Generation/Tokenize", request_serializer=None,
                                           response_deserializer=pb.TokenizeResponse.FromString)
        for call, body in ((raw_generate, not_utf8), (raw_generate, good[:-1]), (raw_tokenize, b"\x0a\x01\xff")):
            with pytest.raises(grpc.RpcError) as raised:
                result = call(body, timeout=30)
                list(result) if call is raw_generate else result
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
            assert raised.value.details().startswith("request: not a valid "), raised.value.details()
        responses = list(raw_generate(good, timeout=30))
    assert responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


def test_full_waiting_queue_is_resource_exhausted(fresh_replica):
    replica = fresh_replica(max_num_seqs=1, max_waiting_requests=1)
    long_request = pb.GenerateRequest(text="long", sampling=sampling(max_tokens=200, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            load_stub = pb_grpc.LoadReporterStub(channel)
            # One at a time: two adds the core takes in before one step would both count as
            # waiting, and the second would already be refused.
            running = asyncio.ensure_future(collect_stream(stub, long_request))
            await until(lambda load: load.num_running == 1, load_stub)
            queued = asyncio.ensure_future(collect_stream(stub, long_request))
            await until(lambda load: load.num_waiting == 1, load_stub)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect_stream(stub, long_request)
            running.cancel()
            queued.cancel()
            return raised.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting queue is full" in error.details()


def test_queue_filling_after_validation_is_still_resource_exhausted(fresh_replica):
    # The front checks the bound against the core's last load; the core's scheduler can
    # still refuse when it takes the request in (a burst within one step, or a stale load).
    # The client must see the same status either way.
    replica = fresh_replica(max_num_seqs=1, max_waiting_requests=2)
    front = replica.async_engine
    long_request = pb.GenerateRequest(text="long", sampling=sampling(max_tokens=200, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            load_stub = pb_grpc.LoadReporterStub(channel)
            running = [asyncio.ensure_future(collect_stream(stub, long_request))]
            await until(lambda load: load.num_running == 1, load_stub)
            running += [asyncio.ensure_future(collect_stream(stub, long_request)) for _ in range(2)]
            await until(lambda load: load.num_waiting == 2, load_stub)
            # Blind the front to the full queue, as a stale load would.
            replica.on_loop(lambda: setattr(front, "_load", dataclasses.replace(front.load(), num_waiting=0)))
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect_stream(stub, pb.GenerateRequest(text="x", sampling=sampling(max_tokens=4)))
            for call in running:
                call.cancel()
            return raised.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting queue is full" in error.details()
    load = replica.wait_until_idle()
    assert load.kv_blocks_free == load.kv_blocks_total


def test_client_deadline_is_deadline_exceeded_and_frees_the_request(replica):
    request = pb.GenerateRequest(text="slow", sampling=sampling(max_tokens=200, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect_stream(generation_stub(channel), request, timeout=0.1)
            return raised.value

    assert asyncio.run(run()).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    load = replica.wait_until_idle()
    assert load.kv_blocks_free == load.kv_blocks_total


def test_missed_ttft_deadline_is_deadline_exceeded_and_frees_the_request(fresh_replica):
    replica = fresh_replica(max_num_seqs=1)  # one runs; the next waits behind it
    long_request = pb.GenerateRequest(text="long", sampling=sampling(max_tokens=120, ignore_eos=True))
    hurried = pb.GenerateRequest(request_id="hurried", text="now", ttft_deadline_ms=50.0,
                                 sampling=sampling(max_tokens=8, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            running = asyncio.ensure_future(collect_stream(stub, long_request))
            while replica.async_engine.load().num_running == 0:
                await asyncio.sleep(0.002)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect_stream(stub, hurried)
            return raised.value, await running

    error, long_responses = asyncio.run(run())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details() == "ttft_deadline_ms: no first token within the deadline of 50 ms (request 'hurried')"
    assert long_responses[-1].usage.completion_tokens == 120  # the running request was not disturbed
    load = replica.wait_until_idle()
    assert load.kv_blocks_free == load.kv_blocks_total and load.num_waiting == 0


def test_ttft_slo_sets_the_requests_deadline_for_the_scheduler(fresh_replica):
    replica = fresh_replica(scheduling_policy="slo")
    request = pb.GenerateRequest(request_id="slo", text="aim", ttft_slo_ms=1500.0,
                                 sampling=sampling(max_tokens=60, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            call = generation_stub(channel).Generate(request)
            await call.read()  # the first token: the request is live in the engine now
            live = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                replica.async_engine.core.call_utility("request_state", "slo"), replica.loop))
            call.cancel()
            return live["ttft_deadline"] - live["arrival_time"]

    assert asyncio.run(run()) == pytest.approx(1.5)


def test_cancelling_half_of_50_streams_frees_every_block_once_the_rest_finish(replica):
    rng = random.Random(0)
    requests = [
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[rng.randrange(256) for _ in range(rng.randrange(4, 60))]),
                           sampling=sampling(max_tokens=rng.randrange(10, 60), ignore_eos=True))
        for _ in range(50)
    ]

    async def collect_stream_of(call):
        return [response async for response in call]

    async def cancel_after_first_response(call):
        async for _ in call:
            call.cancel()
        return "cancelled"

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            calls = [stub.Generate(request) for request in requests]
            finishing = [collect_stream_of(call) for call in calls[1::2]]
            cancelling = [cancel_after_first_response(call) for call in calls[0::2]]
            return await asyncio.gather(*finishing, *cancelling, return_exceptions=True)

    results = asyncio.run(run())
    finished, cancelled = results[:25], results[25:]
    assert all(responses[-1].finish_reason == pb.FINISH_REASON_LENGTH for responses in finished)
    assert all(isinstance(result, asyncio.CancelledError) or result == "cancelled" for result in cancelled)
    load = replica.wait_until_idle()
    assert load.kv_blocks_free == load.kv_blocks_total == ROOMY_BLOCKS - 1
    assert replica.core_call("check_invariants")  # in the core: no block held, no request stranded


def test_text_over_the_character_limit_is_refused_before_tokenizing(fresh_replica):
    replica = fresh_replica(limits=RequestLimits(max_prompt_chars=1000))
    with grpc.insecure_channel(replica.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(generation_stub(channel).Generate(pb.GenerateRequest(text="x" * 1001, sampling=sampling(max_tokens=2))))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("text: 1001 characters exceeds the limit of 1000")
        with pytest.raises(grpc.RpcError) as raised:
            generation_stub(channel).Tokenize(pb.TokenizeRequest(text="x" * 1001))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_message_over_the_byte_limit_is_invalid_argument_naming_request(replica):
    """gRPC's default receive bound is 4 MiB, the byte limit itself: the server refused a larger
    message as RESOURCE_EXHAUSTED before the limit's check could name it (and a configured limit
    above 4 MiB was unreachable). 1 Mi emoji are within the character limit and over 4 MiB."""
    request = pb.GenerateRequest(text="\N{GRINNING FACE}" * (1024 * 1024), sampling=sampling(max_tokens=1))
    assert request.ByteSize() > RequestLimits().max_request_bytes
    with grpc.insecure_channel(replica.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(generation_stub(channel).Generate(request))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith(f"request: {request.ByteSize()} bytes exceeds the limit of 4194304")
        assert list(generation_stub(channel).Generate(pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=1))))


def test_a_message_over_the_byte_limit_is_refused_from_its_raw_size_before_it_is_parsed(replica):
    """Its parsed message's ByteSize is a whole serialization (10 ms of the event loop for 4 MiB of
    token ids), and parsing it costs more: the bound is checked on the bytes that arrived. Bytes
    that would not even parse are refused for their size."""
    over = b"\xff" * (RequestLimits().max_request_bytes + 1)
    with grpc.insecure_channel(replica.address) as channel:
        for method, response_type in (("Generate", pb.GenerateResponse), ("Tokenize", pb.TokenizeResponse)):
            call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
                f"/headroom.v1.Generation/{method}", request_serializer=None,
                response_deserializer=response_type.FromString)
            with pytest.raises(grpc.RpcError) as raised:
                result = call(over, timeout=30)
                list(result) if method == "Generate" else result
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert raised.value.details() == f"request: {len(over)} bytes exceeds the limit of 4194304 bytes"


def test_a_message_far_past_the_byte_limit_is_refused_by_grpc_unread(replica):
    # The receive bound was 32 MiB: 30 MiB of token ids were parsed on the event loop (every
    # stream stalled) before the byte limit refused them. Now gRPC refuses them as they arrive.
    limits = RequestLimits()
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (2 * limits.receive_cap())),
                                 sampling=sampling(max_tokens=1))
    assert request.ByteSize() > limits.receive_cap() > limits.max_request_bytes
    with grpc.insecure_channel(replica.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(generation_stub(channel).Generate(request))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert list(generation_stub(channel).Generate(pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=1))))


def refused_beside_small_calls(replica, request: pb.GenerateRequest) -> tuple[float, list[float], grpc.aio.AioRpcError]:
    """Sends `request` (one the replica works on, then refuses) while Tokenize calls go back to
    back; its time to the refusal, the calls' round trips meanwhile, and the refusal."""
    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            await stub.Tokenize(pb.TokenizeRequest(text="warm up"))
            big = asyncio.ensure_future(collect_stream(stub, request))
            started = time.perf_counter()
            round_trips = []
            while not big.done():
                sent = time.perf_counter()
                await stub.Tokenize(pb.TokenizeRequest(text="small"))
                round_trips.append(time.perf_counter() - sent)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await big
            return time.perf_counter() - started, round_trips, raised.value

    big_s, round_trips, error = asyncio.run(run())
    assert len(round_trips) >= 3, (big_s, round_trips)  # long enough to stall, if it could
    # Stalled, one round trip would take most of big_s; 0.1 s alone failed once on a slow VM.
    assert max(round_trips) < max(0.1, big_s / 3), (big_s, round_trips)
    return big_s, round_trips, error


def test_a_long_prompt_being_tokenized_does_not_stall_other_calls(replica):
    """The replica tokenizes 960k characters (just under the default limit; 0.5-3 s of a core,
    depending on the machine) on a worker thread before it can tell the prompt is too long for
    the context, while small calls keep answering."""
    big_s, _, error = refused_beside_small_calls(replica, pb.GenerateRequest(
        text="lorem ipsum " * 80_000, sampling=sampling(max_tokens=4)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("prompt: ")
    assert big_s > 0.2


def test_a_conversation_of_many_messages_being_rendered_does_not_stall_other_calls(replica):
    """400,000 empty messages (2 MB) took 0.65 s of the event loop to gather, check and render
    before the rendered text was found over the character limit; large conversations are
    rendered on a worker thread, so small calls keep answering."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="u") for _ in range(400_000)])
    _, _, error = refused_beside_small_calls(replica, pb.GenerateRequest(chat=chat, sampling=sampling(max_tokens=4)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("chat.messages: "), error


# ---- load reports and metrics -----------------------------------------------------------
def test_watch_load_tracks_preemptions_and_headroom_under_a_cramped_pool(fresh_replica):
    replica = fresh_replica(num_kv_blocks=CRAMPED_BLOCKS)
    rng = random.Random(1)
    requests = [
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[rng.randrange(256) for _ in range(30)]),
                           sampling=sampling(max_tokens=120, ignore_eos=True))
        for _ in range(8)
    ]
    full_headroom = (CRAMPED_BLOCKS - 1) * BLOCK_SIZE

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            watch = pb_grpc.LoadReporterStub(channel).WatchLoad(pb.WatchLoadRequest(max_interval_ms=50))
            loads = [await watch.read()]
            stub = generation_stub(channel)
            generating = asyncio.gather(*(collect_stream(stub, request) for request in requests))
            while not (generating.done() and loads[-1].num_running == 0 and loads[-1].num_waiting == 0):
                loads.append(await watch.read())
            watch.cancel()
            return loads, await generating

    loads, streams = asyncio.run(run())
    assert all(responses[-1].usage.completion_tokens == 120 for responses in streams)
    engine_preemptions = replica.core_call("counters")["preemptions"]
    assert engine_preemptions > 0
    assert loads[-1].preemptions_total == engine_preemptions
    assert max(load.preemption_rate for load in loads) > 0
    assert [load.seq for load in loads] == sorted(set(load.seq for load in loads))
    assert loads[0].headroom_tokens == full_headroom
    assert min(load.headroom_tokens for load in loads) < full_headroom / 2
    assert loads[-1].headroom_tokens == full_headroom and loads[-1].kv_blocks_free == CRAMPED_BLOCKS - 1
    prometheus_key = ("headroom_num_preemptions_total", (("model", MODEL_ID), ("replica", REPLICA_ID)))
    deadline = time.monotonic() + 5
    while replica.scrape()[prometheus_key] != engine_preemptions and time.monotonic() < deadline:
        time.sleep(0.05)  # the metrics task syncs right after the engine publishes its last load
    assert replica.scrape()[prometheus_key] == engine_preemptions


def test_watch_load_pushes_at_least_every_max_interval_while_idle(replica):
    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            watch = pb_grpc.LoadReporterStub(channel).WatchLoad(pb.WatchLoadRequest(max_interval_ms=50))
            started = time.monotonic()
            loads = [await watch.read() for _ in range(6)]
            watch.cancel()
            return loads, time.monotonic() - started

    loads, elapsed_s = asyncio.run(run())
    assert elapsed_s < 1.0  # 5 intervals of 50 ms, with slack for a busy machine
    assert all(later.seq > earlier.seq for earlier, later in zip(loads, loads[1:]))
    assert all(load.replica_id == REPLICA_ID and load.kv_blocks_total == ROOMY_BLOCKS - 1 for load in loads)


def test_get_load_agrees_with_the_engine_when_idle(replica):
    replica.wait_until_idle()
    with grpc.insecure_channel(replica.address) as channel:
        load = pb_grpc.LoadReporterStub(channel).GetLoad(pb.LoadRequest())
    engine_load = replica.on_loop(replica.async_engine.load)
    assert (load.kv_blocks_free, load.preemptions_total, load.max_num_seqs) == (
        engine_load.kv_blocks_free, engine_load.preemptions_total, engine_load.max_num_seqs)
    # When the core took it, however long ago: an idle core's load stays current, so it is not old.
    assert load.timestamp <= time.time() and load.load_age_ms == 0


def test_metrics_endpoint_parses_and_carries_every_replica_metric(replica):
    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            return await collect_stream(generation_stub(channel),
                                        pb.GenerateRequest(text="count me", sampling=sampling(max_tokens=5, ignore_eos=True)))

    asyncio.run(run())
    labels = (("model", MODEL_ID), ("replica", REPLICA_ID))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        samples = replica.scrape()
        if samples.get(("headroom_generation_tokens_total", labels), 0) >= 5:
            break
        time.sleep(0.05)
    sample_names = {name for name, _ in samples}
    for name in REPLICA_METRIC_NAMES:
        assert name in sample_names or f"{name}_bucket" in sample_names, name
    assert samples[("headroom_time_to_first_token_seconds_count", labels)] >= 1
    assert samples[("headroom_inter_token_latency_seconds_count", labels)] >= 4
    assert samples[("headroom_request_success_total", (("finish_reason", "length"),) + labels)] >= 1


def test_latency_histograms_fill_when_a_caller_streams_from_the_engine_directly(replica):
    """The Ray Serve deployment streams from AsyncEngine.generate, not through this server's
    Generate: the histograms must be recorded on that path too."""
    labels = (("model", MODEL_ID), ("replica", REPLICA_ID))
    before = replica.scrape()

    async def consume():
        prompt = replica.engine.tokenizer.encode("direct")
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        return [output async for output in replica.async_engine.generate(prompt, params)]

    outputs = replica.call(consume())
    assert outputs[-1].finish_reason == "length"
    after = replica.scrape()
    grew = lambda name: after[(name, labels)] - before.get((name, labels), 0)  # noqa: E731
    assert grew("headroom_time_to_first_token_seconds_count") == 1
    assert grew("headroom_inter_token_latency_seconds_count") == 5
    assert grew("headroom_e2e_request_latency_seconds_count") == 1
    assert grew("headroom_request_queue_time_seconds_count") == 1
    finished_length = ("headroom_request_success_total", (("finish_reason", "length"),) + labels)
    assert after[finished_length] - before.get(finished_length, 0) == 1


def test_slo_metrics_follow_the_engine(fresh_replica):
    # Predictor gauges start at the configured line, not 0, so seeing them proves the sync.
    replica = fresh_replica(scheduling_policy="slo", slo_predictor_per_token_ms=0.25, slo_predictor_base_ms=30.0)
    labels = (("model", MODEL_ID), ("replica", REPLICA_ID))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        samples = replica.scrape()  # the metrics task syncs at least once a second while idle
        if samples[("headroom_slo_ttft_predictor_base_seconds", labels)] > 0:
            break
        time.sleep(0.05)
    assert samples[("headroom_slo_ttft_predictor_per_token_seconds", labels)] == pytest.approx(0.00025)
    assert samples[("headroom_slo_ttft_predictor_base_seconds", labels)] == pytest.approx(0.03)
    assert samples[("headroom_slo_preemptions_total", labels)] == 0


# ---- unary RPCs and health --------------------------------------------------------------
def test_tokenize_and_model_info_match_the_engine(replica):
    with grpc.insecure_channel(replica.address) as channel:
        stub = generation_stub(channel)
        tokens = stub.Tokenize(pb.TokenizeRequest(text="héllo", add_special_tokens=True)).token_ids
        info = stub.GetModelInfo(pb.ModelInfoRequest())
    assert list(tokens) == replica.engine.tokenizer.encode("héllo", add_special_tokens=True)
    assert (info.model_id, info.max_model_len, info.vocab_size, info.block_size, info.eos_token_id) == (
        MODEL_ID, MAX_MODEL_LEN, 320, BLOCK_SIZE, 257)


def test_health_is_serving_for_the_server_and_each_service(replica):
    for service in ("", "headroom.v1.Generation", "headroom.v1.LoadReporter"):
        assert replica.health_status(service) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_services_in_both_protocol_versions(replica, version):
    with grpc.insecure_channel(replica.address) as channel:
        services, files = reflect(channel, version, "headroom.v1.Generation")
    assert {"headroom.v1.Generation", "headroom.v1.LoadReporter", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    assert any(file.package == "headroom.v1" and file.service[0].name == "Generation" for file in files)


# ---- a cluster replica's internal endpoint ----------------------------------------------
def test_without_generation_behind_a_token_the_server_answers_loads_to_the_token_only(replicas):
    """As LLMReplica runs it: LoadReporter (and open health and reflection) behind the cluster
    token, no Generation, on the first free port from a base (here the base is taken)."""
    replica, base_port = replicas[1]  # its own, started beside the module's replica: nothing else touches it
    token = (("authorization", "Bearer cluster-secret"),)
    assert base_port < replica.port < base_port + 8
    with grpc.insecure_channel(replica.address) as channel:
        generate = generation_stub(channel).Generate(
            pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=2)), metadata=token, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            list(generate)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        calls = load_reporter_calls(channel)
        for name, call in calls.items():
            for metadata in (None, (("authorization", "Bearer cluster-secre"),), (("authorization", "cluster-secret"),)):
                with pytest.raises(grpc.RpcError) as unauthenticated:
                    call(metadata)
                assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
                assert "cluster token" in unauthenticated.value.details()
                assert "cluster-secre" not in unauthenticated.value.details()
        assert calls["GetLoad"](token).replica_id == REPLICA_ID
        assert calls["WatchLoad"](token).replica_id == REPLICA_ID
        assert calls["WatchKVEvents"](token).snapshot
        services, _ = reflect(channel, "v1", "headroom.v1.LoadReporter")
    assert "headroom.v1.LoadReporter" in services and "headroom.v1.Generation" not in services
    for service in ("", "headroom.v1.LoadReporter"):
        assert replica.health_status(service) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        replica.health_status("headroom.v1.Generation")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND



def test_graceful_shutdown_reports_not_serving_refuses_new_work_and_finishes_in_flight(fresh_replica):
    replica = fresh_replica()
    in_flight = pb.GenerateRequest(text="finish me", sampling=sampling(max_tokens=150, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_stub(channel)
            call = stub.Generate(in_flight)
            responses = [await call.read()]
            stopping = replica.stop_in_background(grace_s=30)
            health = await _health_status_when_not_serving(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect_stream(stub, pb.GenerateRequest(text="late", sampling=sampling(max_tokens=2)))
            # Every load call begun now says why (GetLoad answered OK, a new KV-event watch ended
            # OK with nothing): routers stop sending requests here.
            loads = pb_grpc.LoadReporterStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as get_load:
                await loads.GetLoad(pb.LoadRequest())
            with pytest.raises(grpc.aio.AioRpcError) as watch_events:
                async for _ in loads.WatchKVEvents(pb.WatchKVEventsRequest()):
                    pass
            responses += await read_to_end(call)
            await asyncio.wrap_future(stopping)
            return health, refused.value, [get_load.value, watch_events.value], responses, await call.code()

    health, refused, load_refusals, responses, code = asyncio.run(run())
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    for error in load_refusals:
        assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == "the replica is shutting down"
        assert not_serving_reason(error.trailing_metadata()) == SHUTTING_DOWN
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH and responses[-1].usage.completion_tokens == 150
    assert code == grpc.StatusCode.OK


def test_shutdown_past_its_grace_ends_in_flight_streams_with_abort(fresh_replica):
    replica = fresh_replica()
    request = pb.GenerateRequest(text="cut me off", sampling=sampling(max_tokens=200, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            call = generation_stub(channel).Generate(request)
            responses = [await call.read()]
            await asyncio.wrap_future(replica.stop_in_background(grace_s=0))
            responses += await read_to_end(call)
            return responses, await call.code()

    responses, code = asyncio.run(run())
    assert code == grpc.StatusCode.OK
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert responses[-1].usage.completion_tokens < 200


async def until(condition, load_stub: pb_grpc.LoadReporterStub, timeout_s: float = 60.0) -> None:
    """Poll GetLoad until `condition(load)` holds; fail (not hang) after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition(await load_stub.GetLoad(pb.LoadRequest())):
        assert time.monotonic() < deadline, "the replica never reached the expected load"
        await asyncio.sleep(0.005)


async def read_to_end(call) -> list[pb.GenerateResponse]:
    """The rest of a stream already read with call.read() (grpc.aio forbids mixing in iteration)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def _health_status_when_not_serving(channel, timeout: float = 10.0) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        status = (await stub.Check(health_pb2.HealthCheckRequest())).status
        if status != health_pb2.HealthCheckResponse.SERVING or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.005)


def _keyword_generate_response(output, replica_id: str) -> pb.GenerateResponse:
    """generate_response as it was first written: every field by keyword, the reference."""
    from replica.server.grpc_service import FINISH_REASON_TO_PROTO

    stop = ({"stop_string": output.stop_reason} if isinstance(output.stop_reason, str) else
            {"stop_token_id": output.stop_reason} if isinstance(output.stop_reason, int) else {})
    scored = output.prompt_logprobs
    prompt = {} if scored is None else {"prompt_logprobs": pb.PromptLogprobs(
        logprobs=scored.logprobs, ranks=scored.ranks,
        top_logprobs=[pb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs) for top in scored.top or ()])}
    return pb.GenerateResponse(
        request_id=output.request_id, token_ids=output.new_token_ids, text=output.text,
        finish_reason=FINISH_REASON_TO_PROTO[output.finish_reason],
        usage=pb.Usage(prompt_tokens=output.num_prompt_tokens, completion_tokens=output.num_output_tokens,
                       cached_prompt_tokens=output.num_cached_tokens),
        replica_id=replica_id, logprobs=output.logprobs or (),
        top_logprobs=[pb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs) for top in output.top_logprobs or ()],
        **stop, **prompt)


def test_each_output_field_reaches_its_generate_response_field():
    # generate_response sets only the fields an output has (it runs once per message); it must
    # give the message the keyword form gives, usage included when every count is 0.
    from replica.core.outputs import PromptLogprobs, RequestOutput, TopLogprobs
    from replica.server.grpc_service import generate_response

    outputs = [
        RequestOutput("r", [], "", None, 0, 0, 0, None, None, None),
        RequestOutput("r-1", [17], "x", None, 12, 1, 16, None, None, None),
        RequestOutput("r-2", [17, 18], "xy", "stop", 12, 9, 0, [-0.5, -1.25],
                      [TopLogprobs([17, 3], [-0.5, -2.0]), TopLogprobs([18, 4], [-1.25, -1.5])], "STOP"),
        RequestOutput("r-3", [257], "", "stop", 5, 3, 0, None, None, 257),
        RequestOutput("r-4", [], "", "abort", 5, 3, 0, None, None, None),
        RequestOutput("r-5", [9], "\t", "length", 5, 8, 0, [-0.0], None, None),
        # A first output with the prompt's logprobs: with alternatives, without, and a one-token
        # prompt's (none to give, but there: the client asked).
        RequestOutput("r-6", [4], "a", None, 3, 1, 0, None, None, None, PromptLogprobs(
            [-1.5, -0.25], [4, 1], [TopLogprobs([8, 2], [-0.5, -1.0]), TopLogprobs([6, 1], [-0.25, -3.0])])),
        RequestOutput("r-7", [4], "a", None, 3, 1, 0, None, None, None, PromptLogprobs([-1.5, -0.25], [4, 1], None)),
        RequestOutput("r-8", [4], "a", None, 1, 1, 0, None, None, None, PromptLogprobs([], [], [])),
    ]
    for output in outputs:
        response = generate_response(output, "replica-a")
        assert response == _keyword_generate_response(output, "replica-a"), output
        assert response.HasField("usage")
        assert response.HasField("prompt_logprobs") == (output.prompt_logprobs is not None)
        assert response.SerializeToString(deterministic=True) == _keyword_generate_response(
            output, "replica-a").SerializeToString(deterministic=True)


def test_a_long_prompts_logprobs_response_is_built_off_the_event_loop(monkeypatch):
    """A first response with 8,192 positions of 20 alternatives took 23 ms to build, on the event
    loop every stream shares: past INLINE_PROMPT_LOGPROBS_MAX_POSITIONS on a worker thread."""
    import threading

    from replica.core.outputs import PromptLogprobs, RequestOutput
    from replica.server import grpc_service

    threads = []
    original = grpc_service.generate_responses

    def recording(*args):
        threads.append(threading.current_thread())
        return original(*args)

    monkeypatch.setattr(grpc_service, "generate_responses", recording)

    def first_output(positions: int) -> RequestOutput:
        return RequestOutput("r", [4], "a", None, positions + 1, 1, 0,
                             prompt_logprobs=PromptLogprobs([-1.0] * positions, [2] * positions, None))

    long = first_output(grpc_service.INLINE_PROMPT_LOGPROBS_MAX_POSITIONS + 1)
    (response,) = asyncio.run(grpc_service.generate_responses_off_loop(long, "replica-a"))
    assert len(response.prompt_logprobs.logprobs) == len(long.prompt_logprobs.logprobs)
    assert threads[-1] is not threading.main_thread()
    asyncio.run(grpc_service.generate_responses_off_loop(first_output(8), "replica-a"))
    assert threads[-1] is threading.main_thread()


def test_a_large_output_constraint_is_read_off_the_event_loop(monkeypatch):
    """A 3.8 MiB json_schema (within the 4 MiB request bound) was parsed and checked on the
    replica's event loop: another stream's largest gap between messages went from 10 ms to
    2.5 s. Past INLINE_CONSTRAINT_MAX_CHARS it is read on a worker thread; a small one inline."""
    import threading

    from replica.core.structured_output import StructuredOutput
    from replica.server import grpc_service

    threads = []
    original = StructuredOutput.of

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(StructuredOutput, "of", recording)
    properties = {f"p{index}": {"type": "string"} for index in range(grpc_service.INLINE_CONSTRAINT_MAX_CHARS // 20)}
    large = pb.GenerateRequest(json_schema=json.dumps({"type": "object", "properties": properties}))
    assert len(large.json_schema) > grpc_service.INLINE_CONSTRAINT_MAX_CHARS
    constraint, field_name = asyncio.run(grpc_service.output_constraint_from_proto(large))
    assert field_name == "json_schema" and threads[-1] is not threading.main_thread()
    asyncio.run(grpc_service.output_constraint_from_proto(pb.GenerateRequest(regex="[ab]+")))
    assert threads[-1] is threading.main_thread()
