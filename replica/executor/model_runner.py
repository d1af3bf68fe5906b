"""Turns a SchedulerOutput into one forward pass and one sampled token per request that
caught up, with inputs prepared for replay.

Inputs live in persistent device buffers filled by one non-blocking copy per step from
(pinned) host memory; block tables stay on the device and change by the blocks a step adds;
decode-only steps replay a CUDA graph captured for their padded batch size (on CUDA,
unless `enforce_eager`); sampling runs on the device and its token ids come back with one
asynchronous copy. `launch` queues a step and returns at once; `StepInFlight.result()`
waits for its tokens, so the engine can schedule the next step in between. A step with
structured-output rows is launched up to its logits only: its grammars' masks need the tokens
of the step before, so the engine takes those in first and then calls `sample_tokens`, while
the forward pass runs on the device (vLLM's execute_model / sample_tokens split).

A request that asks for its prompt's log-probabilities has them computed from the logits of
each prefill chunk's positions, a bounded number of rows at a time (sampler.PROMPT_LOGITS_BYTES), and
copied back beside the sampled tokens; a step with such rows runs eagerly and unpruned, and a
step without them computes no logits but the sampling rows'.

Padded rows of a graph batch are harmless: slot -1 (the KV write skips it), sequence
length 1 on the null block 0 (attention stays finite), never sampled.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from replica.attention import AttentionMetadata, allocate_kv_cache, block_table_width
from replica.config import EngineConfig
from replica.executor import cuda_runtime
from replica.executor.cuda_graphs import DecodeGraphs, capture_sizes, padded_batch_size
from replica.executor.kv_swap import KVSwapper
from replica.executor.request_rows import RequestRows
from replica.executor.sampler import LogitsProcessing, Sampler, SamplingBatch, logprobs_of, prompt_logits_rows
from replica.executor.staging import StagedField, StagedInputs
from replica.executor.step_abort import StepAbort, StepAborted
from replica.executor.logits_processors import Penalties, to_device
from replica.core.outputs import PromptLogprobArrays, TopLogprobs
from replica.model import LlamaForCausalLM, ModelConfig, OutputRows
from replica.core.request import MAX_TOP_LOGPROBS
from replica.core.structured_output import GrammarBitmask, GrammarMask
from replica.core.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

# How many decoder layers the host may run ahead of the device in a step that may be aborted
# (CUDA; on a CPU the forward runs where the host is). Unpaced, the host only launches the
# kernels and passes every layer's check in the first few ms of a big prefill (an 8B model's
# 4k-token chunk: roughly 10 ms of launches for 100 ms of GPU work), so an abort the SLO
# monitor orders later never fires. Two layers queued hide the next layer's launches behind
# the device's work (a layer's launches take a fraction of its GPU time); an abort wastes at
# most those two, already launched, layers.
ABORT_PACING_LAYERS = 2


@dataclass
class ModelRunnerOutput:
    """One sampled token (and its logprobs when asked) per request that caught up this step."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, Optional[float]]  # None for rows that did not ask; empty when none did
    top_logprobs: dict[str, TopLogprobs] = field(default_factory=dict)  # only requests that asked
    # Per request gathering its prompt's logprobs this step (any row, sampling or not): the first
    # position's index in PromptLogprobs and the values from there on.
    prompt_logprobs: dict[str, tuple[int, PromptLogprobArrays]] = field(default_factory=dict)


@dataclass
class PromptLogprobRows:
    """A step's token rows whose logits give prompt log-probabilities (host arrays, one entry per
    row), and the spans of them each request gathers."""

    token_index: np.ndarray  # int64: the row in the forward pass's tokens
    target_ids: np.ndarray  # int64: the prompt token that follows it, whose logprob is taken
    spans: list[tuple[str, int, int, int]]  # request id, first position, rows, alternatives asked
    max_top: int  # the most alternatives a span asks for


@dataclass
class _PromptLogprobsInFlight:
    """A step's prompt log-probabilities on their way to the host."""

    spans: list[tuple[str, int, int, int]]
    logprobs: torch.Tensor  # host float32 [rows]
    ranks: torch.Tensor  # host int64 [rows]
    top_token_ids: Optional[torch.Tensor]  # host int64 [rows, max_top]
    top_logprobs: Optional[torch.Tensor]  # host float32 [rows, max_top]
    done: Optional[torch.cuda.Event]  # under tensor parallelism, one that watches the workers

    def wait(self) -> float:
        """Until they are on the host; the seconds it waited."""
        if self.done is None:
            return 0.0
        start = time.perf_counter()
        self.done.synchronize()
        return time.perf_counter() - start

    def result(self) -> dict[str, tuple[int, PromptLogprobArrays]]:
        """Per request, as numpy arrays (copies: the step's pinned buffers are not held on to),
        which the engine core keeps and sends as they are."""
        logprobs, ranks = self.logprobs.numpy().copy(), self.ranks.numpy().astype(np.int32)
        top_ids = top_values = None
        if self.top_token_ids is not None:
            top_ids, top_values = self.top_token_ids.numpy().astype(np.int32), self.top_logprobs.numpy().copy()
        gathered, row = {}, 0
        for request_id, first_position, num_rows, num_top in self.spans:
            end = row + num_rows
            top = (top_ids[row:end, :num_top], top_values[row:end, :num_top]) if num_top else (None, None)
            gathered[request_id] = (first_position, PromptLogprobArrays(logprobs[row:end], ranks[row:end], *top))
            row = end
        return gathered


@dataclass
class StepInFlight:
    """A step queued on the device; result() waits for its sampled tokens."""

    request_ids: list[str]  # of the rows that sample, in sampling order
    wants_logprobs: list[bool]
    token_ids: Optional[torch.Tensor] = None  # host (pinned on CUDA) int64 [rows]
    logprobs: Optional[torch.Tensor] = None  # host float32 [rows], when any row asked
    num_top_logprobs: Optional[list[int]] = None  # alternatives each row asked for, when any did
    top_token_ids: Optional[torch.Tensor] = None  # host int64 [rows, max asked]
    top_logprobs: Optional[torch.Tensor] = None  # host float32 [rows, max asked]
    done: Optional[torch.cuda.Event] = None
    graph_batch_size: Optional[int] = None  # the padded size replayed, None for an eager pass
    launch_s: float = 0.0  # host time launch() took: input preparation and kernel launches
    # Of launch()'s time, what an abortable step's pacing waited for the device (CUDA): device
    # time, not host work, so it is not in launch_s.
    pacing_s: float = 0.0
    wait_s: float = field(default=0.0)  # host time result() spent waiting for the device
    # Launched up to its logits; sampling waits for its grammars (ModelRunner.sample_tokens).
    unsampled: Optional["_UnsampledStep"] = None
    prompt_logprobs: Optional[_PromptLogprobsInFlight] = None  # when a request gathers them this step

    def result(self) -> ModelRunnerOutput:
        if self.unsampled is not None:
            raise RuntimeError("the step's constrained rows were never sampled (ModelRunner.sample_tokens)")
        output = self._sampled()
        if self.prompt_logprobs is not None:  # computed before the sampling rows: seldom a wait of its own
            self.wait_s += self.prompt_logprobs.wait()
            output.prompt_logprobs = self.prompt_logprobs.result()
        return output

    def _sampled(self) -> ModelRunnerOutput:
        if not self.request_ids:
            return ModelRunnerOutput({}, {})
        if self.done is not None:
            start = time.perf_counter()
            self.done.synchronize()
            self.wait_s = time.perf_counter() - start
        token_ids = dict(zip(self.request_ids, self.token_ids.tolist()))
        if self.logprobs is None:  # no row asked
            return ModelRunnerOutput(token_ids, {}, self._top_logprobs())
        return ModelRunnerOutput(
            token_ids,
            {request_id: logprob if wanted else None
             for request_id, logprob, wanted in zip(self.request_ids, self.logprobs.tolist(), self.wants_logprobs)},
            self._top_logprobs(),
        )

    def _top_logprobs(self) -> dict[str, TopLogprobs]:
        if self.num_top_logprobs is None:
            return {}
        return {request_id: TopLogprobs(ids[:count], values[:count])
                for request_id, count, ids, values in zip(self.request_ids, self.num_top_logprobs,
                                                          self.top_token_ids.tolist(), self.top_logprobs.tolist())
                if count}


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, *, cuda_graphs: bool = False):
        """cuda_graphs: capture decode graphs now (CUDA only; the engine decides from
        enforce_eager, the device and whether the attention backend is graph-safe)."""
        self.model = model
        self.device = torch.device(device)
        # Asked at each layer boundary whether to abandon the step (the SLO policy sets it).
        self.step_abort: Optional[StepAbort] = None
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_tokens = config.max_num_batched_tokens
        self.max_mask_ms = config.structured_output_max_mask_ms
        self.dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(
            model_config.num_hidden_layers, config.num_kv_blocks, config.block_size,
            model_config.num_key_value_heads, model_config.head_dim, self.dtype, self.device,
        )
        # The host KV tier: its memory and the block copies each step's SchedulerOutput asks for.
        self.kv_swap = (KVSwapper(self.kv_caches, config.num_host_kv_blocks, self.device)
                        if config.num_host_kv_blocks else None)
        max_blocks_per_seq = block_table_width(config.max_model_len, config.block_size)
        # The logits' width: the model's vocabulary (a tensor-parallel rank's LM head holds a block of it).
        self.vocab_size = model_config.vocab_size
        self.rows = RequestRows(self.max_num_seqs, max_blocks_per_seq, self.vocab_size, self.device)
        # Room for a step's block-table changes in the one copy: every token of the budget
        # opening a block, plus a few whole tables of admissions; more goes in a second copy.
        self.block_change_capacity = self.max_num_tokens // self.block_size + 8 * max_blocks_per_seq + self.max_num_seqs
        self.staged = StagedInputs(self._staged_fields(), self.device)
        self.batch_block_tables = torch.zeros((self.max_num_seqs, max_blocks_per_seq), dtype=torch.int32,
                                              device=self.device)
        # Each row's latest sampled token, on the device: with overlapped scheduling a decode's
        # input token is sampled by the step before it and never visits the host first.
        self.last_token_by_row = torch.zeros(self.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        # Query offsets of a decode-only step and the sampling rows of a step where every
        # sequence samples, without building them each step.
        self._arange = np.arange(max(self.max_num_seqs, self.max_num_tokens) + 1, dtype=np.int64)
        # Query offsets of the sampling rows as one-token sequences (the last layer's queries of a pruned pass).
        self._single_token_starts = torch.arange(self.max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.sampler = Sampler()
        self.grammar_bitmask: Optional[GrammarBitmask] = None  # made by the first step with a constrained row
        on_cuda = cuda_runtime.on_cuda(self.device)
        pinned = cuda_runtime.pins_host_memory(self.device)
        self._host_token_ids = [torch.zeros(self.max_num_seqs, dtype=torch.int64, pin_memory=pinned)
                                for _ in range(2)]
        self._host_logprobs = [torch.zeros(self.max_num_seqs, dtype=torch.float32, pin_memory=pinned)
                               for _ in range(2)]
        # Flat, so that [rows, k] is a contiguous view whatever k: the target of one async copy.
        self._host_top_token_ids = [torch.zeros(self.max_num_seqs * MAX_TOP_LOGPROBS, dtype=torch.int64,
                                                pin_memory=pinned) for _ in range(2)]
        self._host_top_logprobs = [torch.zeros(self.max_num_seqs * MAX_TOP_LOGPROBS, dtype=torch.float32,
                                               pin_memory=pinned) for _ in range(2)]
        # One per decoder layer, recorded at its check in a step that may be aborted (the host's
        # pacing, _layer_check) and reused by every such step; none on a CPU, where there is
        # nothing to pace.
        self._layer_events = ([torch.cuda.Event() for _ in range(model_config.num_hidden_layers)]
                              if on_cuda else None)
        # Whether a step step_abort may abort is launched paced (the engine then takes the step
        # before it in first, LLMEngine._step); an attribute so a CPU test can run that path.
        self.paces_layers = self._layer_events is not None
        self._pacing_s = 0.0  # this launch's pacing waits (launch() resets it)
        self._num_launched = 0
        # Rows of full-vocabulary logits computed for prompt log-probabilities, in all (tests
        # check that a request that asks for none costs none).
        self.num_prompt_logprob_rows = 0
        self.decode_sizes: list[int] = []
        # What a padded decode pass leaves for the sampler: every row's logits and greedy token.
        self.decode_logits: Optional[torch.Tensor] = None  # float32 [largest size, vocab]
        self.decode_greedy: Optional[torch.Tensor] = None  # int64 [largest size]
        self.graphs: Optional[DecodeGraphs] = None
        if cuda_graphs:
            if not on_cuda:
                raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
            self.enable_decode_padding()
            self.graphs = DecodeGraphs(self._decode_pass, self.decode_sizes)
            with torch.inference_mode():
                self.graphs.capture()

    def _staged_fields(self) -> list[StagedField]:
        tokens, seqs = self.max_num_tokens, self.max_num_seqs
        return [
            StagedField("input_ids", torch.int64, tokens),
            StagedField("positions", torch.int64, tokens),
            StagedField("slot_mapping", torch.int64, tokens),
            StagedField("query_start_loc", torch.int32, seqs + 1),
            StagedField("seq_lens", torch.int32, seqs),
            StagedField("batch_rows", torch.int64, seqs),  # each sequence's row: its block table
            StagedField("pending_token_index", torch.int64, seqs),  # inputs whose id is on the device...
            StagedField("pending_rows", torch.int64, seqs),  # ...as the latest sample of these rows
            # A padded decode pass takes those ids in the graph: per row, is its input on the device?
            StagedField("decode_pending", torch.bool, seqs),
            StagedField("logits_indices", torch.int64, seqs),  # hidden rows that sample
            StagedField("sampling_seqs", torch.int64, seqs),  # ...and their sequences
            StagedField("sample_rows", torch.int64, seqs),
            StagedField("temperature", torch.float32, seqs),
            StagedField("top_k", torch.int32, seqs),
            StagedField("top_p", torch.float32, seqs),
            StagedField("min_p", torch.float32, seqs),
            StagedField("seeded_rows", torch.int64, seqs),
            StagedField("seeds", torch.int64, seqs),
            StagedField("seed_steps", torch.int64, seqs),
            # The penalties of the sampling rows, written only by steps where some row has them.
            StagedField("repetition_penalty", torch.float32, seqs),
            StagedField("frequency_penalty", torch.float32, seqs),
            StagedField("presence_penalty", torch.float32, seqs),
            # Variable length, so last: the copy stops where the step's changes end.
            StagedField("block_changes", torch.int32, 2 * self.block_change_capacity),
        ]

    def check_recoverable(self) -> None:
        """After a failed step: raise if this runner cannot step again (one device always can;
        TensorParallelRunner's workers may be stuck in the failed step)."""

    def enable_decode_padding(self) -> None:
        """Pad decode-only steps to the capture ladder, as graph replays need. Graphs turn
        it on; on its own (any device) it runs the padded pass eagerly, which lets a CPU
        test check that padding changes no output."""
        self.decode_sizes = capture_sizes(self.max_num_seqs, self.max_num_tokens)
        largest = max(self.decode_sizes)
        if self.decode_greedy is None:  # once: captured graphs write these very tensors
            self.decode_logits = torch.zeros((largest, self.vocab_size), dtype=torch.float32, device=self.device)
            self.decode_greedy = torch.zeros(largest, dtype=torch.int64, device=self.device)
        views = self.staged.host_views()
        self._pad_decode_rows(views, 0, max(self.decode_sizes))
        self.staged.send()
        torch.index_select(self.rows.block_tables.device, 0,
                           self.staged.device_views["batch_rows"][:max(self.decode_sizes)],
                           out=self.batch_block_tables[:max(self.decode_sizes)])

    # ---- one step ----------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        in_flight = self.launch(scheduler_output)
        if in_flight.unsampled is not None:
            in_flight = self.sample_tokens(in_flight)
        return in_flight.result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> StepInFlight:
        """Queue one step's forward pass and sampling; returns without waiting for them.
        A step that step_abort lets be aborted runs eagerly, asking it before each decoder
        layer; StepAborted leaves this method when it says yes."""
        rows = self.rows
        for request_id in scheduler_output.finished_req_ids:
            rows.remove(request_id)
        for request_id in scheduler_output.preempted_req_ids:
            rows.remove(request_id)
        if scheduler_output.block_copies is not None:  # before anything this step reads or overwrites
            self.kv_swap.copy(scheduler_output.block_copies)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return StepInFlight([], [])
        start = time.perf_counter()
        self._pacing_s = 0.0
        step_abort = self.step_abort
        abortable = step_abort is not None and step_abort.begin(scheduler_output)
        try:
            step = self._prepare(scheduled, graphable=not abortable)
            hidden = self._forward(step, self._layer_check(scheduler_output.step_id) if abortable else None)
        finally:
            if step_abort is not None:
                step_abort.end()
        prompt_logprobs = None
        if step.prompt_logprobs is not None:  # before the sampling rows' logits, as every rank takes them
            prompt_logprobs = self._send_prompt_logprobs(step.prompt_logprobs, hidden)
        in_flight = self._sample(step, hidden, scheduled)
        in_flight.prompt_logprobs = prompt_logprobs
        in_flight.pacing_s = self._pacing_s
        in_flight.launch_s = time.perf_counter() - start - self._pacing_s
        return in_flight

    @torch.inference_mode()
    def sample_tokens(self, in_flight: StepInFlight) -> StepInFlight:
        """Sample a step that launch() left at its logits: the constrained rows' masks are built
        now, from grammars that have taken in every token of the steps before (the caller saw to
        it), and the whole step samples in one pass. Returns the step with its tokens on the way."""
        start = time.perf_counter()
        unsampled = in_flight.unsampled
        step, scheduled = unsampled.step, unsampled.scheduled
        constrained_seqs = step.constrained_seqs
        if self.grammar_bitmask is None:
            self.grammar_bitmask = GrammarBitmask(self.max_num_seqs, self.vocab_size, self.device,
                                                  self.max_mask_ms)
        grammar = self.grammar_bitmask.build(np.searchsorted(step.sampling_seqs, constrained_seqs),
                                             [scheduled[index].request.grammar for index in constrained_seqs])
        sampled = self._sample_logits(step, unsampled.logits, scheduled, grammar)
        sampled.prompt_logprobs = in_flight.prompt_logprobs
        in_flight.unsampled = None
        sampled.launch_s = in_flight.launch_s + time.perf_counter() - start
        sampled.pacing_s = in_flight.pacing_s
        return sampled

    def _layer_check(self, step_id: int) -> Callable[[int], None]:
        """The model's layer hook for an abortable step: StepAborted when step_abort says so.
        On CUDA it first paces the host: before layer L it marks the work launched so far
        (layers < L) with an event and waits for the device to finish layers
        < L - ABORT_PACING_LAYERS, so each check is asked with the device at most that many
        layers behind, not after the host has raced through the whole pass's launches. Past the
        step_abort's stubbornness limit (its max_abort_layer) no abort can fire: the rest of the
        pass is launched unpaced."""
        abort_now = self.step_abort.abort_now
        events = self._layer_events if self.paces_layers else None
        last_paced = getattr(self.step_abort, "max_abort_layer", None)
        if last_paced is None and events is not None:
            last_paced = len(events) - 1
        wait_for_device = self._wait_for_device

        def check(layer_index: int) -> None:
            if events is not None and layer_index <= last_paced:
                events[layer_index].record()
                if layer_index >= ABORT_PACING_LAYERS:
                    waited = time.perf_counter()
                    wait_for_device(events[layer_index - ABORT_PACING_LAYERS])
                    self._pacing_s += time.perf_counter() - waited
            victim_request_id = abort_now(step_id, layer_index)
            if victim_request_id is not None:
                raise StepAborted(victim_request_id, layer_index)

        return check

    def _wait_for_device(self, event: torch.cuda.Event) -> None:
        """Until the device has run the work `event` marks. synchronize() releases the GIL: the
        SLO monitor's thread runs meanwhile, and its order is read at the check that follows."""
        event.synchronize()

    def _prepare(self, scheduled: list[ScheduledRequest], graphable: bool) -> "_StepPlan":
        """Fill the host staging buffer for this step and send it (one copy)."""
        rows = self.rows
        block_tables = rows.block_tables
        row_of = rows.row_of
        num_seqs = len(scheduled)
        # One pass over the step's sequences (it runs for every running request each step):
        # admissions and new blocks, and the per-sequence values the arrays are built from.
        seq_row_list, query_len_list, start_list, token_lists, request_ids, samples = [], [], [], [], [], []
        constrained_seqs = []  # sampling sequences with a structured-output grammar
        prompt_logprob_seqs = []  # sequences of requests gathering their prompt's logprobs
        for entry in scheduled:
            request = entry.request
            if entry.is_new:
                row = rows.add(request, entry.new_block_ids)
            else:
                row = row_of[request.request_id]
                if entry.new_block_ids:
                    block_tables.append(row, entry.new_block_ids)
            seq_row_list.append(row)
            query_len_list.append(entry.num_new_tokens)
            start_list.append(entry.start_pos)
            token_lists.append(request.all_token_ids)
            request_ids.append(request.request_id)
            samples.append(entry.samples)
            if request.grammar is not None and entry.samples:
                constrained_seqs.append(len(samples) - 1)
            if request.gathers_prompt_logprobs:
                prompt_logprob_seqs.append(len(samples) - 1)
        rows.flush_admissions()
        seq_rows = np.array(seq_row_list, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        # A token the host does not have yet (a position past the request's known tokens)
        # is the one the previous, still running, step samples: overlapped scheduling.
        known_lens = np.fromiter(map(len, token_lists), np.int64, num_seqs)
        pending = starts >= known_lens
        max_query_len = max(query_len_list)
        decode_only = max_query_len == 1

        views = self.staged.host_views()
        query_start_loc = views["query_start_loc"][: num_seqs + 1]
        input_ids = views["input_ids"]
        if decode_only:
            num_tokens = num_seqs
            query_start_loc[:] = self._arange[: num_seqs + 1]
            seq_lens = starts + 1
            input_ids[:num_tokens] = 0  # pending inputs: their ids are copied in on the device
            views["decode_pending"][:num_seqs] = pending
            known_seqs = np.flatnonzero(~pending).tolist()  # none at all under overlapped scheduling
            if known_seqs:
                input_ids[known_seqs] = [token_lists[index][start_list[index]] for index in known_seqs]
            positions, token_rows = starts, seq_rows
        else:
            query_lens = np.array(query_len_list, dtype=np.int64)
            query_start_loc[0] = 0
            np.cumsum(query_lens, out=query_start_loc[1:])
            num_tokens = int(query_start_loc[-1])
            seq_lens = starts + query_lens
            input_ids[:num_tokens] = list(itertools.chain.from_iterable(
                tokens[start:start + count] if start < len(tokens) else (0,)
                for tokens, start, count in zip(token_lists, start_list, query_len_list)))
            token_seq = np.repeat(np.arange(num_seqs), query_lens)
            positions = np.arange(num_tokens) - query_start_loc[token_seq] + starts[token_seq]
            token_rows = seq_rows[token_seq]
        views["positions"][:num_tokens] = positions
        block_size = self.block_size
        views["slot_mapping"][:num_tokens] = (block_tables.host[token_rows, positions // block_size].astype(np.int64)
                                              * block_size + positions % block_size)
        views["seq_lens"][:num_seqs] = seq_lens
        views["batch_rows"][:num_seqs] = seq_rows
        pending_seqs = np.flatnonzero(pending)
        views["pending_token_index"][: len(pending_seqs)] = query_start_loc[pending_seqs]
        views["pending_rows"][: len(pending_seqs)] = seq_rows[pending_seqs]

        prompt_logprobs = (_prompt_logprob_rows(scheduled, prompt_logprob_seqs, query_start_loc)
                           if prompt_logprob_seqs else None)
        graph_size = None
        if decode_only and graphable and self.decode_sizes and prompt_logprobs is None:
            graph_size = padded_batch_size(self.decode_sizes, num_seqs)
            if graph_size is not None:
                self._pad_decode_rows(views, num_seqs, graph_size)

        if all(samples):  # every decode step, most mixed ones
            sampling_seqs = self._arange[:num_seqs]
            sample_request_ids = request_ids
        else:
            sampling_seqs = np.flatnonzero(samples)
            sample_request_ids = [request_ids[index] for index in sampling_seqs.tolist()]
        sample_rows = seq_rows[sampling_seqs]
        num_samples = len(sampling_seqs)
        views["logits_indices"][:num_samples] = query_start_loc[sampling_seqs + 1] - 1
        views["sampling_seqs"][:num_samples] = sampling_seqs
        views["sample_rows"][:num_samples] = sample_rows
        sampling = rows.sampling_of(sample_rows)
        views["temperature"][:num_samples] = sampling.arrays.temperature
        views["top_k"][:num_samples] = sampling.arrays.top_k
        views["top_p"][:num_samples] = sampling.arrays.top_p
        views["min_p"][:num_samples] = sampling.arrays.min_p
        seeded = sampling.seeded
        num_seeded = len(seeded)
        if num_seeded:
            views["seeded_rows"][:num_seeded] = seeded
            views["seeds"][:num_seeded] = sampling.arrays.seed[seeded]
            # A seeded draw is keyed by the index of the output token it produces.
            views["seed_steps"][:num_seeded] = (seq_lens[sampling_seqs[seeded]]
                                                - rows.num_prompt_tokens[sample_rows[seeded]])
        if sampling.any_penalized:
            views["repetition_penalty"][:num_samples] = sampling.arrays.repetition_penalty
            views["frequency_penalty"][:num_samples] = sampling.arrays.frequency_penalty
            views["presence_penalty"][:num_samples] = sampling.arrays.presence_penalty

        change_index, change_ids = block_tables.take_changes()
        num_changes = len(change_index)
        staged_changes = min(num_changes, self.block_change_capacity)
        if staged_changes:
            changes = views["block_changes"]
            changes[:staged_changes] = change_index[:staged_changes]
            changes[staged_changes:2 * staged_changes] = change_ids[:staged_changes]
        self.staged.send(self.staged.end_of("block_changes", 2 * staged_changes))
        if num_changes > staged_changes:  # rare: many admissions with long (prefix-cached) tables at once
            self._apply_unstaged_changes(change_index[staged_changes:], change_ids[staged_changes:])
        return _StepPlan(
            num_seqs=num_seqs, num_tokens=num_tokens, max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()), graph_size=graph_size, num_pending=len(pending_seqs),
            max_sampling_seq_len=int(seq_lens[sampling_seqs].max()) if num_samples else 0,
            num_staged_changes=staged_changes, sampling_seqs=sampling_seqs, num_seeded=num_seeded,
            facts=sampling.facts, wants_logprobs=sampling.wants_logprobs,
            num_top_logprobs=sampling.num_top_logprobs, any_logit_bias=sampling.any_logit_bias,
            any_repetition=sampling.any_repetition, any_additive=sampling.any_additive,
            sample_request_ids=sample_request_ids,
            constrained_seqs=constrained_seqs or None, prompt_logprobs=prompt_logprobs,
        )

    def _apply_unstaged_changes(self, flat_index: np.ndarray, block_ids: np.ndarray) -> None:
        """Block-table changes past the staged buffer's room: a copy of their own, still
        asynchronous (a tensor-parallel rank 0 also sends them to its workers)."""
        self.rows.block_tables.apply_on_device(to_device(flat_index, None, self.device),
                                               to_device(block_ids, None, self.device))

    def _pad_decode_rows(self, views: dict[str, np.ndarray], start: int, end: int) -> None:
        """Rows [start, end) of a padded decode batch: one token each that writes no KV (slot
        -1) and attends to one slot of the null block, so it stays finite and costs nothing."""
        if start == end:
            return
        views["input_ids"][start:end] = 0
        views["positions"][start:end] = 0
        views["slot_mapping"][start:end] = -1
        views["seq_lens"][start:end] = 1
        views["query_start_loc"][start + 1:end + 1] = np.arange(start + 1, end + 1)
        views["batch_rows"][start:end] = self.rows.null_row
        views["decode_pending"][start:end] = False

    def _forward(self, step: "_StepPlan", layer_hook: Optional[Callable[[int], None]]) -> Optional[torch.Tensor]:
        """The hidden states of the step's tokens; None for a padded decode step, whose pass
        leaves every row's logits and greedy token in decode_logits / decode_greedy."""
        device_views = self.staged.device_views
        block_tables = self.rows.block_tables
        if step.num_staged_changes:
            changes = device_views["block_changes"]
            block_tables.apply_on_device(changes[:step.num_staged_changes],
                                         changes[step.num_staged_changes:2 * step.num_staged_changes])
        if step.graph_size is not None:  # the pass gathers its block tables and input ids itself
            if self.graphs is not None:
                self.graphs.replay(step.graph_size)
            else:
                self._decode_pass(step.graph_size)
            return None
        torch.index_select(block_tables.device, 0, device_views["batch_rows"][:step.num_seqs],
                           out=self.batch_block_tables[:step.num_seqs])
        if step.num_pending:
            input_ids = device_views["input_ids"]
            input_ids.index_copy_(0, device_views["pending_token_index"][:step.num_pending],
                                  self.last_token_by_row.index_select(0, device_views["pending_rows"][:step.num_pending]))
        metadata = AttentionMetadata(
            query_start_loc=device_views["query_start_loc"][:step.num_seqs + 1],
            seq_lens=device_views["seq_lens"][:step.num_seqs],
            block_tables=self.batch_block_tables[:step.num_seqs],
            slot_mapping=device_views["slot_mapping"][:step.num_tokens],
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        output_rows = None
        if step.prunes_last_layer:
            num_samples = len(step.sampling_seqs)
            sampling_seqs = device_views["sampling_seqs"][:num_samples]
            logits_indices = device_views["logits_indices"][:num_samples]
            output_rows = OutputRows(logits_indices, AttentionMetadata(
                query_start_loc=self._single_token_starts[:num_samples + 1],
                seq_lens=metadata.seq_lens.index_select(0, sampling_seqs),
                block_tables=metadata.block_tables.index_select(0, sampling_seqs),
                slot_mapping=metadata.slot_mapping.index_select(0, logits_indices),
                max_query_len=1,
                max_seq_len=step.max_sampling_seq_len,
            ))
        return self.model(device_views["input_ids"][:step.num_tokens], device_views["positions"][:step.num_tokens],
                          self.kv_caches, metadata, layer_hook, output_rows)

    def _decode_pass(self, size: int) -> None:
        """What a decode graph of `size` rows captures: the rows' block tables and their input
        ids still on the device (sampled by the step before), the forward pass, then every
        row's logits and greedy token into decode_logits / decode_greedy (padding rows' too:
        cheaper than a gather, and a greedy batch then needs no sampler launches at all)."""
        device_views = self.staged.device_views
        batch_rows = device_views["batch_rows"][:size]
        torch.index_select(self.rows.block_tables.device, 0, batch_rows, out=self.batch_block_tables[:size])
        input_ids = device_views["input_ids"][:size]
        input_ids.copy_(torch.where(device_views["decode_pending"][:size],
                                    self.last_token_by_row.index_select(0, batch_rows), input_ids))
        logits = self.model.compute_logits(self._decode_forward(size))
        self.decode_logits[:size].copy_(logits)
        torch.argmax(logits, dim=-1, out=self.decode_greedy[:size])  # ties go to the lowest id, as the sampler's

    def _decode_forward(self, size: int) -> torch.Tensor:
        """The forward pass of a padded decode step of `size` rows. Its metadata holds only
        bounds that do not depend on the batch (max_query_len 1, max_seq_len max_model_len);
        the kernels read the real lengths on the device."""
        device_views = self.staged.device_views
        metadata = AttentionMetadata(
            query_start_loc=device_views["query_start_loc"][:size + 1],
            seq_lens=device_views["seq_lens"][:size],
            block_tables=self.batch_block_tables[:size],
            slot_mapping=device_views["slot_mapping"][:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        return self.model(device_views["input_ids"][:size], device_views["positions"][:size], self.kv_caches,
                          metadata)

    def _sample(self, step: "_StepPlan", hidden: Optional[torch.Tensor],
                scheduled: list[ScheduledRequest]) -> StepInFlight:
        """The step's logits, then its sampling queued; a step with constrained rows stops at its
        logits (queued on the device) and waits for sample_tokens."""
        num_samples = len(step.sampling_seqs)
        if not num_samples:
            return StepInFlight([], [], graph_batch_size=step.graph_size)
        logits_indices = self.staged.device_views["logits_indices"][:num_samples]
        if hidden is not None:
            logits = self.logits_of(step, hidden)
        else:  # a padded decode pass: a decode's token is its row, so the sampling rows lead
            every_row = num_samples == step.num_seqs
            logits = self.decode_logits[:num_samples] if every_row else self.decode_logits.index_select(0, logits_indices)
            facts = step.facts
            if (facts["all_greedy"] and not facts["any_logprobs"] and not step.processed
                    and step.constrained_seqs is None):
                greedy = self.decode_greedy
                return self._send_sampled(step, greedy[:num_samples] if every_row else greedy.index_select(
                    0, logits_indices), None, None, None)
        if step.constrained_seqs is not None:
            return StepInFlight(step.sample_request_ids, step.wants_logprobs, graph_batch_size=step.graph_size,
                                unsampled=_UnsampledStep(step, logits, scheduled))
        return self._sample_logits(step, logits, scheduled, None)

    def logits_of(self, step: "_StepPlan", hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the step's sampling rows from its forward pass's hidden states (a pass
        pruned to those rows returned theirs alone, in order)."""
        if not step.prunes_last_layer:
            hidden = hidden.index_select(0, self.staged.device_views["logits_indices"][:len(step.sampling_seqs)])
        return self.model.compute_logits(hidden)

    def prompt_logprob_logits(self, rows: PromptLogprobRows, hidden: torch.Tensor
                              ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The full-vocabulary logits at `rows`, a bounded number of rows at a time
        (sampler.prompt_logits_rows): (start, end, logits) per piece. Under tensor parallelism
        every rank computes each piece (its logits are a gather); only rank 0 takes values."""
        num_rows = len(rows.token_index)
        token_index = to_device(rows.token_index, None, self.device)
        piece = prompt_logits_rows(self.vocab_size)
        for start in range(0, num_rows, piece):
            end = min(start + piece, num_rows)
            yield start, end, self.model.compute_logits(hidden.index_select(0, token_index[start:end]))
        self.num_prompt_logprob_rows += num_rows

    def prompt_logprob_values(self, rows: PromptLogprobRows, hidden: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The prompt tokens' logprobs, ranks and top alternatives at `rows` (device tensors),
        piece by piece (prompt_logprob_logits), so that only the gathered values outlive each
        piece's full-vocabulary logits."""
        num_rows = len(rows.token_index)
        target_ids = to_device(rows.target_ids, None, self.device)
        logprobs = torch.empty(num_rows, dtype=torch.float32, device=self.device)
        ranks = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        top_logprobs = top_token_ids = None
        if rows.max_top:
            top_logprobs = torch.empty((num_rows, rows.max_top), dtype=torch.float32, device=self.device)
            top_token_ids = torch.empty((num_rows, rows.max_top), dtype=torch.int64, device=self.device)
        for start, end, logits in self.prompt_logprob_logits(rows, hidden):
            values = logprobs_of(logits, target_ids[start:end], rows.max_top)
            for out, value in zip((logprobs, ranks, top_logprobs, top_token_ids), values):
                if out is not None:
                    out[start:end] = value
        return logprobs, ranks, top_token_ids, top_logprobs

    def _send_prompt_logprobs(self, rows: PromptLogprobRows, hidden: torch.Tensor) -> _PromptLogprobsInFlight:
        """The step's prompt log-probabilities computed and copied to the host without waiting."""
        values = [_to_host(value) if value is not None else None for value in self.prompt_logprob_values(rows, hidden)]
        done = None
        if cuda_runtime.on_cuda(self.device):
            done = torch.cuda.Event()
            done.record()
        return _PromptLogprobsInFlight(rows.spans, *values, done)

    def keep_sampled(self, token_ids: torch.Tensor) -> None:
        """The step's sampled tokens stay on the device, in their rows, as the next step's inputs."""
        self.last_token_by_row.index_copy_(0, self.staged.device_views["sample_rows"][:len(token_ids)], token_ids)

    def _sample_logits(self, step: "_StepPlan", logits: torch.Tensor, scheduled: list[ScheduledRequest],
                       grammar: Optional[GrammarMask]) -> StepInFlight:
        device_views = self.staged.device_views
        num_samples = len(step.sampling_seqs)
        batch = SamplingBatch(
            temperature=device_views["temperature"][:num_samples],
            top_k=device_views["top_k"][:num_samples],
            top_p=device_views["top_p"][:num_samples],
            min_p=device_views["min_p"][:num_samples],
            seeds=device_views["seeds"][:step.num_seeded],
            seeded_rows=device_views["seeded_rows"][:step.num_seeded],
            step_indices=device_views["seed_steps"][:step.num_seeded],
            **step.facts,
            processors=self._logits_processing(step, scheduled),
            grammar=grammar,
        )
        sampled = self.sampler.sample(logits, batch)
        return self._send_sampled(step, sampled.token_ids, sampled.logprobs, sampled.top_token_ids,
                                  sampled.top_logprobs)

    def _send_sampled(self, step: "_StepPlan", token_ids: torch.Tensor, logprobs: Optional[torch.Tensor],
                      top_token_ids: Optional[torch.Tensor], top_logprobs: Optional[torch.Tensor]) -> StepInFlight:
        """Keep the sampled tokens on the device for the next step's inputs and copy them (and
        any logprobs) to the host without waiting; the StepInFlight waits when read."""
        num_samples = len(token_ids)
        self.keep_sampled(token_ids)
        if step.any_repetition or step.any_additive:  # the penalized rows' histories grow on the device
            self.rows.penalties.count(self.staged.device_views["sample_rows"][:num_samples], token_ids)
        # Two host buffers alternate: with overlapped scheduling the next step's copy lands
        # while this step's tokens are still being read.
        slot = self._num_launched % 2
        self._num_launched += 1
        host_token_ids = self._host_token_ids[slot][:num_samples]
        host_token_ids.copy_(token_ids, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            host_logprobs = self._host_logprobs[slot][:num_samples]
            host_logprobs.copy_(logprobs, non_blocking=True)
        host_top_token_ids = host_top_logprobs = None
        if top_token_ids is not None:
            shape = top_token_ids.shape
            host_top_token_ids = self._host_top_token_ids[slot][:shape.numel()].view(shape)
            host_top_token_ids.copy_(top_token_ids, non_blocking=True)
            host_top_logprobs = self._host_top_logprobs[slot][:shape.numel()].view(shape)
            host_top_logprobs.copy_(top_logprobs, non_blocking=True)
        done = None
        if cuda_runtime.on_cuda(self.device):
            done = torch.cuda.Event()
            done.record()
        return StepInFlight(
            step.sample_request_ids, step.wants_logprobs, host_token_ids, host_logprobs, step.num_top_logprobs, host_top_token_ids,
            host_top_logprobs, done, step.graph_size,
        )

    def _logits_processing(self, step: "_StepPlan", scheduled: list[ScheduledRequest]
                           ) -> Optional[LogitsProcessing]:
        """logit_bias and penalties of a batch where some row has them: the rows' parameters
        when some row has logit_bias, and the penalties' staged parameters and rows of the
        persistent PenaltyState (which has counted every token sampled before this step, the
        one of a step still in flight included: the device runs them in order)."""
        if not step.processed:
            return None
        bias_params = None
        if step.any_logit_bias:
            bias_params = [scheduled[index].request.sampling_params for index in step.sampling_seqs.tolist()]
        penalties = None
        if step.any_repetition or step.any_additive:
            views, num_samples = self.staged.device_views, len(step.sampling_seqs)
            penalties = Penalties(self.rows.penalties, views["sample_rows"][:num_samples],
                                  views["repetition_penalty"][:num_samples], views["frequency_penalty"][:num_samples],
                                  views["presence_penalty"][:num_samples], step.any_repetition, step.any_additive)
        return LogitsProcessing(bias_params, penalties)


def _prompt_logprob_rows(scheduled: list[ScheduledRequest], seqs: list[int], query_start_loc: np.ndarray
                         ) -> Optional[PromptLogprobRows]:
    """The rows of a step whose logits give prompt log-probabilities: of each of these
    sequences (requests gathering them), its positions p in this step's slice whose next
    token is still a prompt token (p < prompt length - 1), past those it has gathered already
    (a prefill recomputed after a preemption); None when there are none."""
    token_index, target_ids, spans = [], [], []
    for seq in seqs:
        entry = scheduled[seq]
        request = entry.request
        first = max(entry.start_pos, request.prompt_logprobs.num_positions)
        end = min(entry.start_pos + entry.num_new_tokens, len(request.prompt_token_ids) - 1)
        if first >= end:
            continue
        row = int(query_start_loc[seq]) + first - entry.start_pos
        token_index.extend(range(row, row + end - first))
        target_ids.extend(request.prompt_token_ids[first + 1:end + 1])
        spans.append((request.request_id, first, end - first, request.sampling_params.prompt_logprobs))
    if not spans:
        return None
    return PromptLogprobRows(np.array(token_index, dtype=np.int64), np.array(target_ids, dtype=np.int64), spans,
                             max(num_top for *_, num_top in spans))


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in host memory, without waiting (pinned, non-blocking) on CUDA."""
    if not cuda_runtime.on_cuda(tensor.device):
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda_runtime.pins_host_memory(tensor.device))
    return host.copy_(tensor, non_blocking=True)


@dataclass
class _StepPlan:
    """What the host decided for one step, for the device half of the launch."""

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    graph_size: Optional[int]  # padded decode batch size, None for an eager pass
    num_pending: int
    num_staged_changes: int
    sampling_seqs: np.ndarray
    num_seeded: int
    facts: dict
    wants_logprobs: list[bool]
    num_top_logprobs: Optional[list[int]]  # per sampling row, when any asks for alternatives
    # What some sampling row asks of logits_processors.py.
    any_logit_bias: bool
    any_repetition: bool
    any_additive: bool  # a frequency or presence penalty
    sample_request_ids: list[str]  # of the sampling rows, in order
    max_sampling_seq_len: int  # the longest context among the sequences that sample (0: none does)
    # The sampling sequences with a structured-output grammar (indices into the step's), if any.
    constrained_seqs: Optional[list[int]] = None
    prompt_logprobs: Optional[PromptLogprobRows] = None  # rows whose logits give prompt logprobs, if any

    @property
    def processed(self) -> bool:
        """Some sampling row has logit_bias or penalties: its logits go through the sampler."""
        return self.any_logit_bias or self.any_repetition or self.any_additive

    @property
    def prunes_last_layer(self) -> bool:
        """An eager pass with tokens that do not sample runs its last layer, past the K/V write, for
        the sampling rows alone (a prefill's other tokens only fill the cache), unless some of
        those tokens' logits give prompt log-probabilities."""
        return self.graph_size is None and len(self.sampling_seqs) < self.num_tokens and self.prompt_logprobs is None


@dataclass
class _UnsampledStep:
    """A launched step's logits (queued on the device), waiting for its grammars' masks."""

    step: _StepPlan
    logits: torch.Tensor
    scheduled: list[ScheduledRequest]
