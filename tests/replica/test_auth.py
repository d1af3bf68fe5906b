"""Bearer credentials: the constant-time check, and the gRPC interceptor over a real loopback
server (health open, every other method refused without the secret, unary and streaming)."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from replica.server import auth
from replica.server.auth import BearerAuthInterceptor, Credentials, bearer_token


def test_no_secret_configured_accepts_anything():
    assert not Credentials().required
    assert Credentials().accepts(None) and Credentials().accepts("whatever")


def test_only_a_configured_secret_is_accepted():
    credentials = Credentials(["key-one", "key-two"])
    assert credentials.accepts("key-one") and credentials.accepts("key-two")
    for wrong in (None, "", "key-on", "key-one ", "KEY-ONE", "key-three"):
        assert not credentials.accepts(wrong), wrong


def test_authorization_header_needs_the_bearer_scheme():
    credentials = Credentials(["sk-1"])
    assert credentials.accepts_authorization("Bearer sk-1")
    for header in (None, "", "sk-1", "Basic sk-1", "Bearer ", "Bearersk-1", "bearer sk-1x", "Bearer sk-1 sk-1"):
        assert not credentials.accepts_authorization(header), header
    assert bearer_token("Bearer abc") == "abc" and bearer_token("Token abc") is None


def test_the_bearer_scheme_is_case_insensitive_and_spaces_around_the_token_are_dropped():
    """RFC 7235: the scheme is case-insensitive and one or more spaces part it from the token;
    `bearer <key>` (as some HTTP libraries send it) was refused as a missing key."""
    credentials = Credentials(["sk-1"])
    for header in ("bearer sk-1", "BEARER sk-1", "Bearer  sk-1", " Bearer sk-1 "):
        assert credentials.accepts_authorization(header), header
        assert bearer_token(header) == "sk-1", header


def test_every_secret_is_compared_with_compare_digest(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    Credentials(["first", "second", "third"]).accepts("first")  # matches the first: still compares all three
    assert [secret for _, secret in calls] == [b"first", b"second", b"third"]


def _fastest_check_s(check, values: dict[str, str], rounds: int = 30, calls: int = 40) -> dict[str, float]:
    """The fastest of `rounds` batches of `calls` checks of each value, the values' batches
    interleaved (so load on the machine falls on all of them alike), in this thread's CPU time
    (so time spent preempted is not counted)."""
    fastest = {name: float("inf") for name in values}
    for _ in range(rounds):
        for name, value in values.items():
            start = time.thread_time_ns()
            for _ in range(calls):
                check(value)
            fastest[name] = min(fastest[name], (time.thread_time_ns() - start) / calls / 1e9)
    return fastest


def test_a_wrong_key_of_the_right_length_and_of_another_length_take_the_same_time():
    """Through the check every door runs (Credentials.accepts_authorization). A 64 KiB key
    makes the comparison most of the call: at a real key's 64 characters it is ~30 ns of a
    ~1 us call, and a leak would drown in the interpreter's noise. The probe: the same
    measurement of `==`, which stops at the first difference or a length mismatch, tells a
    one-character key from a right-length one many times over."""
    secret = secrets.token_hex(32 * 1024)

    def other_than(character: str) -> str:
        return "0" if character != "0" else "1"

    wrong_keys = {
        "right length, last character wrong": secret[:-1] + other_than(secret[-1]),
        "right length, first character wrong": other_than(secret[0]) + secret[1:],
        "one character longer": secret + "0",
        "one character shorter": secret[:-1],
        "one character": "0",
    }
    credentials = Credentials([secret])
    headers = {name: f"Bearer {key}" for name, key in wrong_keys.items()}
    assert not any(credentials.accepts_authorization(header) for header in headers.values())
    fastest = _fastest_check_s(credentials.accepts_authorization, headers)
    baseline = fastest["right length, last character wrong"]
    ratios = {name: seconds / baseline for name, seconds in fastest.items()}
    # Within noise; what is left of a difference is the handling of the presented value's own
    # bytes (the one-character key skips copying 64 KiB), which its sender knows anyway.
    assert all(0.75 <= ratio <= 1.33 for ratio in ratios.values()), ratios

    encoded_secret = secret.encode()
    leaky = {name: fastest_s for name, fastest_s in _fastest_check_s(
        lambda key: key.encode() == encoded_secret,
        {name: wrong_keys[name] for name in ("right length, last character wrong", "one character")}).items()}
    assert leaky["one character"] < 0.5 * leaky["right length, last character wrong"], leaky


def test_empty_or_padded_secrets_are_refused_without_echoing_them():
    for bad in ([""], [" padded"], ["trail\n"]):
        with pytest.raises(ValueError) as error:
            Credentials(bad)
        assert "padded" not in str(error.value) and "trail" not in str(error.value)
    assert "s3cret" not in repr(Credentials(["s3cret"]))


def _echo_handlers():
    async def say(request: bytes, context) -> bytes:
        return request

    async def repeat(request: bytes, context):
        for _ in range(3):
            yield request

    return grpc.method_handlers_generic_handler("test.Echo", {
        "Say": grpc.unary_unary_rpc_method_handler(say),
        "Repeat": grpc.unary_stream_rpc_method_handler(repeat),
    })


async def _serve_and_call(credentials: Credentials):
    server = grpc.aio.server(interceptors=[BearerAuthInterceptor(credentials, "cluster token")])
    server.add_generic_rpc_handlers((_echo_handlers(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    results = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            say = channel.unary_unary("/test.Echo/Say")
            repeat = channel.unary_stream("/test.Echo/Repeat")
            for name, metadata in (("none", None), ("wrong", (("authorization", "Bearer nope"),)),
                                   ("no_scheme", (("authorization", "tok"),)),
                                   ("right", (("authorization", "Bearer tok"),))):
                try:
                    results[f"say_{name}"] = await say(b"hi", metadata=metadata, timeout=10)
                except grpc.aio.AioRpcError as error:
                    results[f"say_{name}"] = (error.code(), error.details())
                try:
                    results[f"repeat_{name}"] = [m async for m in repeat(b"yo", metadata=metadata, timeout=10)]
                except grpc.aio.AioRpcError as error:
                    results[f"repeat_{name}"] = (error.code(), error.details())
            check = health_pb2_grpc.HealthStub(channel).Check
            results["health"] = (await check(health_pb2.HealthCheckRequest(), timeout=10)).status
    finally:
        await server.stop(None)
    return results


def test_interceptor_refuses_calls_without_the_secret_and_leaves_health_open():
    results = asyncio.run(_serve_and_call(Credentials(["tok"])))
    for call in ("say", "repeat"):
        for name in ("none", "wrong", "no_scheme"):
            code, details = results[f"{call}_{name}"]
            assert code == grpc.StatusCode.UNAUTHENTICATED, (call, name)
            assert "cluster token" in details and "nope" not in details
    assert results["say_right"] == b"hi"
    assert results["repeat_right"] == [b"yo"] * 3
    assert results["health"] == health_pb2.HealthCheckResponse.SERVING


def test_interceptor_without_secrets_lets_everything_through():
    results = asyncio.run(_serve_and_call(Credentials()))
    assert results["say_none"] == b"hi" and results["repeat_wrong"] == [b"yo"] * 3


# ---- where the API keys come from ----------------------------------------------------------
def test_flag_keys_replace_the_environments_and_a_key_file_adds_its_lines(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys\n\nfile-key-1\n  file-key-2  \n")
    environ = {auth.API_KEY_ENV: "env-1, env-2", auth.API_KEY_FILE_ENV: str(key_file)}
    assert auth.configured_api_keys(environ=environ) == ["env-1", "env-2", "file-key-1", "file-key-2"]
    assert auth.configured_api_keys(["flag-1", "flag-2"], environ=environ) == ["flag-1", "flag-2", "file-key-1",
                                                                                 "file-key-2"]
    assert auth.configured_api_keys(environ={}) == [] and auth.configured_api_keys(environ={auth.API_KEY_ENV: ""}) == []
    assert not auth.api_key_credentials(environ={}).required
    assert auth.configured_api_keys(environ={auth.API_KEY_ENV: "k", auth.API_KEY_REQUIRED_ENV: "1"}) == ["k"]


@pytest.mark.parametrize("keys, file_text, environ, message", [
    (["sk-1,sk-2"], None, {}, "--api-key: an API key cannot contain ','"),
    ([""], None, {}, "--api-key: an API key must be non-empty"),
    ([" sk-padded"], None, {}, "--api-key: an API key must be non-empty, without surrounding whitespace"),
    (None, None, {auth.API_KEY_ENV: "sk-1,,sk-2"}, "HEADROOM_API_KEY: an empty key between commas"),
    (None, "# only a comment\n\n", {}, "--api-key-file: {path} holds no API key"),
    # The Helm chart's Secret, blank (a `$(openssl rand -hex 32)` that printed nothing): closed, not open.
    (None, None, {auth.API_KEY_ENV: " \n", auth.API_KEY_REQUIRED_ENV: "1"},
     "HEADROOM_API_KEY_REQUIRED: a key is required, but HEADROOM_API_KEY and HEADROOM_API_KEY_FILE hold none"),
])
def test_an_unusable_key_source_is_one_line_naming_it_and_never_a_key(tmp_path, keys, file_text, environ, message):
    path = tmp_path / "keys"
    if file_text is not None:
        path.write_text(file_text)
    with pytest.raises(auth.CredentialsError) as error:
        auth.configured_api_keys(keys, str(path) if file_text is not None else None, environ)
    assert str(error.value).startswith(message.format(path=path)) and "\n" not in str(error.value)
    assert "sk-" not in str(error.value)


def test_a_missing_key_file_names_the_flag_or_the_variable_that_gave_it(tmp_path):
    missing = str(tmp_path / "absent")
    with pytest.raises(auth.CredentialsError, match=f"^--api-key-file: cannot read {missing}: No such file"):
        auth.configured_api_keys(key_file=missing, environ={})
    with pytest.raises(auth.CredentialsError, match=f"^HEADROOM_API_KEY_FILE: cannot read {missing}"):
        auth.configured_api_keys(environ={auth.API_KEY_FILE_ENV: missing})


def test_serves_flags_reach_its_processes_through_the_environment(tmp_path):
    import argparse

    key_file = tmp_path / "keys"
    key_file.write_text("file-key\n")
    environ = {auth.API_KEY_ENV: "inherited"}
    auth.export_api_key_flags(argparse.Namespace(api_key=["k1", "k2"], api_key_file=str(key_file)), environ)
    # A Ray worker reading only the environment accepts exactly what the flags configured.
    assert auth.configured_api_keys(environ=environ) == ["k1", "k2", "file-key"]
    assert environ[auth.API_KEY_FILE_ENV] == str(key_file.resolve())
    untouched = {auth.API_KEY_ENV: "inherited"}
    auth.export_api_key_flags(argparse.Namespace(api_key=None, api_key_file=None), untouched)
    assert untouched == {auth.API_KEY_ENV: "inherited"}


def test_a_server_beyond_loopback_without_a_key_gets_one_warning_line():
    warning = auth.open_door_warning("0.0.0.0", Credentials())
    assert warning.startswith("warning: serving on 0.0.0.0 without an API key") and "\n" not in warning
    assert auth.open_door_warning("0.0.0.0", Credentials(["k"])) is None
    for loopback in ("127.0.0.1", "localhost", "::1"):
        assert auth.open_door_warning(loopback, Credentials()) is None


def test_a_client_sends_its_flag_or_the_first_configured_key_as_bearer_metadata():
    assert auth.client_api_key("flag-key", {auth.API_KEY_ENV: "env-1,env-2"}) == "flag-key"
    assert auth.client_api_key(None, {auth.API_KEY_ENV: "env-1,env-2"}) == "env-1"
    assert auth.client_api_key(None, {}) is None
    assert auth.authorization_metadata("k") == (("authorization", "Bearer k"),)
    assert auth.authorization_metadata(None) == ()
