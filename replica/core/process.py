"""The engine-core process: `python -m replica.core.process --fd N[,N...]`, started by the
front (EngineCoreClient) with one end of a socketpair per front (front 0, which started it,
first). It reads a CoreSpec from front 0, builds the engine, answers CoreReady (or
CoreFailed with the error) on every channel and runs EngineCore until front 0 says Shutdown
or goes away.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import logging
import os
import signal
import socket
import sys
from typing import Callable

from replica.config import ConfigError
from replica.model.config import ModelConfigError, ModelLoadError
from replica.text.tokenizer import TokenizerLoadError
from replica.ipc.channel import ChannelClosed, FrameSocket
from replica.ipc.messages import CoreFailed, CoreReady, CoreSpec, error_for_front, load_to_wire


# The collector's young-generation threshold in the engine core and the replica's front. A
# decode step allocates a few objects per running request (the core: its scheduled entry,
# token update, output; the front: its output, response message, coroutine frames) that live
# a step or two; at Python's default of 700, a batch of 256 had them scanned every step.
GC_GEN0_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Once a serving process is built: everything alive now (in the core the model's
    modules, the tokenizer, the block pool, imported code: ~300k objects; in the front grpc's
    and protobuf's modules) lives as long as the process, so it is moved out of the
    collector's reach. A full collection then scans only what serving created since, a
    millisecond or two where it stopped the core's busy loop for ~100 ms and the front's event
    loop for 55-80 ms, and young collections run about once every 20k surviving objects
    instead of every step (vLLM's engine core freezes its startup heap the same way)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def import_callable(path: str) -> Callable:
    """"package.module:attribute" -> the attribute."""
    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def build_engine(spec: CoreSpec):
    if spec.torch_threads is not None:
        import torch

        torch.set_num_threads(spec.torch_threads)
    factory = import_callable(spec.engine_factory)
    return factory(spec.config, spec.model, device=spec.device, dtype=spec.dtype,
                   attention_backend=spec.attention_backend)


# prctl(2)'s option that has the kernel signal this process when its parent dies.
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent, the front `parent_pid`, dies (Linux;
    elsewhere only the channel's EOF ends a serving core); strictly, when the thread that
    started it ends: the front's event loop's, which runs as long as the front. Building the
    engine takes minutes for a large model, reading no channel: a front killed meanwhile
    (SIGKILL, the OOM killer, Ray killing a replica's actor) left the core building, then
    holding its memory and device, for nothing. SIGKILL, as SIGINT and SIGTERM are ignored
    here; a front that died before this ran is no longer this process's parent."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", required=True,
                        help="this end of each front's socketpair, comma-separated, front 0's first")
    parser.add_argument("--parent-pid", type=int, required=True, help="front 0's process: this one dies with it")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    # Ctrl-C in a terminal reaches the whole process group, and a service manager's stop (systemd
    # signals every process of the unit) sends SIGTERM to each; the front decides when the core
    # stops (after its graceful drain, and with several fronts after theirs), so the core must
    # not die first. Front 0 dying takes the core with it (die_with_parent); another front that
    # dies closes its channel, which the core reads.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    fds = [int(fd) for fd in args.fd.split(",")]
    channels = []
    for fd in fds:
        # Not inherited by anything the engine may spawn: a grandchild holding the socket would
        # hide this process's death from the front (it waits for EOF).
        os.set_inheritable(fd, False)
        channels.append(FrameSocket(socket.socket(fileno=fd)))
    channel = channels[0]
    try:
        spec: CoreSpec = channel.recv()
    except ChannelClosed:
        return 1
    try:
        engine = build_engine(spec)
    except (ConfigError, ModelConfigError, ModelLoadError, TokenizerLoadError) as error:
        # A setting the model or the host refuses (max_model_len past the model's, a host KV
        # tier larger than the host's memory), or a checkpoint that cannot be loaded (its
        # message names the file): the front raises it to whoever started the engine, which
        # says it in one line; a traceback here would bury that line.
        _send_all(channels, CoreFailed(error_for_front(error)))
        return 1
    except Exception as error:
        logging.getLogger(__name__).exception("engine core failed to start")
        _send_all(channels, CoreFailed(error_for_front(error)))
        return 1
    engine.prepare_structured_outputs()  # not in the first constrained request's step
    _send_all(channels, CoreReady(engine.config, engine.model_config, tuple(engine.eos_token_ids),
                                  engine.sampling_defaults, str(engine.device), load_to_wire(engine.load())))
    from replica.core.engine_core import EngineCore  # after the engine: its imports are the slow part anyway

    freeze_startup_heap()

    EngineCore(engine, channels).run()
    return 0


def _send_all(channels: list[FrameSocket], message) -> None:
    """Front 0 is waiting for this answer; the others read it when they attach (it waits in
    their socket), or have gone, which is theirs to say."""
    for front, channel in enumerate(channels):
        try:
            channel.send(message)
        except (ChannelClosed, OSError):
            if front == 0:
                raise


if __name__ == "__main__":
    raise SystemExit(main())
