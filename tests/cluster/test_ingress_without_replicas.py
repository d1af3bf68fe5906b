"""What the ingress answers on its own, through its route methods on the built-in model (no
Ray): /tokenize, /detokenize and /v1/models with no replica up, /version from a source tree with no
package metadata, and the retry wait a 429 or 503 asks for, drawn per refusal."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.cluster.test_openai_api import completing_ingress, post
from tests.cluster.test_openai_vllm_compat import answer, http_request, no_replica

REPO = Path(__file__).resolve().parents[2]


def replica_never_answers(ingress, max_model_len=None):
    """`ingress` as it stands with no replica up: nothing said yet, and a call to one (Serve's
    handle, which waits for a replica to come) never returns."""
    from cluster.config import ClusterConfig

    async def waits_for_a_replica():
        await asyncio.Event().wait()

    ingress._model_info, ingress.model_info = None, waits_for_a_replica
    ingress.engine_config = ClusterConfig(model="builtin", engine={"max_model_len": max_model_len}).engine
    return ingress


@pytest.mark.parametrize("max_model_len", [None, 200])
def test_tokenize_and_detokenize_answer_with_no_replica_up(max_model_len):
    """Both awaited a replica's ModelInfo for max_model_len and the vocabulary's size: with no
    replica up they hung. The context length is the configured one, else null until a replica
    has said it (a profiled KV pool may cut it); the vocabulary is the checkpoint's."""
    ingress = replica_never_answers(completing_ingress(no_replica), max_model_len)
    tokenizer = ingress.tokenizer

    async def scenario():
        routes = [ingress.tokenize(http_request("/tokenize", {"prompt": "hello"})),
                  ingress.detokenize(http_request("/detokenize", {"tokens": tokenizer.encode("hello")})),
                  ingress.detokenize(http_request("/detokenize", {"tokens": [1, ingress.vocab_size]}))]
        return [answer(await asyncio.wait_for(route, 10)) for route in routes]

    tokenized, detokenized, refused = asyncio.run(scenario())
    assert tokenized == (200, {"count": len(tokenizer.encode("hello")), "max_model_len": max_model_len,
                               "tokens": tokenizer.encode("hello"), "token_strs": None})
    assert detokenized == (200, {"prompt": tokenizer.decode(tokenizer.encode("hello"))})
    assert refused[0] == 400 and refused[1]["error"]["param"] == "tokens"


@pytest.mark.parametrize("max_model_len", [None, 200])
def test_the_model_list_answers_with_no_replica_up(max_model_len):
    """/v1/models (and /v1/models/{id}) awaited a replica's ModelInfo for max_model_len: with no
    replica up they hung. The context length is /tokenize's: the configured one, else null."""
    ingress = replica_never_answers(completing_ingress(no_replica), max_model_len)

    async def scenario():
        return await asyncio.wait_for(ingress.models(), 5), await asyncio.wait_for(ingress.model(ingress.model_id), 5)

    listed, retrieved = asyncio.run(scenario())
    assert listed == {"object": "list", "data": [retrieved]}
    assert retrieved["id"] == ingress.model_id and retrieved["max_model_len"] == max_model_len


def test_tokenize_and_the_model_list_give_the_context_a_replica_said_once_one_has():
    ingress = completing_ingress(no_replica)  # its replica said max_model_len 256
    status, reply = answer(asyncio.run(ingress.tokenize(http_request("/tokenize", {"prompt": "hello"}))))
    assert status == 200 and reply["max_model_len"] == 256
    assert asyncio.run(ingress.models())["data"][0]["max_model_len"] == 256


def test_the_ingress_reads_the_vocabulary_a_replica_reads():
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.model.checkpoint import read_model_config
    from replica.model.registry import resolve_model_path

    engine = LLMEngine(make_engine_config(max_model_len=256, block_size=16, num_kv_blocks=64), "builtin",
                       device="cpu")
    try:
        assert read_model_config(resolve_model_path("builtin")).vocab_size == engine.model_config.vocab_size
    finally:
        engine.shutdown()


FAKE_NO_METADATA = """
import importlib.metadata as metadata
real = metadata.version
def version(name):
    if name == "headroom":
        raise metadata.PackageNotFoundError(name)
    return real(name)
metadata.version = version
"""


def test_the_ingress_imports_from_a_source_tree_and_reports_its_pyproject_version(tmp_path, monkeypatch):
    """Run from a source tree (PYTHONPATH, a Ray working_dir) no package metadata exists: the
    version lookup at import raised PackageNotFoundError, so nothing importing the ingress
    (headroom serve, the Serve application) started."""
    code = FAKE_NO_METADATA + "import cluster.ingress\nprint(cluster.ingress.HEADROOM_VERSION)\n"
    ran = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ran.returncode == 0, ran.stderr[-2000:]
    with open(REPO / "pyproject.toml", "rb") as file:
        assert ran.stdout.strip() == tomllib.load(file)["project"]["version"]
    # Neither metadata nor a pyproject.toml: still a version string.
    from cluster.ingress import headroom_version

    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    assert headroom_version(tmp_path) == "0+unknown"


def test_each_refusal_asks_for_a_wait_of_its_own_which_the_openai_client_waits():
    """Every 429 and 503 said `Retry-After: 1`, which the openai client waits exactly (no
    jitter of its own): every client refused together came back together, to be refused again."""
    from openai import OpenAI
    from openai._base_client import httpx2
    from openai._models import FinalRequestOptions

    from replica.errors import QueueFullError

    async def refused(request):
        raise QueueFullError("the waiting queue is full")
        yield

    headers = [asyncio.run(post(completing_ingress(refused), "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
               .headers for _ in range(20)]
    waits_ms = [int(header["retry-after-ms"]) for header in headers]
    assert all(500 <= wait_ms <= 2000 for wait_ms in waits_ms) and max(waits_ms) - min(waits_ms) >= 300
    assert [header["retry-after"] for header in headers] == [str(-(-wait_ms // 1000)) for wait_ms in waits_ms]
    client = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1", max_retries=2)
    options = FinalRequestOptions.construct(method="post", url="/completions")
    client_waits = [client._calculate_retry_timeout(2, options, httpx2.Headers(dict(header))) for header in headers]
    assert client_waits == [wait_ms / 1000 for wait_ms in waits_ms]
