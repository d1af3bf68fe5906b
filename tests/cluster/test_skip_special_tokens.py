"""vLLM's `skip_special_tokens`: false keeps every special token in the text (it was a 400), on
the ingress's routes with the replica's front detokenizing (the built-in model; no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from tests.cluster.test_openai_api import completing_ingress, post
from tests.cluster.test_openai_vllm_compat import answer, front_detokenizing


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_skip_special_tokens_false_keeps_every_special_token_in_the_text(path):
    from tests.cluster.test_openai_api import RecordingTokenizer

    tokenizer = RecordingTokenizer().real
    special = tokenizer.special_token_ids(["<|reserved_5|>"])[0]
    generated = [special] + tokenizer.encode("Sure.", add_special_tokens=False) + [tokenizer.eos_token_id]
    sent = []
    ingress = completing_ingress(front_detokenizing(tokenizer, generated, sent))
    chat = path.endswith("chat/completions")
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}

    def text(**extra):
        status, reply = answer(asyncio.run(post(ingress, path, {**body, "max_tokens": 10, **extra})))
        assert status == 200, reply
        choice = reply["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    # The EOS that ends it is no text either way, as in vLLM.
    assert text(skip_special_tokens=False) == "<|reserved_5|>Sure." and sent[-1].skip_special_tokens is False
    assert text() == text(skip_special_tokens=True) == text(skip_special_tokens=None) == "Sure."
    assert sent[-1].skip_special_tokens is True
    status, reply = answer(asyncio.run(post(ingress, path, {**body, "skip_special_tokens": "no"})))
    assert status == 400 and reply["error"]["param"] == "skip_special_tokens"


def test_skip_special_tokens_crosses_to_the_core_and_is_checked_where_it_enters():
    from replica.core.request import Request, SamplingParams
    from replica.errors import InvalidRequestError
    from replica.ipc.messages import AddRequest

    request = Request("r", [1, 2], SamplingParams(skip_special_tokens=False))
    assert AddRequest.of(request).to_request((0,)).sampling_params.skip_special_tokens is False
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(skip_special_tokens="no").validate(prompt_len=2, max_model_len=64)
    assert refused.value.field == "skip_special_tokens"
