"""Front 0 starting the other fronts of its engine core (`headroom replica --api-server-count`)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest


def test_a_front_hung_while_starting_fails_the_start_naming_it(monkeypatch):
    """Front 0 waited on a front's first line for ever: one hung while starting (before it
    served) kept the replica from ever serving, with nothing said. Now the start fails after
    FRONT_ATTACH_TIMEOUT_S (the core's own bound on a front's attach), naming the front."""
    import cluster.replica_command as replica_command
    from replica.config import EngineConfig

    popen = subprocess.Popen

    def hung_front(command, **kwargs):  # reads its settings, then never writes a line
        return popen([sys.executable, "-c", "import sys, time; sys.stdin.buffer.read(); time.sleep(60)"], **kwargs)

    monkeypatch.setattr(replica_command.subprocess, "Popen", hung_front)
    monkeypatch.setattr(replica_command, "FRONT_ATTACH_TIMEOUT_S", 0.5)
    ours, theirs = socket.socketpair()
    settings = replica_command.FrontSettings({}, EngineConfig(), "replica-0", None, 0, None)
    others = replica_command.OtherFronts()

    async def start():
        started = time.monotonic()
        try:
            with pytest.raises(replica_command.FrontFailed) as failed:
                await asyncio.wait_for(others.start([theirs], settings), 30)
            return failed.value, time.monotonic() - started
        finally:
            await others.stop(0.0)

    try:
        error, waited = asyncio.run(start())
    finally:
        ours.close()
    pid = others.processes[0].pid
    assert str(error) == f"front 1 of the engine core (pid {pid}) did not start serving within 0.5 s"
    assert waited < 10 and others.processes[0].poll() is not None
