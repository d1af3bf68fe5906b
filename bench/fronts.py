"""Which front of a `headroom replica --api-server-count N` holds which connection, from
/proc (Linux): the fronts share one port (SO_REUSEPORT) and the kernel picks a front per
new connection, so a client that wants its streams spread evenly opens connections until
each front holds its share (bench_served.py), and a test can tell which front served it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

# A channel of its own connection: gRPC otherwise shares one subchannel between channels to
# the same address, so every channel would reach the same front.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def front_pids(front0_pid: int) -> list[int]:
    """Front 0 (the `headroom replica` process) and the other fronts it started, in order."""
    others = [child for child in children(front0_pid) if "--front" in Path(f"/proc/{child}/cmdline").read_text()]
    return [front0_pid] + others


def engine_core_pid(front0_pid: int) -> int:
    (core,) = [child for child in children(front0_pid)
               if "replica.core.process" in Path(f"/proc/{child}/cmdline").read_text()]
    return core


def served_connections(pid: int, port: int) -> int:
    """Established TCP connections process `pid` accepted on `port`."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:
            continue
        if target.name.startswith("socket:["):
            inodes.add(target.name[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


async def channels_per_front(address: str, fronts: list[int], per_front: int,
                             max_tries: int = 1000) -> list[list[grpc.aio.Channel]]:
    """`per_front` connected channels to each front at `address` ("host:port"), as lists in
    the fronts' order: connections are opened one at a time and each is kept by the front
    that accepted it, or closed once that front has its share."""
    port = int(address.rsplit(":", 1)[1])
    held: list[list[grpc.aio.Channel]] = [[] for _ in fronts]
    for _ in range(max_tries):
        if min(len(channels) for channels in held) >= per_front:
            return held
        before = [served_connections(pid, port) for pid in fronts]
        channel = grpc.aio.insecure_channel(address, options=OWN_CONNECTION)
        await channel.channel_ready()
        after = before
        for _ in range(100):  # the accept shows in /proc once the front's poller took it
            after = [served_connections(pid, port) for pid in fronts]
            if after != before:
                break
            await asyncio.sleep(0.01)
        front = next((index for index in range(len(fronts)) if after[index] > before[index]), None)
        if front is None or len(held[front]) >= per_front:
            await channel.close()
        else:
            held[front].append(channel)
    raise RuntimeError(f"no even spread of connections over {len(fronts)} fronts in {max_tries} tries")
