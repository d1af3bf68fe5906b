"""The front <-> engine-core channel: pickled frames with a 4-byte length prefix over one Unix
socketpair. Measured against multiprocessing's Connection and ZeroMQ ipc in
bench/bench_channel.py; a socket also tells each side at once when the other process dies
(its end reads EOF), which is how the front fails streams and the core exits.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct("<I")
_PROTOCOL = pickle.HIGHEST_PROTOCOL


class ChannelClosed(EOFError):
    """The other end closed the socket (its process exited or died)."""


def encode_frame(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class FrameSocket:
    """The core's blocking end: one thread receives, one sends (a lock guards sends anyway)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, obj: Any) -> None:
        frame = encode_frame(obj)
        with self._send_lock:
            self.sock.sendall(frame)

    def recv(self) -> Any:
        (size,) = _HEADER.unpack(self._recv_exactly(_HEADER.size))
        return pickle.loads(self._recv_exactly(size))

    def _recv_exactly(self, size: int) -> bytes:
        buffer = bytearray(size)
        view = memoryview(buffer)
        while view:
            try:
                received = self.sock.recv_into(view)
            except OSError as error:  # reset by a dying peer, or closed under us
                raise ChannelClosed(str(error)) from None
            if received == 0:
                raise ChannelClosed("the front closed the channel")
            view = view[received:]
        return bytes(buffer)

    def shutdown(self) -> None:
        """End the connection both ways, keeping the socket: a thread blocked sending or
        receiving on it wakes with an error or EOF (closing alone would leave it blocked), and
        the other end reads EOF."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self.sock.close()


class AsyncFrameSocket:
    """The front's end, on its event loop: writes never block (the core always reads)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> "AsyncFrameSocket":
        # A step's outputs can be large (256 requests); the default 64 KiB limit only bounds readline.
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 24)
        return cls(reader, writer)

    def send(self, obj: Any) -> None:
        if self._writer.is_closing():
            raise ChannelClosed("the channel to the engine core is closed")
        self._writer.write(encode_frame(obj))

    async def recv(self) -> Any:
        try:
            (size,) = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))
            payload = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            raise ChannelClosed("the engine core closed the channel") from error
        return pickle.loads(payload)

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
