"""Per-step inputs staged in host memory and sent to the device with one copy.

Every field (input ids, positions, slot mapping, ...) is a typed view at a fixed byte
offset of one host buffer and of its device twin, so a captured CUDA graph always reads
the same addresses. Two host buffers alternate: the host fills step N+1 while the copy of
step N may still be queued behind the device's work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

# Fields start at multiples of this many bytes: any dtype's view of the bytes is aligned.
FIELD_ALIGNMENT = 64


@dataclass(frozen=True)
class StagedField:
    name: str
    dtype: torch.dtype
    capacity: int  # elements


class StagedInputs:
    def __init__(self, fields: Sequence[StagedField], device: torch.device, num_host_buffers: int = 2):
        self.device = torch.device(device)
        self.offsets: dict[str, int] = {}
        self.itemsizes: dict[str, int] = {}
        offset = 0
        for field in fields:
            offset = -(-offset // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
            self.offsets[field.name] = offset
            self.itemsizes[field.name] = torch.empty((), dtype=field.dtype).element_size()
            offset += field.capacity * self.itemsizes[field.name]
        self.num_bytes = -(-offset // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
        self._fields = list(fields)
        on_cuda = self.device.type == "cuda"
        self._device_bytes = torch.zeros(self.num_bytes, dtype=torch.uint8, device=self.device)
        # Pinned memory lets the copy run asynchronously; a CPU "device" needs none.
        self._host_bytes = [torch.zeros(self.num_bytes, dtype=torch.uint8, pin_memory=on_cuda)
                            for _ in range(num_host_buffers)]
        self.device_views = self._views(self._device_bytes)
        self._host_views = [{name: view.numpy() for name, view in self._views(host).items()}
                            for host in self._host_bytes]
        self._copy_done: list[Optional[torch.cuda.Event]] = [None] * num_host_buffers
        self._current = 0
        self._last_sent = (0, 0)  # (host buffer, bytes) of the latest send

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for field in self._fields:
            start = self.offsets[field.name]
            views[field.name] = buffer[start:start + field.capacity * self.itemsizes[field.name]].view(field.dtype)
        return views

    def host_views(self) -> dict[str, np.ndarray]:
        """The numpy views of the host buffer to fill for the next send; waits (if ever) until
        the copy that last read this buffer has left it."""
        done = self._copy_done[self._current]
        if done is not None:
            done.synchronize()
            self._copy_done[self._current] = None
        return self._host_views[self._current]

    def end_of(self, name: str, count: int) -> int:
        """Byte offset just past the first `count` elements of field `name`."""
        return self.offsets[name] + count * self.itemsizes[name]

    def send(self, num_bytes: Optional[int] = None) -> None:
        """Copy the first num_bytes (default: all) of the filled host buffer to the device, in
        stream order and without blocking the host; the next host_views() is the other buffer."""
        num_bytes = self.num_bytes if num_bytes is None else num_bytes
        # Copied as 8-byte words: a byte-wise copy of the same memory is split across
        # threads on a CPU "device", which costs milliseconds on a busy machine.
        num_words = -(-num_bytes // 8)
        host = self._host_bytes[self._current].view(torch.int64)
        self._device_bytes.view(torch.int64)[:num_words].copy_(host[:num_words], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copy_done[self._current] = event
        self._last_sent = (self._current, num_words * 8)
        self._current = (self._current + 1) % len(self._host_bytes)

    def last_sent(self) -> bytes:
        """A copy of what the latest send() copied: a tensor-parallel rank 0 ships these bytes
        to the other ranks, whose receive() makes their device views the same."""
        buffer, num_bytes = self._last_sent
        return self._host_bytes[buffer][:num_bytes].numpy().tobytes()

    def receive(self, data: bytes) -> None:
        """Fill the host buffer with another rank's last_sent() and send it to this device."""
        self.host_views()  # waits until the buffer is free to fill
        host = self._host_bytes[self._current]
        host[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.send(len(data))
