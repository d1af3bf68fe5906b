"""Host time per engine step, on the CPU, with the device's work taken out.

On a GPU with async scheduling the host half of step N+1 (schedule, prepare and launch,
then appending step N's tokens) runs while the device runs step N, so it must stay well
under the device's step (~3 ms at batch 256 on an H100 for a 1.1B Llama; target: ~1 ms of
host work, the runner's launch <= 0.5 ms). This runs the real LLMEngine on the CPU with a
tiny model, async scheduling on and decode batches padded to the CUDA-graph ladder (as
graph replays pad), at a steady decode batch of B requests with ~400-token contexts, and
reports the host time of each phase per step:

  schedule   Scheduler.schedule()
  launch     ModelRunner.launch() less the device's work (the forward pass a graph replay
             replaces, lm_head, the sampler, the inputs' copy): rows, inputs staged, block
             tables, the small torch ops around them
  update     the previous step's tokens to outputs (Scheduler.update: append, stop checks,
             finishing; the CoreOutput rows the engine core sends, or with --detokenize the
             in-process engine's detokenized RequestOutputs)
  other      the rest of LLMEngine.step()
  host       the four above: LLMEngine.step() less the device's work (the budget's figure)
  core       after the step, the engine-core process's send: the step's rows, the load
             snapshot, the KV events, pickling the message (on its send thread, which holds
             the GIL as it pickles); not timed with --detokenize (the core never detokenizes)

By default the timed steps' forward pass returns zeros at once (the model's forward is
replaced on this engine's instance), as a graph replay returns to the host; --forward real
runs it. lm_head, the sampler, the staged inputs' copy and any forward pass are timed
(module hooks, wrappers on this engine's objects) and subtracted: on the CPU they do what a
GPU does on the device, and a GPU host pays only their launches. What stays is Python,
numpy and the dispatch of the few small torch ops around them. A real forward pass streams
the whole KV cache through the CPU's caches, which slows the host path after it (~0.15 ms
at batch 256): the default measures the host path as a GPU host runs it, caches warm.
Medians are the figures to read on a shared machine; means show the interference. Budget:
host ms per step <= 1.0 at batch 256 (launch <= 0.5).

    python bench/bench_host_step.py [--batch-sizes 64,256] [--context 400] [--steps 64]
                                    [--forward null|real] [--gc serving|default] [--profile]
                                    [--detokenize] [--model tiny|builtin|DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pathlib
import pstats
import random
import statistics
import time

import torch

HOST_BUDGET_MS = 1.0  # whole host path per step at batch 256
LAUNCH_BUDGET_MS = 0.5  # the runner's launch (issue 20)
PHASES = ("schedule", "launch", "update", "other", "host", "core")
MAX_NUM_BATCHED_TOKENS = 2048
WARM_STEPS = 4


class DeviceTimer:
    """Seconds spent in what a GPU does on the device and a CPU "device" does on the host:
    the model's forward pass and lm_head (module hooks), the sampler (on the CPU a greedy
    argmax over 256 rows alone takes ~0.15 ms) and the staged inputs' copy (~70 kB that a
    GPU receives by DMA; on the CPU a memcpy into cache-cold memory, ~0.03 ms), the last
    two through wrappers on this engine's objects."""

    def __init__(self, engine):
        self.total_s = 0.0
        self._start = 0.0
        for module in (engine.model, engine.model.lm_head):
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)
        self._time(engine.runner.sampler, "sample")
        self._time(engine.runner.staged, "send")

    def _time(self, owner, name: str) -> None:
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - start

        setattr(owner, name, timed)

    def _enter(self, module, args) -> None:
        self._start = time.perf_counter()

    def _exit(self, module, args, output) -> None:
        self.total_s += time.perf_counter() - self._start


def tiny_model_dir() -> str:
    """The built-in model's tokenizer and config shrunk to one narrow layer (random weights):
    the forward pass is subtracted anyway, a small one keeps the run short and quiet."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from replica.model.registry import resolve_model_path

    source = pathlib.Path(resolve_model_path("builtin"))
    target = pathlib.Path(tempfile.mkdtemp(prefix="headroom-host-step-"))
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32)
    (target / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    hidden, vocab, inter, head_dim = 64, config["vocab_size"], 128, 32
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.layers.0.self_attn.q_proj.weight": (2 * head_dim, hidden),
              "model.layers.0.self_attn.k_proj.weight": (head_dim, hidden),
              "model.layers.0.self_attn.v_proj.weight": (head_dim, hidden),
              "model.layers.0.self_attn.o_proj.weight": (hidden, 2 * head_dim),
              "model.layers.0.mlp.gate_proj.weight": (inter, hidden),
              "model.layers.0.mlp.up_proj.weight": (inter, hidden),
              "model.layers.0.mlp.down_proj.weight": (hidden, inter)}
    weights = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                 "model.norm.weight"):
        weights[name] = torch.ones(hidden)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def max_output_tokens(batch: int, context: int, steps: int) -> int:
    """Enough for every request to decode through the timed steps: prefill admits them over
    several steps (budget 2048 tokens), and the first ones decode that much longer."""
    prefill_steps = -(-batch * context // MAX_NUM_BATCHED_TOKENS)
    return prefill_steps + WARM_STEPS + steps + 8


def make_engine(model_dir: str, batch: int, context: int, steps: int):
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine

    max_model_len = 1024
    blocks_per_request = -(-(context + max_output_tokens(batch, context, steps)) // 16)
    config = make_engine_config(max_model_len=max_model_len, max_num_seqs=batch, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                num_kv_blocks=batch * blocks_per_request + 64, async_scheduling=True)
    engine = LLMEngine(config, model_dir, device="cpu", dtype="float32")
    engine.runner.enable_decode_padding()  # as CUDA graphs pad every decode step
    return engine


def measure(engine, batch: int, context: int, steps: int, detokenize: bool, profile: bool,
            null_forward: bool) -> dict:
    """Per-phase host milliseconds per step (mean and median over `steps` decode steps)."""
    from replica.core.request import SamplingParams

    vocab_size = engine.model_config.vocab_size
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=max_output_tokens(batch, context, steps), temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(f"host-{batch}-{i}", [rng.randrange(3, vocab_size) for _ in range(context)], params)
                for i in range(batch)]
    for request in requests:
        engine.add_request(request, detokenize=detokenize)
    while any(r.num_output_tokens == 0 for r in requests):  # prefill
        engine.step()
        engine.take_kv_events()
    timer = DeviceTimer(engine)
    if null_forward:
        # The decode steps' forward pass returns zeros at once, as a graph replay returns to
        # the host: no attention over 100k cached tokens runs on the CPU to evict the host
        # path's working set from its caches between steps.
        hidden = torch.zeros(max(engine.runner.decode_sizes), engine.model_config.hidden_size)
        engine.model.forward = lambda input_ids, *args, **kwargs: hidden[:input_ids.shape[0]]
    for _ in range(WARM_STEPS):
        engine.step()
        engine.take_kv_events()
    from replica.ipc.channel import encode_frame
    from replica.core.engine_core import EngineCore

    core = EngineCore(engine, channels=None)  # never run: only its per-step send is timed
    core._requests.update((request.request_id, request) for request in requests)
    phases = {name: [] for name in PHASES}
    profiler = cProfile.Profile() if profile else None
    gc.collect()  # what the prefill left; a young collection may still fall in a timed step
    for _ in range(steps):
        device_before = timer.total_s
        if profiler is not None:
            profiler.enable()
        # What the engine core runs (step_rows), or the in-process engine that detokenizes.
        outputs = engine.step() if detokenize else engine.step_rows()
        if profiler is not None:
            profiler.disable()
        core_start = time.perf_counter()
        if not detokenize:
            core._send_outputs(outputs)
            encode_frame(core._outboxes[0].get())
        phases["core"].append(time.perf_counter() - core_start)
        t = engine.last_step
        assert t.num_seqs == batch and t.num_tokens == batch, f"not a full decode step: {t}"
        forward_s = timer.total_s - device_before
        launch_s = t.launch_s - forward_s
        host_s = t.wall_s - t.wait_s - forward_s
        phases["schedule"].append(t.schedule_s)
        phases["launch"].append(launch_s)
        phases["update"].append(t.update_s)
        phases["other"].append(host_s - t.schedule_s - launch_s - t.update_s)
        phases["host"].append(host_s)
    for request in requests:
        engine.abort_request(request.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # drains a step still in flight
    if profiler is not None:
        print(f"\ncProfile of {steps} decode steps at batch {batch} (device work included; by own time):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return {name: dict(mean_ms=1000 * statistics.fmean(values), median_ms=1000 * statistics.median(values))
            for name, values in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="tiny (default: the built-in model cut to one narrow layer), builtin, or a directory")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--context", type=int, default=400, help="prompt tokens per request (default 400)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size (default 64)")
    parser.add_argument("--detokenize", action="store_true",
                        help="detokenize in the engine (the serving core leaves it to the front)")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed steps and print the top functions")
    parser.add_argument("--forward", choices=("null", "real"), default="null",
                        help="null (default): timed decode steps skip the model's forward pass; real: they "
                             "run it on the CPU (timed and subtracted, but its memory traffic slows the host "
                             "path after it)")
    parser.add_argument("--gc", choices=("serving", "default"), default="serving",
                        help="serving (default): the collector as the engine-core process sets it once the "
                             "engine is built (startup heap frozen, young threshold 20k); default: Python's")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: a GPU host computes nothing, and idle OpenMP "
                             "workers waking up would be timed as host work)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from replica.model.registry import resolve_model_path

    model_dir = tiny_model_dir() if args.model == "tiny" else str(resolve_model_path(args.model))
    print(f"model={args.model} context={args.context} steps={args.steps} detokenize={args.detokenize} "
          f"torch threads={torch.get_num_threads()}; host ms per decode step, device work excluded (mean / median)")
    print(f"{'batch':>6} " + " ".join(f"{name:>15}" for name in PHASES))
    results = {}
    for batch in (int(size) for size in args.batch_sizes.split(",")):
        engine = make_engine(model_dir, batch, args.context, args.steps)
        if args.gc == "serving":
            from replica.core.process import freeze_startup_heap

            freeze_startup_heap()
        try:
            result = results[batch] = measure(engine, batch, args.context, args.steps, args.detokenize, args.profile,
                                              args.forward == "null")
        finally:
            engine.shutdown()
        print(f"{batch:>6} " + " ".join(f"{result[name]['mean_ms']:>7.3f} / {result[name]['median_ms']:<5.3f}"
                                         for name in PHASES))
    if 256 in results:
        host, launch = results[256]["host"]["mean_ms"], results[256]["launch"]["mean_ms"]
        print(f"batch 256: host {host:.3f} ms / budget {HOST_BUDGET_MS} ms = {host / HOST_BUDGET_MS:.2f}x "
              f"({'MET' if host <= HOST_BUDGET_MS else 'MISSED'}); launch {launch:.3f} ms / {LAUNCH_BUDGET_MS} ms = "
              f"{launch / LAUNCH_BUDGET_MS:.2f}x ({'MET' if launch <= LAUNCH_BUDGET_MS else 'MISSED'})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
