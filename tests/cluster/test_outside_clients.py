"""The cluster as clients nobody on the project wrote meet it, on one live cluster started as
`headroom serve` starts it: cancelled streams stop on every path, one large request stalls
nobody, Prometheus (with deploy/prometheus.yml and the cluster's own target files) fills
every dashboard panel and fires no alert, the cluster port answers health checks and
reflection v1 and v1alpha, and the official `openai` client works with the parameters
people send, structured outputs and tool calls included.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Literal

import grpc
import jsonschema
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from cluster import status_command  # noqa: E402
from cluster.deployment import METRICS_ENDPOINT_STAT, routing_stats, running_replicas  # noqa: E402
from cluster.prometheus_targets import replicas_file, router_file  # noqa: E402
from protos import headroom_pb2 as pb  # noqa: E402
from protos import headroom_pb2_grpc as pb_grpc  # noqa: E402
from replica.server.metrics import REPLICA_METRIC_NAMES  # noqa: E402
from tests.cluster.prometheus_harness import (  # noqa: E402
    prometheus_binary, prometheus_unavailable, running_prometheus, scrape_config_for, with_grafana_variables,
)
from tests.cluster.serve_harness import (  # noqa: E402
    APP_NAME, ENGINE, GRPC_TIMEOUT_S, generate_request, grpc_target, http_base, local_cluster, small_config,
    sse_events, stream_generate,
)
from tests.cluster.test_dashboard import alert_expressions, dashboard_queries, metric_names  # noqa: E402
from tests.replica.replica_harness import reflect  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

# A small KV pool (47 usable blocks of 16 per replica) so that the load run really preempts,
# and no prefix cache to serve a preempted request's blocks back: it recomputes them, so
# the recompute panel has something to show too.
ENGINE_OVERRIDES = {"num_kv_blocks": 48, "enable_prefix_caching": False}
# Long prompts are allowed up to 600k characters: tokenizing one takes a second or more here.
MAX_PROMPT_CHARS = 600_000
CONFIG = small_config(28700, engine=ENGINE_OVERRIDES, limits={"max_prompt_chars": MAX_PROMPT_CHARS})
HTTP = http_base(CONFIG)
TARGETS_DIR = Path(CONFIG.applications[0].args.monitoring.targets_dir)
NUM_CANCELLED = 50
# As long as the context allows: a stream the cancellation misses runs for many seconds.
LONG_MAX_TOKENS = ENGINE["max_model_len"] - 16
MAX_SIZE_DELAY_S = 0.1


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(CONFIG) as config:
        yield config


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{HTTP}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_until_idle(timeout_s: float = 60.0) -> list:
    """Every replica's load once none runs or queues anything (or the last seen, at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [status.load for status in status_command.replica_statuses()]
        if all(load.num_running == 0 and load.num_waiting == 0 for load in loads) or time.monotonic() > deadline:
            return loads


def assert_nothing_runs_one_second_after(loads_after_1s: list) -> None:
    still_running = sum(load.num_running + load.num_waiting for load in loads_after_1s)
    assert still_running == 0, f"{still_running} cancelled requests still running or queued 1 s later"
    assert all(load.kv_blocks_free == load.kv_blocks_total for load in loads_after_1s), loads_after_1s


# ---- cancellation -------------------------------------------------------------------------
def test_cancelled_grpc_streams_stop_generating_through_serves_proxy(cluster, channel):
    wait_until_idle()
    stub = pb_grpc.GenerationStub(channel)

    def cancel_after_first_token(index: int) -> int:
        call = stub.Generate(generate_request(LONG_MAX_TOKENS, prompt=f"cancel me {index}"), timeout=GRPC_TIMEOUT_S)
        first = next(call)
        call.cancel()
        return len(first.token_ids)

    with concurrent.futures.ThreadPoolExecutor(max_workers=NUM_CANCELLED) as pool:
        assert all(pool.map(cancel_after_first_token, range(NUM_CANCELLED)))
    time.sleep(1.0)
    assert_nothing_runs_one_second_after([status.load for status in status_command.replica_statuses()])
    # Each cancel left Serve's task for the next item unread: a 1.4 KB traceback in the proxy's log.
    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
    logs = "".join(path.read_text(errors="replace") for path in logs_dir.glob("worker-*.err"))
    assert "RequestCancelledError" not in logs


def test_closed_http_streams_stop_generating(cluster):
    wait_until_idle()
    body = {"model": APP_NAME, "max_tokens": LONG_MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}

    def close_after_first_chunk(index: int) -> bool:
        with requests.post(f"{HTTP}/v1/completions", json={**body, "prompt": f"close me {index}"},
                           stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: {"):
                    return True  # leaving the block closes the connection
        return False

    with concurrent.futures.ThreadPoolExecutor(max_workers=NUM_CANCELLED) as pool:
        assert all(pool.map(close_after_first_chunk, range(NUM_CANCELLED)))
    time.sleep(1.0)
    assert_nothing_runs_one_second_after([status.load for status in status_command.replica_statuses()])


def preemptions_so_far() -> float:
    return sum(scrape_all_samples("headroom_num_preemptions_total"))


def scrape_all_samples(name: str) -> list[float]:
    values = []
    for target in read_targets(replicas_file(TARGETS_DIR, APP_NAME)):
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
            values += [sample.value for family in text_string_to_metric_families(response.read().decode())
                       for sample in family.samples if sample.name == name]
    return values


def test_constrained_streams_closed_mid_stream_and_while_preempted_free_every_block(cluster):
    """Constrained streams in a pool too small for them: once one is preempted (recomputed
    later), every client closes its stream; nothing runs or holds a block a second later."""
    wait_until_idle()
    before = preemptions_so_far()
    close = threading.Event()
    body = {"model": APP_NAME, "max_tokens": LONG_MAX_TOKENS, "temperature": 0, "stream": True,
            "guided_regex": f"[a-z]{{{LONG_MAX_TOKENS + 8}}}"}

    def stream_until_closed(index: int) -> int:
        chunks = 0
        with requests.post(f"{HTTP}/v1/completions", json={**body, "prompt": f"constrained {index}"},
                           stream=True, timeout=120) as response:
            for line in response.iter_lines():
                chunks += line.startswith(b"data: {")
                if close.is_set():
                    break  # leaving the block closes the connection
        return chunks

    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        streams = [pool.submit(stream_until_closed, index) for index in range(32)]
        deadline = time.monotonic() + 60
        while preemptions_so_far() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        preempted = preemptions_so_far() > before
        close.set()
        assert all(stream.result() > 0 for stream in streams)
    assert preempted, "no constrained request was preempted: the pool is too roomy for this test"
    time.sleep(1.0)
    assert_nothing_runs_one_second_after([status.load for status in status_command.replica_statuses()])


def test_clients_gone_while_their_grammars_compile_leave_nothing_behind(cluster):
    """Clients each send a constraint slow to compile (a JSON schema's enum of 30,000 strings)
    and disconnect while it compiles or waits for an ingress compile thread (their waits are
    cancelled with them, and so are the compiles nobody else waits for: tests/replica/
    test_structured_output.py); no block stays taken, and the next constrained request is served."""
    wait_until_idle()
    slow = [f"value {index}" for index in range(30_000)]

    def send_and_go(index: int) -> bool:
        body = completion(max_tokens=4, guided_json={"enum": [*slow, f"gone {index} {time.time()}"]})
        try:
            requests.post(f"{HTTP}{C}", json=body, timeout=(30, 0.2))
        except requests.exceptions.ReadTimeout:
            return True
        return False

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(send_and_go, range(4)))
    response = requests.post(f"{HTTP}{C}", json=completion(max_tokens=4, guided_choice=["yes", "no", str(time.time())]),
                             timeout=120)
    assert response.status_code == 200, response.text
    assert_nothing_runs_one_second_after(wait_until_idle())


def test_a_slow_grammar_compile_stalls_no_other_stream(cluster):
    """While a constraint slow to compile (seconds, at the ingress and again in the engine core:
    a JSON schema's enum of 60,000 strings) waits for its compiles, an unconstrained stream
    beside it keeps streaming: its longest gap between responses is a fraction of the time the
    constrained request took, whose output then keeps to the schema.

    The stream beside is gRPC's, through the same ingress: it answers each token as it comes. An
    OpenAI stream holds back text that is not yet whole UTF-8, and the random model's greedy
    output from "x" holds back ~100 tokens at once (a 0.6 s gap with no stall at all), which
    failed this test whenever the compiles took under ~1.3 s."""
    wait_until_idle()
    stamps: list[float] = []
    answered_event = threading.Event()

    def stream() -> None:  # one stream after another, until the constrained request is answered
        with grpc.insecure_channel(grpc_target(cluster)) as channel:
            while not answered_event.is_set():
                result = stream_generate(channel, generate_request(LONG_MAX_TOKENS, prompt="x"),
                                         on_response=lambda _: stamps.append(time.perf_counter()))
                assert result.code == grpc.StatusCode.OK, result.details

    values = [f"value {index}" for index in range(60_000)] + [f"fresh {time.time()}"]  # compiled afresh
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        beside = pool.submit(stream)
        while len(stamps) < 3 and not beside.done():
            time.sleep(0.01)
        sent = time.perf_counter()
        try:
            response = requests.post(f"{HTTP}{C}", json=completion(max_tokens=32, temperature=0, prompt="pick one",
                                                                   guided_json={"enum": values}), timeout=300)
        finally:
            answered = time.perf_counter()
            answered_event.set()
        beside.result()
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and json.loads(choice["text"]) in values, choice
    during = [later - earlier for earlier, later in zip(stamps, stamps[1:]) if earlier >= sent and later <= answered]
    assert during, "the stream ended before the compile began"
    assert max(during) < (answered - sent) / 2, (max(during), answered - sent)


def test_a_grammar_of_rules_nested_thousands_deep_is_served_and_the_ingress_lives_on(cluster):
    """Rules nested 4,000 deep (80 KB) overflowed the compile thread's stack and killed the
    ingress's process (SIGSEGV) as it checked the grammar."""
    depth = 4000
    grammar = "start: r0\n" + "\n".join(f'r{index}: "x" r{index + 1} | "y"' for index in range(depth)) + f'\nr{depth}: "z"'
    response = requests.post(f"{HTTP}{C}", json=completion(max_tokens=8, temperature=0, guided_grammar=grammar),
                             timeout=120)
    assert response.status_code == 200, response.text
    assert re.fullmatch("x*y?", response.json()["choices"][0]["text"]), response.json()
    assert good_http_request_succeeds()


# ---- one large request stalls nobody ------------------------------------------------------
def small_call_latencies(channel, until: threading.Event) -> list[float]:
    """Round trips of small calls that only the ingress serves (Tokenize over gRPC, the model
    list over HTTP), back to back until `until` is set."""
    stub = pb_grpc.GenerationStub(channel)
    latencies = []
    while not until.is_set():
        started = time.perf_counter()
        stub.Tokenize(pb.TokenizeRequest(text="small"), timeout=30)
        requests.get(f"{HTTP}/v1/models", timeout=30).raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


def delays_beside(channel, big_request) -> tuple[object, float, list[float]]:
    """Runs `big_request()` while small calls go on; returns its result, the small calls'
    median round trip beforehand, and their round trips during it."""
    baseline_done = threading.Event()
    timer = threading.Timer(1.0, baseline_done.set)
    timer.start()
    baseline = statistics.median(small_call_latencies(channel, baseline_done))
    big_done = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        small = pool.submit(small_call_latencies, channel, big_done)
        time.sleep(0.05)
        try:
            result = big_request()
        finally:
            big_done.set()
        during = small.result()
    return result, baseline, during


def result_delaying_no_other_request(channel, big_request) -> object:
    """`big_request()`'s result, asserting that small calls beside it were delayed by at most
    MAX_SIZE_DELAY_S over their round trip before it. A miss is measured once more: a stall the
    server causes (work on an event loop) repeats with the request, a hiccup of a shared 2-core
    machine (one call 0.11-0.15 s late, twice in full-suite runs beside other load) does not."""
    tries = []
    for _ in range(2):
        result, baseline, during = delays_beside(channel, big_request)
        tries.append((baseline, during))
        if during and max(during) - baseline <= MAX_SIZE_DELAY_S:
            return result
    raise AssertionError(f"small calls delayed past {MAX_SIZE_DELAY_S} s in both tries (baseline, during): {tries}")


def test_a_10mb_http_body_is_413_and_delays_no_other_request(cluster, channel):
    body = json.dumps({"model": APP_NAME, "prompt": "x" * 10_000_000, "max_tokens": 1}).encode()

    def post_big():
        return requests.post(f"{HTTP}/v1/completions", data=body, headers={"content-type": "application/json"},
                             timeout=120)

    response = result_delaying_no_other_request(channel, post_big)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["message"].startswith("body: ") and error["code"] == "request_too_large"


def test_a_batch_of_50000_prompts_is_refused_at_once_and_delays_no_other_request(cluster, channel):
    """Every prompt's every sequence was a replica call of its own, built and started on the
    ingress's event loop: 50,000 one-token prompts (250 KB) held every other request for
    seconds before the replicas' queues refused them (1,000 prompts with n=16: a stream beside
    it stalled 86 s). A request may ask for max_num_seqs sequences in all."""
    body = json.dumps({"model": APP_NAME, "prompt": [[1]] * 50_000, "max_tokens": 1}).encode()

    def post_batch():
        return requests.post(f"{HTTP}{C}", data=body, headers={"content-type": "application/json"}, timeout=120)

    response = result_delaying_no_other_request(channel, post_batch)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text


def generate_from_another_client(cluster, request: pb.GenerateRequest):
    """A call sending `request` (serialized beforehand, so this process spends no time on it
    during the call) on a connection of its own, as another client would; it returns
    (code, details)."""
    raw = request.SerializeToString()
    other = grpc.insecure_channel(grpc_target(cluster))
    generate = other.unary_stream("/headroom.v1.Generation/Generate", request_serializer=lambda data: data,
                                  response_deserializer=pb.GenerateResponse.FromString)

    def call():
        try:
            list(generate(raw, timeout=GRPC_TIMEOUT_S))
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            return error.code(), error.details()
        finally:
            other.close()

    return call


def test_a_10mb_grpc_message_is_invalid_argument_and_delays_no_other_request(cluster, channel):
    big = pb.GenerateRequest(text="x" * 10_000_000, sampling=pb.SamplingParams(max_tokens=1))
    code, details = result_delaying_no_other_request(channel, generate_from_another_client(cluster, big))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request: "), details


def proxy_peak_rss_bytes(port: int) -> int:
    """The high-water mark of the resident memory of the Serve proxy listening on `port`."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        if any("ProxyActor" in part for part in process.info["cmdline"] or ()):
            if any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
                   for conn in process.net_connections(kind="tcp")):
                return process.memory_full_info().rss if sys.platform != "linux" else int(
                    re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{process.pid}/status").read_text()).group(1)) * 1024
    raise AssertionError(f"no Serve proxy listens on {port}")


def test_a_grpc_message_far_past_the_bound_is_refused_as_it_arrives_not_buffered(cluster):
    """Serve's gRPC server took messages up to 2 GiB and buffered each whole before any handler
    (the API key's, the size bound's) ran: a 600 MB one from anyone took the proxy to 2.3 GB.
    gRPC itself now refuses one far past the bound as it arrives."""
    size = 128 * 1024 * 1024
    before = proxy_peak_rss_bytes(cluster.grpc_options.port)
    with grpc.insecure_channel(grpc_target(cluster), options=[("grpc.max_send_message_length", -1)]) as other:
        generate = other.unary_stream("/headroom.v1.Generation/Generate", request_serializer=lambda data: data,
                                      response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(b"\x0a" + b"x" * (size - 1), timeout=GRPC_TIMEOUT_S))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert proxy_peak_rss_bytes(cluster.grpc_options.port) - before < size // 2
    assert good_http_request_succeeds()


def test_a_long_prompt_is_tokenized_without_delaying_other_requests(cluster, channel):
    """Within the character limit, but longer than the context: the ingress must tokenize
    it (a second or more of one core) to know, and it does so off the event loop."""
    big = pb.GenerateRequest(text="lorem ipsum " * (MAX_PROMPT_CHARS // 12), sampling=pb.SamplingParams(max_tokens=1))
    started = time.perf_counter()
    (code, details), baseline, during = delays_beside(channel, generate_from_another_client(cluster, big))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt: "), details
    assert time.perf_counter() - started > 0.3  # long enough to stall everyone, were it on the loop
    assert during and max(during) - baseline <= MAX_SIZE_DELAY_S, (baseline, during)


# ---- health and reflection on the cluster port --------------------------------------------
@pytest.mark.parametrize("service", ["", "headroom.v1.Generation"])
def test_grpc_health_check_on_the_cluster_port_is_serving(channel, service):
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_on_the_cluster_port_lists_and_describes_generation(channel, version):
    services, files = reflect(channel, version, "headroom.v1.Generation")
    assert {"headroom.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    assert any(file.package == "headroom.v1" and file.service[0].name == "Generation" for file in files)


def test_unknown_application_metadata_is_not_found(channel):
    call = pb_grpc.GenerationStub(channel).Generate(generate_request(2), metadata=[("application", "nope")], timeout=30)
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND and raised.value.details().startswith("application: ")
    assert stream_generate(channel, generate_request(2)).code == grpc.StatusCode.OK


def test_a_loopback_cluster_refuses_generation_to_clients_on_other_machines(cluster):
    """Serve binds its gRPC proxy to every interface; reached through this machine's network
    address (as another machine would reach it), Generate is refused."""
    address = ray.util.get_node_ip_address()
    if address.startswith("127."):
        pytest.skip("this machine has no network address to come in through")
    with grpc.insecure_channel(f"{address}:{cluster.grpc_options.port}") as remote:
        result = stream_generate(remote, generate_request(2))
    assert result.code == grpc.StatusCode.PERMISSION_DENIED, (result.code, result.details)


# ---- Prometheus: discovery, every dashboard panel, quiet alerts ---------------------------
def read_targets(path: Path) -> list[str]:
    return [target for group in json.loads(path.read_text()) for target in group["targets"]]


def test_target_files_list_exactly_the_running_replicas_and_the_router(cluster):
    announced = sorted(routing_stats(replica)[METRICS_ENDPOINT_STAT] for _, replica in running_replicas(APP_NAME))
    assert len(announced) == 2
    deadline = time.monotonic() + 15
    while read_targets(replicas_file(TARGETS_DIR, APP_NAME)) != announced and time.monotonic() < deadline:
        time.sleep(0.5)
    assert read_targets(replicas_file(TARGETS_DIR, APP_NAME)) == announced
    (router_target,) = read_targets(router_file(TARGETS_DIR, APP_NAME))
    for target in announced + [router_target]:
        assert target.startswith("127.0.0.1:")  # a loopback cluster binds every endpoint to loopback
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
            assert b"headroom_" in response.read()


def run_load(channel, seconds: float) -> None:
    """Concurrent gRPC and HTTP streams long enough, in a pool small enough, to preempt."""
    deadline = time.monotonic() + seconds

    def grpc_stream(index: int) -> None:
        while time.monotonic() < deadline:
            assert stream_generate(channel, generate_request(96, prompt=f"load {index}")).code == grpc.StatusCode.OK

    def http_stream(index: int) -> None:
        while time.monotonic() < deadline:
            body = {"model": APP_NAME, "prompt": f"load {index}", "max_tokens": 96, "ignore_eos": True, "stream": True}
            with requests.post(f"{HTTP}/v1/completions", json=body, stream=True, timeout=120) as response:
                assert sse_events(response)[-1] == "[DONE]"

    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        futures = [pool.submit(grpc_stream, index) for index in range(12)]
        futures += [pool.submit(http_stream, index) for index in range(12)]
        for future in futures:
            future.result()


def scrape_all() -> dict[str, float]:
    """The largest value of every sample name over every target the cluster lists."""
    largest: dict[str, float] = {}
    for path in (replicas_file(TARGETS_DIR, APP_NAME), router_file(TARGETS_DIR, APP_NAME)):
        for target in read_targets(path):
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
                for family in text_string_to_metric_families(response.read().decode()):
                    for sample in family.samples:
                        largest[sample.name] = max(largest.get(sample.name, 0.0), sample.value)
    return largest


# Panels of features this cluster does not run, flat by design here: the host KV tier (off by
# default, num_host_kv_blocks 0; tests/replica/test_kv_swap_engine.py drives its counters) and
# the autoscaler (fixed num_replicas; tests/cluster/test_autoscaling_live.py runs it).
OFF_HERE = ("headroom_num_swap_preemptions_total", "headroom_recompute_tokens_avoided_total", "headroom_autoscaler_")


def panels_of_features_on_here() -> list[str]:
    return [query for query in dashboard_queries() if not any(name in query for name in OFF_HERE)]


def test_every_dashboard_query_has_data_after_load_and_no_alert_fires(cluster, channel, tmp_path):
    """Without a prometheus binary, the metrics each query reads must have a non-zero sample
    in a scrape taken during the load; with one, Prometheus runs deploy/prometheus.yml
    against the cluster's target files and evaluates every query and alert rule itself.
    Panels of features this cluster does not run (OFF_HERE) are left out."""
    assert len(panels_of_features_on_here()) < len(dashboard_queries())  # the probe: something is left out
    if prometheus_binary() is None:
        scrapes = []
        loader = threading.Thread(target=run_load, args=(channel, 8.0))
        loader.start()
        while loader.is_alive():
            scrapes.append(scrape_all())
            time.sleep(0.5)
        loader.join()
        for query in panels_of_features_on_here():
            for metric in metric_names(query):
                series = [f"{metric}_count", f"{metric}_total", metric]
                assert any(scrape.get(name, 0) > 0 for scrape in scrapes for name in series), (query, metric)
        pytest.skip(f"{prometheus_unavailable()}: checked the queried metrics' samples, not the queries")

    with running_prometheus(scrape_config_for(str(TARGETS_DIR)), tmp_path) as prometheus:
        prometheus.wait_for_targets("headroom-replica", 2)
        prometheus.wait_for_targets("headroom-router", 1)
        time.sleep(2)  # a few scrapes before the load, so rates have a baseline
        for expr in alert_expressions():  # a healthy, idle cluster: every alert quiet
            assert prometheus.query(expr) == [], expr
        load_started = time.time()
        run_load(channel, 8.0)
        time.sleep(3)  # the scrapes that saw the load's end
        assert prometheus.query("sum(headroom_num_preemptions_total)")[0]["value"][1] != "0", \
            "the load run must preempt, or the preemption panels show nothing"
        for query in panels_of_features_on_here():
            if query.startswith("label_values("):
                metric, _, label = query.removeprefix("label_values(").rstrip(")").rpartition(", ")
                if metric:  # the model: one series per replica
                    assert [series["metric"][label] for series in prometheus.query(metric)] == [APP_NAME] * 2
                else:  # the application: every series that carries one names this one
                    found = prometheus.query(f'count by ({label}) ({{{label}!=""}})')
                    assert [series["metric"][label] for series in found] == [APP_NAME]
                continue
            # The panel over the load's time range: some point of some series is a positive number.
            result = prometheus.query_range(with_grafana_variables(query), load_started, time.time())
            values = [float(value) for series in result for _, value in series["values"]]
            assert any(value == value and value > 0 for value in values), (query, result)
        # Overload may make an alert pending (that is what they watch for); none fires.
        assert prometheus.query('ALERTS{alertstate="firing"}') == []
        assert prometheus.query('up{job=~"headroom-.*"} == 0') == []


# ---- the official openai client -----------------------------------------------------------
def test_openai_client_completion_greedy_stream_equals_whole_and_stops_on_a_stop_string(client):
    whole = client.completions.create(model=APP_NAME, prompt="hello", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=APP_NAME, prompt="hello", max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices)
    assert streamed == text and whole.choices[0].finish_reason == "length"

    cut = next(start for start in range(2, len(text) - 2)
               if text.index(text[start:start + 2]) == start and "\ufffd" not in text[start:start + 2])
    stopped = client.completions.create(model=APP_NAME, prompt="hello", max_tokens=24, temperature=0,
                                        stop=[text[cut:cut + 2]], extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == text[:cut] and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == text[cut:cut + 2]
    assert stopped.usage.completion_tokens < 24


def test_openai_client_completion_n2_logprobs_seed_and_penalties(client):
    kwargs = dict(model=APP_NAME, prompt="seeded", max_tokens=12, temperature=1.0, seed=7, n=2, logprobs=5,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [choice.index for choice in first.choices] == [0, 1]
    assert [choice.text for choice in first.choices] == [choice.text for choice in again.choices]
    assert first.choices[0].logprobs.tokens != first.choices[1].logprobs.tokens  # each choice its own seed
    for choice in first.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 12
        # Top 5 and the sampled one, keyed by text: lone bytes of the byte-level vocabulary all
        # decode to U+FFFD, so alternatives can share a key (which ones depends on the seeded path).
        assert all(len(top) <= 6 and (len(top) >= 5 or "\ufffd" in top) for top in choice.logprobs.top_logprobs)
        assert all(token in top for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs))
    assert first.usage.completion_tokens == 24

    plain = client.completions.create(model=APP_NAME, prompt="la la la", max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    penalized = client.completions.create(model=APP_NAME, prompt="la la la", max_tokens=20, temperature=0,
                                          frequency_penalty=1.5, presence_penalty=0.5,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert penalized.choices[0].text != plain.choices[0].text


def test_openai_client_chat_logprobs_top5_n2_stream_and_stop(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    whole = client.chat.completions.create(model=APP_NAME, messages=messages, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 16 and all(len(entry.top_logprobs) == 5 for entry in content)
    assert all(entry.top_logprobs[0].token == entry.token for entry in content)  # greedy picks the top one

    stream = client.chat.completions.create(model=APP_NAME, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == whole.choices[0].message.content
    assert all(delta.content or delta.role for delta in deltas[:-1]), "an empty delta mid-stream"
    assert chunks[-1].usage.completion_tokens == 16

    text = whole.choices[0].message.content
    two = client.chat.completions.create(model=APP_NAME, messages=messages, max_tokens=16, temperature=0.8,
                                         seed=3, n=2, stop=[text[-3:]], extra_body={"ignore_eos": True})
    assert [choice.index for choice in two.choices] == [0, 1]
    assert all(choice.finish_reason in ("stop", "length") for choice in two.choices)


PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
    "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3},
}, "required": ["name", "age", "role", "scores"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_openai_client_json_schema_response_format_validates_streamed_and_whole_with_n2(client):
    # The built-in model has random weights: left alone it never writes JSON, so every valid
    # document here is the grammar's doing.
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model=APP_NAME, messages=[USER], max_tokens=160, temperature=1.0, seed=5,
                                           n=2, response_format=response_format)
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
    stream = client.chat.completions.create(model=APP_NAME, messages=[USER], max_tokens=160, temperature=1.0, seed=5,
                                            n=2, response_format=response_format, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [choice.message.content for choice in whole.choices]


def test_openai_client_parse_returns_the_pydantic_model(client):
    import pydantic

    class Reading(pydantic.BaseModel):
        sensor: Literal["a", "b"]
        value: int = pydantic.Field(ge=0, le=99)
        ok: bool

    parsed = client.chat.completions.parse(model=APP_NAME, messages=[USER], max_tokens=64, temperature=0,
                                           response_format=Reading)
    assert isinstance(parsed.choices[0].message.parsed, Reading)


def test_completions_guided_choice_regex_and_structured_outputs_match_streamed_and_whole(client):
    choices = ["red", "green", "blue"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        whole = client.completions.create(model=APP_NAME, prompt="colour:", max_tokens=8, temperature=1.0, seed=1,
                                          n=3, extra_body=extra)
        assert all(choice.text in choices and choice.finish_reason == "stop" for choice in whole.choices)
    pattern = r"[0-9]{3}-[A-Z]{2}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=APP_NAME, prompt="code:", max_tokens=12, temperature=0, stream=True, extra_body=extra)
            if chunk.choices)
        assert re.fullmatch(pattern, streamed)
    grammar = 'start: "yes" | "no" | "n/a"'
    answer = client.completions.create(model=APP_NAME, prompt="q:", max_tokens=8, temperature=0,
                                       extra_body={"guided_grammar": grammar})
    assert answer.choices[0].text in ("yes", "no", "n/a")
    cut = client.completions.create(model=APP_NAME, prompt="q:", max_tokens=3, temperature=0,
                                    extra_body={"guided_regex": "[a-z]{10}"})
    assert cut.choices[0].finish_reason == "length" and re.fullmatch("[a-z]{1,3}", cut.choices[0].text)


BLOWUP = "(a{1000}){1000}"  # a regex whose lexer exceeds llguidance's per-token budget on its first byte


def test_a_constraint_whose_lexer_blows_up_is_refused_by_name_and_one_failing_mid_output_ends_in_error(cluster, client,
                                                                                                      channel):
    """The regex passed the edges and its request ended after one token in the engine (a ~0.2 s
    step); now it is a 400 / INVALID_ARGUMENT naming its field. A grammar whose blow-up comes
    later (a few bytes into a Lark terminal after two others: the edge probes each terminal to
    the mask after its first byte) still fails mid-output: it ends there with an error
    naming its parameter (it ended with a bare finish reason abort), whole and streamed (after
    the text so far) on HTTP, and on gRPC; no KV block stays taken."""
    import openai

    for extra, param in (({"guided_regex": BLOWUP}, "guided_regex"),
                         ({"structured_outputs": {"regex": BLOWUP}}, "structured_outputs.regex")):
        response = requests.post(f"{HTTP}{C}", json=completion(max_tokens=4, **extra), timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert "too complex for the grammar engine" in response.json()["error"]["message"]
    stub = pb_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(pb.GenerateRequest(text="hi", regex=BLOWUP, sampling=pb.SamplingParams(max_tokens=4)),
                           timeout=GRPC_TIMEOUT_S))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("regex: it is too complex"), raised.value.details()

    late = f'start: "pick" /[0-9]/ LATE\nLATE: /q[ab]x{BLOWUP}/'
    failed = "its output constraint failed at token"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=APP_NAME, prompt="q:", max_tokens=12, temperature=0,
                                  extra_body={"guided_grammar": late})
    assert refused.value.body["param"] == "guided_grammar" and failed in refused.value.body["message"], refused.value
    texts = []
    with pytest.raises(openai.APIError) as cut:
        for chunk in client.completions.create(model=APP_NAME, prompt="q:", max_tokens=12, temperature=0, stream=True,
                                               extra_body={"guided_grammar": late}):
            texts.extend(choice.text for choice in chunk.choices)
    assert failed in str(cut.value) and re.fullmatch("pick([0-9](q[ab]?x?)?)?", "".join(texts)), (cut.value, texts)
    texts = []
    with pytest.raises(grpc.RpcError) as cut:
        for response in stub.Generate(pb.GenerateRequest(text="q:", grammar=late, sampling=pb.SamplingParams(
                max_tokens=12, temperature=0.0)), timeout=GRPC_TIMEOUT_S):
            texts.append(response.text)
    assert cut.value.code() == grpc.StatusCode.INVALID_ARGUMENT, cut.value
    assert cut.value.details().startswith(f"grammar: {failed}"), cut.value.details()  # the field it was sent in
    assert re.fullmatch("pick([0-9](q[ab]?x?)?)?", "".join(texts)), texts
    assert_nothing_runs_one_second_after(wait_until_idle())


def _arguments_valid(call, tools) -> None:
    schema = next(tool["function"]["parameters"] for tool in tools if tool["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_openai_client_tools_required_and_named_return_calls_that_validate(client):
    tools = [WEATHER_TOOL, TIME_TOOL]
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    required = client.chat.completions.create(model=APP_NAME, messages=messages, tools=tools, tool_choice="required",
                                              max_tokens=200, temperature=1.0, seed=2)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        _arguments_valid(call, tools)
    named = client.chat.completions.create(
        model=APP_NAME, messages=messages, tools=tools, max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    # A forced call finishes with stop, as OpenAI's API and vLLM finish it.
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    _arguments_valid(call, tools)

    # The call and its result go back into the conversation through the chat template.
    answered = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    follow_up = client.chat.completions.create(model=APP_NAME, messages=answered, tools=tools, max_tokens=4,
                                               temperature=0)
    assert follow_up.choices[0].message.content is not None  # auto: no call in random text, content as is
    assert not follow_up.choices[0].message.tool_calls


def test_streamed_tool_calls_arrive_as_written_and_the_clients_accumulator_assembles_the_whole_responses(client):
    # Strict tools: the client's stream helper parses each call's arguments once they are done.
    tools = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in (WEATHER_TOOL, TIME_TOOL)]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kwargs = dict(model=APP_NAME, messages=[USER], tools=tools, tool_choice=tool_choice, max_tokens=200,
                      temperature=0)
        whole = client.chat.completions.create(**kwargs)
        fragments: dict[int, int] = {}  # argument deltas per call
        with client.chat.completions.stream(**kwargs) as stream:
            for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    fragments[event.index] = fragments.get(event.index, 0) + 1
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls
        assert [(call.function.name, call.function.arguments) for call in streamed] == [
            (call.function.name, call.function.arguments) for call in whole.choices[0].message.tool_calls]
        # A forced call finishes with stop, as OpenAI's API and vLLM finish it.
        assert final.choices[0].finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        for call in streamed:
            assert call.id.startswith("call_") and call.type == "function"
            assert call.function.parsed_arguments == json.loads(call.function.arguments)
            _arguments_valid(call, tools)
        # As the grammar writes them, not whole at the end: every call's arguments in several deltas.
        assert len(fragments) == len(streamed) and all(count > 1 for count in fragments.values()), fragments


def test_headroom_generate_constrains_its_output_through_serves_grpc_proxy(cluster, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    for flags, matches in ((["--choice", "up", "--choice", "down"], lambda out: out in ("up", "down")),
                           (["--regex", "[a-c]{4}"], lambda out: re.fullmatch("[a-c]{4}", out)),
                           (["--json-schema", str(schema)], lambda out: isinstance(json.loads(out)["ok"], bool))):
        finished = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "generate", "go", "--target", grpc_target(cluster),
             "--max-tokens", "16", *flags], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
            timeout=120)
        assert finished.returncode == 0, finished.stderr
        assert matches(finished.stdout.strip()), finished.stdout


def test_batched_prompts_echo_and_best_of_through_http(cluster):
    body = {"model": APP_NAME, "prompt": ["one", "two"], "max_tokens": 4, "temperature": 0, "n": 2,
            "echo": True, "ignore_eos": True}
    response = requests.post(f"{HTTP}/v1/completions", json=body, timeout=60).json()
    choices = response["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
    assert choices[0]["text"].startswith("one") and choices[0]["text"] == choices[1]["text"]  # greedy twice
    assert choices[2]["text"].startswith("two")
    assert response["usage"]["completion_tokens"] == 16

    token_prompts = requests.post(f"{HTTP}/v1/completions", json={
        **body, "prompt": [[104, 105], [111, 107]], "n": 1}, timeout=60).json()["choices"]
    assert [choice["text"][:2] for choice in token_prompts] == ["hi", "ok"]  # echoed, decoded

    best = requests.post(f"{HTTP}/v1/completions", json={
        "model": APP_NAME, "prompt": "best", "max_tokens": 6, "temperature": 1.0, "seed": 1, "best_of": 3,
        "logprobs": 0, "ignore_eos": True}, timeout=60).json()
    assert len(best["choices"]) == 1 and best["usage"]["completion_tokens"] == 18
    candidates = [requests.post(f"{HTTP}/v1/completions", json={
        "model": APP_NAME, "prompt": "best", "max_tokens": 6, "temperature": 1.0, "seed": 1 + index, "logprobs": 0,
        "ignore_eos": True}, timeout=60).json()["choices"][0] for index in range(3)]
    most_likely = max(candidates, key=lambda choice: sum(choice["logprobs"]["token_logprobs"]))
    assert best["choices"][0]["text"] == most_likely["text"]


def test_unhonourable_parameters_are_400_naming_them(cluster):
    for extra, param in ((
            {"functions": [{"name": "f"}]}, "functions"),
            ({"structural_tag": {"type": "structural_tag"}}, "structural_tag")):
        response = requests.post(f"{HTTP}/v1/chat/completions", json={
            "model": APP_NAME, "messages": [{"role": "user", "content": "hi"}], **extra}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_client_errors_log_one_line_not_a_traceback(cluster, channel):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[99_999]), sampling=pb.SamplingParams(max_tokens=2))
    assert stream_generate(channel, request).code == grpc.StatusCode.INVALID_ARGUMENT
    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    deadline = time.monotonic() + 10
    while True:
        logs = "".join(path.read_text(errors="replace") for path in logs_dir.glob("replica_*Ingress*.log"))
        if "request refused: InvalidRequestError: prompt_token_ids" in logs or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "request refused: InvalidRequestError: prompt_token_ids" in logs
    assert "Traceback" not in logs


def test_replica_histograms_are_filled_in_cluster_mode():
    """The histograms the latency panels read have observations on every replica."""
    for target in read_targets(replicas_file(TARGETS_DIR, APP_NAME)):
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
            samples = {sample.name: sample.value for family in text_string_to_metric_families(response.read().decode())
                       for sample in family.samples}
        for name in REPLICA_METRIC_NAMES:
            if name.endswith("_seconds") and not name.startswith("headroom_slo"):
                assert samples[f"{name}_count"] > 0, (target, name)


# ---- probes: bad input, each refused where it enters, and the next request served --------
def completion(**fields):
    return {"model": APP_NAME, "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields):
    return {"model": APP_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def without(body: dict, key: str) -> dict:
    return {name: value for name, value in body.items() if name != key}


def raw(text: str) -> bytes:
    """A body json.dumps cannot write (NaN, Infinity, lone surrogates, broken JSON)."""
    return text.encode("utf-8", errors="surrogatepass")


C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}
# (probe id, method, path, body, HTTP status, the param named, or the message's start when no param)
HTTP_PROBES = [
    ("max_tokens_zero", "POST", C, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens_negative", "POST", C, completion(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens_not_a_number", "POST", C, completion(max_tokens="ten"), 400, "max_tokens"),
    ("max_tokens_past_context", "POST", C, completion(max_tokens=ENGINE["max_model_len"]), 400, "max_tokens"),
    ("prompt_missing", "POST", C, without(completion(), "prompt"), 400, "prompt"),
    ("prompt_empty_list", "POST", C, completion(prompt=[]), 400, "prompt"),
    ("prompt_empty_token_list", "POST", C, completion(prompt=[[]]), 400, "prompt"),
    ("prompt_mixed_list", "POST", C, completion(prompt=[1, "a"]), 400, "prompt"),
    ("prompt_token_past_vocabulary", "POST", C, completion(prompt=[99_999]), 400, "prompt"),
    ("prompt_negative_token", "POST", C, completion(prompt=[-1]), 400, "prompt"),
    ("prompt_past_context", "POST", C, completion(prompt=[1] * ENGINE["max_model_len"]), 400, "prompt"),
    ("prompt_past_character_limit", "POST", C, completion(prompt="x" * (MAX_PROMPT_CHARS + 1)), 400, "prompt"),
    ("prompt_lone_surrogate", "POST", C,
     raw('{"model": "builtin", "prompt": "a\\ud800b", "max_tokens": 2}'), 400, "prompt"),
    ("batched_prompt_lone_surrogate", "POST", C,
     raw('{"model": "builtin", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'), 400, "prompt[1]"),
    ("temperature_nan", "POST", C, raw('{"model": "builtin", "prompt": "hi", "temperature": NaN}'), 400, "temperature"),
    ("temperature_infinity", "POST", C,
     raw('{"model": "builtin", "prompt": "hi", "temperature": Infinity}'), 400, "temperature"),
    ("temperature_1e309", "POST", C, raw('{"model": "builtin", "prompt": "hi", "temperature": 1e309}'), 400, "temperature"),
    ("temperature_negative", "POST", C, completion(temperature=-1), 400, "temperature"),
    ("temperature_string", "POST", C, completion(temperature="hot"), 400, "temperature"),
    ("top_p_zero", "POST", C, completion(top_p=0), 400, "top_p"),
    ("top_p_above_one", "POST", C, completion(top_p=1.5), 400, "top_p"),
    ("top_k_below_minus_one", "POST", C, completion(top_k=-5), 400, "top_k"),
    ("min_p_above_one", "POST", C, completion(min_p=2), 400, "min_p"),
    ("stop_a_number", "POST", C, completion(stop=123), 400, "stop"),
    ("stop_list_with_a_number", "POST", C, completion(stop=["ok", 5]), 400, "stop"),
    ("stop_empty_string", "POST", C, completion(stop=[""]), 400, "stop"),
    ("n_zero", "POST", C, completion(n=0), 400, "n"),
    ("n_past_max_num_seqs", "POST", C, completion(n=1000), 400, "n"),
    ("batch_past_max_num_seqs", "POST", C, completion(prompt=["a"] * 9, n=2), 400, "prompt"),
    ("batched_token_prompt_past_vocabulary", "POST", C, completion(prompt=[[1], [99_999]]), 400, "prompt[1]"),
    ("echoed_token_id_below_zero", "POST", C, completion(prompt=[-1], echo=True), 400, "prompt"),
    ("echoed_token_id_past_a_c_long", "POST", C, completion(prompt=[2 ** 70], echo=True), 400, "prompt"),
    ("best_of_below_n", "POST", C, completion(n=2, best_of=1), 400, "best_of"),
    ("best_of_streamed", "POST", C, completion(best_of=3, stream=True), 400, "best_of"),
    ("logprobs_above_20", "POST", C, completion(logprobs=21), 400, "logprobs"),
    ("logprobs_negative", "POST", C, completion(logprobs=-1), 400, "logprobs"),
    ("prompt_logprobs_streamed", "POST", C, completion(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("presence_penalty_above_two", "POST", C, completion(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty_below_minus_two", "POST", C, completion(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition_penalty_zero", "POST", C, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("logit_bias_key_not_a_token", "POST", C, completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias_token_past_vocabulary", "POST", C, completion(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("logit_bias_above_100", "POST", C, completion(logit_bias={"5": 500}), 400, "logit_bias"),
    ("stop_token_id_past_vocabulary", "POST", C, completion(stop_token_ids=[99_999]), 400, "stop_token_ids"),
    ("seed_not_a_number", "POST", C, completion(seed="x"), 400, "seed"),
    ("suffix", "POST", C, completion(suffix="end"), 400, "suffix"),
    ("min_tokens", "POST", C, completion(min_tokens=5), 400, "min_tokens"),
    ("beam_search", "POST", C, completion(use_beam_search=True), 400, "use_beam_search"),
    ("stream_options_without_stream", "POST", C, completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("unknown_model", "POST", C, completion(model="gpt-4"), 404, "model"),
    ("malformed_json", "POST", C, raw('{"model": "builtin", "prompt": '), 400, "body: invalid JSON"),
    ("not_utf8", "POST", C, b'{"model": "builtin", "prompt": "\xff\xfe"}', 400, "body: not UTF-8"),
    ("json_array_body", "POST", C, raw("[1, 2]"), 400, "body: expected a JSON object"),
    ("body_past_byte_limit", "POST", C, completion(prompt="y" * 4_300_000), 413, "body: "),
    ("body_nested_past_jsons_recursion_limit", "POST", C,
     raw('{"model": "builtin", "prompt": ' + "[" * 5000 + "]" * 5000 + "}"), 400, "body: nested more than 64 levels"),
    ("guided_json_text_nested_past_64_levels", "POST", C, completion(guided_json="[" * 100 + "]" * 100), 400,
     "guided_json"),
    ("guided_grammar_past_128_kib", "POST", C, completion(guided_grammar="start: " + " | ".join(
        f'"rule choice {index}"' for index in range(10_000))), 400, "guided_grammar"),
    ("stop_past_64_strings", "POST", C, completion(stop=[f"s{index}" for index in range(65)]), 400, "stop"),
    ("stop_token_ids_past_1024", "POST", C, completion(stop_token_ids=[1] * 1025), 400, "stop_token_ids"),
    ("logit_bias_past_1024_entries", "POST", C, completion(logit_bias={str(index): 1 for index in range(1025)}), 400,
     "logit_bias"),
    ("messages_empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("messages_missing", "POST", CHAT, without(chat(), "messages"), 400, "messages"),
    ("role_unknown", "POST", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
    ("content_a_number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("content_an_image", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     400, "messages[0].content"),
    ("content_lone_surrogate", "POST", CHAT, raw(
        '{"model": "builtin", "messages": [{"role": "user", "content": "\\ud800"}]}'), 400, "messages[0].content"),
    ("user_tool_calls", "POST", CHAT, chat(messages=[{**USER, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "messages[0].tool_calls"),
    ("tool_without_name", "POST", CHAT, chat(tools=[{"type": "function", "function": {"description": "d"}}]), 400,
     "tools[0].function.name"),
    ("tool_parameters_not_an_object", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]), 400, "tools[0].function.parameters"),
    ("tool_choice_unknown_function", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                        tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice.function.name"),
    ("tool_choice_required_without_tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("functions", "POST", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("json_schema_invalid", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}), 400, "response_format.json_schema.schema"),
    ("json_schema_unsupported_keyword", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), 400, "response_format.json_schema.schema"),
    ("json_schema_missing", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("json_schema_without_name", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}), 400, "response_format.json_schema.name"),
    ("stream_a_string", "POST", C, completion(stream="yes"), 400, "stream"),  # lax parsing read it as true
    ("response_format_unknown_type", "POST", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("guided_regex_unbalanced", "POST", C, completion(guided_regex="a(b"), 400, "guided_regex"),
    ("guided_grammar_syntax_error", "POST", C, completion(guided_grammar="start: ( "), 400, "guided_grammar"),
    ("guided_choice_empty", "POST", C, completion(guided_choice=[]), 400, "guided_choice"),
    ("guided_json_not_json", "POST", C, completion(guided_json="{nope"), 400, "guided_json"),
    ("two_constraints", "POST", C, completion(guided_regex="a", guided_choice=["b"]), 400, "guided_choice"),
    ("structured_outputs_unknown_key", "POST", C, completion(structured_outputs={"whitespace_pattern": " "}), 400,
     "structured_outputs.whitespace_pattern"),
    ("structured_outputs_empty", "POST", C, completion(structured_outputs={}), 400, "structured_outputs"),
    ("tool_choice_with_response_format", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
        response_format={"type": "json_object"}), 400, "response_format"),
    ("guided_json_a_number", "POST", C, completion(guided_json=5), 400, "guided_json"),
    ("guided_json_false", "POST", C, completion(guided_json=False), 400, "guided_json"),
    ("guided_choice_not_strings", "POST", C, completion(guided_choice=[1, 2]), 400, "guided_choice[0]"),
    ("guided_regex_matches_nothing", "POST", C, completion(guided_regex="[^\\s\\S]"), 400, "guided_regex"),
    ("json_schema_ref_loop", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}}), 400, "response_format.json_schema.schema"),
    ("json_schema_a_string", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": "object"}}), 400, "response_format.json_schema.schema"),
    ("json_schema_strict_not_a_boolean", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": "very"}}), 400, "response_format.json_schema.strict"),
    ("response_format_a_string", "POST", CHAT, chat(response_format="json_object"), 400, "response_format"),
    ("tool_choice_unknown_mode", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                    tool_choice="sometimes"), 400, "tool_choice"),
    ("tool_choice_function_missing", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                        tool_choice={"type": "function"}), 400, "tool_choice.function"),
    ("tool_choice_required_empty_tools", "POST", CHAT, chat(tools=[], tool_choice="required"), 400, "tool_choice"),
    ("tool_parameters_schema_invalid", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]), 400,
     "tools[0].function.parameters"),
    ("tool_parameters_schema_invalid_required", "POST", CHAT, chat(tools=[
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "a(b"}}}}}], tool_choice="required"), 400,
     "tools[1].function.parameters"),
    ("assistant_tool_call_without_id", "POST", CHAT, chat(messages=[USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "messages[1].tool_calls[0].id"),
    ("assistant_tool_call_arguments_an_object", "POST", CHAT, chat(messages=[USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("audio_output", "POST", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    ("max_completion_tokens_negative", "POST", CHAT, without(chat(max_completion_tokens=-1), "max_tokens"), 400,
     "max_completion_tokens"),
    ("max_completion_tokens_zero", "POST", CHAT, without(chat(max_completion_tokens=0), "max_tokens"), 400,
     "max_completion_tokens"),
    ("top_logprobs_without_logprobs", "POST", CHAT, chat(top_logprobs=5), 400, "top_logprobs"),
    # This cluster's replicas schedule fcfs: a priority would be silently ignored (vLLM: 400).
    ("priority_without_priority_scheduling", "POST", CHAT, chat(priority=-5), 400, "priority"),
    ("chat_temperature_past_float32", "POST", CHAT, chat(temperature=1e308), 400, "temperature"),
    ("top_logprobs_above_20", "POST", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("chat_temperature_nan", "POST", CHAT, raw(
        '{"model": "builtin", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'), 400, "temperature"),
    ("unknown_path", "GET", "/v1/nope", None, 404, "GET /v1/nope: "),
    ("wrong_method", "POST", "/v1/models", None, 405, "POST /v1/models: "),
]


def good_http_request_succeeds() -> bool:
    response = requests.post(f"{HTTP}{C}", json=completion(max_tokens=1), timeout=60)
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("method, path, body, status, named", [probe[1:] for probe in HTTP_PROBES],
                         ids=[probe[0] for probe in HTTP_PROBES])
def test_bad_http_input_is_refused_in_openais_shape_and_the_next_request_is_served(
        cluster, method, path, body, status, named):
    if isinstance(body, bytes):
        response = requests.request(method, f"{HTTP}{path}", data=body, headers={"content-type": "application/json"},
                                    timeout=60)
    else:
        response = requests.request(method, f"{HTTP}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    if status == 405:  # RFC 9110: a 405 names the methods the path takes
        assert response.headers.get("allow") == "GET", response.headers
    payload = response.json()
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, payload
    error = payload["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    if named.endswith(": ") or " " in named:  # no parameter at fault: the message says where
        assert error["message"].startswith(named), error
    elif error["code"] == "context_length_exceeded":  # OpenAI's words, which clients match on
        assert error["param"] == named and "maximum context length" in error["message"], error
    else:
        assert error["param"] == named and error["message"].startswith(f"{named}: "), error
    assert good_http_request_succeeds()


def sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**{"max_tokens": 2, **fields})


def text_request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=sampling(**fields))


# (probe id, request (or raw bytes), metadata, status, the start of the details)
GRPC_PROBES = [
    ("no_prompt", pb.GenerateRequest(sampling=sampling()), (), grpc.StatusCode.INVALID_ARGUMENT, "prompt: "),
    ("empty_text", pb.GenerateRequest(text="", sampling=sampling()), (), grpc.StatusCode.INVALID_ARGUMENT, "prompt: "),
    ("empty_token_ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]), sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt: "),
    ("token_past_vocabulary", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[99_999]), sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids: "),
    ("negative_token", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-3]), sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids: "),
    ("prompt_past_context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * ENGINE["max_model_len"]),
                                               sampling=sampling()), (), grpc.StatusCode.INVALID_ARGUMENT, "prompt: "),
    ("text_past_character_limit", pb.GenerateRequest(text="x" * (MAX_PROMPT_CHARS + 1), sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "text: "),
    ("message_past_byte_limit", pb.GenerateRequest(text="x" * 4_300_000, sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "request: "),
    ("not_a_generate_request", b"\xff\xff\xff", (), grpc.StatusCode.INVALID_ARGUMENT, "request: "),
    ("max_tokens_zero", text_request(max_tokens=0), (), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: "),
    ("max_tokens_past_context", text_request(max_tokens=10_000), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.max_tokens: "),
    ("temperature_nan", text_request(temperature=float("nan")), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature: "),
    ("temperature_infinity", text_request(temperature=float("inf")), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature: "),
    ("temperature_negative", text_request(temperature=-1.0), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature: "),
    ("top_p_zero", text_request(top_p=0.0), (), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: "),
    ("top_k_below_minus_one", text_request(top_k=-2), (), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k: "),
    ("min_p_above_one", text_request(min_p=2.0), (), grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p: "),
    ("presence_penalty_above_two", text_request(presence_penalty=5.0), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.presence_penalty: "),
    ("repetition_penalty_negative", text_request(repetition_penalty=-1.0), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.repetition_penalty: "),
    ("top_logprobs_above_20", text_request(top_logprobs=50), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.top_logprobs: "),
    ("stop_empty_string", text_request(stop=[""]), (), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop: "),
    ("logit_bias_past_vocabulary", text_request(logit_bias={99_999: 1.0}), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.logit_bias: "),
    ("stop_token_past_vocabulary", text_request(stop_token_ids=[99_999]), (), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.stop_token_ids: "),
    ("negative_ttft_deadline", pb.GenerateRequest(text="hi", ttft_deadline_ms=-1.0, sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "ttft_deadline_ms: "),
    ("zero_ttft_slo", pb.GenerateRequest(text="hi", ttft_slo_ms=0.0, sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "ttft_slo_ms: "),
    ("unknown_application", text_request(), (("application", "nope"),), grpc.StatusCode.NOT_FOUND, "application: "),
    ("json_schema_unknown_type", pb.GenerateRequest(text="hi", json_schema='{"type": "frobnicate"}',
                                                    sampling=sampling()), (), grpc.StatusCode.INVALID_ARGUMENT,
     "json_schema: "),
    ("regex_unbalanced", pb.GenerateRequest(text="hi", regex="a(b", sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "regex: "),
    ("choice_empty", pb.GenerateRequest(text="hi", choice=pb.Choices(), sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "choice: "),
    ("grammar_syntax_error", pb.GenerateRequest(text="hi", grammar="start: ( ", sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "grammar: "),
    ("json_schema_false", pb.GenerateRequest(text="hi", json_schema="false", sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "json_schema: "),
    ("json_schema_nested_past_64_levels", pb.GenerateRequest(text="hi", json_schema="[" * 5000 + "]" * 5000,
                                                             sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "json_schema: nested more than 64 levels"),
    ("grammar_past_128_kib", pb.GenerateRequest(text="hi", grammar="start: " + " | ".join(
        f'"rule choice {index}"' for index in range(10_000)), sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "grammar: a grammar may be at most 128 KiB"),
    ("regex_matches_nothing", pb.GenerateRequest(text="hi", regex="[^\\s\\S]", sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "regex: "),
    ("json_schema_unsupported_keyword", pb.GenerateRequest(text="hi", json_schema='{"not": {"type": "string"}}',
                                                           sampling=sampling()), (),
     grpc.StatusCode.INVALID_ARGUMENT, "json_schema: "),
]


def raw_generate(channel, payload, metadata) -> tuple[grpc.StatusCode, str]:
    generate = channel.unary_stream(
        "/headroom.v1.Generation/Generate",
        request_serializer=lambda data: data if isinstance(data, bytes) else data.SerializeToString(),
        response_deserializer=pb.GenerateResponse.FromString,
    )
    try:
        list(generate(payload, metadata=metadata, timeout=GRPC_TIMEOUT_S))
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details()


@pytest.mark.parametrize("payload, metadata, code, details", [probe[1:] for probe in GRPC_PROBES],
                         ids=[probe[0] for probe in GRPC_PROBES])
def test_bad_grpc_input_is_refused_naming_the_field_and_the_next_request_is_served(
        cluster, channel, payload, metadata, code, details):
    got_code, got_details = raw_generate(channel, payload, metadata)
    assert got_code == code and got_details.startswith(details), (got_code, got_details)
    good = stream_generate(channel, generate_request(1))
    assert good.code == grpc.StatusCode.OK and good.num_tokens == 1


def test_the_probe_table_replays_at_least_60_bad_inputs():
    assert len(HTTP_PROBES) + len(GRPC_PROBES) >= 60
