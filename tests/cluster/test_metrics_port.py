"""Where a process of the cluster serves /metrics (cluster.deployment.serve_metrics_on_free_port),
on real sockets: an in-place update starts the application's new ingress while the old one
drains, holding the router metrics port the chart's PodMonitor scrapes."""

import asyncio
import socket
import time

import pytest

from cluster.deployment import serve_metrics_on_free_port
from router.metrics import start_http_server


def held_port() -> socket.socket:
    """A listening socket on a free loopback port, as a draining predecessor holds one."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_the_base_port_is_waited_for_while_a_predecessor_releases_it_within_the_bound():
    holder = held_port()
    base = holder.getsockname()[1]

    async def start():
        asyncio.get_running_loop().call_later(0.5, holder.close)  # the old ingress' __del__
        return await serve_metrics_on_free_port(start_http_server, "127.0.0.1", base, "ports.router_metrics",
                                                base_port_wait_s=10.0)

    started = time.monotonic()
    server = asyncio.run(start())
    try:
        assert server.server_port == base  # not base + 1, which it would have kept for good
        assert time.monotonic() - started < 5.0
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("wait_s", [0.0, 0.5])
def test_past_the_bound_or_without_one_it_counts_up(wait_s):
    holder = held_port()
    base = holder.getsockname()[1]
    try:
        started = time.monotonic()
        server = asyncio.run(serve_metrics_on_free_port(start_http_server, "127.0.0.1", base, "ports.metrics",
                                                        base_port_wait_s=wait_s))
        try:
            assert server.server_port > base and time.monotonic() - started >= wait_s
        finally:
            server.shutdown()
            server.server_close()
    finally:
        holder.close()
