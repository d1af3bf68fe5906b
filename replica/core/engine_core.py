"""EngineCore: the busy loop of the engine-core process. It owns the LLMEngine (scheduler,
model runner, KV cache, SLO monitor) and never waits on a client: between steps it takes
whatever the front has sent (adds, aborts, utility calls), runs one step, and hands one
batched StepOutputs to a sender thread. A receiver thread decodes messages while a step
runs, so the SLO monitor sees urgent arrivals during the forward pass they wait behind.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any, Optional

from replica.core.engine import LLMEngine
from replica.core.request import Request
from replica.parallel.group import TensorParallelDead
from replica.ipc.channel import ChannelClosed, FrameSocket
from replica.ipc.messages import (
    AbortRequests, AddRequest, Shutdown, StepFailed, StepOutputs, UtilityCall, UtilityResult, error_for_front,
    from_wire, load_to_wire, to_wire,
)
from replica.core.slo import SLOView

logger = logging.getLogger(__name__)


class EngineCore:
    # What a UtilityCall may run: read-only views of the core's state, for tests and tools.
    UTILITIES = ("request_state", "counters", "check_invariants", "cached_block_hashes", "grammar_compiler_ready")

    def __init__(self, engine: LLMEngine, channel: FrameSocket):
        self.engine = engine
        engine.collect_failures()  # sent with each step's rejected adds
        self.channel = channel
        # Live requests by id: their admission time rides on their first output.
        self._requests: dict[str, Request] = {}
        self._inbox: list[Any] = []  # decoded messages (adds already as Requests)
        self._inbox_changed = threading.Condition()
        self._arrivals: list[SLOView] = []  # adds in the inbox, as the SLO monitor sees them
        self._channel_closed = False
        self._outbox: queue.SimpleQueue[Optional[tuple]] = queue.SimpleQueue()
        self._rejected: list[tuple[str, BaseException]] = []
        self._stopping = False

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until the front sends Shutdown or closes the channel."""
        # This process's base thread count is its environment's (under Serve, the one CPU Ray
        # reserved the replica): large steps may run on the cores nothing else uses.
        self.engine.borrow_idle_cpus()
        receiver = threading.Thread(target=self._receive_loop, name="core-receive", daemon=True)
        sender = threading.Thread(target=self._send_loop, name="core-send", daemon=True)
        receiver.start()
        sender.start()
        try:
            self._busy_loop()
        finally:
            for request_id in list(self._requests):
                self.engine.abort_request(request_id)
            self.engine.shutdown()
            self._outbox.put(None)
            sender.join(timeout=5.0)
            self.channel.close()

    def _busy_loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            messages = self._take_inbox(block=not engine.has_unfinished_requests())
            if messages is None:
                return  # the front is gone: nobody would read another output
            self._apply(messages)
            if self._stopping:
                return
            if engine.has_unfinished_requests():
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
            request_ids = list(self._requests)
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            self._requests.clear()
            self._outbox.put(to_wire(StepFailed(request_ids, f"engine step failed: {error}")))
            self._send_outputs([])
            return
        self._send_outputs(rows)

    def _apply(self, messages: list[Any]) -> None:
        engine = self.engine
        for message in messages:
            if isinstance(message, Request):
                try:
                    # Validated at the edge; the front detokenizes.
                    engine.enqueue(message, detokenize=False)
                except Exception as error:  # raced past the front's checks (e.g. the queue filled)
                    self._rejected.append((message.request_id, error_for_front(error)))
                    continue
                self._requests[message.request_id] = message
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    if self._requests.pop(request_id, None) is not None:
                        engine.abort_request(request_id)
            elif isinstance(message, UtilityCall):
                self._outbox.put(to_wire(self._call_utility(message)))
            elif isinstance(message, Shutdown):
                self._stopping = True

    def _send_outputs(self, rows: list[tuple]) -> None:
        """One StepOutputs: the step's CoreOutput rows as the engine built them, the load after it."""
        requests = self._requests
        for row in rows:
            if row[2] is not None:  # its finish reason: it has left the engine
                del requests[row[0]]
        stats = self.engine.stats
        # Adds refused, and requests the engine ended with an error (rows above finish them).
        rejected = self._rejected + [(request_id, error_for_front(error))
                                     for request_id, error in self.engine.take_failed()]
        self._rejected = []
        self._outbox.put(to_wire(StepOutputs(
            rows, load_to_wire(self.engine.load()), stats.step_time_s, stats.generation_tokens_per_s,
            self._kv_events(), rejected,
        )))

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

    def check_invariants(self) -> bool:
        self.engine.scheduler.check_invariants()
        return True

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash the prefix cache can hit now (what the front's KV-event mirror must hold)."""
        return list(self.engine.scheduler.kv_cache.pool.cached_blocks)

    # ---- the threads -------------------------------------------------------------------
    def _take_inbox(self, block: bool) -> Optional[list[Any]]:
        """Everything received since the last call; waits for something when `block`.
        None once the channel is closed and nothing is left."""
        with self._inbox_changed:
            while block and not self._inbox and not self._channel_closed:
                self._inbox_changed.wait()
            messages, self._inbox = self._inbox, []
            if self._arrivals:
                self._arrivals = []
                self._publish_arrivals()
            if not messages and self._channel_closed:
                return None
            return messages

    def _receive_loop(self) -> None:
        eos_token_ids = self.engine.eos_token_ids
        while True:
            try:
                message = from_wire(self.channel.recv())
            except ChannelClosed:
                break
            if isinstance(message, AddRequest):
                message = message.to_request(eos_token_ids)
            with self._inbox_changed:
                self._inbox.append(message)
                if isinstance(message, Request) and self.engine.slo_monitor is not None:
                    self._arrivals.append(SLOView.of(message))
                    self._publish_arrivals()
                self._inbox_changed.notify()
        with self._inbox_changed:
            self._channel_closed = True
            self._inbox_changed.notify()

    def _publish_arrivals(self) -> None:
        # Requests received while a forward pass runs reach the scheduler only after it, and
        # may be the reason to abort it: the monitor must see them now.
        monitor = self.engine.slo_monitor
        if monitor is not None:
            monitor.publish_arrivals(tuple(self._arrivals))

    def _send_loop(self) -> None:
        while (wire := self._outbox.get()) is not None:
            try:
                self.channel.send(wire)
            except (ChannelClosed, OSError):
                return  # the front is gone; the busy loop finds out from the receiver
