"""The front's output processor, fed CoreOutput rows as the core sends them: stop strings are
matched here on the detokenized text across token boundaries, end the stream as "stop"
without the string and tell the core to drop the request; what the core reports (a stop
token id, top logprobs) reaches the outputs; the request observer sees every output and
every failure. The byte-level built-in tokenizer makes one token per byte."""

from __future__ import annotations

from typing import Optional

import pytest

from replica.core.outputs import RequestOutput
from replica.core.outputs import TopLogprobs
from replica.model.registry import resolve_model_path
from replica.core.request import Request, SamplingParams
from replica.front.output_processor import OutputProcessor
from replica.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(resolve_model_path("builtin"))


class CollectingStream:
    """A request's stream that keeps what it is given."""

    def __init__(self, request: Request):
        self.request = request
        self.items: list[RequestOutput | BaseException] = []

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)

    @property
    def text(self) -> str:
        return "".join(item.text for item in self.items if isinstance(item, RequestOutput))


class RecordingObserver:
    def __init__(self):
        self.seen: list[tuple[str, Optional[str]]] = []

    def on_output(self, request: Request, output: RequestOutput) -> None:
        self.seen.append((request.request_id, output.finish_reason))

    def on_failed(self, request: Request) -> None:
        self.seen.append((request.request_id, "failed"))


class Harness:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.aborted_in_core: list[str] = []
        self.observer = RecordingObserver()
        self.processor = OutputProcessor(tokenizer, self.aborted_in_core.append, self.observer)

    def track(self, request_id: str, **sampling) -> CollectingStream:
        stream = CollectingStream(Request(request_id, [1, 2, 3], SamplingParams(max_tokens=100, **sampling)))
        self.processor.track(stream)
        return stream

    def generate(self, request_id: str, text: str, *, finish_last: Optional[str] = None) -> None:
        """The core streams `text` one token per step; the last row finishes as `finish_last`."""
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        for index, token_id in enumerate(token_ids):
            finish = finish_last if index == len(token_ids) - 1 else None
            self.processor.process([(request_id, [token_id], finish, 0, None, None, None, None, None)])


@pytest.fixture
def harness(tokenizer) -> Harness:
    return Harness(tokenizer)


def test_a_stop_string_split_across_tokens_ends_the_stream_as_stop_without_it_and_drops_the_request_in_the_core(
        harness):
    stream = harness.track("r", stop=("END",))
    harness.generate("r", "one two END three four")
    assert stream.text == "one two "
    last = stream.items[-1]
    assert last.finish_reason == "stop" and last.stop_reason == "END"
    assert last.num_output_tokens == len("one two END")  # the core's rows after the hit were dropped
    assert harness.aborted_in_core == ["r"]
    assert "r" not in harness.processor


def test_a_multibyte_stop_string_matches_across_the_tokens_of_one_character(harness):
    stream = harness.track("r", stop=("€",))
    harness.generate("r", "price: 5€ each")
    assert stream.text == "price: 5" and stream.items[-1].stop_reason == "€"


def test_include_stop_str_in_output_keeps_the_string(harness):
    stream = harness.track("r", stop=("\n\n",), include_stop_str_in_output=True)
    harness.generate("r", "first\n\nsecond")
    assert stream.text == "first\n\n" and stream.items[-1].finish_reason == "stop"


def test_text_held_back_as_a_possible_stop_comes_out_when_the_core_finishes_the_request(harness):
    stream = harness.track("r", stop=("ENX",))
    harness.generate("r", "ends in EN", finish_last="length")
    assert stream.text == "ends in EN"
    assert stream.items[-1].finish_reason == "length" and stream.items[-1].stop_reason is None
    assert harness.aborted_in_core == []  # the core had finished it itself


def test_no_text_is_held_back_without_stop_strings(harness):
    stream = harness.track("r")
    harness.generate("r", "E")
    assert stream.text == "E" and stream.items[-1].finish_reason is None


def test_the_cores_stop_token_id_and_top_logprobs_reach_the_output(harness):
    stream = harness.track("r", stop_token_ids=(7,), top_logprobs=2)
    harness.processor.process([("r", [5], None, 0, [-0.5], [([5, 9], [-0.5, -1.5])], None, 11.0, None)])
    harness.processor.process([("r", [7], "stop", 0, [-0.1], [([7, 5], [-0.1, -2.0])], 7, None, None)])
    first, last = stream.items
    assert first.top_logprobs == [TopLogprobs([5, 9], [-0.5, -1.5])] and first.stop_reason is None
    assert last.finish_reason == "stop" and last.stop_reason == 7
    assert stream.request.first_admitted_time == 11.0


def test_a_prompts_logprobs_reach_the_first_output_as_the_core_sent_them(harness):
    import numpy as np

    from replica.core.outputs import PromptLogprobArrays, PromptLogprobs

    stream = harness.track("r", prompt_logprobs=1)
    sent = PromptLogprobArrays(np.array([-1.5, -0.25], np.float32), np.array([3, 1], np.int32),
                               np.array([[9], [2]], np.int32), np.array([[-0.5], [-0.25]], np.float32))
    harness.processor.process([("r", [5], None, 0, None, None, None, 11.0, sent.to_wire())])
    harness.processor.process([("r", [7], "length", 0, None, None, None, None, None)])
    first, last = stream.items
    assert first.prompt_logprobs == PromptLogprobs([-1.5, -0.25], [3, 1], [TopLogprobs([9], [-0.5]),
                                                                       TopLogprobs([2], [-0.25])])
    assert last.prompt_logprobs is None


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_tokens_text_is_left_out_unless_asked_for_as_vllm_does(harness, include):
    """The token the core stopped on ("A", one of stop_token_ids) was in the text; vLLM leaves
    it out unless include_stop_str_in_output, and keeps its id either way."""
    stop_id = harness.tokenizer.encode("A", add_special_tokens=False)[0]
    stream = harness.track("r", stop_token_ids=(stop_id,), include_stop_str_in_output=include)
    harness.generate("r", "hi")
    harness.processor.process([("r", [stop_id], "stop", 0, None, None, stop_id, None, None)])
    assert stream.text == ("hiA" if include else "hi")
    assert stream.items[-1].new_token_ids == [stop_id] and stream.items[-1].stop_reason == stop_id


def test_the_observer_sees_every_output_abort_and_failure(harness):
    harness.track("done")
    harness.track("aborted")
    harness.track("failed")
    harness.generate("done", "ab", finish_last="length")
    harness.processor.finish("aborted", "abort")
    harness.processor.fail_all(lambda: RuntimeError("core died"))
    assert harness.observer.seen == [("done", None), ("done", "length"), ("aborted", "abort"), ("failed", "failed")]


def test_with_a_fronts_suffix_every_client_id_is_its_own_and_finish_all_ends_each_once(tokenizer):
    """A front of several knows its requests in the core by `id|fK`. A client id may itself
    look like a core id ("a|f1" beside "a"): each still gets a core id of its own, membership
    asks client ids only, and shutdown's finish_all ends every stream once, by its core id."""
    aborted_in_core: list[str] = []
    processor = OutputProcessor(tokenizer, aborted_in_core.append, core_id_suffix="|f1")
    streams = {}
    for client_id in ("a", "a|f1"):
        core_id = processor.core_id_for(client_id)
        streams[client_id] = CollectingStream(Request(core_id, [1, 2, 3], SamplingParams(max_tokens=10)))
        processor.track(streams[client_id], client_id)
    assert [stream.request.request_id for stream in streams.values()] == ["a|f1", "a|f1|f1"]
    assert "a" in processor and "a|f1" in processor and "a|f1|f1" not in processor
    processor.finish_all("abort")
    assert sorted(aborted_in_core) == ["a|f1", "a|f1|f1"] and len(processor) == 0
    for client_id, stream in streams.items():
        assert [(item.request_id, item.finish_reason) for item in stream.items] == [(client_id, "abort")]


def tracked(processor: OutputProcessor, client_id: str, **sampling) -> CollectingStream:
    """A new request of this client id, under the core id the processor gives it."""
    stream = CollectingStream(Request(processor.core_id_for(client_id), [1, 2, 3],
                                      SamplingParams(max_tokens=100, **sampling)))
    processor.track(stream, client_id)
    return stream


def test_a_stop_string_ends_the_request_whose_row_matched_it_not_a_client_of_that_id(tokenizer):
    """Client "a" aborted, its retry is known to the core as "a#1", and another client's id is
    "a#1" (so its core id is another). The retry's stop string ended the *client* "a#1" (its
    stream got the retry's last output, and the core dropped the wrong request)."""
    aborted: list[str] = []
    processor = OutputProcessor(tokenizer, aborted.append)
    tracked(processor, "a")
    processor.finish("a", "abort")
    retry, other = tracked(processor, "a", stop=("END",)), tracked(processor, "a#1", stop=("END",))
    assert retry.request.request_id == "a#1" != other.request.request_id
    aborted.clear()
    for token_id in tokenizer.encode("END", add_special_tokens=False):
        processor.process([(retry.request.request_id, [token_id], None, 0, None, None, None, None, None)])
    assert retry.items[-1].finish_reason == "stop" and retry.items[-1].request_id == "a"
    assert other.items == [] and "a#1" in processor and aborted == ["a#1"]


def test_a_core_id_ended_early_is_given_to_no_new_request_while_its_rows_may_arrive(tokenizer):
    """The retry of "a" (core id "a#1") is aborted too; a new client "a#1" was given core id
    "a#1" again, and a row the aborted retry still had in flight reached its stream."""
    processor = OutputProcessor(tokenizer, lambda core_id: None)
    tracked(processor, "a")
    processor.finish("a", "abort")
    retry = tracked(processor, "a")
    processor.finish("a", "abort")
    other = tracked(processor, "a#1")
    assert other.request.request_id != retry.request.request_id
    processor.process([(retry.request.request_id, [ord("Z")], None, 0, None, None, None, None, None)])  # in flight
    assert other.items == []
