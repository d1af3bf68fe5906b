"""LLMEngine: one replica's engine. add_request / step / abort_request over the scheduler,
the model runner and the tokenizer; every step returns the token and text deltas of the
requests that advanced, with finish reasons and usage counts. With async scheduling (on by
default on CUDA) a step schedules and launches the next forward pass before it waits for the
previous one, and returns the previous one's deltas. Under the "slo" policy an SLO monitor
thread may have a step's forward pass abandoned between decoder layers."""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from replica.model.checkpoint import generation_eos_ids, sampling_defaults
from replica.model.registry import resolve_model_path
from replica.config import ConfigError, EngineConfig
from replica.core.kv_events import KVEvent
from replica.model import load_model
from replica.executor import ModelRunner, cuda_runtime
from replica.executor.cpu_threads import StepThreads
from replica.executor.cuda_graphs import use_cuda_graphs
from replica.executor.memory_profile import kv_cache_bytes_per_block
from replica.executor.rank_config import resolve_rank_config
from replica.executor.preemption_profile import preemption_costs
from replica.executor.model_runner import StepInFlight
from replica.core.outputs import GatheredPromptLogprobs, PromptLogprobArrays, RequestOutput, StepStats, make_request
from replica.core.request import Request, RequestStatus, SamplingParams, validate_request
from replica.core.structured_output import GrammarCompiler, compiled_in_time
from replica.core.load import SchedulerLoad
from replica.core.scheduler import Scheduler, SchedulerOutput
from replica.errors import EngineStepError, HeadroomError, InvalidRequestError, QueueFullError
from replica.core.slo_monitor import SLOAbort, SLOMonitor
from replica.executor.step_abort import StepAborted
from replica.parallel.executor import TensorParallelRunner, start_tensor_parallel
from replica.parallel.group import NO_TENSOR_PARALLEL
from replica.parallel.vote import TensorParallelVote
from replica.text.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)
# How long an engine with nothing else to run waits for a grammar to finish compiling per step.
COMPILE_WAIT_S = 0.005


@dataclass
class StepTiming:
    """Where the latest step's wall time went (benchmarks read it after each step)."""

    wall_s: float = 0.0
    wait_s: float = 0.0  # blocked on the device for the completed step's tokens
    launch_s: float = 0.0  # in the model runner preparing inputs and launching kernels
    num_seqs: int = 0  # sequences launched this step
    num_tokens: int = 0  # tokens launched this step (== num_seqs for a decode-only step)
    graph_batch_size: Optional[int] = None  # the padded size of a replayed decode graph
    schedule_s: float = 0.0  # in scheduler.schedule()
    # Turning the completed step's tokens into outputs (appending them, stop checks,
    # finishing requests, detokenizing): from its wait to the outputs, less the wait.
    update_s: float = 0.0
    # In the model runner waiting for the device between an abortable step's layers (its
    # pacing, CUDA): device time, apart from launch_s.
    pacing_s: float = 0.0

    @property
    def host_s(self) -> float:
        return self.wall_s - self.wait_s - self.pacing_s


@dataclass
class _LaunchedStep:
    scheduler_output: SchedulerOutput
    in_flight: StepInFlight


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def indexed_device(device: torch.device) -> torch.device:
    """`device` with its index: plain "cuda" (the default, `--device cuda`) is the current CUDA
    device, as torch places a tensor there. torch.cuda.set_device refuses a device without an
    index (ValueError), and a tensor's .device always has one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(device: torch.device) -> None:
    """ConfigError naming `device` where this host has no such device: torch fails only at the
    first tensor placed there, deep inside the model's load, as a traceback."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {device} asked for, but this host has no CUDA device torch can use "
                          f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device: {device} asked for, but this host has {torch.cuda.device_count()} CUDA devices")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: str = "builtin",
        *,
        device: Optional[str] = None,
        dtype: Optional[str] = None,
        attention_backend: str = "auto",
        clock: Callable[[], float] = time.monotonic,
    ):
        """model: a local Hugging Face directory, or "builtin" for the offline default. On
        CUDA with config.gpu_memory_utilization set, a profiling run sizes the KV pool."""
        model_dir = resolve_model_path(model)
        self.model_name = str(model)
        self.device = torch.device(device) if device else default_device()
        check_device(self.device)
        self.device = indexed_device(self.device)
        if cuda_runtime.on_cuda(self.device):
            # Events, streams and graph captures made without a device take the current one:
            # on cuda:1 they went to cuda:0 (a capture of nothing, events that waited for nothing).
            torch.cuda.set_device(self.device)
        # The front renders chat with the server's template (--chat-template, which replaces a
        # broken checkpoint template); the core only tokenizes and detokenizes.
        self.tokenizer = Tokenizer.from_pretrained(model_dir, check_chat_template=False)
        # Tensor parallelism: worker processes for ranks 1..N-1; this process is rank 0.
        self.tp_workers = start_tensor_parallel(config, model_dir, self.device, dtype, attention_backend)
        tp = self.tp_workers.tp if self.tp_workers is not None else NO_TENSOR_PARALLEL
        self.model, self.model_config = load_model(
            model_dir, dtype=dtype, device=self.device, attention_backend=attention_backend, fused_ops=config.fused_ops,
            tp=tp,
        )
        config = resolve_rank_config(config, self.model, self.model_config, self.device, tp)
        on_cuda = cuda_runtime.on_cuda(self.device)
        self.config = config
        # config.json's, then generation_config.json's (as HF's generate() stops on both), else the tokenizer's.
        eos_token_ids = tuple(dict.fromkeys(
            self.model_config.eos_token_ids + generation_eos_ids(model_dir, self.model_config.vocab_size)))
        self.eos_token_ids = eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        # What requests leave unset takes (config.generation_config): the doors build each
        # request's SamplingParams with it, so an in-process caller's SamplingParams are its own.
        self.sampling_defaults = sampling_defaults(model_dir, config.generation_config)
        if self.sampling_defaults.model_values:
            logger.warning("default sampling parameters from the model's generation_config.json: %s (a request's "
                           "own values win; generation_config: none ignores the file)",
                           ", ".join(f"{name}={value}" for name, value in self.sampling_defaults.model_values.items()))
        self.scheduler = Scheduler(config, clock=clock)
        graph_safe_backend = self.model.attn_backend.supports_cuda_graphs
        cuda_graphs = use_cuda_graphs(self.device, config.enforce_eager, graph_safe_backend)
        if on_cuda and not config.enforce_eager and not graph_safe_backend:
            logger.warning("attention backend %r cannot be captured in CUDA graphs; every step runs eagerly",
                           self.model.attn_backend.name)
        if self.tp_workers is None:
            self.runner = ModelRunner(self.model, self.model_config, config, self.device, cuda_graphs=cuda_graphs)
        else:
            self.runner = TensorParallelRunner(self.model, self.model_config, config, self.device, self.tp_workers,
                                               cuda_graphs=cuda_graphs)
        if config.num_host_kv_blocks:  # what swapping a victim costs against recomputing it, per token and block
            self.scheduler.preemption.costs = preemption_costs(self.model, self.model_config, config, self.device,
                                                               self.runner.kv_swap, tp)
            self.scheduler.kv_block_bytes = self.runner.kv_swap.bytes_per_block * tp.size  # every rank's shard
            # A prefetched swap-in overlaps the step before on a copy stream; on the CPU the copies
            # run in turn with the step, so a prefetch would only make its request resume a step later.
            self.scheduler.prefetch_swap_ins = on_cuda
        self.async_scheduling = on_cuda if config.async_scheduling is None else config.async_scheduling
        self._in_flight: Optional[_LaunchedStep] = None  # the step launched but not yet updated (overlap)
        self.last_step = StepTiming()
        self.clock = clock
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Structured outputs: the compiler (made by the first constrained request) and the
        # requests whose grammar compiles on its thread; they join the scheduler when it is done.
        self.grammar_compiler: Optional[GrammarCompiler] = None
        # Each with the time its compile must be done by (structured_output_compile_timeout_s).
        self._compiling: dict[str, tuple[Request, Future, float]] = {}
        # Requests the engine ended with an error of theirs (their output constraint failed or
        # was too costly to follow), each also finished "abort" in the step's outputs. Kept only
        # once the engine core asks for them (collect_failures): it sends them to the front, whose
        # streams then fail with that error; an in-process caller sees the "abort".
        self.failed: Optional[list[tuple[str, Exception]]] = None
        self.stats = StepStats()
        # Set by borrow_idle_cpus (the engine-core process); in-process engines keep their threads.
        self.step_threads: Optional[StepThreads] = None
        self.slo_monitor: Optional[SLOMonitor] = None
        if config.scheduling_policy == "slo":
            self.slo_monitor = SLOMonitor(config, self.scheduler.ttft_predictor, clock)
            # Stubbornness: a pass that has run more layers than this refuses to abort.
            max_abort_layer = int(config.slo_abort_max_layer_fraction * self.model_config.num_hidden_layers)
            self.runner.step_abort = SLOAbort(self.slo_monitor, self.scheduler, max_abort_layer)
            if self.tp_workers is not None:  # every rank votes at each layer boundary
                self.slo_monitor.order_board = self.tp_workers.board
                self.runner.step_abort = TensorParallelVote(self.runner.step_abort, self.tp_workers.tp)
            self.slo_monitor.start()
        per_block = kv_cache_bytes_per_block(self.model_config, config.block_size, self.runner.dtype)
        logger.info("engine ready: model=%s device=%s kv_blocks=%d x %d tokens (%.2f GiB) cuda_graphs=%s "
                    "async_scheduling=%s", self.model_name, self.device, config.num_kv_blocks, config.block_size,
                    config.num_kv_blocks * per_block / 2**30, self.runner.graphs is not None,
                    self.async_scheduling)

    # ---- requests --------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                     **options) -> Request:
        """A request for this engine; options (priority, ttft_deadline, arrival_time,
        cache_salt, ttft_slo_ms) as in the module's make_request."""
        return make_request(request_id, prompt_token_ids, sampling_params, config=self.config,
                            eos_token_ids=self.eos_token_ids, clock=self.clock, **options)

    def add_request(self, request: Request, detokenize: bool = True) -> None:
        """Validate and queue a request: the edge for in-process callers (offline use, tests,
        benchmarks), as vLLM's LLM class is. Raises InvalidRequestError (naming the field) or
        QueueFullError. The engine stops a request on EOS, stop_token_ids or max_tokens; stop
        strings are matched on detokenized text by the front (replica/front/output_processor.py)."""
        validate_request(request.prompt_token_ids, request.sampling_params, max_model_len=self.config.max_model_len,
                         vocab_size=self.model_config.vocab_size)
        self.enqueue(request, detokenize)

    def enqueue(self, request: Request, detokenize: bool = True) -> None:
        """Queue a request an edge has validated (the engine core's adds: the replica's servicer or
        the cluster's ingress did). Raises only what the engine's own state decides: QueueFullError,
        or the scheduler's guards (Scheduler.check_request)."""
        if request.request_id in self._compiling:
            # Not yet the scheduler's, so its guard cannot see it: a second add of this id was
            # taken, and the first request then failed (or was dropped, never to finish) as its
            # compile ended (helper-43's fuzzing).
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if request.sampling_params.prompt_logprobs is not None:
            request.prompt_logprobs = GatheredPromptLogprobs(request.sampling_params.prompt_logprobs)
        if request.sampling_params.structured_output is not None:
            self._add_constrained(request)
        else:
            self.scheduler.add_request(request)
        if detokenize:
            params = request.sampling_params
            self.detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                kept_special_token_ids=params.kept_special_token_ids)

    def _add_constrained(self, request: Request) -> None:
        """Check it now, compile its grammar on the compiler's thread (a cached grammar is done
        at once) and schedule it when compiled, at the next step: a slow schema never stalls one."""
        self.scheduler.check_request(request)
        if len(self.scheduler.waiting) + len(self._compiling) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        future = self._grammars().compile(request.sampling_params.structured_output)
        deadline = time.monotonic() + self.config.structured_output_compile_timeout_s
        # Parked even when the compile is already done (a cached grammar, or a cached failure):
        # the next step adopts it before it schedules, and reports a failure as the request's
        # end; adopting here would drop that report and leave the request's stream open forever.
        self._compiling[request.request_id] = (request, future, deadline)

    def _grammars(self) -> GrammarCompiler:
        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler.for_tokenizer(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids, self.config)
        return self.grammar_compiler

    def prepare_structured_outputs(self) -> None:
        """Build the grammar compiler now, before any request (the engine core does, before it
        reports ready): llguidance's view of the tokenizer takes ~0.23 s on SmolLM2's 49k ids
        with the GIL held, so built by the first constrained request it stalled every running
        request's step that long (more on a busy core). A tokenizer llguidance cannot take is
        logged here and left to the first constrained request to report, as before."""
        if self.tokenizer is None or self.grammar_compiler is not None:
            return
        try:
            self._grammars()
        except BaseException as error:  # noqa: BLE001 - a panic in llguidance (Rust) is a BaseException
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            logger.warning("structured outputs: no grammar compiler for this tokenizer (%s); a constrained "
                           "request will report it", error)

    def _adopt_compiled(self) -> list[Request]:
        """Schedule the requests whose grammar compiled; the ones it failed for (the edge
        compiles every constraint first, so only a time bound hit here) finish aborted and are
        returned."""
        failed = []
        now = time.monotonic()
        for request_id, (request, future, deadline) in list(self._compiling.items()):
            if not future.done() and now < deadline:
                continue
            del self._compiling[request_id]
            try:
                if not compiled_in_time(future, deadline):
                    self._drop_compile_if_unwanted(request, future)
                    raise TimeoutError(f"its grammar took longer than "
                                       f"{self.config.structured_output_compile_timeout_s:g} s to compile")
                request.grammar = self.grammar_compiler.matcher(request.sampling_params.structured_output, future)
                self.scheduler.add_request(request)
            except Exception as error:  # noqa: BLE001 - reported as the request's end, logged
                logger.warning("request %s: structured output not served: %s", request_id, error)
                self._fail(request_id, _compile_failure(error))
                request.status = RequestStatus.FINISHED_ABORTED
                self.detokenizers.pop(request_id, None)
                failed.append(request)
        return failed

    def abort_request(self, request_id: str) -> Optional[Request]:
        """Abort and free the request's KV blocks now."""
        self.detokenizers.pop(request_id, None)
        parked = self._compiling.pop(request_id, None)
        if parked is not None:  # not in the scheduler yet: nothing allocated
            parked[0].status = RequestStatus.FINISHED_ABORTED
            self._drop_compile_if_unwanted(parked[0], parked[1])
            return parked[0]
        return self.scheduler.abort_request(request_id)

    def _drop_compile_if_unwanted(self, request: Request, future: Future) -> None:
        """A parked request left (aborted, or its compile timed out): its compile leaves the
        compiler's queue if it has not started and no other parked request waits for it."""
        if all(other is not future for _, other, _ in self._compiling.values()):
            self.grammar_compiler.cancel_queued(request.sampling_params.structured_output, future)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._compiling)

    def load(self) -> SchedulerLoad:
        load = self.scheduler.load()
        if not self._compiling:
            return load
        # Requests parked for their grammar's compile are queued work too: the router scores
        # and the autoscaler counts them as waiting, not as a replica with nothing to do.
        parked = [request for request, _, _ in self._compiling.values()]
        return replace(load, num_waiting=load.num_waiting + len(parked),
                       waiting_prefill_tokens=load.waiting_prefill_tokens + sum(r.num_tokens for r in parked))

    def collect_failures(self) -> None:
        """Keep the requests the engine ends with an error, for take_failed."""
        if self.failed is None:
            self.failed = []

    def take_failed(self) -> list[tuple[str, Exception]]:
        """The (request id, error) of the requests the engine ended with an error since the
        previous call (collect_failures first)."""
        failed, self.failed = self.failed, []
        return failed

    def _fail(self, request_id: str, error: Exception) -> None:
        if self.failed is not None:
            self.failed.append((request_id, error))

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix-cache events (blocks stored / removed) since the previous call, oldest
        first: plain tuples, so a front in another process can receive them as a message.
        Call once after each step; the replica numbers and streams them (replica/front/kv_event_log.py)."""
        return self.scheduler.kv_cache.take_kv_events()

    def recover_from_failed_step(self) -> None:
        """After step() raised (a forward pass or its wait failed: a device error, out of memory)
        and the caller aborted every live request, leave the engine able to serve again, as
        though it were fresh: the step still in flight is dropped (under async scheduling it
        was launched before the failure and would be waited on, and fail, in the next step),
        and the prefix cache is emptied on both tiers, since blocks are registered before the
        pass that writes them and host copies planned beside it may never have run: a later
        request would have hit KV that was never written (helper-46's fuzzing)."""
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("recover_from_failed_step: abort every live request first")
        self.runner.check_recoverable()  # tensor parallel: the other ranks may be stuck in the failed step
        self._in_flight = None
        if cuda_runtime.on_cuda(self.device):
            # Whatever of it is still queued ends before the next step writes the inputs it may
            # read; an error the device keeps (a sticky CUDA fault) raises here, and the engine
            # core then exits, as it must: nothing more can run on that device.
            torch.cuda.synchronize(self.device)
        self.scheduler.kv_cache.clear_prefix_cache()

    def shutdown(self) -> None:
        """Stop the SLO monitor thread and the tensor-parallel workers, if any."""
        if self.slo_monitor is not None:
            self.slo_monitor.stop()
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None
        if self.grammar_compiler is not None:
            self.grammar_compiler.shutdown()

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A step aborted at a layer boundary (SLO policy) yields no
        outputs. With async scheduling the step launches the next forward pass before it
        waits for the previous one, and returns the previous one's outputs; a step with
        structured-output rows is sampled once the previous one's tokens are taken in."""
        return self._step(as_rows=False)

    def step_rows(self) -> list[tuple]:
        """step() for the engine core: each output as the CoreOutput row it crosses to the
        front in (replica/ipc/messages.py), built here once instead of as a RequestOutput the
        core would take apart again (the core detokenizes nothing, so a row is all there is)."""
        return self._step(as_rows=True)

    def _step(self, as_rows: bool) -> list:
        start = time.perf_counter()
        not_served = self._adopt_compiled() if self._compiling else []
        if self._compiling and not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            # Nothing to run but grammars compiling: wait a moment for one instead of spinning
            # (the busy loop would take a core from the compile), short enough to take new work.
            wait([future for _, future, _ in self._compiling.values()], timeout=COMPILE_WAIT_S,
                 return_when=FIRST_COMPLETED)
            not_served += self._adopt_compiled()
        if not_served:
            not_served = [(request.request_id, [], "abort", request.num_cached_tokens, None, None, None, None, None)
                          if as_rows else RequestOutput.of(request, [], "", "abort") for request in not_served]
        outputs = not_served
        wait_s = sample_s = early_s = 0.0
        if (self._in_flight is not None and self.runner.paces_layers and self.runner.step_abort is not None
                and self.scheduler.may_schedule_prefill()):
            # A step that may be aborted launches paced: the host waits on the device layer by
            # layer, so the launch returns near the end of its pass, and the step before's tokens,
            # taken in after it, would wait that long (a first token a whole step late). Take them
            # in first: this step loses its overlap (a device gap of the host's schedule and
            # prepare), not its predecessor's outputs a step.
            early = time.perf_counter()
            outputs = outputs + self._complete(self._in_flight, as_rows)
            wait_s, self._in_flight = self._in_flight.in_flight.wait_s, None
            early_s = time.perf_counter() - early  # counted as the update it is, not as scheduling
        scheduler_output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        launched = self._launch(scheduler_output)
        if self.async_scheduling:
            previous, self._in_flight = self._in_flight, launched
        else:
            previous = launched
        completing = time.perf_counter()
        if launched is not None and launched.in_flight.unsampled is not None:
            # Its constrained rows' masks stand on the previous step's tokens: take those in
            # first (their matchers advance), while the forward pass just launched runs.
            if previous is not launched and previous is not None:
                outputs = outputs + self._complete(previous, as_rows)
                wait_s, previous = previous.in_flight.wait_s, None
            sampling = time.perf_counter()
            launched.in_flight = self.runner.sample_tokens(launched.in_flight)
            sample_s = time.perf_counter() - sampling  # counted in launch_s, not update_s
        if previous is not None:
            outputs = outputs + self._complete(previous, as_rows)
            wait_s = previous.in_flight.wait_s
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            # Everything finished with the previous step: what is in flight is all discarded.
            self._complete(self._in_flight, as_rows)
            self._in_flight = None
        end = time.perf_counter()
        self.last_step = StepTiming(
            end - start, wait_s, launched.in_flight.launch_s if launched is not None else 0.0,
            len(scheduler_output.scheduled), scheduler_output.num_scheduled_tokens,
            launched.in_flight.graph_batch_size if launched is not None else None,
            scheduled - start - early_s, end - completing + early_s - wait_s - sample_s,
            launched.in_flight.pacing_s if launched is not None else 0.0,
        )
        elapsed = end - start
        if launched is not None or previous is not None or early_s:
            self.stats.observe(elapsed, len(outputs))
        return outputs

    def borrow_idle_cpus(self) -> None:
        """Let large steps on the CPU run on the cores nothing else uses at that moment, beyond the
        threads torch has now (config.borrow_idle_cpus_min_tokens; replica/executor/cpu_threads.py).
        The engine-core process calls it: there the base count is its environment's (one thread per
        CPU Ray reserved a replica). Not under tensor parallelism, whose ranks keep one count."""
        if self.device.type == "cpu" and self.tp_workers is None:
            self.step_threads = StepThreads.for_this_process(self.config.borrow_idle_cpus_min_tokens or None)
            if self.step_threads is not None:
                logger.info("steps of >= %d tokens may run on up to %d torch threads when those cores are idle "
                            "(%d otherwise)", self.step_threads.min_tokens, self.step_threads.limit,
                            self.step_threads.base)

    def _launch(self, scheduler_output: SchedulerOutput) -> Optional[_LaunchedStep]:
        """Queue the step on the device; None when it has nothing to run or its forward pass
        was aborted at a layer boundary (the runner's step_abort said so)."""
        if scheduler_output.is_empty:
            self.runner.launch(scheduler_output)  # drops the state of finished and preempted requests
            return None
        if self.step_threads is not None:
            self.step_threads.before_step(scheduler_output.num_scheduled_tokens)
        try:
            in_flight = self.runner.launch(scheduler_output)
        except StepAborted as aborted:
            self.scheduler.abort_step(scheduler_output, aborted.victim_request_id, aborted.num_layers_done)
            return None
        return _LaunchedStep(scheduler_output, in_flight)

    def _complete(self, launched: _LaunchedStep, as_rows: bool) -> list:
        """Wait for a launched step's tokens, append them and build the outputs (RequestOutputs,
        or the engine core's CoreOutput rows)."""
        runner_output = launched.in_flight.result()
        if runner_output.prompt_logprobs:  # first: a request's first token carries them all
            self._gather_prompt_logprobs(launched.scheduler_output, runner_output.prompt_logprobs)
        updates = self.scheduler.update(launched.scheduler_output, runner_output.sampled_token_ids)
        # Once per request and step: the lookups below are skipped when nothing asked for them
        # (the engine core leaves detokenizing to the front), and the output is built directly.
        detokenizers = self.detokenizers
        all_logprobs = runner_output.logprobs
        all_top_logprobs = runner_output.top_logprobs
        outputs = []
        for update in updates:
            request = update.request
            request_id = request.request_id
            token_id = update.token_id
            finished = update.finished
            grammar = request.grammar
            if grammar is not None:
                if not grammar.accept(token_id):
                    # The mask allowed the token, so the matcher failed consuming it: one of
                    # llguidance's limits, tripped by a lexeme past what the edge's probes reach (a
                    # blow-up a few bytes into it). The request ends here rather than
                    # going on unconstrained, which no client asked for.
                    why = "its output constraint failed at token %d: %s" % (
                        token_id, " ".join(grammar.matcher.get_error().split())[:300])
                else:
                    why = grammar.too_slow  # its masks held the batch back (GrammarBitmask)
                if why is not None and finished is None:
                    logger.warning("request %s ends (abort): %s", request_id, why)
                    self.scheduler.abort_request(request_id)
                    self._fail(request_id, InvalidRequestError("structured_output", why))
                    finished = RequestStatus.FINISHED_ABORTED
            text = ""
            if detokenizers:
                detokenizer = detokenizers.get(request_id)
                if detokenizer is not None:
                    # The token it stopped on (EOS, a stop token id) is left out of the text, as
                    # the front leaves it out (replica/front/output_processor.py; vLLM's rule).
                    if (finished != RequestStatus.FINISHED_STOPPED
                            or request.sampling_params.include_stop_str_in_output):
                        text = detokenizer.add_tokens([token_id])
                    if finished is not None:
                        text += detokenizer.flush()
                        del detokenizers[request_id]
            logprobs = top_logprobs = prompt_logprobs = None
            first = len(request.output_token_ids) == 1
            if first and request.prompt_logprobs is not None:
                # Out with this output: the core need not hold them (a 128k-token prompt's top 20
                # are millions of entries) for the rest of the request's life.
                prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            if all_logprobs:
                logprob = all_logprobs.get(request_id)
                logprobs = [logprob] if logprob is not None else None
            if all_top_logprobs:
                top = all_top_logprobs.get(request_id)
                top_logprobs = [top] if top is not None else None
            if as_rows:  # CoreOutput's fields; plain tuples all the way down, the fastest to pickle
                outputs.append((
                    request_id, [token_id], finished.finish_reason if finished is not None else None,
                    request.num_cached_tokens, logprobs, [tuple(top)] if top_logprobs else None,
                    request.stop_reason if finished is not None else None,
                    request.first_admitted_time if first else None,
                    prompt_logprobs.to_wire() if prompt_logprobs is not None else None,
                ))
            else:
                outputs.append(RequestOutput(
                    request_id, [token_id], text, finished.finish_reason if finished is not None else None,
                    len(request.prompt_token_ids), len(request.output_token_ids), request.num_cached_tokens,
                    logprobs, top_logprobs, request.stop_reason if finished is not None else None,
                    prompt_logprobs.unpack() if prompt_logprobs is not None else None,
                ))
        return outputs

    def _gather_prompt_logprobs(self, scheduler_output: SchedulerOutput,
                                gathered: dict[str, tuple[int, PromptLogprobArrays]]) -> None:
        """Add a step's prompt log-probabilities to the requests of that step still live. By the
        step's own request objects, not their ids: one aborted while its step was in flight may
        have a new request under its id, which took the old one's values (or, from a later
        position than it holds, failed the whole step in GatheredPromptLogprobs.extend)."""
        stepped = {entry.request.request_id: entry.request for entry in scheduler_output.scheduled}
        live = self.scheduler.requests
        for request_id, (first_position, values) in gathered.items():
            request = stepped[request_id]
            if live.get(request_id) is request and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(first_position, values)

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (offline batch use and tests); returns output token ids."""
        requests = []
        for index, prompt in enumerate(prompts):
            request = self.make_request(f"offline-{index}-{id(prompts)}", prompt, sampling_params)
            self.add_request(request, detokenize=False)
            requests.append(request)
        while self.has_unfinished_requests():
            self.step()
            self.take_kv_events()  # nobody subscribes offline: drop them as a server would send them
        return [list(r.output_token_ids) for r in requests]


def _compile_failure(error: Exception) -> Exception:
    """What a parked request whose grammar could not be served ends with, for its client: the
    constraint's own fault names it (INVALID_ARGUMENT); a compile past the time bound here, for
    a constraint the edge compiled within it, is this replica's backlog, worth retrying
    (RESOURCE_EXHAUSTED); anything else is the replica's error."""
    if isinstance(error, InvalidRequestError):
        return InvalidRequestError("structured_output", error.message)
    if isinstance(error, TimeoutError):
        return QueueFullError(f"structured_output: {error} on this replica (its grammar compiles are backed up); "
                              f"retry")
    if isinstance(error, HeadroomError):
        return error
    return EngineStepError(f"structured output not served: {type(error).__name__}: {error}")
