"""A device, its streams and kernel library for the GPU tests, with declared uploads and downloads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer, PinnedBuffer, StagingRing
from ninfer_rt.cuda.streams import Stream, StreamSet

POISON = 0xFF  # every bf16 0xFFFF / f32 0xFFFFFFFF is a NaN: an element the kernel skipped stays NaN
MIN_UPLOAD_BYTES = 16


@dataclass
class GpuSession:
    streams: StreamSet
    lib: KernelLibrary
    buffers: list[Buffer] = field(default_factory=list)

    @classmethod
    def open(cls) -> GpuSession:
        device = open_device()
        return cls(StreamSet(device), KernelLibrary(device))

    def stream(self, name: str) -> Stream:
        return self.streams.create(name)

    def empty(self, stream: Stream, nbytes: int, name: str) -> DeviceBuffer:
        """A device buffer filled with POISON (in `stream`'s order)."""
        buffer = DeviceBuffer(self.streams, nbytes, name)
        self.buffers.append(buffer)
        stream.memset(buffer, POISON, label=f"poison {name}")
        return buffer

    def upload(self, stream: Stream, array: np.ndarray, name: str) -> DeviceBuffer:
        data = np.ascontiguousarray(array)
        staged = PinnedBuffer(self.streams, data.nbytes, f"{name}:host")
        staged.write(data, label=f"stage {name}")
        buffer = DeviceBuffer(self.streams, data.nbytes, name)
        self.buffers.append(buffer)
        stream.copy(buffer, staged, label=f"upload {name}")
        stream.synchronize()
        staged.free()
        return buffer

    def download(self, stream: Stream, buffer: Buffer, dtype: np.dtype, count: int) -> np.ndarray:
        """The first `count` elements of `buffer`, after everything `stream` has queued so far."""
        host = PinnedBuffer(self.streams, buffer.nbytes, f"{buffer.name}:readback")
        stream.copy(host, buffer, label=f"download {buffer.name}")
        stream.synchronize()
        values = host.read(np.dtype(dtype), (count,), label=f"read {buffer.name}")
        host.free()
        return values

    def release(self) -> None:
        """Free this test's buffers once every stream is idle."""
        for stream in self.streams.streams:
            stream.synchronize()
        for buffer in self.buffers:
            buffer.free()
        self.buffers.clear()

    def close(self) -> None:
        self.release()
        self.lib.close()
        self.streams.destroy()


OneStreamT = TypeVar("OneStreamT", bound="OneStream")


@dataclass
class OneStream:
    """A session's single "compute" stream, for kernel tests: inputs published through a StagingRing, as the
    engine publishes them; poisoned outputs; downloads in the stream's order."""

    session: GpuSession
    stream: Stream

    @classmethod
    def open(cls: type[OneStreamT]) -> OneStreamT:
        session = GpuSession.open()
        return cls(session, session.stream("compute"))

    @property
    def streams(self) -> StreamSet:
        return self.session.streams

    @property
    def lib(self) -> KernelLibrary:
        return self.session.lib

    def upload(self, array: np.ndarray, spare: int = 0) -> DeviceBuffer:
        """`array` in a device buffer with `spare` poisoned bytes after it."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buffer = DeviceBuffer(self.streams, max(raw.size + spare, MIN_UPLOAD_BYTES), "test")
        if spare:
            self.stream.memset(buffer, POISON)
        ring = StagingRing(self.streams, 1, raw.size)
        ring.publish(self.stream, buffer, raw, label="upload")
        ring.free()
        return buffer

    def poisoned(self, nbytes: int) -> DeviceBuffer:
        return self.session.empty(self.stream, nbytes, "out")

    def download(self, buffer: DeviceBuffer, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        host = PinnedBuffer(self.streams, buffer.nbytes, "host")
        self.stream.copy(host, buffer)
        self.stream.record().synchronize()
        return host.read(np.dtype(dtype), shape, label="download")
