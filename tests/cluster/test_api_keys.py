"""Who may generate (issue 28), on one live cluster deployed as KubeRay's RayService deploys it:
Ray started with two API keys in its environment (HEADROOM_API_KEY and HEADROOM_API_KEY_FILE,
as the Helm chart sets them), the application (two replicas) deployed from a Serve config file
with HTTPS on Serve's HTTP proxy, which Serve's controller builds in a task of its own, where the
cluster token is made (`headroom serve`'s own path, which builds it in the driver, is
test_cli's and every other live module's). The application runs and its routers hear both
replicas' loads with that token; every /v1 route and every Generation method refuses a call
without an accepted key (missing, wrong, wrong case, in another header, an empty bearer) in the
documented shape, and serves it with either key; health and reflection stay open; the official
`openai` client works with api_key=; gRPC over TLS works through a TLS-terminating proxy in
front of Serve's gRPC proxy; the Helm chart's HTTPS readiness probe passes against the HTTPS
proxy, where KubeRay's plain-HTTP one fails; and no key or token shows up in the logs, the metrics, Serve's
application details, an error or `headroom status`. The doors' checks are also probed
in-process: each presented key is compared with hmac.compare_digest against every configured
key, whatever its length.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import ssl
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from ray.experimental import internal_kv  # noqa: E402
from ray.serve.context import _get_global_client  # noqa: E402

from cluster import grpc_proxy, ingress, status_command  # noqa: E402
from cluster.cli import main  # noqa: E402
from cluster.config import APP_IMPORT_PATH, load_config  # noqa: E402
from protos import headroom_pb2 as pb  # noqa: E402
from protos import headroom_pb2_grpc as pb_grpc  # noqa: E402
from replica.server import auth  # noqa: E402
from replica.server.auth import API_KEY_ENV, API_KEY_FILE_ENV, Credentials  # noqa: E402
from replica.server.request_limits import RequestLimits  # noqa: E402
from router import cluster_token as cluster_token_module  # noqa: E402
from router.cluster_token import cluster_token  # noqa: E402
from tests.cluster.serve_harness import (  # noqa: E402
    APP_NAME, GRPC_TIMEOUT_S, deploy_from_config_file, generate_request, grpc_target, local_ray, small_config,
)
from tests.cluster.tls_harness import TLSTerminatingProxy, self_signed_certificate  # noqa: E402
from tests.replica.replica_harness import reflect  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.shared_ray]  # Ray: serve_harness.shared_ray

BASE_PORT = 29500  # HTTP; gRPC +1, replica metrics +10, router metrics +20 (away from the other live modules)
# Fresh and distinctive on every run, so that finding one in the logs means this run leaked it.
KEY_A = f"hrkey-a-{secrets.token_hex(12)}"  # from HEADROOM_API_KEY
KEY_B = f"hrkey-b-{secrets.token_hex(12)}"  # from HEADROOM_API_KEY_FILE
WRONG_KEY = f"hrkey-x-{secrets.token_hex(12)}"  # the right length, not a key
PRESENTED_VALUES = (KEY_A, KEY_B, WRONG_KEY, KEY_A.upper())
HTTPS = f"https://127.0.0.1:{BASE_PORT}"
UNAUTHORIZED_BODY_SHAPE = {"type": "invalid_request_error", "param": None, "code": "invalid_api_key"}

# How clients get it wrong: (HTTP headers, gRPC metadata).
REFUSED = {
    "no key": ({}, ()),
    "wrong key": ({"Authorization": f"Bearer {WRONG_KEY}"}, (("authorization", f"Bearer {WRONG_KEY}"),)),
    "key of the wrong case": ({"Authorization": f"Bearer {KEY_A.upper()}"},
                              (("authorization", f"Bearer {KEY_A.upper()}"),)),
    "key in x-api-key": ({"x-api-key": KEY_A}, (("x-api-key", KEY_A),)),
    "key in api-key": ({"api-key": KEY_A}, (("api-key", KEY_A),)),
    "empty bearer": ({"Authorization": "Bearer "}, (("authorization", "Bearer "),)),
    "key without the scheme": ({"Authorization": KEY_A}, (("authorization", KEY_A),)),
}


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


# What the cluster fixture saw between Ray's start and the deployment.
SEEN_BEFORE_DEPLOYMENT: dict[str, object] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tls_files):
    """Ray started as `headroom serve` starts it, the keys in its environment as the Helm chart
    sets them; the application deployed from a Serve config file, as KubeRay's RayService and
    `serve run deploy/serve_config.yaml` deploy it (Serve's controller builds it)."""
    cert, key = tls_files
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text(f"# the second team's key\n\n{KEY_B}\n")
    document = small_config(BASE_PORT).model_dump(exclude_unset=True)
    document["http_options"].update(ssl_certfile=str(cert), ssl_keyfile=str(key))
    saved = {name: os.environ.get(name) for name in (API_KEY_ENV, API_KEY_FILE_ENV)}
    os.environ.update({API_KEY_ENV: KEY_A, API_KEY_FILE_ENV: str(key_file)})
    try:
        with local_ray(load_config(document)) as config:
            # Ray's processes took the keys when Ray started; this test process' clients name theirs.
            _restore(saved)
            SEEN_BEFORE_DEPLOYMENT["cluster token"] = stored_cluster_token()
            deploy_from_config_file(config, tmp_path_factory.mktemp("serve") / "serve_config.yaml")
            yield config
    finally:
        _restore(saved)


def stored_cluster_token():
    """The cluster token in Ray's key-value store, None before any process made it."""
    token = internal_kv._internal_kv_get(cluster_token_module._KV_KEY, namespace=cluster_token_module._KV_NAMESPACE)
    return None if token is None else token.decode()


def _restore(saved: dict) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def https(cluster, tls_files) -> requests.Session:
    session = requests.Session()
    session.verify = str(tls_files[0])
    session.trust_env = False  # else $REQUESTS_CA_BUNDLE, where set, would replace `verify`
    return session


def authorization(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def assert_unauthorized(response: requests.Response, presented: dict) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert {name: error[name] for name in UNAUTHORIZED_BODY_SHAPE} == UNAUTHORIZED_BODY_SHAPE
    assert error["message"].startswith("missing or invalid API key (send header 'Authorization: Bearer")
    assert not any(value in error["message"] for value in PRESENTED_VALUES)


# ---- the declarative deployment ------------------------------------------------------------
def test_serves_controller_built_the_application_from_the_config_file_and_made_the_cluster_token(cluster):
    application = _get_global_client().get_serve_details()["applications"][APP_NAME]
    assert application["status"] == "RUNNING" and application["source"] == "declarative"
    assert application["deployed_app_config"]["import_path"] == APP_IMPORT_PATH
    # No process had made a token before the deployment, and this one built nothing.
    assert SEEN_BEFORE_DEPLOYMENT["cluster token"] is None and stored_cluster_token() is not None


def test_rays_own_ports_refuse_a_client_without_rays_token_so_the_cluster_token_stays_inside(cluster):
    """Ray's GCS listens on every interface: with its token auth turned off (as `headroom serve`
    used to), anyone reaching it read the cluster token from Ray's store with a plain gRPC call."""
    import ray
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    from router.cluster_token import _KV_KEY, _KV_NAMESPACE, cluster_token

    assert cluster_token()  # the secret at stake exists
    gcs_port = ray._private.worker.global_worker.node.gcs_address.rsplit(":", 1)[1]
    with grpc.insecure_channel(f"{ray.util.get_node_ip_address()}:{gcs_port}") as outsider:
        with pytest.raises(grpc.RpcError) as refused:
            gcs_service_pb2_grpc.InternalKVGcsServiceStub(outsider).InternalKVGet(
                gcs_service_pb2.InternalKVGetRequest(key=_KV_KEY, namespace=_KV_NAMESPACE.encode()), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_ingress_router_hears_both_replicas_loads_with_the_cluster_token(cluster, https):
    statuses = status_command.replica_statuses()  # `headroom status` reads each load with the token
    replica_ids = {status.replica_id for status in statuses}
    assert len(replica_ids) == 2 and all(status.load is not None for status in statuses), statuses
    ports = cluster.applications[0].args.ports
    body = {"model": APP_NAME, "prompt": "hi", "max_tokens": 1}
    # The router observes the age of each replica's load it scores, for every replica it has
    # heard a load from (WatchLoad, which refuses a router without the token), on every request.
    heard, deadline = set(), time.monotonic() + 60
    while heard != replica_ids and time.monotonic() < deadline:
        reply = https.post(f"{HTTPS}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        metrics = requests.get(f"http://{ports.bind_address}:{ports.router_metrics}/metrics", timeout=30).text
        heard = {sample.labels["replica"] for family in text_string_to_metric_families(metrics)
                 for sample in family.samples
                 if sample.name == "headroom_router_load_age_seconds_count" and sample.value > 0}
    assert heard == replica_ids


# ---- HTTP (HTTPS through Serve's proxy) -------------------------------------------------------
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_http_without_an_accepted_key_is_401_in_openais_shape(https, case):
    headers = REFUSED[case][0]
    assert_unauthorized(https.get(f"{HTTPS}/v1/models", headers=headers, timeout=60), headers)
    body = {"model": APP_NAME, "prompt": "hi", "max_tokens": 2}
    assert_unauthorized(https.post(f"{HTTPS}/v1/completions", json=body, headers=headers, timeout=60), headers)


def test_http_with_either_key_is_served(https):
    models = https.get(f"{HTTPS}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == APP_NAME
    body = {"model": APP_NAME, "prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    completion = https.post(f"{HTTPS}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_B}"},
                            timeout=120)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 3


def test_http_health_is_open_and_plain_http_is_not_served(https):
    assert https.get(f"{HTTPS}/health", timeout=60).status_code == 200
    with pytest.raises(requests.ConnectionError):  # the port speaks TLS only
        requests.get(f"http://127.0.0.1:{BASE_PORT}/health", timeout=10)


def test_the_helm_charts_https_readiness_probe_passes_where_kuberays_plain_http_one_fails(cluster):
    """The proxy half of the readiness probe the chart gives worker pods with tls set, as
    rendered, run against this HTTPS proxy; KubeRay's own (plain HTTP) fails against it."""
    pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's Go SDK for Python) not installed")
    from tests.cluster.test_helm import rayservice, render, worker_container

    probe = worker_container(rayservice(render({"tls": {"existingSecret": "serve-cert"}})))["readinessProbe"]
    proxy_check = probe["exec"]["command"][2].split(" && ")[1]
    assert "https://localhost:8000/" in proxy_check
    here = proxy_check.replace("localhost:8000", f"127.0.0.1:{BASE_PORT}")
    kuberays = here.replace(" --no-check-certificate", "").replace("https://", "http://")
    for command, passes in ((here, True), (kuberays, False)):
        ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
        assert (ran.returncode == 0) == passes, (command, ran.returncode, ran.stdout, ran.stderr)


def test_https_needs_the_certificate_to_be_trusted(cluster):
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{HTTPS}/health", timeout=10)  # the system's CAs do not know a self-signed one


def test_the_openai_client_works_with_api_key_and_fails_with_authentication_error_without(cluster, tls_files):
    def client(api_key: str):
        http_client = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(tls_files[0])))
        return openai.OpenAI(base_url=f"{HTTPS}/v1", api_key=api_key, max_retries=0, timeout=120,
                             http_client=http_client)

    reply = client(KEY_A).chat.completions.create(model=APP_NAME, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1
    without_key = lambda: client(KEY_A).models.list(extra_headers={"Authorization": openai.omit})  # noqa: E731
    for call in (lambda: client(WRONG_KEY).models.list(), without_key):
        with pytest.raises(openai.AuthenticationError) as refused:
            call()
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


# ---- gRPC through Serve's proxy -------------------------------------------------------------
def call_each_method(channel: grpc.Channel, metadata) -> dict[str, tuple[grpc.StatusCode, str]]:
    stub = pb_grpc.GenerationStub(channel)
    calls = {
        "Generate": lambda: list(stub.Generate(generate_request(2), metadata=metadata, timeout=GRPC_TIMEOUT_S)),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=GRPC_TIMEOUT_S),
        "GetModelInfo": lambda: stub.GetModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=GRPC_TIMEOUT_S),
    }
    results = {}
    for method, call in calls.items():
        try:
            call()
            results[method] = (grpc.StatusCode.OK, "")
        except grpc.RpcError as error:
            results[method] = (error.code(), error.details())
    return results


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_grpc_without_an_accepted_key_is_unauthenticated(channel, case):
    for method, (code, details) in call_each_method(channel, REFUSED[case][1]).items():
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, code, details)
        assert details == "missing or invalid API key (send metadata 'authorization: Bearer <api key>')"


def test_grpc_with_either_key_is_served(channel):
    for key in (KEY_A, KEY_B):
        assert set(call_each_method(channel, authorization(key)).values()) == {(grpc.StatusCode.OK, "")}
    responses = list(pb_grpc.GenerationStub(channel).Generate(generate_request(3), metadata=authorization(KEY_B),
                                                              timeout=GRPC_TIMEOUT_S))
    assert sum(len(response.token_ids) for response in responses) == 3


def test_grpc_health_and_reflection_are_open(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "headroom.v1.Generation"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == \
            health_pb2.HealthCheckResponse.SERVING
    services, files = reflect(channel, "v1", "headroom.v1.Generation")
    assert "headroom.v1.Generation" in services and files


def test_grpc_over_tls_through_a_tls_terminating_proxy(cluster, tls_files):
    cert, key = tls_files
    proxy = TLSTerminatingProxy(cluster.grpc_options.port, cert, key)
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{proxy.port}", credentials) as tls_channel:
            responses = list(pb_grpc.GenerationStub(tls_channel).Generate(
                generate_request(3), metadata=authorization(KEY_A), timeout=GRPC_TIMEOUT_S))
            assert sum(len(response.token_ids) for response in responses) == 3
            assert call_each_method(tls_channel, ())["Generate"][0] == grpc.StatusCode.UNAUTHENTICATED
        assert proxy.connections >= 1  # the probe: the calls really crossed the TLS proxy
        with grpc.secure_channel(f"localhost:{cluster.grpc_options.port}", credentials) as no_tls_there:
            with pytest.raises(grpc.RpcError) as refused:  # Serve's gRPC port itself speaks no TLS
                pb_grpc.GenerationStub(no_tls_there).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proxy.close()


# ---- the CLI clients ---------------------------------------------------------------------
def test_generate_and_bench_send_the_key_from_the_flag_or_the_environment(cluster, monkeypatch, capsys):
    target = grpc_target(cluster)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["generate", "hi", "--target", target, "--max-tokens", "2", "--api-key", KEY_A]) == 0
    assert main(["generate", "hi", "--target", target, "--max-tokens", "2"]) == 1
    assert "UNAUTHENTICATED: missing or invalid API key" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, KEY_B)
    assert main(["generate", "hi", "--target", target, "--max-tokens", "2"]) == 0
    assert main(["bench", "--target", target, "--requests", "2", "--concurrency", "2", "--prompt-tokens", "8",
                 "--max-tokens", "2"]) == 0
    assert main(["bench", "--target", target, "--requests", "2", "--api-key", WRONG_KEY]) == 1
    out = capsys.readouterr()
    assert "UNAUTHENTICATED" in out.err and WRONG_KEY not in out.out + out.err


def test_generate_and_bench_reach_the_cluster_over_tls_through_the_proxy(cluster, tls_files, monkeypatch, capsys):
    cert, key = tls_files
    proxy = TLSTerminatingProxy(cluster.grpc_options.port, cert, key)
    target, generate = f"localhost:{proxy.port}", ["generate", "hi", "--max-tokens", "2", "--api-key", KEY_A]
    try:
        assert main([*generate, "--target", target, "--tls-ca-cert", str(cert)]) == 0
        # --tls verifies against the system's trust store: OpenSSL's default CA file, which
        # $SSL_CERT_FILE names instead where set; it knows no self-signed certificate.
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        assert main([*generate, "--target", target, "--tls", "--timeout-s", "30"]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        assert main(["bench", "--target", target, "--tls", "--api-key", KEY_B, "--requests", "2", "--concurrency", "2",
                     "--prompt-tokens", "8", "--max-tokens", "2"]) == 0
        assert "2 completed, 0 failed" in capsys.readouterr().out
        assert proxy.connections >= 3  # the probe: each command's channel crossed the TLS proxy
    finally:
        proxy.close()


def test_status_says_what_the_grpc_door_answers_a_client_with_or_without_a_key(cluster, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    door = f"{APP_NAME}: gRPC door 127.0.0.1:{cluster.grpc_options.port}"
    for flags, verdict in (([], "requires an API key (--api-key or $HEADROOM_API_KEY checks one)"),
                           (["--api-key", KEY_B], "accepts the API key"),
                           (["--api-key", WRONG_KEY], "refuses the API key")):
        assert main(["status", *flags]) == 0
        printed = capsys.readouterr()
        assert f"{door} {verdict}\n" in printed.out, printed.out
        assert not any(value in printed.out + printed.err for value in PRESENTED_VALUES)


# ---- no key anywhere -----------------------------------------------------------------------
def test_no_key_or_token_shows_in_logs_metrics_errors_serve_details_or_status(cluster, capsys):
    """Last in the module: every call above has left whatever it logs."""
    assert main(["status"]) == 0
    status_text = capsys.readouterr().out
    assert "builtin" in status_text  # the probe: status listed the replica
    # Serve's view of the application, which its REST API and dashboard show: the config as
    # deployed (the probe: it is there), the deployments' options (the router's kwargs among them).
    serve_details = json.dumps(_get_global_client().get_serve_details(), default=str)
    assert APP_IMPORT_PATH in serve_details and "request_router_kwargs" in serve_details
    ports = cluster.applications[0].args.ports
    metrics = "".join(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
                      for port in (ports.metrics, ports.router_metrics))
    assert "headroom_" in metrics  # the probe: real metrics endpoints
    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    # The probe: the refused calls were logged (Serve's access log), where a leak would show.
    logged = subprocess.run(["grep", "-rlF", "GET /v1/models 401", str(session_dir)], capture_output=True, text=True)
    assert logged.stdout, f"no access log of a refused call under {session_dir}"
    for value in (*PRESENTED_VALUES, cluster_token()):
        assert value not in status_text and value not in metrics and value not in serve_details, value
        found = subprocess.run(["grep", "-rlF", "--", value, str(session_dir)], capture_output=True, text=True)
        assert found.stdout == "", f"a key shows in {found.stdout}"


# ---- the checks themselves, in-process: compare_digest against every key ------------------------
@pytest.fixture
def compare_digest_calls(monkeypatch) -> list[tuple[bytes, bytes]]:
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    return calls


WRONG_KEYS_BY_LENGTH = {"the right length": WRONG_KEY, "a different length": "x"}


async def _asgi_get(app, path: str, headers: dict[str, str]) -> int:
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "query_string": b"",
             "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"]


def test_the_http_check_compares_any_wrong_key_with_every_key_in_constant_time(monkeypatch, compare_digest_calls):
    monkeypatch.setenv(API_KEY_ENV, f"{KEY_A},{KEY_B}")
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)

    async def routes(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = ingress.RequireAPIKey(routes)
    for length, wrong in WRONG_KEYS_BY_LENGTH.items():
        compare_digest_calls.clear()
        assert asyncio.run(_asgi_get(app, "/v1/models", {"Authorization": f"Bearer {wrong}"})) == 401, length
        assert compare_digest_calls == [(wrong.encode(), KEY_A.encode()), (wrong.encode(), KEY_B.encode())], length
    assert asyncio.run(_asgi_get(app, "/v1/models", {"Authorization": f"Bearer {KEY_B}"})) == 200
    assert asyncio.run(_asgi_get(app, "/health", {})) == 200


def test_http_takes_the_bearer_scheme_in_any_case_and_the_key_between_spaces(monkeypatch):
    """RFC 7235: `bearer <key>` and padded values are the same credential (they were 401)."""
    from starlette.testclient import TestClient

    monkeypatch.setenv(API_KEY_ENV, KEY_A)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)

    async def routes(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    client = TestClient(ingress.RequireAPIKey(routes))
    for value in (f"Bearer {KEY_A}", f"bearer {KEY_A}", f"BEARER {KEY_A}", f"Bearer  {KEY_A}", f"Bearer {KEY_A} "):
        assert client.get("/v1/models", headers={"Authorization": value}).status_code == 200, value
    for value in (f"bearer {WRONG_KEY}", f"Basic {KEY_A}", KEY_A, f"bearer{KEY_A}"):
        response = client.get("/v1/models", headers={"Authorization": value})
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", value


def test_the_grpc_proxys_check_compares_any_wrong_key_with_every_key_in_constant_time(compare_digest_calls):
    """The proxy's own handler (grpc_proxy.bounded_unary) on a real loopback server, with a
    stand-in for the Serve handler it would ship the request to."""
    shipped = []

    async def serve_handler(request, context) -> bytes:
        shipped.append(request)
        return pb.ModelInfo(model_id="shipped").SerializeToString()

    async def call_with(metadata) -> tuple[grpc.StatusCode, int]:
        server = grpc.aio.server()
        handler = grpc_proxy.bounded_unary(serve_handler, pb.ModelInfoRequest, RequestLimits(),
                                           Credentials([KEY_A, KEY_B]))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "headroom.v1.Generation", {"GetModelInfo": grpc.unary_unary_rpc_method_handler(handler)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as probe_channel:
                stub = pb_grpc.GenerationStub(probe_channel)
                try:
                    await stub.GetModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=30)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as error:
                    return error.code()
        finally:
            await server.stop(None)

    for length, wrong in WRONG_KEYS_BY_LENGTH.items():
        compare_digest_calls.clear()
        assert asyncio.run(call_with(authorization(wrong))) == grpc.StatusCode.UNAUTHENTICATED, length
        assert compare_digest_calls == [(wrong.encode(), KEY_A.encode()), (wrong.encode(), KEY_B.encode())], length
    assert not shipped  # refused in the proxy: nothing went on to an application
    assert asyncio.run(call_with(authorization(KEY_A))) == grpc.StatusCode.OK and len(shipped) == 1


def test_the_ingress_refuses_a_grpc_call_that_came_without_headroom_s_proxy_check():
    """A call routed by Serve's plain handlers reaches the ingress unchecked: the ingress
    refuses it itself, setting UNAUTHENTICATED on Serve's context (which Serve's proxy answers
    with), here around a real grpc.aio call's context."""
    from ray.serve.grpc_util import RayServegRPCContext

    from replica.errors import AuthenticationError

    seen = {}

    async def model_info(raw: bytes, context) -> bytes:
        serve_context = RayServegRPCContext(context)
        try:
            ingress.refuse_without_api_key(serve_context, Credentials([KEY_A]))
            seen["refused"] = False
        except AuthenticationError:
            seen["refused"] = True
            await context.abort(serve_context.code(), serve_context.details())
        return b""

    async def call_with(metadata):
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "headroom.v1.Generation", {"GetModelInfo": grpc.unary_unary_rpc_method_handler(model_info)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as probe_channel:
                call = probe_channel.unary_unary("/headroom.v1.Generation/GetModelInfo")
                try:
                    await call(b"", metadata=metadata, timeout=30)
                    return grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as error:
                    return error.code(), error.details()
        finally:
            await server.stop(None)

    code, details = asyncio.run(call_with(authorization(WRONG_KEY)))
    assert seen["refused"] and code == grpc.StatusCode.UNAUTHENTICATED and "API key" in details
    assert WRONG_KEY not in details
    assert asyncio.run(call_with(authorization(KEY_A)))[0] == grpc.StatusCode.OK and not seen["refused"]


@pytest.mark.parametrize("keys, environ, file_text, source", [
    (["hrkey-clé"], {}, None, "--api-key"),
    (None, {API_KEY_ENV: "hrkey-ok,hrkey-clé"}, None, API_KEY_ENV),
    (None, {}, "hrkey-ok\nhrkey-\x7fdel\n", "--api-key-file: "),
])
def test_a_key_no_client_can_send_is_refused_where_it_is_configured(tmp_path, keys, environ, file_text, source):
    """A non-ASCII key was accepted, then matched no client that sends it as UTF-8 (curl: the
    server reads headers as Latin-1) and none that cannot send it (httpx, the openai client,
    gRPC metadata): every request was 401 with the right key."""
    key_file = None
    if file_text is not None:
        key_file = tmp_path / "keys"
        key_file.write_text(file_text)
    with pytest.raises(auth.CredentialsError) as error:
        auth.configured_api_keys(keys, str(key_file) if key_file else None, environ)
    message = str(error.value)
    assert message.startswith(source) and "printable ASCII" in message and "hrkey" not in message, message


@pytest.mark.parametrize("path, root_path, needs_key", [
    ("/v1/models", "", True),
    ("/m/v1/models", "/m", True),
    ("/m/v1", "/m", True),
    ("/m/health", "/m", False),
    ("/health", "", False),
    # The prefix is cut at a segment boundary only, as Starlette's routes match the path:
    # under root /v the path /v1/models is served as /v1/models, and must need the key.
    ("/v1/models", "/v", True),
    ("/v1x/models", "", False),
])
def test_the_key_is_required_on_the_path_the_routes_match(path, root_path, needs_key):
    from cluster.ingress import _needs_api_key

    assert _needs_api_key({"path": path, "root_path": root_path}) is needs_key
