"""CUDA's runtime played on a CPU, so the replica's CUDA-only host branches run in CI.

`emulate_cuda_runtime(monkeypatch)` makes `replica.executor.cuda_runtime.on_cuda` say yes for the
CPU and stands in for the torch.cuda calls those branches make: events, streams, set_device,
synchronize, cudart's host registration, and CUDA graphs. The kernels stay what the CPU runs
(Triton's interpreter for the GPU's kernels: import attention_harness first).

The graph stand-in keeps what makes a CUDA graph a CUDA graph. A capture records the device
work of the code under it, op by op: every aten op (a TorchDispatchMode), collective and
Triton launch, with the very tensors and Python scalars they were given. A replay runs those
again on those tensors, writing each op's result into the tensor its capture made (the graph's
pool), and runs no Python: a pass whose inputs are refilled in place replays right; one whose
Python picks values at each call (a scalar, a tile, a fresh buffer put in an attribute)
replays what the capture saw, as the GPU would. A host read during a capture (`.item()`,
`int()` or `bool()` of a tensor, a nonzero) raises, as CUDA's capture does; `.tolist()` and
`.numpy()` read CPU memory without the dispatcher and pass unseen (test_step_host_reads.py's
TorchFunctionMode probes every such read in a step's launch).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
import triton.runtime.interpreter as triton_interpreter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from replica.executor import cuda_runtime
from replica.parallel.group import TensorParallel

# aten ops that read a device value on the host: refused inside a capture, as CUDA refuses a
# synchronizing call in a capturing stream.
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.is_nonzero.default}


class HostReadDuringCapture(RuntimeError):
    pass


@dataclass
class RuntimeCounts:
    """What the emulated runtime was asked for: the probes that the CUDA branches really ran."""

    events_recorded: int = 0
    events_synchronized: int = 0
    stream_waits: int = 0
    host_registrations: int = 0
    captures: list = field(default_factory=list)  # ops recorded per captured graph, in order
    replays: int = 0
    memory_profiles: int = 0


class _Event:
    _counts: RuntimeCounts  # each emulation's subclass sets its own

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.synchronized = 0

    def record(self, stream=None) -> None:
        self._counts.events_recorded += 1

    def synchronize(self) -> None:
        self.synchronized += 1
        self._counts.events_synchronized += 1

    def wait(self, stream=None) -> None:
        self._counts.stream_waits += 1

    def query(self) -> bool:
        return True


class _Stream:
    _counts: RuntimeCounts

    def __init__(self, device=None, priority: int = 0):
        pass

    def wait_event(self, event) -> None:
        self._counts.stream_waits += 1

    def wait_stream(self, stream) -> None:
        self._counts.stream_waits += 1

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else torch.cuda.Event()
        event.record(self)
        return event


class _Cudart:
    def __init__(self, counts: RuntimeCounts):
        self._counts = counts

    def cudaHostRegister(self, pointer: int, length: int, flags: int) -> int:
        self._counts.host_registrations += 1
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:
        return 0


@dataclass
class _Recorded:
    run: Callable[[], Any]  # the op again, on the same arguments
    output: Any  # what its capture returned
    kind: str = "aten"  # or "triton" (a kernel launch), "collective" (tensor parallelism's)


def _write_back(captured: Any, replayed: Any) -> None:
    """A replayed op's results into the tensors its capture returned (the graph's memory)."""
    for old, new in zip(tree_leaves(captured), tree_leaves(replayed)):
        if not isinstance(old, torch.Tensor) or old is new:
            continue
        if (old.untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
                and old.storage_offset() == new.storage_offset() and old.stride() == new.stride()):
            continue  # a view of the same memory (or an in-place op's own input)
        old.copy_(new)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[_Recorded]):
        super().__init__()
        self.ops = ops
        self.paused = 0  # inside a Triton launch: its own host work is not device work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and func in _HOST_READS:
            raise HostReadDuringCapture(f"{func} read a device value on the host during a CUDA-graph capture")
        output = func(*args, **kwargs)
        if not self.paused:
            self.ops.append(_Recorded(lambda: func(*args, **kwargs), output))
        return output


class _Graph:
    _counts: RuntimeCounts

    def __init__(self, keep_graph: bool = False):
        self.ops: list[_Recorded] = []

    def pool(self) -> object:
        return self

    def replay(self) -> None:
        self._counts.replays += 1
        for op in self.ops:
            _write_back(op.output, op.run())


class _GraphCapture:
    """torch.cuda.graph(graph, pool=..., stream=..., capture_error_mode=...)."""

    _counts: RuntimeCounts

    def __init__(self, graph: _Graph, pool=None, stream=None, capture_error_mode: str = "global"):
        self._graph = graph
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        recorder = _Recorder(self._graph.ops)
        launch = triton_interpreter.GridExecutor.__call__

        def recording_launch(executor, *args, **kwargs):
            recorder.paused += 1
            try:
                output = launch(executor, *args, **kwargs)
            finally:
                recorder.paused -= 1
            self._graph.ops.append(_Recorded(lambda: launch(executor, *args, **kwargs), None, "triton"))
            return output

        # A tensor-parallel collective: the group is the backend itself (ProcessGroupGloo /
        # ProcessGroupNCCL), whose calls bypass the dispatcher; a CUDA capture records NCCL's
        # kernels all the same, so this records each as the rank ran it (TensorParallel._run).
        collective = TensorParallel._run

        def recording_collective(tp, name, start):
            collective(tp, name, start)
            self._graph.ops.append(_Recorded(lambda: collective(tp, name, start), None, "collective"))

        self._stack.enter_context(_patched(triton_interpreter.GridExecutor, "__call__", recording_launch))
        self._stack.enter_context(_patched(TensorParallel, "_run", recording_collective))
        self._stack.enter_context(recorder)
        return self._graph

    def __exit__(self, *exc) -> bool:
        self._stack.close()
        if exc[0] is None:
            self._counts.captures.append(len(self._graph.ops))
        return False


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def emulate_cuda_runtime(monkeypatch, device_memory_bytes: int = 2**30) -> RuntimeCounts:
    """Until `monkeypatch` undoes it, the CPU runs the replica's CUDA runtime branches. The
    caching allocator reports a device of `device_memory_bytes`, all free, nothing allocated (a
    profiling run under gpu_memory_utilization then gives the KV pool that fraction of it)."""
    counts = RuntimeCounts()
    # Classes, as torch's are (code annotates with them: `torch.cuda.CUDAGraph | None`), each
    # counting into this emulation's counts.
    event, stream_type, graph, capture = (type(base.__name__.lstrip("_"), (base,), {"_counts": counts})
                                          for base in (_Event, _Stream, _Graph, _GraphCapture))
    stream = stream_type()
    monkeypatch.setattr(cuda_runtime, "on_cuda", lambda device: True)
    monkeypatch.setattr(cuda_runtime, "pins_host_memory", lambda device: False)  # no pinned allocator here
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "Stream", stream_type)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext(stream))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(counts))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)

    def mem_get_info(device=None) -> tuple[int, int]:
        counts.memory_profiles += 1
        return device_memory_bytes, device_memory_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return counts


def emulate_gpu_replica(monkeypatch, device_memory_bytes: int = 2**30) -> RuntimeCounts:
    """emulate_cuda_runtime, and attention backend "auto" picks the GPU's (Triton, interpreted):
    an engine built with defaults then takes the GPU's whole path, CUDA graphs included (the
    torch backend reads lengths on the host, so no graph holds it). For bench_gpu.py
    --cpu-smoke --emulate-cuda; tests name their backend."""
    import replica.model.loader as loader
    from replica.attention import get_attention_backend

    counts = emulate_cuda_runtime(monkeypatch, device_memory_bytes)
    monkeypatch.setattr(loader, "get_attention_backend",
                        lambda name, device: get_attention_backend("triton" if name == "auto" else name, device))
    return counts


def emulated_worker_main(spec, connection, board) -> None:
    """A tensor-parallel worker process (spawned: the test's patches do not reach it) under the
    emulated runtime, as rank 0 is: put this in executor.worker_main's place."""
    import attention_harness  # noqa: F401  (the interpreter's fixes, in this process too)
    from replica.parallel import executor

    emulate_gpu_replica(pytest.MonkeyPatch())
    executor.worker_main(spec, connection, board)
