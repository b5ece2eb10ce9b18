"""Kernel timing: CUDA-event medians over graph-replayed launch loops, against a measured roofline.

What a kernel benchmark must not measure, and how this module keeps it out:
- Python launch overhead (~5 us a launch, more than many decode kernels take): the launches are captured
  once into a CUDA graph of `launches` back-to-back launches and only graph replays are timed.
- Cold-start effects (module load, clocks ramping up): one eager run, then `warmup` untimed replays.
- Noise: each replay is timed with its own pair of events and the median replay is reported.
- L2 hits that the model's step would not get (a layer's weights or KV are read once per step, long
  evicted when read again): such inputs are allocated as several copies, ROTATE_BYTES (many times the L2)
  in all, and each launch reads the next copy (`BenchSession.cold`).
- Unrealistic data: buffers hold random bf16 N(0, 0.02) (read as int8 codes or f32 they are finite too),
  never zeros or one repeated byte, whose low bit toggling would flatter power-limited clocks.
The roofline is measured on the same device in the same run: the device-to-device copy rate (bytes read
plus written) for memory, the cuBLASLt bf16 GEMM rate for tensor-core math.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
from cuda.bindings import driver as cu

from ninfer_rt.cuda.driver import Device, check
from ninfer_rt.cuda.graphs import capture
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.memory import DeviceBuffer, StagingRing
from ninfer_rt.cuda.streams import Stream, StreamSet

LAUNCHES = 20  # per captured graph
REPEATS = 30  # timed replays; the median is reported
WARMUP = 3  # untimed replays after the eager run
ROTATE_BYTES = 512 << 20  # what the copies of a cold input add up to: several times any current L2
MAX_COLD_COPIES = 256  # a tiny input stays L2-resident anyway; more copies would only cost set-up time
RANDOM_SOURCE_BYTES = 32 << 20  # one uploaded random block, tiled into every buffer by device copies
COPY_BYTES = 2 << 30  # large enough that the copy runs at steady-state HBM rate
GEMM_SIZE = 8192  # square bf16 GEMM: large enough to run at the tensor cores' sustained rate


@dataclass(frozen=True)
class Roofline:
    bytes_per_s: float  # device-to-device copy, bytes read + written
    flops_per_s: float | None  # cuBLASLt bf16 GEMM; None where cuBLASLt is unavailable


@dataclass(frozen=True)
class Measurement:
    """One timed case: median seconds per launch and the work a launch does (unique bytes, flops)."""

    kernel: str
    case: str
    seconds: float
    bytes: int
    flops: int = 0
    params: dict[str, object] = field(default_factory=dict)  # the case's sizes, as columns for tables and JSON lines

    def roofline_fraction(self, roofline: Roofline) -> float:
        """The roofline's time for this work (the slower of memory and math) over the measured time."""
        bound = self.bytes / roofline.bytes_per_s
        if self.flops and roofline.flops_per_s:
            bound = max(bound, self.flops / roofline.flops_per_s)
        return bound / self.seconds


def time_launches(
    stream: Stream, launch: Callable[[int], None], launches: int = LAUNCHES, repeats: int = REPEATS, warmup: int = WARMUP
) -> float:
    """Median seconds per `launch(i)` (i = 0, 1, ...: which rotating input to use), timed over replays of
    a graph of `launches` back-to-back calls."""
    launch(0)  # loads the kernels' modules: nothing may load while capturing
    graph = capture(stream, lambda: [launch(i) for i in range(launches)])
    try:
        for _ in range(warmup):
            graph.replay()
        times = []
        for _ in range(repeats):
            start = stream.record(timing=True)
            graph.replay()
            times.append(start.elapsed_ms(stream.record(timing=True)))
    finally:
        graph.destroy()
    return statistics.median(times) / 1e3 / launches


def l2_cache_bytes(device: Device) -> int:
    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
    return int(check(cu.cuDeviceGetAttribute(attribute, device.handle), "cuDeviceGetAttribute(L2)"))


def cold_copies(device: Device, nbytes: int) -> int:
    """Copies of an `nbytes` input that, read round-robin, span ROTATE_BYTES (at least 8x the L2): each read misses L2."""
    span = max(ROTATE_BYTES, 8 * l2_cache_bytes(device))
    return max(2, min(MAX_COLD_COPIES, -(-span // nbytes)))


def copy_bandwidth(streams: StreamSet, nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Device-to-device copy rate in bytes/s counting bytes read + written (the achievable memory roofline)."""
    stream = streams.create("bandwidth")
    src, dst = DeviceBuffer(streams, nbytes, "bw_src"), DeviceBuffer(streams, nbytes, "bw_dst")
    stream.copy(dst, src)  # warm-up
    start = stream.record(timing=True)
    for _ in range(repeats):
        stream.copy(dst, src)
    seconds = start.elapsed_ms(stream.record(timing=True)) / 1000
    src.free()
    dst.free()
    return 2 * nbytes * repeats / seconds


@dataclass
class BenchSession:
    """A device, one stream and a kernel library for benchmarks, with buffers freed per case."""

    device: Device
    streams: StreamSet
    stream: Stream
    lib: KernelLibrary
    random_source: DeviceBuffer
    launches: int = LAUNCHES
    repeats: int = REPEATS
    _buffers: list[DeviceBuffer] = field(default_factory=list, init=False)

    @classmethod
    def open(cls, device: Device, launches: int = LAUNCHES, repeats: int = REPEATS) -> BenchSession:
        streams = StreamSet(device, verify=False)  # benchmarks measure the kernels, not the verifier
        stream = streams.create("bench")
        source = DeviceBuffer(streams, RANDOM_SOURCE_BYTES, "random_source")
        values = (np.random.default_rng(0).standard_normal(RANDOM_SOURCE_BYTES // 2) * 0.02).astype(ml_dtypes.bfloat16)
        ring = StagingRing(streams, 1, RANDOM_SOURCE_BYTES)
        ring.publish(stream, source, values.view(np.uint8), label="random source")
        ring.free()
        return cls(device, streams, stream, KernelLibrary(device), source, launches, repeats)

    def roofline(self) -> Roofline:
        return Roofline(copy_bandwidth(self.streams), self.gemm_rate())

    def gemm_rate(self, size: int = GEMM_SIZE) -> float | None:
        """bf16 tensor-core FLOP/s of a square cuBLASLt GEMM, or None where cuBLASLt cannot be loaded."""
        from ninfer_rt.cuda.blas import Blas, BlasUnavailableError, GemmShape  # nvmath loads only when asked

        try:
            blas = Blas(self.streams)
        except BlasUnavailableError:
            return None
        shape = GemmShape(size, size, size)
        x, w, out = (self.filled(size * size * 2, name) for name in ("gemm_x", "gemm_w", "gemm_out"))
        seconds = time_launches(self.stream, lambda _: blas.gemm(self.stream, x, w, out, shape), launches=5, repeats=10)
        self.release()
        blas.close()
        return 2 * size**3 / seconds

    def filled(self, nbytes: int, name: str) -> DeviceBuffer:
        """A buffer of random bf16 values (tiled from the random source), freed by `release`."""
        buffer = DeviceBuffer(self.streams, max(nbytes, 16), name)
        self._buffers.append(buffer)
        for offset in range(0, buffer.nbytes, RANDOM_SOURCE_BYTES):
            size = min(RANDOM_SOURCE_BYTES, buffer.nbytes - offset)
            self.stream.copy(buffer, self.random_source, size, dst_offset=offset, label=f"fill {name}")
        return buffer

    def cold(self, nbytes: int, name: str, count: int | None = None) -> list[DeviceBuffer]:
        """Copies of an input that the model reads from HBM (weights, KV): use copy i % len for launch i.
        `count` (default: cold_copies of nbytes) lets the parts of one input (codes and scales) rotate together."""
        return [self.filled(nbytes, f"{name}{i}") for i in range(count or cold_copies(self.device, nbytes))]

    def upload(self, array: np.ndarray, name: str) -> DeviceBuffer:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buffer = DeviceBuffer(self.streams, data.size, name)
        self._buffers.append(buffer)
        ring = StagingRing(self.streams, 1, data.size)
        ring.publish(self.stream, buffer, data, label=f"upload {name}")
        ring.free()
        return buffer

    def time(self, launch: Callable[[int], None], variants: int = 1) -> float:
        """Median seconds per launch; the graph holds at least `variants` launches so every rotating copy is used."""
        return time_launches(self.stream, launch, max(self.launches, variants), self.repeats)

    def release(self) -> None:
        self.stream.synchronize()
        for buffer in self._buffers:
            buffer.free()
        self._buffers.clear()

    def close(self) -> None:
        self.release()
        self.random_source.free()
        self.lib.close()
        self.streams.destroy()
