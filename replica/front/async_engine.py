"""AsyncEngine: the replica's front, on asyncio. The engine itself runs in an engine-core
process of its own (replica/core/, over replica/ipc/); this side queues validated requests,
owns one stream of RequestOutput deltas per request (detokenized here), mirrors the core's
load after every step, and turns a lost client into an abort message the core applies before
its next step.
Every output and every error that ends a stream passes one place (the OutputProcessor), where
an optional RequestObserver (the request metrics) sees it, whoever consumes the stream.

Requests come validated by the edge that took them (the replica's gRPC servicer, or the
cluster's ingress against its replicas' ModelInfo: replica.core.request.validate_request) and
are trusted here; the front refuses only what its own state decides (a request id in use, the
queue full by the core's latest load, a closing or dead core). If the core process dies,
every open stream fails with EngineDeadError at once, new requests are refused with it, and
`dead` says so (health checks read it).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence

from replica.config import EngineConfig
from replica.core.outputs import RequestOutput, StepStats, make_request
from replica.front.kv_event_log import KVEventLog
from replica.model import ModelConfig
from replica.model.registry import resolve_model_path
from replica.core.request import Request, SamplingDefaults, SamplingParams
from replica.errors import EngineDeadError, EngineShutdownError, EngineStepError, FirstTokenDeadlineExceeded, InvalidRequestError, QueueFullError, StreamStalledError
from replica.core.load import SchedulerLoad
from replica.front.core_client import EngineCoreClient
from replica.ipc.messages import CoreSpec, StepFailed, StepOutputs, load_from_wire
from replica.front.output_processor import OutputProcessor, RequestObserver
from replica.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineShutdownError", "EngineStepError", "FirstTokenDeadlineExceeded",
           "RequestStream", "ServedEngine", "StreamStalledError"]


class RequestStream:
    """Async iterator over one request's outputs; ends after the output with a finish reason.

    Outputs that arrive while the consumer is busy are merged into one (their tokens, text
    and logprobs concatenated, the latest counts and finish reason kept), as vLLM's output
    collector does: a consumer that falls behind the engine (a gRPC or HTTP stream writing one
    message per output) catches up with one message instead of a backlog, so its cost per
    token falls exactly when it is the bottleneck; one that keeps up still gets every step.

    With `stream_interval` N > 1 (EngineConfig.stream_interval, vLLM's and SGLang's
    `--stream-interval`), the consumer is woken only when an output is due: the first output
    at once (TTFT unchanged), then once N tokens have accumulated since the last one it read,
    and the last output (or an error) at once with whatever is held. Held outputs are merged
    as above, so every consumer (the gRPC Generate servicer, the cluster's HTTP and gRPC
    streams) writes one message per N tokens; a consumer that falls behind still merges more.

    With `first_token_timeout_s`, waiting for the first output longer than that (from the
    stream's creation) raises FirstTokenDeadlineExceeded; the caller aborts the request.

    With `stall_timeout_s` (EngineConfig.stream_stall_timeout_s), a consumer that leaves due
    outputs unread that long (a client that keeps its stream open but stops reading: its writer
    blocks on the transport's flow control) stalls the stream: `put` says so and the output
    processor aborts the request (`abandon`), so neither its KV blocks nor its growing backlog
    outlive the reader's interest. The time counts from the first output that found an earlier
    one still unread; a consumer that keeps up never reads the clock."""

    def __init__(self, request: Request, first_token_timeout_s: Optional[float] = None, stream_interval: int = 1,
                 stall_timeout_s: float = 0.0):
        self.request = request
        self._pending: collections.deque[RequestOutput | MergingOutput | BaseException] = collections.deque()
        # Set while something in _pending is due to the consumer (with interval 1: whenever
        # anything is pending).
        self._arrived = asyncio.Event()
        self._stall_timeout_s = stall_timeout_s
        self._unread_since: Optional[float] = None  # when an output first found a due one unread
        self._interval = stream_interval
        self._released_first = False  # an output has been made due: later ones wait for N tokens
        self.finished = False
        self._first_token_timeout_s = first_token_timeout_s
        self._first_token_by = (
            None if first_token_timeout_s is None else asyncio.get_running_loop().time() + first_token_timeout_s
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Queue `item` for the consumer; True once the consumer has left due outputs unread past
        the stall timeout (the caller then ends the request: `abandon`)."""
        pending = self._pending
        last = pending[-1] if pending else None
        if isinstance(item, RequestOutput) and isinstance(last, MergingOutput):
            last.add(item)
        elif isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            pending[-1] = MergingOutput(last).add(item)
        else:
            pending.append(item)
        if self._interval > 1 and isinstance(item, RequestOutput) and item.finish_reason is None:
            if self._released_first and len(pending[-1].new_token_ids) < self._interval:
                return False  # held: its group of N tokens is not full yet
            self._released_first = True
        if self._arrived.is_set():  # what was due before is still unread
            return self._stalled()
        self._arrived.set()
        return False

    def _stalled(self) -> bool:
        if not self._stall_timeout_s:
            return False
        now = time.monotonic()
        if self._unread_since is None:
            self._unread_since = now
            return False
        return now - self._unread_since > self._stall_timeout_s

    def abandon(self) -> StreamStalledError:
        """Drop the unread outputs of a stalled stream (`put` said so); the error that ends it."""
        unread = sum(len(item.new_token_ids) for item in self._pending if not isinstance(item, BaseException))
        self._pending.clear()
        self._arrived.clear()
        return StreamStalledError(
            f"request {self.request.request_id!r}: its reader took nothing for "
            f"{time.monotonic() - self._unread_since:.1f} s (stream_stall_timeout_s {self._stall_timeout_s:g}) "
            f"while {unread} tokens waited; the request was aborted")

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if not self._arrived.is_set():
            if self._first_token_by is None:
                await self._arrived.wait()
            else:
                remaining = self._first_token_by - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(self._arrived.wait(), max(remaining, 0.0))
                except asyncio.TimeoutError:
                    # Not `finished`: the request is still live, and callers abort unfinished streams.
                    raise FirstTokenDeadlineExceeded(
                        f"no first token within the deadline of {self._first_token_timeout_s * 1000:g} ms "
                        f"(request {self.request.request_id!r})"
                    ) from None
        self._first_token_by = None  # the deadline is met once anything arrives
        self._unread_since = None
        item = self._pending.popleft()
        if not self._pending:
            self._arrived.clear()
        if isinstance(item, MergingOutput):
            item = item.output()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class MergingOutput:
    """Outputs a stream's consumer has yet to read, merged as they arrive into one carrying every
    delta in order, its counts, finish and stop reasons the latest's. Extended in place and built
    into a RequestOutput once, when read: merging by building a new output each step copied
    everything held so far, so a reader L tokens behind cost the front's event loop O(L) a step
    and O(L^2) over the stream (~2.4 ms a step at 128k tokens with top-20 logprobs)."""

    __slots__ = ("new_token_ids", "_texts", "logprobs", "top_logprobs", "prompt_logprobs", "latest")

    def __init__(self, first: RequestOutput):
        self.new_token_ids = list(first.new_token_ids)
        self._texts = [first.text]
        self.logprobs = None if first.logprobs is None else list(first.logprobs)
        self.top_logprobs = None if first.top_logprobs is None else list(first.top_logprobs)
        self.prompt_logprobs = first.prompt_logprobs  # only a first token's output has them
        self.latest = first

    def add(self, later: RequestOutput) -> "MergingOutput":
        self.new_token_ids += later.new_token_ids
        self._texts.append(later.text)
        if later.logprobs is not None or self.logprobs is not None:
            self.logprobs = [] if self.logprobs is None else self.logprobs
            self.logprobs += later.logprobs or []
        if later.top_logprobs is not None or self.top_logprobs is not None:
            self.top_logprobs = [] if self.top_logprobs is None else self.top_logprobs
            self.top_logprobs += later.top_logprobs or []
        self.latest = later
        return self

    def output(self) -> RequestOutput:
        """Field by field: dataclasses.replace costs 3x as much (a test checks that no field is
        left out)."""
        latest = self.latest
        return RequestOutput(
            latest.request_id, self.new_token_ids, "".join(self._texts), latest.finish_reason,
            latest.num_prompt_tokens, latest.num_output_tokens, latest.num_cached_tokens, self.logprobs,
            self.top_logprobs, latest.stop_reason, self.prompt_logprobs,
        )


@dataclass
class ServedEngine:
    """What the front knows of the engine in the core: the facts servicers and callers read
    (`async_engine.engine.tokenizer`, `.config`, ...), as LLMEngine offers them in-process."""

    model_name: str
    tokenizer: Tokenizer
    config: EngineConfig  # as the core resolved it
    model_config: ModelConfig
    eos_token_ids: tuple[int, ...]
    sampling_defaults: SamplingDefaults  # what requests leave unset takes
    device: str
    clock: Callable[[], float]
    stats: StepStats  # the core's smoothed step time and token rate, as of its latest step

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                     **options) -> Request:
        return make_request(request_id, prompt_token_ids, sampling_params, config=self.config,
                            eos_token_ids=self.eos_token_ids, clock=self.clock, **options)


class AsyncEngine:
    def __init__(self, spec: CoreSpec, *, fronts: int = 1, front_index: int = 0,
                 core_socket: Optional[socket.socket] = None):
        """Not started: `await start()` spawns the core (or use `AsyncEngine.launch`).
        fronts > 1: the core serves that many fronts, this one first; `core.take_front_sockets()`
        after start hands out the others' channels. core_socket: be front `front_index` of a
        core another front started, over this channel (its spec's model gives the tokenizer)."""
        self.spec = spec
        self.fronts = fronts
        self.front_index = front_index
        self._core_socket = core_socket
        self.stats = StepStats()
        self.core = EngineCoreClient(self._on_step, self._on_step_failed, self._on_dead)
        self._engine: Optional[ServedEngine] = None
        self._processor: Optional[OutputProcessor] = None
        self._accepting = False
        self._ids = itertools.count()
        self.load_version = 0  # bumped each time a new load snapshot arrives from the core
        self._load: Optional[SchedulerLoad] = None
        self._load_arrived_at = 0.0  # time.monotonic() when self._load arrived
        self._sent_since_load = False  # a request went to the core after self._load arrived
        self._load_arrived = asyncio.Event()
        self._dead_listeners: list[Callable[[EngineDeadError], None]] = []
        self._kv_event_listeners: list[Callable[[list], None]] = []
        self._request_observer: Optional[RequestObserver] = None
        # The prefix cache's changes as the core's engine drained them, numbered, for WatchKVEvents.
        self.kv_events = KVEventLog()
        self.on_kv_events(self.kv_events.publish)

    @classmethod
    async def launch(cls, config: EngineConfig, model: str = "builtin", **options) -> "AsyncEngine":
        """Spawn a core for LLMEngine(config, model, **options) and wait until it serves;
        options: device, dtype, attention_backend, torch_threads,
        engine_factory (CoreSpec's fields). Raises the engine's build errors (ConfigError...)."""
        engine = cls(CoreSpec(config, str(model), **options))
        await engine.start()
        return engine

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine core and wait until its engine is built (idempotent)."""
        if self._engine is not None:
            return
        # The tokenizer loads here while the core builds the model.
        tokenizer = Tokenizer.from_pretrained(resolve_model_path(self.spec.model), chat_template=self.spec.chat_template)
        if self._core_socket is not None:
            ready = await self.core.attach(self._core_socket)
        else:
            ready = await self.core.start(self.spec, self.fronts)
        self._engine = ServedEngine(self.spec.model, tokenizer, ready.config, ready.model_config,
                                    ready.eos_token_ids, ready.sampling_defaults, ready.device, time.monotonic,
                                    self.stats)
        # Other fronts' clients may use the same request ids: with several fronts the core knows
        # each front's by a suffix of its own, front 0's too (a client id may end like another
        # front's suffix: "x|f1" from front 0 is "x|f1|f0", never front 1's "x").
        several = self.fronts > 1 or self.front_index > 0
        suffix = f"|f{self.front_index}" if several else ""
        self._processor = OutputProcessor(tokenizer, self._abort_in_core, self._request_observer, suffix)
        self._load = load_from_wire(ready.load)
        self._load_arrived_at = time.monotonic()
        self._accepting = True
        if self._core_socket is not None:
            logger.info("front %d attached to the engine core: %s on %s", self.front_index, self.spec.model,
                        ready.device)
        else:
            logger.info("engine core %d ready: %s on %s", self.core.pid, self.spec.model, ready.device)

    @property
    def engine(self) -> ServedEngine:
        if self._engine is None:
            raise RuntimeError("the engine core is not started: await AsyncEngine.start() first")
        return self._engine

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def dead(self) -> Optional[EngineDeadError]:
        """Why the core is gone, or None while it serves."""
        return self.core.dead

    def on_dead(self, listener: Callable[[EngineDeadError], None]) -> None:
        """Call `listener` once if the core process dies (health reporting)."""
        self._dead_listeners.append(listener)

    def on_kv_events(self, listener: Callable[[list], None]) -> None:
        """Call `listener` with each step's KV events (in order), as the core's engine drained them."""
        self._kv_event_listeners.append(listener)

    def observe_requests(self, observer: RequestObserver) -> None:
        """Show `observer` every request's outputs as they reach its stream (before or after start)."""
        self._request_observer = observer
        if self._processor is not None:
            self._processor.observer = observer

    async def shutdown(self, grace_period_s: float = 5.0,
                       before_core_exit: Optional[Callable[[], Awaitable[None]]] = None) -> None:
        """Stop taking requests, let in-flight ones finish for up to the grace period, abort
        the rest (their streams end with finish reason "abort"), then stop the core (an
        attached front only leaves it). before_core_exit: awaited before that (the core's
        other fronts draining)."""
        self._accepting = False
        processor = self._processor
        if processor is None:
            return
        deadline = asyncio.get_running_loop().time() + grace_period_s
        while len(processor) and self.dead is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        processor.finish_all("abort")
        if before_core_exit is not None:
            await before_core_exit()
        await self.core.shutdown()

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
        """Queue a request its edge validated (replica.core.request.validate_request: the gRPC
        servicer, the cluster's ingress). Raises InvalidRequestError for a request id in use,
        QueueFullError, EngineShutdownError or EngineDeadError before anything is queued.
        ttft_slo_ms: the request's TTFT SLO (see replica.core.engine.make_request), a scheduling
        target; the hard first_token_timeout_s ends the stream with FirstTokenDeadlineExceeded."""
        if self.dead is not None:
            raise self.dead
        if not self._accepting:
            raise EngineShutdownError("the replica is shutting down")
        engine = self.engine
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        if request_id in self._processor:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        request = engine.make_request(self._processor.core_id_for(request_id), prompt_token_ids, sampling_params,
                                      priority=priority, ttft_deadline=ttft_deadline, cache_salt=cache_salt,
                                      ttft_slo_ms=ttft_slo_ms)
        bound = engine.config.max_waiting_requests
        # A fast refusal from the latest load; the core's scheduler has the last word (a burst
        # within one step can still fill the queue: those adds come back rejected).
        if self._load.num_waiting >= bound:
            raise QueueFullError(f"waiting queue is full ({bound} requests)")
        stream = RequestStream(request, first_token_timeout_s, engine.config.stream_interval,
                               engine.config.stream_stall_timeout_s)
        self._processor.track(stream, request_id)
        self.core.add(request)
        self._sent_since_load = True
        return stream

    def abort(self, request_id: str) -> None:
        """End the request's stream now (finish reason "abort") and have the core free its
        blocks before its next step. Unknown or finished ids are ignored."""
        if self._processor is not None:
            self._processor.finish(request_id, "abort")

    def abort_stream(self, stream: "RequestStream") -> None:
        """abort() of the request this stream reads, by its core id: its client's id may equal
        another live request's core id (a cancelled id reused, another front's), and abort()
        by that id ended the other request while this one ran on."""
        if self._processor is not None:
            self._processor.finish_stream(stream.request_id, "abort")

    def _abort_in_core(self, request_id: str) -> None:
        if self.dead is None:  # a dead core holds nothing any more
            self.core.abort(request_id)

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Convenience stream; closing or cancelling it aborts the request."""
        stream = self.add_request(prompt_token_ids, sampling_params, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort_stream(stream)

    # ---- load --------------------------------------------------------------------------
    def load(self) -> SchedulerLoad:
        """The core's snapshot after its latest step (immutable; safe from any task)."""
        return self._load

    def load_age_s(self) -> float:
        """Seconds since the core's latest snapshot arrived here (the core sends one after every
        step, and after applying messages while idle)."""
        return time.monotonic() - self._load_arrived_at

    def load_is_current(self) -> bool:
        """Whether the latest snapshot still describes the core however old it is: it shows
        nothing running or waiting, and the core has been sent no request it may not show
        (none of this front's requests is live, none was sent since it arrived). An idle core
        steps no more, so its snapshot stays true until a request reaches it; a core with work
        that sends no newer one is stuck, and its snapshot ages (ReplicaLoad.load_age_ms).
        This front's requests only: another front's reach the core unseen here, but an idle
        core that takes one sends every front a load showing it before it steps."""
        load = self._load
        return (load is not None and load.num_running == 0 and load.num_waiting == 0
                and not self._sent_since_load and not (self._processor is not None and len(self._processor)))

    async def wait_for_load(self, after_version: int, timeout: float) -> int:
        """Wait until a snapshot newer than after_version arrives, or the timeout."""
        if self.load_version <= after_version:
            try:
                await asyncio.wait_for(self._load_arrived.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.load_version

    # ---- messages from the core --------------------------------------------------------
    def _on_step(self, step: StepOutputs) -> None:
        processor = self._processor
        # Failures first: a request the core ended with an error also has its last row here
        # (finished "abort"), which then finds its stream already failed and is dropped.
        for request_id, error in step.rejected:
            processor.fail(request_id, error)
        processor.process(step.outputs)
        self.stats.step_time_s = step.step_time_s
        self.stats.generation_tokens_per_s = step.generation_tokens_per_s
        self.stats.steps += 1
        if step.kv_events:
            for listener in self._kv_event_listeners:
                listener(step.kv_events)
        self._load = load_from_wire(step.load)
        self._load_arrived_at = time.monotonic()
        self._sent_since_load = False
        self.load_version += 1
        self._wake_load_waiters()

    def _wake_load_waiters(self) -> None:
        # Wake every waiter once; later waiters wait on a fresh event.
        arrived, self._load_arrived = self._load_arrived, asyncio.Event()
        arrived.set()

    def _on_step_failed(self, failure: StepFailed) -> None:
        for request_id in failure.request_ids:
            self._processor.fail(request_id, EngineStepError(failure.message))

    def _on_dead(self, error: EngineDeadError) -> None:
        self._accepting = False
        if self._processor is not None:
            self._processor.fail_all(lambda: EngineDeadError(str(error)))
        for listener in self._dead_listeners:
            listener(error)
        self._wake_load_waiters()  # WatchLoad streams end on a dead core at once
