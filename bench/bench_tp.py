"""Tensor parallelism on the CPU: TP=2 (two gloo ranks, this process and a worker process)
against TP=1 on the same model, and what the SLO abort vote costs per layer, in one run.

    python bench/bench_tp.py [--model builtin|wide] [--repeat 15] [--threads 1] [--device cpu|cuda]
    python bench/bench_tp.py --agreement smollm2-135m --size 3   # greedy tokens at TP=3 against TP=1

Step time: a 128-token prefill step and a 16-sequence decode step, each engine's steps taken in
turns (TP=1, TP=2, TP=1, ...) so drift in the machine's speed weighs on both; medians quoted.
Ratio = TP=1 time / TP=2 time (> 1: TP=2 is faster). On a CPU both ranks share the same cores
and memory bandwidth, so TP=2 cannot win here; the figure is the cost of the collectives (two
all-reduces per layer, one all-gather of the logits, the step shipped to the worker) against
a one-device step. --model wide is a random 4-layer model with a 1024-wide hidden state,
where the GEMMs weigh more than the collectives; builtin is the 256-wide built-in model.

Vote cost: a TP=2 engine under the SLO policy (monitor stopped, no order posted) runs the same
prefill steps with the vote at every layer boundary and without it (its StepAbort detached),
in turns. Per layer: the time rank 0 spends in the vote's all_reduce (timed around each vote;
an upper bound, as it includes waiting for the worker to reach the same boundary), against
the step's time per layer (ratio = vote / layer time); the two step medians are printed too.
The vote runs on the host group (gloo) on either device, so on CUDA it no longer includes
waiting for the device; what an abortable step spends waiting for it is the pacing
(ModelRunner._layer_check, CUDA only), timed apart around each of rank 0's pacing waits, and
the with / without medians hold both.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replica.config import make_engine_config  # noqa: E402
from replica.core.engine import LLMEngine  # noqa: E402
from replica.core.request import SamplingParams  # noqa: E402
from replica.executor.model_runner import ABORT_PACING_LAYERS  # noqa: E402
from replica.model.builtin import ensure_builtin_model  # noqa: E402

PREFILL_TOKENS = 128
DECODE_BATCH = 16


def write_wide_model(model_dir: Path) -> Path:
    """A random Llama, 1024 wide, 16 heads / 8 KV heads, 4 layers, with the built-in tokenizer."""
    from safetensors.torch import save_file

    builtin = ensure_builtin_model()
    model_dir.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(builtin / name, model_dir / name)
    config = json.loads((builtin / "config.json").read_text())
    hidden, heads, kv_heads, head_dim, intermediate, layers = 1024, 16, 8, 64, 2816, 4
    config.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  intermediate_size=intermediate, num_hidden_layers=layers)
    (model_dir / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * 0.02

    weights = {"model.embed_tokens.weight": normal(vocab, hidden), "lm_head.weight": normal(vocab, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for name, shape in {"self_attn.q_proj": (heads * head_dim, hidden),
                            "self_attn.k_proj": (kv_heads * head_dim, hidden),
                            "self_attn.v_proj": (kv_heads * head_dim, hidden),
                            "self_attn.o_proj": (hidden, heads * head_dim), "mlp.gate_proj": (intermediate, hidden),
                            "mlp.up_proj": (intermediate, hidden), "mlp.down_proj": (hidden, intermediate)}.items():
            weights[f"{prefix}.{name}.weight"] = normal(*shape)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(weights, str(model_dir / "model.safetensors"))
    return model_dir


DEVICE = "cpu"


def make_engine(model: str, tensor_parallel_size: int, **overrides) -> LLMEngine:
    config = dict(max_model_len=512, num_kv_blocks=512, max_num_batched_tokens=PREFILL_TOKENS,
                  enable_prefix_caching=False, tensor_parallel_size=tensor_parallel_size, async_scheduling=False)
    config.update(overrides)
    return LLMEngine(make_engine_config(**config), model, device=DEVICE)


class Workload:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.count = 0

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(256) for _ in range(length)]

    def prefill_step(self, engine: LLMEngine) -> float:
        """Time of one step that prefills a fresh PREFILL_TOKENS-token prompt (its first token sampled)."""
        self.count += 1
        request = engine.make_request(f"prefill-{self.count}", self.prompt(PREFILL_TOKENS),
                                      SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        engine.add_request(request, detokenize=False)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    def start_decodes(self, engine: LLMEngine, steps: int) -> None:
        params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
        for index in range(DECODE_BATCH):
            self.count += 1
            engine.add_request(engine.make_request(f"decode-{self.count}", self.prompt(32), params),
                               detokenize=False)
        while any(request.num_output_tokens == 0 for request in engine.scheduler.requests.values()):
            engine.step()

    def decode_step(self, engine: LLMEngine) -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def compare_step_times(model: str, repeat: int) -> dict:
    tp1, tp2 = make_engine(model, 1), make_engine(model, 2)
    workload = Workload(1)
    try:
        for engine in (tp1, tp2):  # warm-up
            workload.prefill_step(engine)
        prefill = {1: [], 2: []}
        for _ in range(repeat):
            for size, engine in ((1, tp1), (2, tp2)):
                prefill[size].append(workload.prefill_step(engine))
        decode = {1: [], 2: []}
        shipped = []  # bytes of staged inputs each TP=2 decode step sent each worker
        for size, engine in ((1, tp1), (2, tp2)):
            workload.start_decodes(engine, repeat)
        for _ in range(repeat):
            for size, engine in ((1, tp1), (2, tp2)):
                decode[size].append(workload.decode_step(engine))
            shipped.append(tp2.runner.staged.last_sent().nbytes)
        for engine in (tp1, tp2):
            while engine.has_unfinished_requests():
                engine.step()
        layers = tp1.model_config.num_hidden_layers
    finally:
        tp2.shutdown()
    return {"prefill": {size: median_ms(times) for size, times in prefill.items()},
            "decode": {size: median_ms(times) for size, times in decode.items()}, "layers": layers,
            "shipped_bytes": statistics.median(shipped), "staged_bytes": tp2.runner.staged.num_bytes}


def vote_cost(model: str, repeat: int) -> dict:
    engine = make_engine(model, 2, scheduling_policy="slo")
    engine.slo_monitor.stop()  # no order is ever posted: every vote answers "go on"
    vote = engine.runner.step_abort
    ballot = vote.ballot
    cast = ballot.cast
    vote_times: list[float] = []

    def timed_cast(ordered: bool, stubborn: bool) -> bool:
        start = time.perf_counter()
        answer = cast(ordered, stubborn)
        vote_times.append(time.perf_counter() - start)
        return answer

    ballot.cast = timed_cast
    wait_for_device = engine.runner._wait_for_device
    pacing_times: list[float] = []

    def timed_wait(event) -> None:
        start = time.perf_counter()
        wait_for_device(event)
        pacing_times.append(time.perf_counter() - start)

    engine.runner._wait_for_device = timed_wait
    workload = Workload(2)
    try:
        workload.prefill_step(engine)
        with_vote, without_vote = [], []
        for _ in range(repeat):
            engine.runner.step_abort = vote
            with_vote.append(workload.prefill_step(engine))
            engine.runner.step_abort = None
            without_vote.append(workload.prefill_step(engine))
        layers = engine.model_config.num_hidden_layers
    finally:
        engine.shutdown()
    step_ms = median_ms(without_vote)
    return {"vote_ms": median_ms(vote_times), "votes": len(vote_times), "layer_ms": step_ms / layers,
            "with_ms": median_ms(with_vote), "without_ms": step_ms, "layers": layers,
            "pacing_ms": median_ms(pacing_times) if pacing_times else None, "pacing_waits": len(pacing_times)}


def agreement(model: str, size: int, num_tokens: int = 16) -> None:
    """Greedy tokens of a few prompts at TP=size against TP=1 on a real model, token by token."""
    from replica.model.registry import resolve_model_path

    model_dir = str(resolve_model_path(model))
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 20000) for _ in range(length)] for length in (12, 40, 90)]
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    outputs = {}
    for tensor_parallel_size in (1, size):
        engine = make_engine(model_dir, tensor_parallel_size, max_num_batched_tokens=32)
        try:
            outputs[tensor_parallel_size] = engine.generate(prompts, params)
        finally:
            engine.shutdown()
    same = sum(a == b for ours, theirs in zip(outputs[size], outputs[1]) for a, b in zip(ours, theirs))
    total = sum(map(len, outputs[1]))
    print(f"{model}: greedy TP={size} = TP=1 on {same}/{total} tokens ({len(prompts)} prompts, chunks of 32)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin", help="builtin | wide | a model directory")
    parser.add_argument("--repeat", type=int, default=15, help="timed steps per engine and workload")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, ranks on cuda:0 and cuda:1)")
    parser.add_argument("--agreement", metavar="MODEL", help="instead: greedy tokens at TP=--size against TP=1")
    parser.add_argument("--size", type=int, default=2, help="--agreement's tensor_parallel_size")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.agreement:
        torch.set_num_threads(args.threads)
        agreement(args.agreement, args.size)
        return
    torch.set_num_threads(args.threads)  # the worker takes the same count
    scratch = None
    model = args.model
    if model == "wide":
        scratch = Path(tempfile.mkdtemp(prefix="bench-tp-"))
        model = str(write_wide_model(scratch / "wide"))
    try:
        steps = compare_step_times(model, args.repeat)
        votes = vote_cost(model, args.repeat)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch)
    backend = "CPU, gloo" if DEVICE == "cpu" else f"{torch.cuda.get_device_name()}, NCCL"
    print(f"model {args.model}, {steps['layers']} layers, {args.threads} thread(s) per rank, {backend}")
    print(f"{'step':<34}{'TP=1 ms':>10}{'TP=2 ms':>10}{'TP=1/TP=2':>11}")
    for name, label in (("prefill", f"prefill, {PREFILL_TOKENS} tokens"), ("decode", f"decode, {DECODE_BATCH} seqs")):
        tp1, tp2 = steps[name][1], steps[name][2]
        print(f"{label:<34}{tp1:>10.2f}{tp2:>10.2f}{tp1 / tp2:>11.2f}")
    print(f"staged inputs a TP=2 decode step ships each worker: {steps['shipped_bytes']:.0f} B of the "
          f"{steps['staged_bytes']} B buffer ({steps['shipped_bytes'] / steps['staged_bytes']:.4f}; the words that "
          f"changed since that buffer was last shipped)")
    print(f"vote per layer (rank 0, {votes['votes']} votes): {votes['vote_ms'] * 1000:.0f} us; "
          f"layer time (TP=2 prefill step / layers): {votes['layer_ms'] * 1000:.0f} us; "
          f"vote / layer = {votes['vote_ms'] / votes['layer_ms']:.3f}")
    pacing = ("none (a CPU: nothing to pace)" if votes["pacing_ms"] is None else
              f"{votes['pacing_ms'] * 1000:.0f} us median over {votes['pacing_waits']} waits")
    print(f"pacing wait per layer (rank 0, the host kept {ABORT_PACING_LAYERS} layers ahead of its device): {pacing}")
    print(f"TP=2 prefill step medians with / without the votes: {votes['with_ms']:.2f} / {votes['without_ms']:.2f} ms "
          f"(their difference is within the noise of a shared machine)")

if __name__ == "__main__":
    main()
