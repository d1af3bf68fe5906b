"""The engine-core channel, measured: round trips of the messages the front and the core
exchange (an add request, a step's batched outputs for 64 and 256 requests) between an
asyncio process and a child process, over each candidate transport, in one run.

    python bench/bench_channel.py [--round-trips 2000]

Candidates: a Unix socketpair with length-prefixed msgpack frames (what replica/ipc uses),
the same frames pickled, multiprocessing's Connection (pickle), and ZeroMQ PAIR over ipc://
with msgpack (needs `pip install pyzmq`; skipped without it). The child decodes each message
and encodes it again, as the core does; the front awaits it on its event loop, as the front
does. Printed: the round trip's p50/p99 and the parent's CPU time per round trip, relative to
the socketpair + msgpack row.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pickle
import socket
import struct
import time

import msgpack

from cluster.stats import percentile

FRAME_HEADER = struct.Struct("<I")


def add_message() -> list:
    prompt = list(range(3, 131))
    return ["add", "req-0123456789ab-7", prompt, [128, 0.0, 1.0, -1, 0.0, None, [], True, False],
            0, 1234.5, None, None]


def step_message(num_requests: int) -> list:
    outputs = [[f"req-0123456789ab-{i}", [i % 300], None, 0, None, None] for i in range(num_requests)]
    load = [4095, 2000, 16, 0.51, 32000, 1200, num_requests, 3, 400, 7, 90, 5, 2, 100, 2000, 256, 0, 0, 0.0, 0.02]
    return ["step", outputs, load, [0.045, 1419.0], [], 17]


# ---- transports: (child serve loop, parent client) ------------------------------------
def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    while view:
        received = sock.recv_into(view)
        if received == 0:
            raise EOFError
        view = view[received:]
    return bytes(buffer)


def serve_socket(sock: socket.socket, codec: str) -> None:
    loads, dumps = (msgpack.unpackb, msgpack.packb) if codec == "msgpack" else (pickle.loads, pickle.dumps)
    try:
        while True:
            (size,) = FRAME_HEADER.unpack(_recv_exactly(sock, FRAME_HEADER.size))
            payload = dumps(loads(_recv_exactly(sock, size)))
            sock.sendall(FRAME_HEADER.pack(len(payload)) + payload)
    except EOFError:
        pass


def serve_connection(connection) -> None:
    try:
        while True:
            connection.send(connection.recv())
    except EOFError:
        pass


def serve_zmq(address: str) -> None:
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    sock.connect(address)
    while True:
        frame = sock.recv()
        if frame == b"":
            break
        sock.send(msgpack.packb(msgpack.unpackb(frame)))
    sock.close(linger=0)
    context.term()


async def socket_client(codec: str, messages: list, round_trips: int) -> list[float]:
    parent_sock, child_sock = socket.socketpair()
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=serve_socket, args=(child_sock, codec))
    child.start()
    child_sock.close()
    reader, writer = await asyncio.open_unix_connection(sock=parent_sock)
    loads, dumps = (msgpack.unpackb, msgpack.packb) if codec == "msgpack" else (pickle.loads, pickle.dumps)
    times = []
    for index in range(round_trips):
        payload = dumps(messages[index % len(messages)])
        start = time.perf_counter()
        writer.write(FRAME_HEADER.pack(len(payload)) + payload)
        (size,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
        loads(await reader.readexactly(size))
        times.append(time.perf_counter() - start)
    writer.close()
    await writer.wait_closed()
    child.join()
    return times


async def connection_client(messages: list, round_trips: int) -> list[float]:
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    child = context.Process(target=serve_connection, args=(child_end,))
    child.start()
    child_end.close()
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(parent_end.fileno(), readable.set)
    times = []
    for index in range(round_trips):
        start = time.perf_counter()
        parent_end.send(messages[index % len(messages)])
        await readable.wait()
        readable.clear()
        parent_end.recv()
        times.append(time.perf_counter() - start)
    loop.remove_reader(parent_end.fileno())
    parent_end.close()
    child.join()
    return times


async def zmq_client(messages: list, round_trips: int) -> list[float]:
    import zmq
    import zmq.asyncio

    address = f"ipc:///tmp/headroom-bench-channel-{os.getpid()}"
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.PAIR)
    sock.bind(address)
    child = multiprocessing.get_context("spawn").Process(target=serve_zmq, args=(address,))
    child.start()
    times = []
    for index in range(round_trips):
        payload = msgpack.packb(messages[index % len(messages)])
        start = time.perf_counter()
        await sock.send(payload)
        msgpack.unpackb(await sock.recv())
        times.append(time.perf_counter() - start)
    await sock.send(b"")
    child.join()
    sock.close(linger=0)
    context.term()
    return times


def run(label: str, client, round_trips: int) -> tuple[str, float, float, float]:
    cpu_start = time.process_time()
    times = asyncio.run(client(round_trips))
    cpu_per_trip_us = (time.process_time() - cpu_start) / round_trips * 1e6
    times = times[len(times) // 10:]  # drop the warm-up tenth
    return label, percentile(times, 0.5) * 1e6, percentile(times, 0.99) * 1e6, cpu_per_trip_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=2000)
    args = parser.parse_args()
    try:
        import zmq  # noqa: F401
        have_zmq = True
    except ImportError:
        have_zmq = False
    for title, messages in (("add request (128-token prompt)", [add_message()]),
                            ("step outputs, 64 requests", [step_message(64)]),
                            ("step outputs, 256 requests", [step_message(256)])):
        size = len(msgpack.packb(messages[0]))
        rows = [
            run("socketpair + msgpack", lambda n: socket_client("msgpack", messages, n), args.round_trips),
            run("socketpair + pickle", lambda n: socket_client("pickle", messages, n), args.round_trips),
            run("mp Connection (pickle)", lambda n: connection_client(messages, n), args.round_trips),
        ]
        if have_zmq:
            rows.append(run("zmq ipc PAIR + msgpack", lambda n: zmq_client(messages, n), args.round_trips))
        print(f"\n{title}: {size} bytes as msgpack, {args.round_trips} round trips each")
        print(f"  {'transport':<26}{'p50 us':>9}{'p99 us':>9}{'parent CPU us/trip':>20}{'p50 vs ours':>13}")
        ours_p50 = rows[0][1]
        for label, p50, p99, cpu in rows:
            print(f"  {label:<26}{p50:>9.1f}{p99:>9.1f}{cpu:>20.1f}{p50 / ours_p50:>12.2f}x")
        if not have_zmq:
            print("  (zmq skipped: pip install pyzmq to include it)")


if __name__ == "__main__":
    main()
