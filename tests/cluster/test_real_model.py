"""The real default model through the whole cluster, as `headroom serve` starts it: an OpenAI
chat completion, a gRPC chat request through Serve's proxy and `headroom generate --chat`
each ask SmolLM2-135M-Instruct for the capital of France, and each answer says Paris; with
tool_choice required it calls the tool, and under a JSON schema its answer validates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import jsonschema
import pytest
import requests

ray = pytest.importorskip("ray")

from protos import headroom_pb2 as pb  # noqa: E402
from replica.model.registry import DEFAULT_MODEL_NAME  # noqa: E402
from tests.cluster.serve_harness import grpc_target, http_base, local_cluster, small_config, stream_generate  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

MODEL = DEFAULT_MODEL_NAME
# One replica: the point is the real model through every hop, not routing between replicas.
CONFIG = small_config(28700, model=MODEL, num_replicas=1, engine={"num_kv_blocks": 64})
QUESTION = "What is the capital of France? Answer in one sentence."
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(smollm2_dir):  # fetched and converted before Ray starts, as `headroom serve` does
    with local_cluster(CONFIG) as config:
        yield config


def test_an_openai_chat_completion_answers_paris(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32, "temperature": 0}
    response = requests.post(f"{http_base(cluster)}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"  # the model ended its turn with <|im_end|>


def test_smollm2_calls_a_required_tool_and_fills_a_json_schema_that_validate(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{http_base(cluster)}/v1", api_key="unused", max_retries=0, timeout=120)
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=64,
        temperature=0, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}])
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), parameters)

    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 100}},
              "required": ["capital", "population_millions"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_a_grpc_chat_request_through_serves_proxy_answers_paris(cluster):
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)]),
                                 sampling=pb.SamplingParams(max_tokens=32, temperature=0.0))
    with grpc.insecure_channel(grpc_target(cluster)) as channel:
        result = stream_generate(channel, request)
    assert result.code == grpc.StatusCode.OK, result.details
    assert "Paris" in "".join(response.text for response in result.responses)
    assert result.responses[-1].finish_reason == pb.FINISH_REASON_STOP


def test_headroom_generate_chat_prints_the_answer(cluster):
    finished = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "--chat", QUESTION, "--target", grpc_target(cluster),
         "--temperature", "0", "--max-tokens", "32"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert finished.returncode == 0, finished.stderr
    assert "Paris" in finished.stdout
