"""Bearer credentials: the constant-time check, and the gRPC interceptor over a real loopback
server (health open, every other method refused without the secret, unary and streaming)."""

from __future__ import annotations

import asyncio
import hmac

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
    for header in (None, "", "sk-1", "Basic sk-1", "Bearer ", "Bearer  sk-1", "bearer sk-1x"):
        assert not credentials.accepts_authorization(header), header
    assert bearer_token("Bearer abc") == "abc" and bearer_token("Token abc") is None


def test_every_secret_is_compared_with_compare_digest(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    Credentials(["first", "second", "third"]).accepts("first")  # matches the first: still compares all three
    assert [secret for _, secret in calls] == [b"first", b"second", b"third"]


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
