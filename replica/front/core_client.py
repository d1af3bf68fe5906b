"""EngineCoreClient: the front's handle on its engine-core process. It spawns the process (a
fresh interpreter, never a fork of the serving process), hands it a CoreSpec, and then sends
adds, aborts (coalesced: every abort of one event-loop turn goes in one message) and utility
calls, while a reader task hands each message from the core to the front's handlers. When
the core dies (EOF on the socket, or its exit seen by the watcher) `on_dead` fires once.

A core may serve several fronts (`headroom replica --api-server-count N`): the client that
starts it asks for the others' channels too (`start(spec, fronts=N)`, then
`take_front_sockets()`) and hands each to another front process, whose client `attach`es to
it. An attached client's Shutdown only takes its own front out; the starting front's stops
the core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from typing import Any, Callable, MutableMapping, Optional

from replica.core.request import Request
from replica.ipc.channel import AsyncFrameSocket, ChannelClosed
from replica.ipc.messages import (
    AbortRequests, AddRequest, CoreFailed, CoreReady, CoreSpec, Shutdown, StepFailed, StepOutputs, UtilityCall,
    UtilityResult, from_wire, to_wire,
)
from replica.errors import EngineDeadError

logger = logging.getLogger(__name__)

# How often the watcher checks the process, in case something else holds the socket open.
PROCESS_WATCH_INTERVAL_S = 0.5
# After Shutdown, the core exits within a step; past this it is killed.
EXIT_TIMEOUT_S = 10.0


class EngineCoreClient:
    def __init__(self, on_step: Callable[[StepOutputs], None], on_step_failed: Callable[[StepFailed], None],
                 on_dead: Callable[[EngineDeadError], None]):
        self._on_step = on_step
        self._on_step_failed = on_step_failed
        self._on_dead = on_dead
        self.process: Optional[subprocess.Popen] = None
        self.ready: Optional[CoreReady] = None
        self.dead: Optional[EngineDeadError] = None
        self._channel: Optional[AsyncFrameSocket] = None
        self._tasks: list[asyncio.Task] = []
        self._pending_aborts: list[str] = []
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._front_sockets: list[socket.socket] = []  # other fronts' ends, until taken

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, spec: CoreSpec, fronts: int = 1) -> CoreReady:
        """Spawn the core and wait until its engine is built; raises the core's build error
        (ConfigError, FileNotFoundError, ...) or EngineDeadError if it died starting.
        fronts > 1: the core also serves that many - 1 other fronts, whose channels
        `take_front_sockets` hands out. Cancelled (Ctrl-C while the engine builds) or failing
        here, it kills the core, which reads no channel until its engine is built."""
        pairs = [socket.socketpair() for _ in range(fronts)]
        core_ends = [core_end for _, core_end in pairs]
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "replica.core.process", "--fd",
                 ",".join(str(core_end.fileno()) for core_end in core_ends), "--parent-pid", str(os.getpid())],
                pass_fds=tuple(core_end.fileno() for core_end in core_ends), env=child_environment(),
            )
        finally:
            for core_end in core_ends:
                core_end.close()
        self._front_sockets = [front_end for front_end, _ in pairs[1:]]
        try:
            self._channel = await AsyncFrameSocket.open(pairs[0][0])
            self._channel.send(spec)
            answer = await self._channel.recv()
        except ChannelClosed:
            code = await asyncio.get_running_loop().run_in_executor(None, self.process.wait)
            await self._channel.close()
            self._close_front_sockets()
            raise EngineDeadError(f"the engine core exited with code {code} while starting") from None
        except BaseException:
            self.process.kill()
            self.process.wait()  # at once: killed
            self._close_front_sockets()
            if self._channel is None:
                pairs[0][0].close()
            else:
                await self._channel.close()
            raise
        if isinstance(answer, CoreFailed):
            await self._channel.close()
            self._close_front_sockets()
            await asyncio.get_running_loop().run_in_executor(None, self.process.wait)
            raise answer.error
        self.ready = answer
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_loop(), name="engine-core-reader"),
                       loop.create_task(self._watch_process(), name="engine-core-watcher")]
        return answer

    def take_front_sockets(self) -> list[socket.socket]:
        """The other fronts' ends of their channels (start(fronts=N)), once: the caller hands
        each to its front's process and closes its own copy, so that the core sees a front's
        death as the end of its channel."""
        sockets, self._front_sockets = self._front_sockets, []
        return sockets

    def _close_front_sockets(self) -> None:
        for front_socket in self.take_front_sockets():
            front_socket.close()

    async def attach(self, sock: socket.socket) -> CoreReady:
        """Serve as another front of a core some other front started, over `sock` (its
        `take_front_sockets`): wait for the core's answer, raising its build error or
        EngineDeadError. No process to watch: the channel's end says the core is gone."""
        self._channel = await AsyncFrameSocket.open(sock)
        try:
            answer = await self._channel.recv()
        except ChannelClosed:
            await self._channel.close()
            raise EngineDeadError("the engine core closed this front's channel while starting") from None
        if isinstance(answer, CoreFailed):
            await self._channel.close()
            raise answer.error
        self.ready = answer
        # A first word (an empty abort: nothing to do) tells the core this front reads its channel
        # now: only then does front_stall_timeout_s run for it, not while its process was starting.
        self._send(AbortRequests([]))
        self._tasks = [asyncio.get_running_loop().create_task(self._read_loop(), name="engine-core-reader")]
        return answer

    async def shutdown(self) -> None:
        """Ask the core to exit (it aborts what it still holds) and wait for it; kill it if it
        hangs. Attached: take this front out (the core aborts its requests) and close the channel."""
        self._close_front_sockets()
        if self._channel is None or (self.process is None and self.ready is None):
            return  # never started (a start that failed here killed its core), or never attached
        self._closing = True
        if self.dead is None:
            try:
                self._flush_aborts()
                self._channel.send(to_wire(Shutdown()))
            except ChannelClosed:
                pass
        if self.process is not None:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(loop.run_in_executor(None, self.process.wait), EXIT_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("engine core %d did not exit in %.0f s; killing it", self.process.pid, EXIT_TIMEOUT_S)
                self.process.kill()
                await loop.run_in_executor(None, self.process.wait)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._channel.close()

    # ---- messages to the core ------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._send(AddRequest.of(request))

    def abort(self, request_id: str) -> None:
        """Queued and sent once per event-loop turn, so a burst of cancellations is one message."""
        if not self._pending_aborts:
            asyncio.get_running_loop().call_soon(self._flush_aborts)
        self._pending_aborts.append(request_id)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run one of EngineCore.UTILITIES in the core between steps; its result or its error.
        Aborts queued before the call leave first, so the core answers after applying them."""
        self._flush_aborts()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(UtilityCall(call_id, method, args))
        return await future

    def _flush_aborts(self) -> None:
        request_ids, self._pending_aborts = self._pending_aborts, []
        if request_ids and self.dead is None:
            self._send(AbortRequests(request_ids))

    def _send(self, message) -> None:
        if self.dead is not None:
            raise self.dead
        self._channel.send(to_wire(message))

    # ---- messages from the core ----------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            try:
                message = from_wire(await self._channel.recv())
            except ChannelClosed:
                self._died("closed its channel")
                return
            if isinstance(message, StepOutputs):
                self._on_step(message)
            elif isinstance(message, StepFailed):
                self._on_step_failed(message)
            elif isinstance(message, UtilityResult):
                future = self._calls.pop(message.call_id, None)
                if future is not None and not future.done():
                    if message.error is not None:
                        future.set_exception(message.error)
                    else:
                        future.set_result(message.value)

    async def _watch_process(self) -> None:
        while self.process.poll() is None:
            await asyncio.sleep(PROCESS_WATCH_INTERVAL_S)
        self._died(f"exited with code {self.process.returncode}")

    def _died(self, how: str) -> None:
        if self.dead is not None or self._closing:
            return
        if self.process is None:  # attached: the core is another front's child
            self.dead = EngineDeadError(f"the engine core {how}")
        else:
            code = self.process.poll()
            detail = how if code is None else f"{how}; exit code {code}"
            self.dead = EngineDeadError(f"the engine core (pid {self.process.pid}) died: {detail}")
        logger.error("%s", self.dead)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self.dead)
        self._calls.clear()
        self._on_dead(self.dead)


# The OpenMP settings that say how idle intra-op threads wait; when the front's environment
# sets none of them, the core's idle workers spin briefly, then sleep (OPENMP_SHORT_WAIT).
OPENMP_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# libgomp (torch's runtime on Linux) spins an idle worker this many iterations (~10-30 us) after
# a parallel region, then sleeps: long enough to bridge the gap between one op of a forward pass
# and the next, too short to hold a core another process needs. Its default, 300k, held both
# cores of a 2-core machine and collapsed a served run 10x under other load; sleeping at once
# (OMP_WAIT_POLICY=PASSIVE, the default until 2026-11-29) woke a worker through the kernel at
# every region: SmolLM2's served steps took 1.8x the offline loop's. Measured on that machine
# (bench_served.py, 64x128, docs/benchmarks.md): SmolLM2 served/offline 0.62 passive -> 0.97;
# the built-in model under two full-priority CPU hogs 1,106 -> 1,299 served tok/s, under three
# nice-10 hogs 2,044-2,146 -> 2,751-2,774. Intel's runtime (KMP_BLOCKTIME=0) still sleeps at once.
OPENMP_SHORT_WAIT = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}


def openmp_waits_briefly(environment: MutableMapping[str, str]) -> None:
    """Sets OPENMP_SHORT_WAIT in `environment` unless it already chose how idle OpenMP threads
    wait (it must be in a process's environment before torch loads its runtime)."""
    if not any(name in environment for name in OPENMP_WAIT_SETTINGS):
        environment.update(OPENMP_SHORT_WAIT)


def child_environment() -> dict[str, str]:
    """The front's environment, with its import path: the core must import the same code
    (this checkout, a test directory), not whatever an installed copy would resolve to.

    The core's OpenMP threads spin only briefly before they sleep unless the environment chose
    otherwise (OPENMP_SHORT_WAIT): by default libgomp spins an idle worker for ~300k iterations
    after each parallel region, so between the forward pass's ops the core holds every core it
    has a thread on, and the front (and anything else on the host) gets the CPU only by
    preempting a worker that the next op then waits for. Measured on the 2-core VM under other
    load (bench_served.py, 64x128): the core spent 55 CPU-s on what takes it 6 when its workers
    sleep, and the served run took 73 s instead of 7 (docs/benchmarks.md)."""
    paths = [os.path.abspath(path or os.getcwd()) for path in sys.path]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    openmp_waits_briefly(environment)
    return environment
