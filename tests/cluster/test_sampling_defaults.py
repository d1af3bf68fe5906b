"""The OpenAI routes give what a body leaves unset (or null) the model's generation_config.json
defaults, as vLLM's server does, and keep what it sets, even the built-in defaults; through the
ingress's own `_complete` on a real Starlette request, without Serve."""

from __future__ import annotations

import asyncio

import pytest

from replica.core.request import SamplingParams
from replica.model.checkpoint import sampling_defaults
from test_openai_api import chunk, completing_ingress, post
from tests.replica.generation_config_files import recommending_checkpoint

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_MODEL_LEN = 256  # completing_ingress's replicas'


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    return sampling_defaults(recommending_checkpoint(tmp_path_factory.mktemp("models") / "recommending"), "auto")


def sent_sampling(defaults, path: str, **body) -> SamplingParams:
    """The sampling parameters the ingress sends a replica for this body."""
    sent = []

    async def replica_stream(request):
        sent.append(request.sampling)
        yield chunk("a", [65], "length")

    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    response = asyncio.run(post(completing_ingress(replica_stream, defaults), path, {**prompt, **body}))
    assert isinstance(response, dict), response.body  # the body of a 200; a refusal is a JSONResponse
    (sampling,) = sent
    return sampling


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_body_that_leaves_sampling_unset_gets_the_models_defaults(defaults, path):
    sampling = sent_sampling(defaults, path, max_tokens=5)
    assert (sampling.temperature, sampling.top_k, sampling.repetition_penalty) == (0.7, 1, 5.0)
    assert (sampling.top_p, sampling.min_p) == (1.0, 0.0)  # the model gives none: SamplingParams'
    nulls = sent_sampling(defaults, path, max_tokens=5, temperature=None, top_k=None, repetition_penalty=None)
    assert (nulls.temperature, nulls.top_k, nulls.repetition_penalty) == (0.7, 1, 5.0)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_body_that_sets_the_built_in_defaults_keeps_them(defaults, path):
    sampling = sent_sampling(defaults, path, max_tokens=5, temperature=1.0, top_k=0, repetition_penalty=1.0)
    assert (sampling.temperature, sampling.top_k, sampling.repetition_penalty) == (1.0, 0, 1.0)


def test_the_models_max_new_tokens_bounds_an_unset_max_tokens_only(defaults):
    assert sent_sampling(defaults, CHAT).max_tokens == 6  # up to the context, at most max_new_tokens
    assert sent_sampling(defaults, CHAT, max_tokens=20).max_tokens == 20
    assert sent_sampling(defaults, COMPLETIONS).max_tokens == 16  # OpenAI's completions default is set
    assert sent_sampling(defaults, COMPLETIONS, max_tokens=None).max_tokens == 6


def test_serve_refuses_a_default_no_request_could_have_before_ray_starts(tmp_path, monkeypatch, capsys):
    """Else the ingress (and every replica Serve starts, in turn) failed its start under Serve."""
    from cluster import serve_command
    from cluster.cli import main

    def no_ray(*args, **kwargs):
        raise AssertionError("headroom serve started Ray with a model it could not serve")

    monkeypatch.setattr(serve_command, "init_local_ray", no_ray)
    model_dir = recommending_checkpoint(tmp_path / "bad", temperature=-1)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(model_dir)])
    assert exited.value.code == 2
    assert "generation_config.json: temperature -1: must be >= 0" in capsys.readouterr().err
