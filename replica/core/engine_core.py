"""EngineCore: the busy loop of the engine-core process. It owns the LLMEngine (scheduler,
model runner, KV cache, SLO monitor) and never waits on a client: between steps it takes
whatever the front has sent (adds, aborts, utility calls), runs one step, and hands one
batched StepOutputs to a sender thread. A receiver thread decodes messages while a step
runs, so the SLO monitor sees urgent arrivals during the forward pass they wait behind.

It may serve several fronts (`headroom replica --api-server-count N`: one event loop in
Python cannot stream a GPU's tokens alone), one channel each, with a receiver and a sender
thread per channel. Each front's requests are its own: their rows, refusals and failures go
to it alone, while every front gets each step's load and KV events (a router's WatchLoad or
WatchKVEvents may land on any of them). Front 0 started the core: its Shutdown, or its
channel closing, stops the core; another front's leaves only that front, whose requests
are aborted. A front that reads nothing for `front_stall_timeout_s` while an output waits for
it (its process wedged: the socket is full, its sender blocked) is taken as gone the same way,
its unsent outputs dropped: the core would otherwise queue a message for it every step, and
keep its requests' KV, for as long as it stays wedged. That clock runs only once the front has
attached (the core has heard from it): a front process still starting reads nothing yet. One
that has not attached FRONT_ATTACH_TIMEOUT_S after the core started (hung while starting) is
taken out the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Optional, Sequence

from replica.core.engine import LLMEngine
from replica.core.request import Request
from replica.errors import InvalidRequestError
from replica.parallel.group import TensorParallelDead
from replica.ipc.channel import ChannelClosed, FrameSocket
from replica.ipc.messages import (
    FRONT_ATTACH_TIMEOUT_S, AbortRequests, AddRequest, Shutdown, StepFailed, StepOutputs, UtilityCall, UtilityResult,
    error_for_front, from_wire, load_to_wire, to_wire,
)
from replica.core.slo import SLOView

logger = logging.getLogger(__name__)

# How often an idle tensor-parallel core checks that its worker processes are alive: one that
# died while nothing ran went unnoticed until the next request (no step sent it anything), so
# the front, Serve's health check and the load stream went on reporting a live replica.
IDLE_WORKER_CHECK_S = 0.5


class EngineCore:
    # What a UtilityCall may run: read-only views of the core's state, for tests and tools.
    UTILITIES = ("request_state", "counters", "check_invariants", "cached_block_hashes", "grammar_compiler_ready",
                 "unsent_messages")

    def __init__(self, engine: LLMEngine, channels: Sequence[FrameSocket] | FrameSocket | None):
        """channels: one per front, front 0's first (a single channel: one front)."""
        self.engine = engine
        engine.collect_failures()  # sent with each step's rejected adds
        if channels is None or isinstance(channels, FrameSocket):
            channels = [channels]
        self.channels = list(channels)
        # Live requests by id, and with several fronts the front each came from.
        self._requests: dict[str, Request] = {}
        self._owners: dict[str, int] = {}
        # Decoded messages as (front, message), adds already as Requests.
        self._inbox: list[tuple[int, Any]] = []
        self._inbox_changed = threading.Condition()
        self._arrivals: list[SLOView] = []  # adds in the inbox, as the SLO monitor sees them
        self._channel_closed = False  # front 0's: the core stops
        # One queue and sender thread per front: a front slow to read backs up only its own.
        self._outboxes: list[queue.SimpleQueue[Optional[tuple]]] = [queue.SimpleQueue() for _ in self.channels]
        self._fronts_open = [True] * len(self.channels)
        # When each front's sender began the message it is sending (None while it waits for one):
        # a front whose socket has taken no whole message for front_stall_timeout_s is wedged.
        self._sending_since: list[Optional[float]] = [None] * len(self.channels)
        # When the core first heard from each front (its receiver's first message; front 0 sent the
        # spec): the stall clock starts there. Another front's process takes seconds to start and
        # attach while front 0 serves, every step's load piling up in its socket meanwhile, and was
        # taken out as wedged before it had read a thing (its attach then failed, and so its start).
        self._attached_at: list[Optional[float]] = [0.0] + [None] * (len(self.channels) - 1)
        self._started_at = time.monotonic()
        self._front_stall_timeout_s = engine.config.front_stall_timeout_s
        self._front_attach_timeout_s = FRONT_ATTACH_TIMEOUT_S
        self._rejected: list[tuple[int, str, BaseException]] = []  # (front, request id, error)
        self._stopping = False

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until the front sends Shutdown or closes the channel."""
        # This process's base thread count is its environment's (under Serve, the one CPU Ray
        # reserved the replica): large steps may run on the cores nothing else uses.
        self.engine.borrow_idle_cpus()
        senders, receivers = [], []
        for front, channel in enumerate(self.channels):
            suffix = "" if front == 0 else f"-{front}"
            receivers.append(threading.Thread(target=self._receive_loop, args=(front,), name=f"core-receive{suffix}",
                                              daemon=True))
            senders.append(threading.Thread(target=self._send_loop, args=(front,), name=f"core-send{suffix}",
                                            daemon=True))
            receivers[-1].start()
            senders[-1].start()
        try:
            self._busy_loop()
        finally:
            for request_id in list(self._requests):
                self.engine.abort_request(request_id)
            self.engine.shutdown()
            for outbox in self._outboxes:
                outbox.put(None)
            for sender in senders:
                sender.join(timeout=5.0)
            for channel in self.channels:
                channel.close()
            # Each receiver wakes as its channel closes. Left running, the last reference to this
            # core (its bound method) went with the thread, which freed the engine's tensors on a
            # daemon thread as the interpreter exited: torch's teardown there ended the process
            # with SIGABRT ("terminate called without an active exception") after most clean
            # shutdowns (helper-46).
            for receiver in receivers:
                receiver.join(timeout=5.0)

    def _busy_loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            idle = not engine.has_unfinished_requests()
            messages = self._take_inbox(block=idle)
            if messages is None:
                return  # the front is gone: nobody would read another output
            self._apply(messages)
            if self._stopping:
                return
            if engine.has_unfinished_requests():
                if idle and len(self.channels) > 1:
                    # Work for an idle core: every front hears it is busy now, not after the step.
                    # A front takes an idle load for current however old (it knows its own sends
                    # only); had this step never ended, a front whose requests were none of it
                    # would have served that idle load as fresh for good.
                    self._send_outputs([])
                    if self._stopping:
                        return  # front 0 was taken out as stalled meanwhile
                self._step()
            elif messages:
                self._send_outputs([])  # aborts, rejections or an idle load change to report

    def _step(self) -> None:
        try:
            rows = self.engine.step_rows()
        except TensorParallelDead:  # a rank is gone: this replica cannot step again
            raise
        except Exception as error:  # a failed forward pass: fail its requests, keep serving
            logger.exception("engine step failed; aborting in-flight requests")
            by_front: list[list[str]] = [[] for _ in self.channels]
            for request_id in self._requests:
                self.engine.abort_request(request_id)
                by_front[self._owners.get(request_id, 0)].append(request_id)
            self._requests.clear()
            self._owners.clear()
            self.engine.recover_from_failed_step()
            for front, request_ids in enumerate(by_front):
                self._put(front, to_wire(StepFailed(request_ids, f"engine step failed: {error}")))
            self._send_outputs([])
            return
        self._send_outputs(rows)

    def _apply(self, messages: list[tuple[int, Any]]) -> None:
        engine = self.engine
        for front, message in messages:
            if isinstance(message, Request):
                if not self._fronts_open[front]:
                    continue  # sent before its front left: nobody would read its outputs
                if message.request_id in self._requests:  # a front keeps its live ids apart, fronts by suffix
                    self._rejected.append((front, message.request_id, error_for_front(InvalidRequestError(
                        "request_id", f"{message.request_id!r} is already in use in the engine core"))))
                    continue
                try:
                    # Validated at the edge; the front detokenizes.
                    engine.enqueue(message, detokenize=False)
                except Exception as error:  # raced past the front's checks (e.g. the queue filled)
                    self._rejected.append((front, message.request_id, error_for_front(error)))
                    continue
                self._requests[message.request_id] = message
                if front:
                    self._owners[message.request_id] = front
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    # Only the front that added a request may abort it.
                    if request_id in self._requests and self._owners.get(request_id, 0) == front:
                        del self._requests[request_id]
                        self._owners.pop(request_id, None)
                        engine.abort_request(request_id)
            elif isinstance(message, UtilityCall):
                self._put(front, to_wire(self._call_utility(message)))
            elif isinstance(message, Shutdown) or message is _FRONT_GONE:
                if front == 0:
                    self._stopping = True
                else:
                    self._front_left(front)

    def _front_left(self, front: int, why: Optional[str] = None) -> None:
        """Front `front` said Shutdown or its channel closed (or, `why`, it stopped reading):
        abort its requests, send it nothing more."""
        if not self._fronts_open[front]:
            return
        self._fronts_open[front] = False
        self._outboxes[front].put(None)
        theirs = [request_id for request_id, owner in self._owners.items() if owner == front]
        for request_id in theirs:
            del self._owners[request_id]
            if self._requests.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
        if why is None:
            logger.info("front %d left; aborted its %d requests", front, len(theirs))
        else:
            logger.warning("front %d %s; aborted its %d requests and closed its channel", front, why, len(theirs))

    def _drop_stalled_fronts(self) -> None:
        """Take out every front whose sender has been blocked on one message for longer than
        front_stall_timeout_s, and every front not attached FRONT_ATTACH_TIMEOUT_S after the
        core started. Its socket is shut, which wakes the sender (a close alone would not), and
        its unsent messages are dropped; the receiver then reads EOF, as from a dead front.
        Front 0's stops the core, as its channel closing does."""
        timeout = self._front_stall_timeout_s
        if not timeout:
            return
        now = time.monotonic()
        for front, (since, attached_at) in enumerate(zip(self._sending_since, self._attached_at)):
            if not self._fronts_open[front]:
                continue
            if attached_at is None:
                if now - self._started_at <= self._front_attach_timeout_s:
                    continue
                why = f"did not attach within {self._front_attach_timeout_s:g} s of the engine core's start"
            else:
                if since is None:
                    continue
                # A send blocked since before the front attached is counted from its attach.
                since = max(since, attached_at)
                if now - since <= timeout:
                    continue
                why = f"read no output for {now - since:.1f} s (front_stall_timeout_s {timeout:g})"
            self.channels[front].shutdown()
            outbox = self._outboxes[front]
            while True:  # its sender may take one meanwhile: empty() then get_nowait() raced it
                try:
                    outbox.get_nowait()
                except queue.Empty:
                    break
            if front == 0:
                logger.warning("front 0 %s; stopping the engine core", why)
                self._fronts_open[0] = False
                self._stopping = True
            else:
                self._front_left(front, why)

    def _put(self, front: int, wire: tuple) -> None:
        if self._fronts_open[front]:
            self._outboxes[front].put(wire)

    def _send_outputs(self, rows: list[tuple]) -> None:
        """One StepOutputs per front: the step's CoreOutput rows as the engine built them (each
        front its own requests'), the load after it."""
        self._drop_stalled_fronts()
        requests = self._requests
        owners = self._owners
        # Adds refused, and requests the engine ended with an error (rows below finish them).
        rejected = self._rejected + [(owners.get(request_id, 0), request_id, error_for_front(error))
                                     for request_id, error in self.engine.take_failed()]
        self._rejected = []
        stats = self.engine.stats
        load = load_to_wire(self.engine.load())
        kv_events = self._kv_events()
        if len(self.channels) == 1:
            for row in rows:
                if row[2] is not None:  # its finish reason: it has left the engine
                    del requests[row[0]]
            self._put(0, to_wire(StepOutputs(
                rows, load, stats.step_time_s, stats.generation_tokens_per_s, kv_events,
                [(request_id, error) for _, request_id, error in rejected],
            )))
            return
        rows_of: list[list[tuple]] = [[] for _ in self.channels]
        for row in rows:
            request_id = row[0]
            if row[2] is not None:
                del requests[request_id]
                front = owners.pop(request_id, 0)
            else:
                front = owners.get(request_id, 0)
            rows_of[front].append(row)
        rejected_of: list[list[tuple[str, BaseException]]] = [[] for _ in self.channels]
        for front, request_id, error in rejected:
            rejected_of[front].append((request_id, error))
        for front in range(len(self.channels)):
            self._put(front, to_wire(StepOutputs(rows_of[front], load, stats.step_time_s,
                                                 stats.generation_tokens_per_s, kv_events, rejected_of[front])))

    def _kv_events(self) -> list[Any]:
        # Drained with every output message, so the front's KV-event log sees each cache
        # change once and in order (replica/front/kv_event_log.py numbers and streams them).
        return self.engine.take_kv_events()

    # ---- utility calls -----------------------------------------------------------------
    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in self.UTILITIES:
            return UtilityResult(call.call_id, None, ValueError(f"method: no utility {call.method!r}"))
        try:
            return UtilityResult(call.call_id, getattr(self, call.method)(*call.args), None)
        except Exception as error:
            return UtilityResult(call.call_id, None, error_for_front(error))

    def request_state(self, request_id: str) -> Optional[dict[str, Any]]:
        """A live request's scheduling state, or None once it has left the engine."""
        request = self.engine.scheduler.requests.get(request_id)
        if request is None:
            return None
        return {"status": request.status.name, "arrival_time": request.arrival_time,
                "ttft_deadline": request.ttft_deadline, "num_computed_tokens": request.num_computed_tokens,
                "num_output_tokens": request.num_output_tokens, "priority": request.priority}

    def counters(self) -> dict[str, int]:
        return dataclasses.asdict(self.engine.scheduler.counters)

    def grammar_compiler_ready(self) -> bool:
        """Whether the engine's grammar compiler is built (process.py builds it before CoreReady)."""
        return self.engine.grammar_compiler is not None

    def unsent_messages(self) -> list[int]:
        """Each front's messages queued in the core and not yet sent (a front behind, or wedged)."""
        return [outbox.qsize() for outbox in self._outboxes]

    def check_invariants(self) -> bool:
        self.engine.scheduler.check_invariants()
        return True

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash the prefix cache can hit now (what the front's KV-event mirror must hold)."""
        return list(self.engine.scheduler.kv_cache.pool.cached_blocks)

    # ---- the threads -------------------------------------------------------------------
    def _take_inbox(self, block: bool) -> Optional[list[tuple[int, Any]]]:
        """Everything received since the last call, as (front, message); waits for something
        when `block`. None once front 0's channel is closed and nothing is left. A
        tensor-parallel worker that exits meanwhile raises TensorParallelDead within
        IDLE_WORKER_CHECK_S, which ends the core as it does from a step."""
        workers = self.engine.tp_workers
        with self._inbox_changed:
            while block and not self._inbox and not self._channel_closed:
                if workers is None:
                    self._inbox_changed.wait()
                elif not self._inbox_changed.wait(IDLE_WORKER_CHECK_S):
                    workers.check_alive()
            messages, self._inbox = self._inbox, []
            if self._arrivals:
                self._arrivals = []
                self._publish_arrivals()
            if not messages and self._channel_closed:
                return None
            return messages

    def _receive_loop(self, front: int) -> None:
        eos_token_ids = self.engine.eos_token_ids
        channel = self.channels[front]
        while True:
            try:
                message = from_wire(channel.recv())
            except ChannelClosed:
                break
            if self._attached_at[front] is None:
                self._attached_at[front] = time.monotonic()
            if isinstance(message, AddRequest):
                message = message.to_request(eos_token_ids)
            with self._inbox_changed:
                self._inbox.append((front, message))
                if isinstance(message, Request) and self.engine.slo_monitor is not None:
                    self._arrivals.append(SLOView.of(message))
                    self._publish_arrivals()
                self._inbox_changed.notify()
        with self._inbox_changed:
            if front == 0:
                self._channel_closed = True
            else:
                self._inbox.append((front, _FRONT_GONE))
            self._inbox_changed.notify()

    def _publish_arrivals(self) -> None:
        # Requests received while a forward pass runs reach the scheduler only after it, and
        # may be the reason to abort it: the monitor must see them now.
        monitor = self.engine.slo_monitor
        if monitor is not None:
            monitor.publish_arrivals(tuple(self._arrivals))

    def _send_loop(self, front: int) -> None:
        outbox, channel, sending_since = self._outboxes[front], self.channels[front], self._sending_since
        while (wire := outbox.get()) is not None:
            sending_since[front] = time.monotonic()
            try:
                channel.send(wire)
            except (ChannelClosed, OSError):
                return  # the front is gone; the busy loop finds out from the receiver
            sending_since[front] = None


# What a front's receiver puts in the inbox when its channel closes (front 0's stops the core).
_FRONT_GONE = object()
