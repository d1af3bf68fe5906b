"""Per-step inputs staged in host memory and sent to the device with one copy.

Every field (input ids, positions, slot mapping, ...) is a typed view at a fixed byte
offset of one host buffer and of its device twin, so a captured CUDA graph always reads
the same addresses. Two host buffers alternate: the host fills step N+1 while the copy of
step N may still be queued behind the device's work.

A tensor-parallel rank 0 ships each send to the other ranks as the 8-byte words of its host
buffer that differ from what it last shipped from that buffer (last_sent); each of them keeps
a mirror of each of rank 0's host buffers as shipped, patches it (receive) and copies the same
bytes to its device as rank 0 did. A decode step changes a few dozen words of a buffer of
75-220 KB. (Per buffer: the two hold different stale rows past a short step's, left by
earlier, longer steps, which stay put from one use of a buffer to its next.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from replica.executor import cuda_runtime

# Fields start at multiples of this many bytes: any dtype's view of the bytes is aligned.
FIELD_ALIGNMENT = 64


@dataclass(frozen=True)
class StagedChanges:
    """One send as another rank needs it: the first num_bytes of rank 0's host buffer `buffer`,
    as the 8-byte words that differ from what was last shipped from that buffer: their
    indices and new values (or, when most differ, every word). Plain bytes: they pickle at a
    fraction of an array's cost."""

    buffer: int
    num_bytes: int
    index: Optional[bytes]  # int32 word indices; None: `words` is all num_bytes
    words: bytes  # int64

    @property
    def nbytes(self) -> int:
        return len(self.index or b"") + len(self.words)


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
        pinned = cuda_runtime.pins_host_memory(self.device)
        self._device_bytes = torch.zeros(self.num_bytes, dtype=torch.uint8, device=self.device)
        # Pinned memory lets the copy run asynchronously; a CPU "device" needs none.
        self._host_bytes = [torch.zeros(self.num_bytes, dtype=torch.uint8, pin_memory=pinned)
                            for _ in range(num_host_buffers)]
        self.device_views = self._views(self._device_bytes)
        self._host_views = [{name: view.numpy() for name, view in self._views(host).items()}
                            for host in self._host_bytes]
        self._host_words = [host.view(torch.int64).numpy() for host in self._host_bytes]
        self._copy_done: list[Optional[torch.cuda.Event]] = [None] * num_host_buffers
        self._current = 0
        self._last_sent = (0, 0)  # (host buffer, bytes) of the latest send
        self._num_sends = 0
        # Tensor parallel, as words, per host buffer of rank 0's: on rank 0 what it last shipped
        # from that buffer, on the other ranks what they last received of it (the same, step
        # after step); allocated on first use.
        self._shipped: Optional[list[np.ndarray]] = None
        self._last_changes: Optional[tuple[int, StagedChanges]] = None  # (send number, its changes)

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
        if cuda_runtime.on_cuda(self.device):
            event = torch.cuda.Event()
            event.record()
            self._copy_done[self._current] = event
        self._last_sent = (self._current, num_words * 8)
        self._num_sends += 1
        self._current = (self._current + 1) % len(self._host_bytes)

    def last_sent(self) -> StagedChanges:
        """What the latest send() copied, as its changes since its host buffer was last
        shipped: a tensor-parallel rank 0 ships each of these (in order, none left out) to the
        other ranks, whose receive() then copies exactly the bytes it copied. Asked again for
        the same send, the same changes. A send never shipped (rank 0 padding its own rows at
        start) is no matter: the next shipment's changes are against the last one shipped."""
        if self._last_changes is not None and self._last_changes[0] == self._num_sends:
            return self._last_changes[1]
        buffer, num_bytes = self._last_sent
        num_words = num_bytes // 8
        sent = self._host_words[buffer][:num_words]
        shipped = self._mirrors()[buffer][:num_words]
        changed = np.flatnonzero(sent != shipped)
        if 3 * len(changed) > 2 * num_words:  # most of it (a long prefill): every word, no index
            shipped[:] = sent
            changes = StagedChanges(buffer, num_bytes, None, sent.tobytes())
        else:
            words = sent[changed]
            shipped[changed] = words
            changes = StagedChanges(buffer, num_bytes, changed.astype(np.int32).tobytes(), words.tobytes())
        self._last_changes = (self._num_sends, changes)
        return changes

    def receive(self, changes: StagedChanges) -> None:
        """Patch this rank's mirror of rank 0's host buffer with rank 0's last_sent(), fill the
        host buffer with the first num_bytes of it and send them to this device."""
        self.host_views()  # waits until the buffer is free to fill
        mirror = self._mirrors()[changes.buffer]
        num_words = changes.num_bytes // 8
        words = np.frombuffer(changes.words, dtype=np.int64)
        if changes.index is None:
            mirror[:num_words] = words
        elif len(words):
            mirror[np.frombuffer(changes.index, dtype=np.int32)] = words
        self._host_words[self._current][:num_words] = mirror[:num_words]
        self.send(changes.num_bytes)

    def _mirrors(self) -> list[np.ndarray]:
        if self._shipped is None:  # as every rank's host buffers start
            self._shipped = [np.zeros(self.num_bytes // 8, dtype=np.int64) for _ in self._host_bytes]
        return self._shipped
