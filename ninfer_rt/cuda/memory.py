"""Device and pinned host memory, and the staging ring for host-to-device publishes.

Buffers have an explicit lifetime (`free()`), a name, and a verifier resource key so every op that
touches them can declare it. On a logical StreamSet (no device) both kinds are plain numpy bytes.

`StagingRing` is rule 3 of docs/ARCHITECTURE.md ("The ordering rules"): block tables, positions and membership
lists are written by the host into a pinned slot, copied on the stream that consumes them, and the slot is
handed out again only after the event recorded behind that copy has completed.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from ninfer_rt.cuda.driver import check
from ninfer_rt.cuda.streams import Event, Stream, StreamSet, require_stream

_ids = itertools.count()


class Buffer:
    """Common part of device and pinned buffers: size, name, resource key, host-visible bytes."""

    on_device = False

    def __init__(self, owner: StreamSet, nbytes: int, name: str) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer {name!r}: size must be positive, got {nbytes}")
        self.owner = owner
        self.nbytes = int(nbytes)
        self.name = name
        self.resource = (name, next(_ids))
        self.ptr = 0
        self._bytes: np.ndarray | None = None

    def host_bytes(self) -> np.ndarray:
        """The bytes as a uint8 numpy array (pinned memory, or any buffer of a logical StreamSet)."""
        if self._bytes is None:
            raise TypeError(f"{self.name}: device memory is not host-visible; copy it to a PinnedBuffer")
        return self._bytes

    def view(self, dtype: np.dtype, shape: tuple[int, ...] | None = None) -> np.ndarray:
        arr = self.host_bytes().view(dtype)
        return arr if shape is None else arr[: int(np.prod(shape))].reshape(shape)

    def free(self) -> None:
        if self.owner.verifier is not None:
            self.owner.verifier.forget([self.resource])
        self._bytes = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.nbytes} bytes)"


class DeviceBuffer(Buffer):
    on_device = True

    def __init__(self, owner: StreamSet, nbytes: int, name: str) -> None:
        super().__init__(owner, nbytes, name)
        if owner.logical:
            # written, not np.zeros' lazily mapped pages: resident from the start like cuMemAlloc's, so host
            # RSS shows the pools' size at once rather than growing as pages are first touched
            self._bytes = np.full(self.nbytes, 0, np.uint8)
            self.on_device = False  # logical: host memory standing in for device memory
        else:
            self.ptr = int(check(cu.cuMemAlloc(self.nbytes), f"cuMemAlloc({name}, {self.nbytes})"))

    def free(self) -> None:
        if self.ptr:
            check(cu.cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0
        super().free()


class DeviceView(Buffer):
    """Bytes [offset, offset + nbytes) of a DeviceBuffer, passed to kernels like a buffer of its own. It
    shares the parent's resource: the verifier sees an access to the view as one to the whole buffer."""

    on_device = True

    def __init__(self, parent: DeviceBuffer, offset: int, nbytes: int, name: str) -> None:
        if offset < 0 or nbytes <= 0 or offset + nbytes > parent.nbytes:
            raise ValueError(f"view {name!r}: bytes {offset}..{offset + nbytes} outside {parent.name} ({parent.nbytes})")
        self.owner = parent.owner
        self.nbytes = nbytes
        self.name = name
        self.resource = parent.resource
        self.ptr = parent.ptr + offset if parent.ptr else 0
        self.on_device = parent.on_device
        self._bytes = parent._bytes[offset : offset + nbytes] if parent._bytes is not None else None

    def free(self) -> None:
        raise TypeError(f"{self.name} is a view of another buffer: free that one")


class PinnedBuffer(Buffer):
    """Page-locked host memory: the only host memory async copies may use."""

    def __init__(self, owner: StreamSet, nbytes: int, name: str) -> None:
        super().__init__(owner, nbytes, name)
        if owner.logical:
            self._bytes = np.zeros(self.nbytes, np.uint8)
        else:
            self.ptr = int(check(cu.cuMemHostAlloc(self.nbytes, 0), f"cuMemHostAlloc({name})"))
            raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
            self._bytes = np.frombuffer(raw, dtype=np.uint8)

    def write(self, data: np.ndarray, offset: int = 0, *, label: str, lane: object = None) -> None:
        """Host write, declared: it races with any copy still reading this buffer."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset + raw.size > self.nbytes:
            raise ValueError(f"{label}: {raw.size} bytes at {offset} overflow {self.name} ({self.nbytes})")
        self.owner.host_access(label, writes=(self.resource,), lane=lane)
        self._bytes[offset : offset + raw.size] = raw

    def read(self, dtype: np.dtype, shape: tuple[int, ...], *, label: str, lane: object = None) -> np.ndarray:
        """Host read, declared: it must come after a sync on the copy that filled this buffer."""
        self.owner.host_access(label, reads=(self.resource,), lane=lane)
        return self.view(dtype, shape).copy()

    def free(self) -> None:
        if self.ptr:
            self._bytes = None
            check(cu.cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0
        super().free()


@dataclass
class StagingSlot:
    buffer: PinnedBuffer
    event: Event | None = None  # recorded behind the last copy that read this slot


class StagingRing:
    """Pinned slots used round-robin; a slot is reused only once its last copy has completed."""

    def __init__(self, owner: StreamSet, slots: int, slot_bytes: int, name: str = "staging") -> None:
        self.slot_bytes = slot_bytes
        self.slots = [StagingSlot(PinnedBuffer(owner, slot_bytes, f"{name}[{i}]")) for i in range(slots)]
        self._next = 0
        self.waits = 0  # how often acquire had to block: a ring too small for the publish rate

    def acquire(self) -> StagingSlot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        if slot.event is not None:
            if not slot.event.query():
                self.waits += 1
                slot.event.synchronize()
            slot.event = None
        return slot

    def publish(
        self, stream: Stream, dst: DeviceBuffer, data: np.ndarray, dst_offset: int = 0, *, label: str, lane: object = None
    ) -> None:
        """Stage `data` and copy it into `dst` in `stream`'s order (the stream that consumes it)."""
        stream = require_stream(stream)
        if data.nbytes > self.slot_bytes:
            raise ValueError(f"{label}: {data.nbytes} bytes exceed the staging slot ({self.slot_bytes})")
        slot = self.acquire()
        slot.buffer.write(data, label=f"{label}: stage", lane=lane)
        stream.copy(dst, slot.buffer, data.nbytes, dst_offset, label=label, lane=lane)
        slot.event = stream.record()

    def free(self) -> None:
        for slot in self.slots:
            if slot.event is not None:
                slot.event.synchronize()
            slot.buffer.free()
