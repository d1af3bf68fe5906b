"""Serving at engine speed: the offline LLMEngine loop against the same engine served by
`headroom replica` (its front and its engine-core process) to a gRPC client in another
process (this one), on the same workloads in one run; prints served / offline.

    python bench/bench_served.py [--workloads 64x128,200x64,256x128] [--core-torch-threads N]
                                 [--model builtin|DIR] [--device cpu|cuda] [--dtype D] [--num-kv-blocks N]
                                 [--emulated-device] [--repeat N] [--stream-interval N[,N...]]
                                 [--api-server-count N[,N...]] [--client-processes N]

Engine: built-in model on the CPU by default, max_model_len 1024, 4,096 blocks, max_num_seqs
256, budget 2048 (bench/bench_gpu.py runs it on a GPU with a 1.1B checkpoint).
Prompts of 32-256 tokens from a fixed seed, greedy with ignore_eos; every stream starts at
once. Targets: served / offline >= 0.9 at 64, 200 and 256 streams; served ITL p99 <= 2x the
offline step time's p99 at 64 streams. Offline runs first, in this process, then the server
starts, so the two never share the CPU.

--emulated-device runs both engines on bench/emulated_device.py's device (CPU only): the
forward pass returns zeros at once and each step's tokens are ready a modelled GPU step time
after its launch (async scheduling on, decode steps padded as graph replays pad), so the
offline loop runs at a GPU's step rate and the served path's own costs (the front, the
channel, the core's loop, the client) show as they would beside a GPU; one torch thread each.
--repeat N runs each workload N times on each side (prompts from seeds 0..N-1, so no served
run hits the prefix cache of an earlier one) and reports the median throughput: a served run
can lose a lot to one unlucky pause, so single runs are noisy.
--stream-interval N starts the replica with `--stream-interval N` (EngineConfig.stream_interval:
the first token of a stream at once, then messages of N tokens); the offline loop has no
messages. The served ITL is then between tokens as the client reads them: 0 within a message.
A comma list (--stream-interval 1,4) serves every workload at each interval, a replica each,
against one offline run: rows labelled @N.
The "CPU ratio" column is the offline engine's CPU seconds over the served side's (core +
front + client): the comparison that holds when other load moves the wall ratio.
--api-server-count N serves from N front processes (`headroom replica --api-server-count N`:
one engine core, N gRPC fronts on one port); the client opens CONNECTIONS_PER_FRONT
connections to each (checked in /proc, bench/fronts.py: the kernel picks the front of a new
connection) and deals its streams over the fronts in turn. The "front" CPU is all fronts'.
A comma list (1,2) serves every workload with each count, a replica each (with a list of
stream intervals too, every pair), against the one offline run: rows labelled /Nf.
--client-processes N splits the client over N processes (stream i in process i mod N; their
CPU is the client's): at a GPU's token rate one asyncio client reading every message is a
bound of its own (an H200 host, 2026-11-29: 0.45 client CPU s in a 0.37 s run).
--grpc-floor also runs a bare grpc.aio Generate server (no engine: it writes a one-token
GenerateResponse per stream each tick, the tick the served run's ITL p50) to this script's
client, and prints the CPU per message of that server and client beside the front's and the
served run's client: the part of the served side's CPU that is gRPC's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ is a namespace package there
from bench.fronts import channels_per_front, engine_core_pid, front_pids  # noqa: E402
from cluster.stats import percentile  # noqa: E402
from protos import headroom_pb2 as pb
from protos import headroom_pb2_grpc as pb_grpc

ENGINE = dict(max_model_len=1024, num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=2048)
THROUGHPUT_TARGET = 0.9
ITL_TARGET_STEPS = 2.0
TARGET_STREAMS = (64, 200, 256)
VOCAB = 256  # the built-in model's byte tokens
# With several fronts, the client's connections to each (the streams are dealt over them).
CONNECTIONS_PER_FRONT = 2
REPO = pathlib.Path(__file__).resolve().parent.parent


@dataclass
class Result:
    tokens_per_s: float
    itl_ms: list[float]  # served: between responses of a stream; offline: step times
    cpu_s: dict[str, float]  # CPU seconds per process over the timed part
    messages: int = 0  # served: Generate responses the client read


def combine(results: list[Result]) -> tuple[Result, list[float]]:
    """Repeated runs as one: the median throughput, every ITL, mean CPU seconds; and each run's rate."""
    rates = [result.tokens_per_s for result in results]
    return Result(statistics.median(rates), [ms for result in results for ms in result.itl_ms],
                  {name: statistics.fmean(result.cpu_s[name] for result in results) for name in results[0].cpu_s},
                  round(statistics.fmean(result.messages for result in results))), rates


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workload(num_streams: int, seed: int = 0) -> list[list[int]]:
    # Seeded by the stream count too: 256 streams' first 64 prompts would otherwise be 64
    # streams' run of the same seed, found in the prefix cache of both sides.
    rng = random.Random(num_streams * 1_000_003 + seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(32, 256))] for _ in range(num_streams)]


def build_offline_engine(model: str, device: str, dtype: str | None, emulated_device: bool = False):
    """One engine for every offline run, as one replica serves every served run."""
    from replica.config import make_engine_config
    from replica.core.engine import LLMEngine
    from replica.core.request import SamplingParams

    engine = LLMEngine(make_engine_config(**ENGINE), model, device=device, dtype=dtype)
    if emulated_device:
        from bench.emulated_device import device_model, emulate_device  # main() put the repository on the path

        emulate_device(engine, *device_model())
    engine.generate([workload(1)[0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    return engine


def run_offline(engine, prompts: list[list[int]], max_tokens: int, run: int) -> Result:
    from replica.core.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    step_ms = []
    cpu_start = time.process_time()
    start = time.perf_counter()  # from the first request's arrival, as the served side's clock
    for index, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(f"offline-{run}-{index}", prompt, params), detokenize=False)
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - step_start) * 1000)
    elapsed = time.perf_counter() - start
    cpu_s = {"engine": time.process_time() - cpu_start}
    engine.take_kv_events()  # nobody subscribes offline
    return Result(len(prompts) * max_tokens / elapsed, step_ms, cpu_s)


def release_device_memory(device: str) -> None:
    """The offline engine's device memory back to the driver before the replica starts."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def start_replica(core_torch_threads: int | None, model: str, device: str,
                  dtype: str | None, emulated_device: bool = False,
                  stream_interval: int | None = None, fronts: int = 1) -> tuple[subprocess.Popen, str]:
    flags = [(f"--{name.replace('_', '-')}" if value is True else f"--{name.replace('_', '-')}={value}")
             for name, value in ENGINE.items()]
    if emulated_device:
        flags.append("--engine-factory=bench.emulated_device:emulated_device_engine")
    if core_torch_threads is not None:
        flags.append(f"--torch-threads={core_torch_threads}")
    if dtype is not None:
        flags.append(f"--dtype={dtype}")
    if stream_interval is not None:
        flags.append(f"--stream-interval={stream_interval}")
    if fronts > 1:
        flags.append(f"--api-server-count={fronts}")
    # The replica's default model is the real one, so name the offline loop's.
    # Its own session: a replica stuck in shutdown is killed whole (core, fronts), not its first process.
    process = subprocess.Popen([sys.executable, "-m", "cluster.cli", "replica", "--model", model, "--port", "0",
                                "--device", device, *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))})
    for line in process.stdout:
        if match := re.match(r"listening on (\S+)", line):
            return process, match.group(1)
    raise RuntimeError("headroom replica exited before it listened")


def cpu_meter(pids: dict[str, int | list[int]]) -> Callable[[], dict[str, float]]:
    """Starts counting the CPU seconds of each named process (a list, as the fronts, as its sum,
    and with several members each one too: name0, name1, ...); the returned call says how many
    each has used since."""
    processes = dict(pids)
    for name, group in pids.items():
        if isinstance(group, list) and len(group) > 1:
            processes.update((f"{name}{index}", pid) for index, pid in enumerate(group))
    before = {name: process_cpu_seconds(pid) for name, pid in processes.items()}
    return lambda: {name: process_cpu_seconds(pid) - before[name] for name, pid in processes.items()}


def served_result(per_stream: list[list[float]], start: float, cpu_s: dict[str, float], messages: int) -> Result:
    elapsed = max(times[-1] for times in per_stream) - start
    itl_ms = [(later - earlier) * 1000 for times in per_stream for earlier, later in zip(times, times[1:])]
    return Result(sum(map(len, per_stream)) / elapsed, itl_ms, cpu_s, messages)


async def open_channels(address: str, fronts: int | list[int]) -> list[grpc.aio.Channel]:
    """One channel, or with several fronts CONNECTIONS_PER_FRONT to each, in the fronts' turn."""
    if isinstance(fronts, list) and len(fronts) > 1:
        by_front = await channels_per_front(address, fronts, CONNECTIONS_PER_FRONT)
        return [by_front[front][round_] for round_ in range(CONNECTIONS_PER_FRONT) for front in range(len(fronts))]
    return [grpc.aio.insecure_channel(address)]


async def run_streams(stubs: list, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[float]], int]:
    """Every prompt a Generate stream at once, dealt over the stubs; each stream's token
    arrival times (perf_counter: one clock for every process here) and the messages read."""
    messages = 0

    async def stream(index: int, prompt: list[int]) -> list[float]:
        nonlocal messages
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        times = []
        async for response in stubs[index % len(stubs)].Generate(request):
            times += [time.perf_counter()] * len(response.token_ids)
            messages += 1
        assert len(times) == max_tokens, len(times)
        return times

    per_stream = await asyncio.gather(*(stream(index, prompt) for index, prompt in enumerate(prompts)))
    return per_stream, messages


def client_worker(conn, address: str, fronts: int | list[int], prompts: list[list[int]], max_tokens: int) -> None:
    """A client process of --client-processes: opens its channels and warms up, says "ready",
    runs its streams on "go", and sends back their arrival times and its message count; a
    failure is sent back as its message (a string) instead."""

    async def work():
        channels = await open_channels(address, fronts)
        try:
            stubs = [pb_grpc.GenerationStub(channel) for channel in channels]
            await run_streams(stubs, [prompt[:16] for prompt in prompts[:4]], max_tokens)  # warm-up
            conn.send("ready")
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            conn.send(await run_streams(stubs, prompts, max_tokens))
        finally:
            for channel in channels:
                await channel.close()

    try:
        asyncio.run(work())
    except BaseException as error:  # noqa: BLE001 (the parent raises it)
        conn.send(f"{type(error).__name__}: {error}")
        raise


def run_served_processes(address: str, pids: dict[str, int | list[int]], prompts: list[list[int]],
                         max_tokens: int, processes: int) -> Result:
    """run_served with the client split over `processes` processes (stream i in process
    i mod N): one asyncio client reading ~50k messages a second is a bound of its own on a
    GPU's host. They connect one at a time (bench/fronts.py tells a front's connections by
    counting them in /proc), then start together; their CPU is the client's."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    workers, conns = [], []

    def receive(index: int, timeout_s: float):
        """Worker `index`'s next message; RuntimeError if it failed, died or said nothing in time
        (the parent holds no child end, so a dead worker's pipe reads EOF at once)."""
        try:
            message = conns[index].recv() if conns[index].poll(timeout_s) else None
        except EOFError:
            message = None
        if message is None or (isinstance(message, str) and message != "ready"):
            raise RuntimeError(f"client process {index}: {message or 'no answer (exit code %s)' % workers[index].exitcode}")
        return message

    try:
        for index in range(processes):
            parent_end, child_end = context.Pipe()
            worker = context.Process(target=client_worker, daemon=True, args=(
                child_end, address, pids.get("front"), prompts[index::processes], max_tokens))
            worker.start()
            child_end.close()
            workers.append(worker)
            conns.append(parent_end)
            receive(index, 120)  # "ready": connected and warmed up
        cpu_used = cpu_meter({**pids, "client": [worker.pid for worker in workers]})
        start = time.perf_counter()
        for conn in conns:
            conn.send("go")
        results = [receive(index, 600) for index in range(processes)]
        cpu_s = cpu_used()
    finally:
        for conn in conns:  # a worker still waiting for "go" reads EOF and ends
            conn.close()
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    return served_result([times for streams, _ in results for times in streams], start, cpu_s,
                         sum(messages for _, messages in results))


async def run_served(address: str, pids: dict[str, int | list[int]], prompts: list[list[int]],
                     max_tokens: int) -> Result:
    """pids: the processes whose CPU is counted, by name; a list (the fronts) counts as one.
    With several fronts, the streams are spread evenly over them: CONNECTIONS_PER_FRONT
    connections to each, the streams dealt round-robin over the fronts."""
    channels = await open_channels(address, pids.get("front"))
    stubs = [pb_grpc.GenerationStub(channel) for channel in channels]
    try:
        await run_streams(stubs, [prompt[:16] for prompt in prompts[:8]], max_tokens)  # warm-up
        cpu_used = cpu_meter(pids)
        start = time.perf_counter()
        per_stream, messages = await run_streams(stubs, prompts, max_tokens)
        cpu_s = cpu_used()
    finally:
        for channel in channels:
            await channel.close()
    return served_result(per_stream, start, cpu_s, messages)


def serve_once(address: str, pids: dict[str, int | list[int]], prompts: list[list[int]], max_tokens: int,
               client_processes: int) -> Result:
    if client_processes > 1:
        return run_served_processes(address, pids, prompts, max_tokens, client_processes)
    return asyncio.run(run_served(address, pids, prompts, max_tokens))


def process_cpu_seconds(pids: int | list[int]) -> float:
    return sum(map(cpu_seconds, pids)) if isinstance(pids, list) else cpu_seconds(pids)


class _FloorServicer(pb_grpc.GenerationServicer):
    """Generate without an engine: one one-token response per stream per tick, as a step
    whose writers keep up sends them."""

    def __init__(self):
        self.tick = asyncio.Event()

    async def Generate(self, request, context):
        count = request.sampling.max_tokens
        for index in range(count):
            await self.tick.wait()
            await context.write(pb.GenerateResponse(
                request_id=request.request_id, token_ids=[index % VOCAB], text="x",
                finish_reason=pb.FINISH_REASON_LENGTH if index == count - 1 else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=index + 1),
                replica_id="replica-0"))


async def serve_grpc_floor(tick_s: float) -> None:
    server = grpc.aio.server()
    servicer = _FloorServicer()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    while True:
        await asyncio.sleep(tick_s)
        ticked, servicer.tick = servicer.tick, asyncio.Event()
        ticked.set()


def run_grpc_floor(prompts: list[list[int]], max_tokens: int, tick_s: float) -> Result:
    process = subprocess.Popen([sys.executable, __file__, "--serve-grpc-floor", str(tick_s)],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))})
    try:
        address = re.match(r"listening on (\S+)", process.stdout.readline()).group(1)
        return asyncio.run(run_served(address, {"server": process.pid, "client": os.getpid()}, prompts, max_tokens))
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="64x128,200x64,256x128", help="STREAMSxTOKENS, comma-separated")
    parser.add_argument("--core-torch-threads", type=int, default=None,
                        help="torch intra-op threads in the engine core (default: torch's)")
    parser.add_argument("--model", default="builtin", help="builtin or a checkpoint directory (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device of both engines (default: %(default)s)")
    parser.add_argument("--dtype", default=None, help="model dtype, e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--num-kv-blocks", type=int, default=ENGINE["num_kv_blocks"],
                        help="KV pool of both engines (default: %(default)s)")
    parser.add_argument("--emulated-device", action="store_true",
                        help="both engines on bench/emulated_device.py's device: a GPU's step rate on the CPU")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per workload and side, fresh prompts each; the median is reported (default 1)")
    parser.add_argument("--grpc-floor", action="store_true",
                        help="also time a bare grpc.aio server writing the same messages (gRPC's own CPU)")
    parser.add_argument("--stream-interval", default=None,
                        help="the replica's stream_interval: tokens per message after a stream's first; a "
                             "comma list (1,4) serves each workload at each, beside one offline run "
                             "(default: the replica's, 1)")
    parser.add_argument("--api-server-count", default="1",
                        help="the replica's front processes (`headroom replica --api-server-count`); the client "
                             "spreads its streams evenly over them; a comma list serves each (default: %(default)s)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes the streams are split over (stream i in process i mod N); one "
                             "asyncio client is a bound of its own at a GPU's token rate (default: %(default)s)")
    parser.add_argument("--serve-grpc-floor", type=float, default=None, help=argparse.SUPPRESS)  # tick, s
    args = parser.parse_args()
    if args.serve_grpc_floor is not None:
        asyncio.run(serve_grpc_floor(args.serve_grpc_floor))
        return
    if args.client_processes < 1:
        parser.error(f"--client-processes: at least 1, not {args.client_processes}")
    if args.grpc_floor and args.client_processes > 1:  # the floor's client is one process
        parser.error("--grpc-floor compares one client process with another: leave --client-processes at 1")
    ENGINE["num_kv_blocks"] = args.num_kv_blocks
    if args.emulated_device:
        if args.device != "cpu":
            parser.error("--emulated-device runs on the CPU")
        ENGINE["async_scheduling"] = True
        args.core_torch_threads = 1
        from bench.emulated_device import device_model

        emulated_device_ms = " + ".join(map(str, device_model()))
        import torch

        torch.set_num_threads(1)
    workloads = [tuple(int(part) for part in item.split("x")) for item in args.workloads.split(",")]
    try:
        intervals = [None] if args.stream_interval is None else [int(item) for item in args.stream_interval.split(",")]
    except ValueError:
        parser.error(f"--stream-interval: integers, comma-separated, not {args.stream_interval!r}")
    try:
        front_counts = [int(item) for item in args.api_server_count.split(",")]
    except ValueError:
        parser.error(f"--api-server-count: integers, comma-separated, not {args.api_server_count!r}")
    setups = [(interval, fronts) for interval in intervals for fronts in front_counts]

    seeds = range(args.repeat)
    engine = build_offline_engine(args.model, args.device, args.dtype, args.emulated_device)
    runs = iter(range(len(workloads) * args.repeat))
    offline = {key: combine([run_offline(engine, workload(key[0], seed), key[1], next(runs)) for seed in seeds])
               for key in workloads}
    engine.shutdown()
    del engine
    release_device_memory(args.device)
    # The client is part of what is measured: what the offline engines left in this process
    # (torch, the model's modules) would make each full collection stop its reads for tens of
    # ms, so its heap is frozen as the replica's processes freeze theirs.
    import gc

    gc.collect()
    gc.freeze()
    served_at = {}  # by (stream interval, fronts): each a replica of its own, beside the one offline run
    failed = {}  # setups that did not serve: named in the targets line, and the exit status is 1
    for interval, fronts in setups:
        # One setup failing (a replica that does not start, a stuck shutdown) keeps the others'
        # figures; each setup's ratios are printed as it ends ("partial:"), so a run cut at a
        # time limit keeps those too.
        try:
            process, address = start_replica(args.core_torch_threads, args.model, args.device, args.dtype,
                                             args.emulated_device, interval, fronts)
            try:
                pids = {"core": engine_core_pid(process.pid), "front": front_pids(process.pid), "client": os.getpid()}
                served_at[interval, fronts] = {key: combine([serve_once(address, pids, workload(key[0], seed), key[1],
                                                                        args.client_processes)
                                                             for seed in seeds]) for key in workloads}
            finally:
                process.send_signal(2)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        except Exception as error:  # noqa: BLE001 - reported, and the other setups still run
            failed[interval, fronts] = f"{type(error).__name__}: {error}"
            print(f"partial:{'' if interval is None else f' interval {interval},'} {fronts} fronts: FAILED "
                  f"{failed[interval, fronts]}", flush=True)
            continue
        for key in workloads:
            rate = served_at[interval, fronts][key][0].tokens_per_s
            print(f"partial: {key[0]} x {key[1]},{'' if interval is None else f' interval {interval},'} {fronts} fronts: "
                  "served/offline "
                  f"{rate / offline[key][0].tokens_per_s:.2f} ({rate:.0f} / {offline[key][0].tokens_per_s:.0f} tok/s)",
                  flush=True)
    setups = [setup for setup in setups if setup in served_at]
    if not setups:
        sys.exit("bench_served: no setup served")
    served = served_at[setups[0]]

    import torch

    print(f"{args.model} model, {args.device}, {args.dtype or 'checkpoint dtype'}, {os.cpu_count()} cores, torch threads: offline {torch.get_num_threads()}, "
          f"core {args.core_torch_threads or 'default'}; engine {ENGINE}"
          + (f"; emulated device: {emulated_device_ms} ms per step + per token" if args.emulated_device else "")
          + (f"; stream interval {args.stream_interval}" if args.stream_interval is not None else "")
          + (f"; fronts {args.api_server_count} ({CONNECTIONS_PER_FRONT} connections each)"
             if front_counts != [1] else "")
          + (f"; {args.client_processes} client processes" if args.client_processes > 1 else "")
          + (f"; median of {args.repeat} runs" if args.repeat > 1 else ""))
    print(f"{'streams x tokens':>17}{'offline tok/s':>15}{'served tok/s':>14}{'served/offline':>16}"
          f"{'step p50/p99 ms':>17}{'served ITL p50/p99 ms':>23}{'tokens/msg':>11}{'CPU ratio':>10}"
          f"   CPU s: offline engine | core, front, client")
    verdicts = []
    for (interval, fronts), key in ((setup, key) for setup in setups for key in workloads):
        (ours, served_rates), (base, _) = served_at[interval, fronts][key], offline[key]
        label = (f" @{interval}" if len(intervals) > 1 else "") + (f" /{fronts}f" if len(front_counts) > 1 else "")
        at = ((f" at interval {interval}" if len(intervals) > 1 else "")
              + (f" with {fronts} fronts" if len(front_counts) > 1 else ""))
        ratio = ours.tokens_per_s / base.tokens_per_s
        step_p99 = percentile(base.itl_ms, 0.99)
        itl_p99 = percentile(ours.itl_ms, 0.99)
        print(f"{f'{key[0]} x {key[1]}' + label:>17}{base.tokens_per_s:>15.0f}{ours.tokens_per_s:>14.0f}{ratio:>16.2f}"
              f"{f'{percentile(base.itl_ms, 0.5):.0f} / {step_p99:.0f}':>17}"
              f"{f'{percentile(ours.itl_ms, 0.5):.0f} / {itl_p99:.0f}':>23}"
              f"{key[0] * key[1] / max(ours.messages, 1):>11.1f}"
              f"{base.cpu_s['engine'] / max(sum(ours.cpu_s[name] for name in ('core', 'front', 'client')), 1e-9):>10.2f}"
              f"   {base.cpu_s['engine']:.2f} | "
              + ", ".join(f"{ours.cpu_s[name]:.2f}" for name in ("core", "front", "client"))
              + (" (fronts " + " + ".join(f"{ours.cpu_s['front' + str(index)]:.2f}" for index in range(fronts)) + ")"
                 if fronts > 1 else "")
              + (f"   runs served/offline: {' '.join(f'{rate / base.tokens_per_s:.2f}' for rate in served_rates)}"
                 if args.repeat > 1 else ""))
        if key[0] in TARGET_STREAMS:
            verdicts.append(f"served/offline at {key[0]} streams{at} {ratio:.2f} (>= {THROUGHPUT_TARGET}: "
                            f"{'MET' if ratio >= THROUGHPUT_TARGET else 'MISSED'})")
        if key[0] == 64:
            verdicts.append(f"ITL p99 at 64 streams{at} {itl_p99:.0f} ms vs 2x step p99 {ITL_TARGET_STEPS * step_p99:.0f} ms "
                            f"({'MET' if itl_p99 <= ITL_TARGET_STEPS * step_p99 else 'MISSED'})")
    verdicts += [f"{'' if interval is None else f'interval {interval}, '}{fronts} fronts: FAILED ({why})"
                 for (interval, fronts), why in failed.items()]
    print("targets: " + "; ".join(verdicts))
    if args.grpc_floor:
        print("gRPC's own CPU: a bare grpc.aio server writing the same messages at the served ITL p50, to this client")
        for key in workloads:
            (ours, _), (base, _) = served[key], offline[key]
            floor = run_grpc_floor(workload(key[0]), key[1], percentile(ours.itl_ms, 0.5) / 1000)
            per_message = lambda cpu_s, result: f"{cpu_s / max(result.messages, 1) * 1e6:.0f}"
            bound = base.cpu_s["engine"] / (ours.cpu_s["core"] + floor.cpu_s["server"] + floor.cpu_s["client"])
            print(f"{f'{key[0]} x {key[1]}':>17}   CPU us per message: front {per_message(ours.cpu_s['front'], ours)}"
                  f" vs bare server {per_message(floor.cpu_s['server'], floor)} "
                  f"({ours.cpu_s['front'] / max(floor.cpu_s['server'], 1e-9):.2f}x); served client "
                  f"{per_message(ours.cpu_s['client'], ours)} vs {per_message(floor.cpu_s['client'], floor)}; "
                  f"served/offline if the front cost only gRPC's CPU (offline CPU / core + bare server + client): "
                  f"{bound:.2f}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
