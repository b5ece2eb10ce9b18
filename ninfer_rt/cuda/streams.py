"""Streams and events with declared accesses: the only way ninfer_rt enqueues device work.

Rule 1 of docs/ARCHITECTURE.md ("The ordering rules"): there is no default stream. `StreamSet` creates
CU_STREAM_NON_BLOCKING streams and nothing else; every enqueue entry point takes a `Stream` and raises
`DefaultStreamError` for `None`, `0`, the legacy or the per-thread stream before the driver is called.
Synchronous driver calls that run on the default stream implicitly (cuMemcpyHtoD, cuMemsetD8, ...) are not
wrapped anywhere.

Every op declares what it reads and writes; with a verifier attached (tests, --verify-ordering) those
declarations are checked for happens-before (ninfer_rt.ordering). A StreamSet without a device is
*logical*: ops run eagerly on the host (the numpy executor), but the same declarations are checked against
the same logical streams, so CI verifies the engine's real op sequence without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from cuda.bindings import driver as cu

from ninfer_rt.cuda.driver import CudaError, Device, check
from ninfer_rt.ordering import CrashContext, Verifier, verify_by_default
from ninfer_rt.ordering.verifier import Resource, Span

if TYPE_CHECKING:
    from ninfer_rt.cuda.fault_drill import FaultDrill
    from ninfer_rt.cuda.memory import Buffer


class DefaultStreamError(ValueError):
    """An enqueue was given the default (legacy or per-thread) stream, None or 0."""


class FatalCudaError(RuntimeError):
    """A sticky CUDA error surfaced at a sync point; the crash context was dumped to `crash_file`."""

    def __init__(self, cause: CudaError, crash_file: str) -> None:
        super().__init__(f"{cause}; the CUDA context is unusable; crash context written to {crash_file}")
        self.cause = cause
        self.crash_file = crash_file


def require_stream(stream: object) -> Stream:
    """The gate of every enqueue API: only a Stream made by a StreamSet passes."""
    if not isinstance(stream, Stream):
        raise DefaultStreamError(
            f"got {stream!r} where a Stream is required: ninfer_rt never enqueues on the default, legacy "
            "or per-thread stream; create streams with StreamSet.create()"
        )
    return stream


_DEFAULT_HANDLES = (0, int(cu.CU_STREAM_LEGACY), int(cu.CU_STREAM_PER_THREAD))
_MAX_LAUNCH_CONFIGS = 4096
Dim3 = tuple[int, int, int]


class StreamSet:
    """The runtime context: device (None = logical/CPU), streams, verifier and crash context."""

    def __init__(self, device: Device | None = None, verify: bool | None = None, dependent_launch: bool | None = None) -> None:
        self.device = device
        # Programmatic dependent launch (kernels_src/common.cuh): Hopper and later, unless NINFER_PDL=0.
        if dependent_launch is None:
            dependent_launch = os.environ.get("NINFER_PDL", "1") != "0"
        self.dependent_launch = dependent_launch and device is not None and device.compute_capability >= (9, 0)
        self.verifier: Verifier | None = Verifier() if (verify_by_default() if verify is None else verify) else None
        self.crash = CrashContext()
        self.streams: list[Stream] = []
        self._host_ring = self.crash.ring("host")
        self.fatal: FatalCudaError | None = None  # set by the first sticky error: the context is dead
        self.fault_drill: FaultDrill | None = None  # serve --debug-fault-after (cuda/fault_drill.py); else None
        # Handles of dropped non-timing events, recorded again instead of created: a decode step records
        # several events, and cuEventCreate + cuEventDestroy cost more than the record itself.
        self.idle_events: list[object] = []

    @property
    def logical(self) -> bool:
        return self.device is None

    def create(self, name: str) -> Stream:
        handle = None
        if self.device is not None:
            handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            if int(handle) in _DEFAULT_HANDLES:
                raise DefaultStreamError(f"cuStreamCreate returned a default-stream handle for {name!r}")
        stream = Stream(self, name, handle)
        self.streams.append(stream)
        return stream

    def host_access(
        self, label: str, reads: Iterable[Resource] = (), writes: Iterable[Resource] = (), lane: object = None
    ) -> None:
        """Declare a host-thread access to pinned/staged memory (or a page hand-over)."""
        reads, writes = tuple(reads), tuple(writes)  # the ring and the verifier both read them
        self._host_ring.note(label, lane, reads, writes)
        if self.verifier is not None:
            self.verifier.op(self.verifier.host(), label, reads, writes, lane)

    def host_merge(self, clock: dict[int, int] | None) -> None:
        if self.verifier is not None and clock is not None:
            self.verifier.merge(self.verifier.host(), clock)

    def synchronized(self, call: Callable[[], Any], what: str) -> Any:
        """Run a host-blocking driver call; a sticky error dumps the crash context and becomes fatal."""
        try:
            return call()
        except CudaError as err:
            if not err.sticky:
                raise
            path = self.crash.dump(error=f"{what}: {err}")
            self.fatal = FatalCudaError(err, str(path))
            raise self.fatal from err

    def destroy(self) -> None:
        while self.idle_events:
            check(cu.cuEventDestroy(self.idle_events.pop()), "cuEventDestroy")
        for stream in self.streams:
            if stream.handle is not None:
                check(cu.cuStreamDestroy(stream.handle), "cuStreamDestroy")
        self.streams.clear()


class Event:
    """A point on one stream. Waiting on it orders later work after everything enqueued before it."""

    def __init__(self, stream: Stream, clock: dict[int, int] | None, handle: object, timing: bool = False) -> None:
        self.stream_name = stream.name
        self.clock = clock
        self.handle = handle
        self._timing = timing
        self._owner = stream.owner
        self._done = handle is None  # logical ops ran eagerly: complete as soon as recorded

    def query(self) -> bool:
        """Non-blocking completion check; a completed event orders the host after it."""
        if not self._done:
            status = cu.cuEventQuery(self.handle)[0]
            if status == cu.CUresult.CUDA_ERROR_NOT_READY:
                return False
            self._owner.synchronized(lambda: check((status,), "cuEventQuery"), f"query event on {self.stream_name}")
            self._done = True
        self._owner.host_merge(self.clock)
        return True

    def synchronize(self) -> None:
        if not self._done:
            self._owner.synchronized(
                lambda: check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize"),
                f"synchronize event on {self.stream_name}",
            )
            self._done = True
        self._owner.host_merge(self.clock)

    def elapsed_ms(self, later: Event) -> float:
        """Milliseconds between this event and a later one (both recorded with timing=True)."""
        self.synchronize()
        later.synchronize()
        return float(check(cu.cuEventElapsedTime(self.handle, later.handle), "cuEventElapsedTime"))

    def __del__(self) -> None:
        # Nobody can wait on this event any more, so its handle may be recorded again (a pending record is
        # simply superseded; waits already enqueued keep the record they saw).
        if self.handle is not None:
            if self._timing:
                cu.cuEventDestroy(self.handle)
            else:
                self._owner.idle_events.append(self.handle)


class Stream:
    """A non-blocking stream (or its logical stand-in). Every op declares its reads and writes."""

    def __init__(self, owner: StreamSet, name: str, handle: object) -> None:
        self.owner = owner
        self.name = name
        self.handle = handle
        self.ring = owner.crash.ring(f"stream:{name}")
        self.timeline = owner.verifier.timeline(f"stream:{name}") if owner.verifier is not None else None
        self._launch_configs: dict[tuple[Dim3, Dim3, int], object] = {}

    def __repr__(self) -> str:
        return f"Stream({self.name!r}{', logical' if self.handle is None else ''})"

    def declare(self, label: str, reads: Iterable[Resource] = (), writes: Iterable[Resource] = (), lane: object = None) -> None:
        """Record an op issued on this stream (called by every enqueue before the driver is).

        Cost per call on a logical stream (tools/bench_verifier_overhead.py, 200k ops, a shared 2-vCPU CI box
        where an empty Python loop iteration costs ~55 ns): verifier off ~0.9 us (the crash-context ring;
        the verifier's share is one `is None` test), on ~17 us (two streams, 3 resources per op)."""
        if self.owner.fatal is not None:  # rule 6: never keep launching into a dead context
            raise self.owner.fatal
        reads, writes = tuple(reads), tuple(writes)  # the ring and the verifier both read them
        self.ring.note(label, lane, reads, writes)
        if self.timeline is not None:
            self.owner.verifier.op(self.timeline, label, reads, writes, lane)
        if self.owner.fault_drill is not None:
            self.owner.fault_drill.after_op(self)

    def launch(
        self,
        function: object,
        grid: Dim3,
        block: Dim3,
        params: object,
        smem: int = 0,
        *,
        label: str,
        reads: Iterable[Resource] = (),
        writes: Iterable[Resource] = (),
        lane: object = None,
    ) -> None:
        """cuLaunchKernel on this stream (cuLaunchKernelEx with programmatic stream serialization where the
        StreamSet allows dependent launch). `params` is cuda.bindings' kernelParams argument."""
        if self.handle is None:
            raise DefaultStreamError(f"cannot launch {label!r} on logical stream {self.name!r} (no device)")
        self.declare(label, reads, writes, lane)
        if self.owner.dependent_launch:
            config = self._launch_configs.get((grid, block, smem)) or self._dependent_launch_config(grid, block, smem)
            self.owner.synchronized(lambda: check(cu.cuLaunchKernelEx(config, function, params, 0), f"cuLaunchKernelEx({label})"), label)
            return
        # a fault already detected comes back from the next launch: the same sticky-error path as at a sync
        self.owner.synchronized(
            lambda: check(cu.cuLaunchKernel(function, *grid, *block, smem, self.handle, params, 0), f"cuLaunchKernel({label})"), label
        )

    def _dependent_launch_config(self, grid: Dim3, block: Dim3, smem: int) -> object:
        """A launch config allowing the kernel to start before the previous one on this stream finishes
        (it waits inside, see kernels_src/common.cuh); cached, since building one costs more than a launch."""
        attribute = cu.CUlaunchAttribute()
        attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = smem
        config.hStream = self.handle
        config.attrs = [attribute]
        config.numAttrs = 1
        if len(self._launch_configs) >= _MAX_LAUNCH_CONFIGS:  # prefill grids vary with the chunk: stay bounded
            self._launch_configs.clear()
        self._launch_configs[(grid, block, smem)] = config
        return config

    def copy(
        self,
        dst: Buffer,
        src: Buffer,
        nbytes: int | None = None,
        dst_offset: int = 0,
        src_offset: int = 0,
        *,
        label: str = "copy",
        lane: object = None,
        reads: Iterable[Resource] | None = None,
        writes: Iterable[Resource] | None = None,
    ) -> None:
        """Async copy between any two buffers (pinned or device) in stream order.

        Declares the copied byte ranges of `src` (read) and `dst` (written) unless `reads`/`writes` name finer resources
        (a KV page copy declares its pages, not the buffers every page lives in)."""
        nbytes = min(dst.nbytes - dst_offset, src.nbytes - src_offset) if nbytes is None else nbytes
        if nbytes < 0 or dst_offset + nbytes > dst.nbytes or src_offset + nbytes > src.nbytes:
            raise ValueError(f"{label}: copy of {nbytes} bytes out of range ({src.name} -> {dst.name})")
        if reads is None:
            reads = (Span(src.resource, src_offset, src_offset + nbytes),)
        if writes is None:
            writes = (Span(dst.resource, dst_offset, dst_offset + nbytes),)
        self.declare(label, reads, writes, lane)
        if self.handle is None:
            dst.host_bytes()[dst_offset : dst_offset + nbytes] = src.host_bytes()[src_offset : src_offset + nbytes]
            return
        d, s = dst.ptr + dst_offset, src.ptr + src_offset
        if dst.on_device and src.on_device:
            check(cu.cuMemcpyDtoDAsync(d, s, nbytes, self.handle), "cuMemcpyDtoDAsync")
        elif dst.on_device:
            check(cu.cuMemcpyHtoDAsync(d, s, nbytes, self.handle), "cuMemcpyHtoDAsync")
        elif src.on_device:
            check(cu.cuMemcpyDtoHAsync(d, s, nbytes, self.handle), "cuMemcpyDtoHAsync")
        else:
            raise ValueError(f"{label}: host-to-host copies are not stream work; copy the arrays directly")

    def memset(self, dst: Buffer, byte: int, nbytes: int | None = None, offset: int = 0, *, label: str = "memset", lane: object = None) -> None:
        nbytes = dst.nbytes - offset if nbytes is None else nbytes
        self.declare(label, (), (Span(dst.resource, offset, offset + nbytes),), lane)
        if self.handle is None:
            dst.host_bytes()[offset : offset + nbytes] = byte
            return
        check(cu.cuMemsetD8Async(dst.ptr + offset, byte, nbytes, self.handle), "cuMemsetD8Async")

    def host_op(
        self,
        fn: Callable[[], Any],
        *,
        label: str,
        reads: Iterable[Resource] = (),
        writes: Iterable[Resource] = (),
        lane: object = None,
    ) -> Any:
        """Logical streams only: run `fn` now as if it were a kernel on this stream."""
        if self.handle is not None:
            raise TypeError(f"host_op {label!r} on a device stream: enqueue a kernel instead")
        self.declare(label, reads, writes, lane)
        return fn()

    def record(self, timing: bool = False) -> Event:
        clock = self.owner.verifier.record(self.timeline) if self.timeline is not None else None
        handle = None
        if self.handle is not None:
            if not timing and self.owner.idle_events:
                handle = self.owner.idle_events.pop()
            else:
                flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
                handle = check(cu.cuEventCreate(flags), "cuEventCreate")
            check(cu.cuEventRecord(handle, self.handle), "cuEventRecord")
        return Event(self, clock, handle, timing)

    def wait(self, event: Event) -> None:
        """Order all later work on this stream after `event`."""
        if not isinstance(event, Event):
            raise TypeError(f"Stream.wait needs an Event, got {event!r}")
        if self.timeline is not None and event.clock is not None:
            self.owner.verifier.wait(self.timeline, event.clock)
        if self.handle is not None and event.handle is not None:
            check(cu.cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def synchronize(self) -> None:
        """Block the host until this stream is idle; orders the host after all its work."""
        clock = self.owner.verifier.snapshot(self.timeline) if self.timeline is not None else None
        if self.handle is not None:
            self.owner.synchronized(lambda: check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize"), f"synchronize {self.name}")
        self.owner.host_merge(clock)
