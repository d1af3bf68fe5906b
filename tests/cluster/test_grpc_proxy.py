"""The cancel-safe Generate handler on Serve's gRPC proxy, without a cluster: a cancelled call
leaves no "Task exception was never retrieved" traceback behind (the live cancellation test in
test_outside_clients.py checks the proxy's logs too)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from cluster.grpc_proxy import bounded_cancel_safe_stream
from protos import headroom_pb2 as pb
from replica.server.auth import Credentials
from replica.server.request_limits import RequestLimits

serve_exceptions = pytest.importorskip("ray.serve.exceptions")


class Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self) -> tuple:
        return ()


async def serve_like_handler(request, context):
    """As Serve's ProxyResponseGenerator streams: each next item awaited in a task of its own,
    which a cancelled wait leaves behind to end with RequestCancelledError once the response is
    cancelled, unread."""
    yield b"first"
    response_cancelled = asyncio.Event()

    async def next_item() -> bytes:
        await response_cancelled.wait()
        raise serve_exceptions.RequestCancelledError("request-1")

    task = asyncio.create_task(next_item())
    try:
        await asyncio.wait([task])
    finally:
        response_cancelled.set()  # the router cancels the response; nobody reads `task`


def test_a_cancelled_generate_leaves_no_unretrieved_request_cancelled_traceback():
    reports = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context))
        handler = bounded_cancel_safe_stream(serve_like_handler, pb.GenerateRequest, RequestLimits(),
                                             Credentials([]))
        stream = handler(pb.GenerateRequest().SerializeToString(), Context())
        assert await stream.__anext__() == b"first"
        await stream.aclose()  # grpc.aio closes the handler when the client cancels
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        # The probe: any other unretrieved exception is still reported, to the handler that was there.
        async def fails() -> None:
            raise ValueError("a real error")

        failing = asyncio.create_task(fails())
        await asyncio.sleep(0)
        del failing
        gc.collect()

    asyncio.run(scenario())
    assert [type(report.get("exception")).__name__ for report in reports] == ["ValueError"], reports
