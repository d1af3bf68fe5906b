"""TLS for the live tests: a self-signed certificate for localhost (made by the `openssl` CLI),
and a TLS-terminating TCP proxy, the part a TLS-terminating load balancer (Envoy, nginx, a
Kubernetes ingress) plays in front of the cluster's gRPC port: clients speak TLS (ALPN h2) to
it, it relays the plaintext HTTP/2 bytes to Serve's gRPC proxy, which has no TLS of its own.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import threading
from pathlib import Path


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, private key) PEM files for localhost and 127.0.0.1, valid for a day."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


class TLSTerminatingProxy:
    """Accepts TLS on 127.0.0.1:`port` (a free one) and relays each connection's plaintext to
    127.0.0.1:`backend_port`; counts the connections it relayed (the probe that traffic really
    went through it)."""

    RELAY_CHUNK_BYTES = 65536

    def __init__(self, backend_port: int, cert: Path, key: Path):
        self.backend_port = backend_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.context.set_alpn_protocols(["h2"])  # gRPC clients insist on HTTP/2 being negotiated
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tls-proxy", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.context), self.loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(self.RELAY_CHUNK_BYTES):
                    writer.write(data)
                    await writer.drain()
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, backend_writer), pipe(backend_reader, client_writer),
                             return_exceptions=True)

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
