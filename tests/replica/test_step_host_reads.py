"""A step's launch reads nothing back from the device (issue 20: async scheduling and CUDA graphs).

On CUDA, any read of a device tensor's values on the host (.item(), .tolist(), .cpu(), .numpy(),
bool(), int(), nonzero, unique, bincount, masked_select, ...) while a step is being launched waits
for the forward pass in flight, and the overlap that async scheduling buys is lost; inside a graph
capture it fails outright. The sampler alone is checked on the meta device (test_sampler.py); this
checks the whole launch of real steps (scheduling, staging, block-table changes, the host tier's
copies and prefetches, the pruned last layer, padded decode passes as a graph runs them, logit bias,
penalties, logprobs, prompt logprobs, seeded and top-k/p/min-p sampling, structured-output masks) without mocks: a
TorchFunctionMode sees every such call made from the engine's code while the CPU engine runs them.

The CPU's own attention backend (replica/attention/torch_*.py) reads sequence lengths on the host by
design and never runs on CUDA (the Triton backend keeps them on the device), so its calls are left
out. Reading a step's results (the runner's StepInFlight.result()) is where the host is meant to
wait, and is not probed. HEADROOM_TEST_DEVICE=cuda runs the same engines on a GPU (Triton
attention, CUDA graphs for the padded decode steps), where only reads of CUDA tensors count, and
where torch's sync debug mode also reports every synchronization made inside torch's own C++
(an index range check, a copy from pageable memory), which no Python-level probe sees.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import replica
from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams

_T = torch.Tensor
HOST_READS = {
    _T.item, _T.tolist, _T.numpy, _T.cpu, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.__array__,
    _T.nonzero, torch.nonzero, _T.unique, torch.unique, _T.bincount, torch.bincount, _T.masked_select,
    torch.masked_select, _T.any, _T.all, _T.__iter__,
}
TEST_DEVICE = os.environ.get("HEADROOM_TEST_DEVICE", "cpu")
REPLICA_DIR = str(Path(replica.__file__).resolve().parent) + os.sep
# Calls whose innermost engine frame is here run only on the CPU's attention backend.
CPU_ONLY = tuple(REPLICA_DIR + name for name in ("attention/torch_ref.py", "attention/torch_plan.py"))


def _of_the_device(args) -> bool:
    """On the CPU every tensor may be the device's; on a GPU only a CUDA tensor is."""
    return TEST_DEVICE == "cpu" or any(isinstance(arg, torch.Tensor) and arg.device.type != "cpu" for arg in args)


def _engine_site(frames) -> str:
    return " <- ".join(f"{frame.filename[len(REPLICA_DIR):]}:{frame.lineno} ({frame.name})"
                       for frame in reversed(frames[-4:]))


class HostReadProbe(TorchFunctionMode):
    """Counts host reads of tensor values made from replica/ code, by call site."""

    def __init__(self):
        super().__init__()
        self.reads: Counter = Counter()
        self.calls: Counter = Counter()  # of the probed methods, by name

    @contextlib.contextmanager
    def cuda_syncs(self):
        """On CUDA, the synchronizations torch itself makes meanwhile (its sync debug mode's
        warnings), counted as reads at the engine frame that caused them; nothing on the CPU."""
        if TEST_DEVICE != "cuda":
            yield
            return

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                stack = traceback.extract_stack()[:-1]
                if any(frame.name == "_unpin" for frame in stack):
                    return  # an earlier engine's host tier collected meanwhile: its teardown drains its copies
                frames = [frame for frame in stack if frame.filename.startswith(REPLICA_DIR)]
                self.reads[(f"torch sync: {message}", _engine_site(frames) or f"{filename}:{lineno}")] += 1

        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and _of_the_device(args):
            frames = [frame for frame in traceback.extract_stack()[:-1] if frame.filename.startswith(REPLICA_DIR)]
            if frames and not frames[-1].filename.startswith(CPU_ONLY):
                self.reads[(getattr(func, "__name__", str(func)), _engine_site(frames))] += 1
        return func(*args, **(kwargs or {}))


def _probe_launches(engine: LLMEngine) -> HostReadProbe:
    """Wrap what the engine runs before a step's results are waited for (earlier tests' engines
    collected first, not inside a probed step)."""
    gc.collect()
    probe = HostReadProbe()

    def probed(method):
        def run(*args, **kwargs):
            probe.calls[method.__name__] += 1
            with probe, probe.cuda_syncs():
                return method(*args, **kwargs)
        return run

    engine.scheduler.schedule = probed(engine.scheduler.schedule)
    engine.runner.launch = probed(engine.runner.launch)
    engine.runner.sample_tokens = probed(engine.runner.sample_tokens)
    engine.runner._decode_pass = probed(engine.runner._decode_pass)  # counted (it runs inside launch)
    return probe


def _mixed_params(max_tokens: int) -> list[SamplingParams]:
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    return [
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, **common),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, **common),
        SamplingParams(temperature=0.0, logit_bias=((5, 3.0),), logprobs=True, top_logprobs=2, **common),
        SamplingParams(temperature=1.0, min_p=0.05, **common),
        SamplingParams(temperature=0.7, frequency_penalty=1.0, seed=9, top_logprobs=1, **common),
        SamplingParams(temperature=0.0, prompt_logprobs=3, **common),  # its prefill steps run eagerly, unpruned
    ]


def _run(engine: LLMEngine, params: list[SamplingParams], prompt_lens: list[int], shared_prefix: int) -> int:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 250) for _ in range(shared_prefix)]
    for index, (row_params, length) in enumerate(zip(params, prompt_lens)):
        prompt = (prefix if index % 2 else []) + [rng.randrange(3, 250) for _ in range(length)]
        engine.add_request(engine.make_request(f"r{index}", prompt, row_params), detokenize=False)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    engine.scheduler.check_invariants()
    return steps


def _assert_no_reads(probe: HostReadProbe) -> None:
    assert not probe.reads, "host reads of tensor values while launching a step:\n" + "\n".join(
        f"{count} x {name}: {site}" for (name, site), count in probe.reads.most_common())


@pytest.mark.parametrize("padded_decode", [False, True], ids=["eager-decode", "padded-decode"])
def test_launching_steps_with_every_sampling_feature_reads_nothing_back(padded_decode):
    # Chunked prefill (budget 32), a shared prefix, decode batches of up to 6 rows. On CUDA the
    # padded decode steps replay graphs; the eager case turns them off.
    engine = LLMEngine(make_engine_config(block_size=4, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8,
                                          num_kv_blocks=64, async_scheduling=True, enforce_eager=not padded_decode),
                       "builtin", device=TEST_DEVICE)
    if padded_decode and engine.runner.graphs is None:
        engine.runner.enable_decode_padding()
    probe = _probe_launches(engine)
    params = _mixed_params(12)
    _run(engine, params, [5 + 3 * index for index in range(len(params))], shared_prefix=12)
    assert probe.calls["launch"] > 0 and engine.runner.num_prompt_logprob_rows > 0
    if padded_decode and engine.runner.graphs is None:
        assert probe.calls["_decode_pass"] > 0, "decode steps must have run the padded pass a graph captures"
    _assert_no_reads(probe)


def test_launching_steps_that_swap_and_prefetch_reads_nothing_back():
    # 13 usable blocks of 4 for six requests growing to 20-44 tokens: victims swap out and back in.
    engine = LLMEngine(make_engine_config(block_size=4, max_model_len=48, max_num_batched_tokens=32, max_num_seqs=8,
                                          num_kv_blocks=14, num_host_kv_blocks=64, preemption_mode="swap",
                                          preemption_recompute_s_per_token=1e-3, preemption_swap_bytes_per_s=1e9,
                                          async_scheduling=True), "builtin", device=TEST_DEVICE)
    if engine.runner.graphs is None:
        engine.runner.enable_decode_padding()
    engine.scheduler.prefetch_swap_ins = True  # as on CUDA
    probe = _probe_launches(engine)
    params = _mixed_params(12)
    _run(engine, params, [5 + 3 * index for index in range(len(params))], shared_prefix=12)
    assert engine.scheduler.counters.swap_preemptions > 0, "the cramped pool must really swap"
    _assert_no_reads(probe)


def test_launching_constrained_steps_reads_nothing_back():
    pytest.importorskip("llguidance")
    from replica.core.structured_output import StructuredOutput

    engine = LLMEngine(make_engine_config(block_size=4, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                                          num_kv_blocks=64, async_scheduling=True), "builtin", device=TEST_DEVICE)
    if engine.runner.graphs is None:
        engine.runner.enable_decode_padding()
    probe = _probe_launches(engine)
    choice = StructuredOutput("choice", ("yes please", "no thanks"))
    params = [SamplingParams(max_tokens=8, temperature=0.0, structured_output=choice),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(max_tokens=8, temperature=0.9, seed=1, structured_output=choice)]
    _run(engine, params, [4, 6, 5], shared_prefix=0)
    assert probe.calls["sample_tokens"] > 0, "the constrained steps must have been sampled after their launch"
    _assert_no_reads(probe)
