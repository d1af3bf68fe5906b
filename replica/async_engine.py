"""AsyncEngine: drives an LLMEngine from asyncio. A background loop steps while there is
work, on one worker thread so the event loop (gRPC streams, load reports) stays responsive;
each request gets a stream of RequestOutput deltas.

Requests are validated at once, in the caller's task; adds and aborts are applied between
steps (the engine is never touched by two threads at once). Abandoning a stream aborts
its request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional, Sequence

from replica.engine import LLMEngine, RequestOutput
from replica.kv_event_log import KVEventLog
from replica.request import InvalidRequestError, Request, SamplingParams
from replica.scheduler import QueueFullError, SchedulerLoad
from replica.slo import SLOView

logger = logging.getLogger(__name__)


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineStepError(RuntimeError):
    """The model failed while running this request's step."""


class FirstTokenDeadlineExceeded(RuntimeError):
    """No first token within the request's hard TTFT deadline; its stream ends with this."""


class RequestStream:
    """Async iterator over one request's outputs; ends after the output with a finish reason.

    With `first_token_timeout_s`, waiting for the first output longer than that (from the
    stream's creation) raises FirstTokenDeadlineExceeded; the caller aborts the request."""

    def __init__(self, request: Request, first_token_timeout_s: Optional[float] = None):
        self.request = request
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self._first_token_by = (
            None if first_token_timeout_s is None else asyncio.get_running_loop().time() + first_token_timeout_s
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._first_token_by is None:
            item = await self._queue.get()
        else:
            remaining = self._first_token_by - asyncio.get_running_loop().time()
            try:
                item = await asyncio.wait_for(self._queue.get(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                # Not `finished`: the request is still live, and callers abort unfinished streams.
                raise FirstTokenDeadlineExceeded(
                    f"no first token within the TTFT deadline of {self.request.request_id!r}"
                ) from None
            self._first_token_by = None  # the deadline is met once anything arrives
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[RequestStream] = []
        self._pending_aborts: set[str] = set()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._loop_task: Optional[asyncio.Task] = None
        self._accepting = True
        self._ids = itertools.count()
        self.load_version = 0  # bumped each time a new load snapshot is published
        self._load: SchedulerLoad = engine.load()
        self._load_changed = asyncio.Condition()
        self.kv_events = KVEventLog()  # the prefix cache's changes, numbered, for WatchKVEvents

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def shutdown(self, grace_period_s: float = 5.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to the grace period, abort
        the rest (their streams end with finish reason "abort"), then stop the loop."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + grace_period_s
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self.abort(request_id)
        while self._streams and self._loop_task is not None and not self._loop_task.done():
            await asyncio.sleep(0.01)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        self.engine.shutdown()

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        request_id: Optional[str] = None,
        priority: int = 0,
        ttft_deadline: Optional[float] = None,
        cache_salt: Optional[str] = None,
        ttft_slo_ms: Optional[float] = None,
        first_token_timeout_s: Optional[float] = None,
    ) -> RequestStream:
        """Validate and queue a request. Raises InvalidRequestError (naming the field),
        QueueFullError or EngineShutdownError before anything is queued. ttft_slo_ms: the
        request's TTFT SLO (see LLMEngine.make_request), a scheduling target; the hard
        first_token_timeout_s ends the stream with FirstTokenDeadlineExceeded instead."""
        if not self._accepting:
            raise EngineShutdownError("the replica is shutting down")
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        engine = self.engine
        request = engine.make_request(request_id, prompt_token_ids, sampling_params, priority=priority,
                                      ttft_deadline=ttft_deadline, cache_salt=cache_salt, ttft_slo_ms=ttft_slo_ms)
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        engine.scheduler.validate_request(request)
        bound = engine.config.max_waiting_requests
        if self._load.num_waiting + len(self._pending_adds) >= bound:
            raise QueueFullError(f"waiting queue is full ({bound} requests)")
        stream = RequestStream(request, first_token_timeout_s)
        self._streams[request_id] = stream
        self._pending_adds.append(stream)
        self._publish_arrivals()
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._pending_aborts.add(request_id)
            self._wakeup.set()

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Convenience stream; closing or cancelling it aborts the request."""
        stream = self.add_request(prompt_token_ids, sampling_params, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    # ---- load --------------------------------------------------------------------------
    def load(self) -> SchedulerLoad:
        """The snapshot published after the latest step (immutable; safe from any task)."""
        return self._load

    async def wait_for_load(self, after_version: int, timeout: float) -> int:
        """Wait until a snapshot newer than after_version is published, or the timeout."""
        async with self._load_changed:
            try:
                await asyncio.wait_for(
                    self._load_changed.wait_for(lambda: self.load_version > after_version), timeout
                )
            except asyncio.TimeoutError:
                pass
        return self.load_version

    async def _publish_load(self) -> None:
        # KV events hook: the step's prefix-cache events go out with its load.
        self.kv_events.publish(self.engine.take_kv_events())
        self._load = self.engine.load()
        self.load_version += 1
        async with self._load_changed:
            self._load_changed.notify_all()

    def _publish_arrivals(self) -> None:
        # The SLO monitor must see requests that arrive while a forward pass runs: they
        # reach the scheduler only after it, and may be the reason to abort it.
        monitor = self.engine.slo_monitor
        if monitor is not None:
            monitor.publish_arrivals(tuple(SLOView.of(stream.request) for stream in self._pending_adds))

    # ---- the loop ----------------------------------------------------------------------
    def _apply_pending(self) -> None:
        engine = self.engine
        adds, self._pending_adds = self._pending_adds, []
        self._publish_arrivals()
        for stream in adds:
            if stream.request_id in self._pending_aborts:
                continue  # aborted before it was ever queued
            try:
                engine.add_request(stream.request)
            except Exception as error:  # raced past validation (e.g. queue filled meanwhile)
                self._streams.pop(stream.request_id, None)
                stream.put(error)
        aborts, self._pending_aborts = self._pending_aborts, set()
        for request_id in aborts:
            stream = self._streams.pop(request_id, None)
            request = engine.abort_request(request_id)
            if stream is not None:
                source = request or stream.request
                stream.put(RequestOutput.of(source, [], "", "abort"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            if not self._pending_adds and not self._pending_aborts and not engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
            self._apply_pending()
            if not engine.has_unfinished_requests():
                await self._publish_load()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, engine.step)
            except Exception as error:  # a failed forward pass: fail its requests, keep serving
                logger.exception("engine step failed; aborting in-flight requests")
                for request_id, stream in list(self._streams.items()):
                    engine.abort_request(request_id)
                    stream.put(EngineStepError(f"engine step failed: {error}"))
                self._streams.clear()
                await self._publish_load()
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]
            await self._publish_load()
            await asyncio.sleep(0)  # let stream consumers and new requests in between steps
