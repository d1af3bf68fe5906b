"""The whole cluster on this machine, started as `headroom serve` starts it: two CPU replicas
of the built-in model behind Serve's gRPC and HTTP proxies. Clients stream over gRPC and over
the OpenAI API (SSE), bad input fails naming the field, the router spreads requests over both
replicas, `headroom status` shows both replicas' load and the router's metrics are scraped.
Each replica's internal endpoint serves loads to holders of the cluster token only, and no
Generate; the token shows in no routing stat, status output, metric, log or command line.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import pathlib
import urllib.request

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")

from cluster import status_command  # noqa: E402
from cluster.cli import main  # noqa: E402
from cluster.deployment import METRICS_ENDPOINT_STAT, PORT_SEARCH, routing_stats, running_replicas  # noqa: E402
from protos import headroom_pb2 as pb  # noqa: E402
from protos import headroom_pb2_grpc as pb_grpc  # noqa: E402
from replica.server.auth import authorization_metadata  # noqa: E402
from router.cluster_token import cluster_token  # noqa: E402
from tests.replica.replica_harness import load_reporter_calls  # noqa: E402
from tests.cluster.serve_harness import (  # noqa: E402
    local_cluster,
    APP_NAME, ENGINE, generate_request, grpc_target, http_base, small_config, sse_events,
    stream_generate,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

CONFIG = small_config(28400)
HTTP = http_base(CONFIG)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(CONFIG) as config:
        yield config


# ---- gRPC through Serve's proxy ----------------------------------------------------------
def test_generate_streams_every_token_through_serves_grpc_proxy(channel):
    result = stream_generate(channel, generate_request(12))
    assert result.code == grpc.StatusCode.OK, result.details
    assert len(result.responses) >= 2  # streamed, not one reply at the end
    last = result.responses[-1]
    assert result.num_tokens == 12 and last.usage.completion_tokens == 12
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert result.replica_id and all(response.replica_id == result.replica_id for response in result.responses)


def test_prompt_logprobs_cross_the_cluster_on_the_first_grpc_response(channel):
    # The replica computes them, Ray carries them back to the ingress, the proxy to the client.
    result = stream_generate(channel, generate_request(3, prompt="hello there", prompt_logprobs=2))
    assert result.code == grpc.StatusCode.OK, result.details
    scored = result.responses[0].prompt_logprobs
    assert len(scored.logprobs) == len(scored.ranks) == len(scored.top_logprobs) == len("hello there") - 1
    assert all(len(top.token_ids) == 2 for top in scored.top_logprobs)
    assert not any(response.HasField("prompt_logprobs") for response in result.responses[1:])


@pytest.mark.parametrize("request_, field", [
    (generate_request(8, temperature=-1.0), "sampling.temperature"),
    (generate_request(8, prompt_logprobs=21), "sampling.prompt_logprobs"),
    (pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)), "prompt"),
    (generate_request(ENGINE["max_model_len"]), "sampling.max_tokens"),
    # Checked by the replica, not the ingress: the field survives the trip back through Ray.
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[99_999]), sampling=pb.SamplingParams(max_tokens=4)), "token_ids"),
])
def test_bad_generate_request_is_invalid_argument_naming_the_field(channel, request_, field):
    result = stream_generate(channel, request_)
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT
    assert result.details.startswith(f"{field}: "), result.details


def test_tokenize_and_model_info_answer_through_the_proxy(channel):
    stub = pb_grpc.GenerationStub(channel)
    assert list(stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=30).token_ids) == [ord("h"), ord("i")]
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert (info.model_id, info.max_model_len, info.block_size) == (APP_NAME, ENGINE["max_model_len"], 16)


def test_requests_spread_over_both_replicas(channel):
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda _: stream_generate(channel, generate_request(24)), range(12)))
    assert all(result.code == grpc.StatusCode.OK and result.num_tokens == 24 for result in results)
    served = collections.Counter(result.replica_id for result in results)
    assert len(served) == 2, served


# ---- OpenAI-compatible HTTP API ----------------------------------------------------------
def test_models_lists_the_served_model_and_retrieves_it_by_id(cluster):
    body = requests.get(f"{HTTP}/v1/models", timeout=30).json()
    assert [model["id"] for model in body["data"]] == [APP_NAME]
    # client.models.retrieve(id): the one model, or 404 model_not_found for another id
    assert requests.get(f"{HTTP}/v1/models/{APP_NAME}", timeout=30).json() == body["data"][0]
    other = requests.get(f"{HTTP}/v1/models/gpt-4o", timeout=30)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_completion_streams_sse_chunks_ending_with_done_and_matches_the_non_streaming_text(cluster):
    body = {"model": APP_NAME, "prompt": "hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with requests.post(f"{HTTP}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed_text = "".join(chunk["choices"][0]["text"] for chunk in chunks)

    whole = requests.post(f"{HTTP}/v1/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["text"] == streamed_text  # greedy: the same tokens either way
    assert whole["usage"]["completion_tokens"] == 10 and whole["choices"][0]["finish_reason"] == "length"


def test_chat_completion_streams_role_then_content_and_answers_whole(cluster):
    body = {"model": APP_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    with requests.post(f"{HTTP}/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}},
                       stream=True, timeout=60) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["usage"]["completion_tokens"] == 6  # the usage chunk comes last

    whole = requests.post(f"{HTTP}/v1/chat/completions", json=body, timeout=60).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": ENGINE["max_model_len"]}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, "messages"),
    ("/v1/completions", {"prompt": [99_999], "max_tokens": 4}, "prompt"),  # rejected by the replica
])
def test_bad_openai_request_is_400_in_openais_error_shape(cluster, path, body, param):
    response = requests.post(f"{HTTP}{path}", json={"model": APP_NAME, **body}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if error["code"] == "context_length_exceeded":  # OpenAI's words, which clients match on
        assert error["message"].startswith("This model's maximum context length is"), error
    else:
        assert error["message"].startswith(f"{param}")


def test_unknown_model_is_404_model_not_found(cluster):
    response = requests.post(f"{HTTP}/v1/completions", json={"model": "gpt-4", "prompt": "hi"}, timeout=60)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


# ---- the CLI against the running cluster ------------------------------------------------
def test_headroom_status_shows_both_replicas_live_load(cluster, channel, capsys):
    statuses = status_command.replica_statuses()
    assert len(statuses) == 2 and all(status.load is not None for status in statuses)
    assert {status.load.replica_id for status in statuses} == {status.replica_id for status in statuses}
    assert all(status.load.kv_blocks_total == ENGINE["num_kv_blocks"] - 1 for status in statuses)

    assert main(["status"]) == 0
    table = capsys.readouterr().out
    for status in statuses:  # the room the router scores (net of committed KV), and the gross
        row = next(line for line in table.splitlines() if status.replica_id in line)
        assert f" {status_command.net_headroom_tokens(status.load)} " in row
        assert f" {status.load.headroom_tokens} " in row
    # This cluster takes no API key: status says anyone can get in.
    assert f"{APP_NAME}: gRPC door 127.0.0.1:{cluster.grpc_options.port} open: serves clients without an API key" \
        in table


def test_headroom_generate_streams_the_text_to_stdout(cluster, capsys):
    assert main(["generate", "hello", "--target", grpc_target(cluster), "--max-tokens", "5",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_headroom_generate_sends_its_sampling_and_constraint_flags(cluster, capsys, tmp_path):
    def generate(*flags: str) -> str:
        assert main(["generate", "hello", "--target", grpc_target(cluster), "--max-tokens", "8", "--ignore-eos",
                     "--raw", *flags]) == 0
        return capsys.readouterr().out[:-1]

    greedy = generate("--temperature", "0")
    hot = ("--temperature", "1.5", "--seed", "3")
    assert generate(*hot) != greedy  # sampling this hot leaves the greedy path...
    assert generate(*hot, "--top-k", "1") == greedy  # ...unless only the likeliest token is left
    assert generate(*hot, "--top-p", "1e-6") == greedy
    stop = greedy[len(greedy) // 2:][:2]
    assert stop and generate("--temperature", "0", "--stop", "\u2603" * 3, "--stop", stop) == greedy[:greedy.index(stop)]
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert generate(*hot, "--grammar", str(grammar)) in ("yes", "no")


def test_headroom_bench_completes_every_request_and_counts_preemptions(cluster, capsys):
    assert main(["bench", "--target", grpc_target(cluster), "--requests", "8", "--concurrency", "4",
                 "--prompt-tokens", "16", "--max-tokens", "8"]) == 0
    summary = capsys.readouterr().out
    assert "8 completed, 0 failed" in summary and "TTFT p50 / p99" in summary
    assert "preemptions" in summary and "n/a" not in summary


def test_router_metrics_are_served_from_the_ingress(cluster, channel):
    stream_generate(channel, generate_request(4))
    port = cluster.applications[0].args.ports.router_metrics
    url = f"http://{cluster.applications[0].args.ports.bind_address}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
    decided_for = {sample.labels["replica"] for sample in families["headroom_router_decisions"].samples
                   if sample.name == "headroom_router_decisions_total"}
    assert decided_for == {status.replica_id for status in status_command.replica_statuses()}


# ---- the replica-internal endpoint and the cluster token -------------------------------------
def test_a_replicas_internal_endpoint_serves_loads_to_the_cluster_token_only_and_no_generate(cluster):
    token = authorization_metadata(cluster_token())
    base_port = cluster.applications[0].args.ports.replica_grpc
    statuses = status_command.replica_statuses()  # `headroom status` reads loads with the token
    assert len(statuses) == 2 and all(status.load is not None for status in statuses)
    for status in statuses:
        assert base_port <= int(status.load_endpoint.rsplit(":", 1)[1]) < base_port + PORT_SEARCH
        with grpc.insecure_channel(status.load_endpoint) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(pb_grpc.GenerationStub(channel).Generate(generate_request(2), metadata=token, timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            calls = load_reporter_calls(channel)
            for name, call in calls.items():
                for metadata in (None, authorization_metadata("not-the-token")):
                    with pytest.raises(grpc.RpcError) as unauthenticated:
                        call(metadata)
                    assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert calls["GetLoad"](token).replica_id == status.replica_id
            assert calls["WatchLoad"](token).replica_id == status.replica_id
            assert calls["WatchKVEvents"](token).snapshot
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING



def test_the_cluster_token_is_in_no_routing_stat_status_output_metric_log_or_command_line(cluster, channel, capsys):
    token = cluster_token()
    assert stream_generate(channel, generate_request(4)).code == grpc.StatusCode.OK
    stats = [routing_stats(replica) for _, replica in running_replicas()]
    assert len(stats) == 2 and not any(token in value for stat in stats for value in stat.values())
    assert main(["status"]) == 0
    printed = capsys.readouterr()
    assert "KV headroom" in printed.out and token not in printed.out + printed.err
    args = cluster.applications[0].args
    metrics_urls = [f"http://{stat[METRICS_ENDPOINT_STAT]}/metrics" for stat in stats]
    metrics_urls.append(f"http://{args.ports.bind_address}:{args.ports.router_metrics}/metrics")
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert "headroom_" in text and token not in text, url
    # Serve's view of the deployments, which its REST API and dashboard show.
    from ray.serve.context import _get_global_client
    assert token not in json.dumps(_get_global_client().get_serve_details(), default=str)
    # Every log the Ray session wrote so far (controller, proxies, replicas, ingress, core workers).
    logs_dir = pathlib.Path(ray._private.worker._global_node.get_logs_dir_path())
    log_files = [path for path in logs_dir.rglob("*") if path.is_file()]
    assert log_files and not any(token.encode() in path.read_bytes() for path in log_files)
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert token.encode() not in cmdline.read_bytes(), cmdline
        except OSError:  # the process ended
            continue
