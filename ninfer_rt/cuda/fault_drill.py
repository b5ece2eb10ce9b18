"""The fault drill (rule 6 of docs/ARCHITECTURE.md, "The ordering rules"): one real fault, mid-run, on purpose.

Armed only by `serve --debug-fault-after N` with NINFER_ALLOW_FAULT_DRILL=1 in the environment (refused
otherwise). After the N-th op any stream declares, a GPU run launches kernels_src/fault_drill.cu on that
stream: an out-of-bounds write that kills the context with CUDA_ERROR_ILLEGAL_ADDRESS, so the next sync
takes the sticky-error path (crash-context dump, FatalCudaError). On logical streams (the numpy executor)
the N-th op raises that same CudaError through StreamSet.synchronized, so the whole path from the fault to
the server's exit runs without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cuda.bindings import driver as cu

from ninfer_rt.cuda.driver import CudaError
from ninfer_rt.cuda.kernels import Arg, Kernel, KernelLibrary, KernelSpec
from ninfer_rt.cuda.streams import Stream, StreamSet

ALLOW_ENV = "NINFER_ALLOW_FAULT_DRILL"
FAULT_DRILL = KernelSpec("fault_drill", "fault_drill_write", (Arg.PTR, Arg.I64))
OUT_OF_BOUNDS = 1 << 40  # floats past a null base: 4 TiB, where no allocation lives
LABEL = "fault drill: out-of-bounds write"


class FaultDrillRefused(ValueError):
    """The drill was asked for without NINFER_ALLOW_FAULT_DRILL=1."""


def check_allowed(after: int) -> None:
    """Refuses the drill unless the environment allows it explicitly (a flag alone must not kill a server)."""
    if os.environ.get(ALLOW_ENV) != "1":
        raise FaultDrillRefused(f"--debug-fault-after {after}: the fault drill kills the server on purpose; "
                                f"set {ALLOW_ENV}=1 to allow it")
    if after < 1:
        raise FaultDrillRefused(f"--debug-fault-after {after}: must be at least 1")


@dataclass
class FaultDrill:
    after: int  # ops declared before the fault
    kernel: Kernel | None  # None on logical streams
    ops: int = 0
    fired: bool = False

    @classmethod
    def arm(cls, streams: StreamSet, after: int) -> FaultDrill:
        """Attach a drill to `streams`; the kernel is loaded now, while the context still works."""
        check_allowed(after)
        kernel = None if streams.device is None else KernelLibrary(streams.device).kernel(FAULT_DRILL)
        drill = cls(after, kernel)
        streams.fault_drill = drill
        return drill

    def after_op(self, stream: Stream) -> None:
        """Called by Stream.declare once the op is recorded: fires on the N-th op, once."""
        if self.fired:
            return
        self.ops += 1
        if self.ops < self.after:
            return
        self.fired = True
        if self.kernel is not None:
            self.kernel.launch(stream, 1, 1, 0, OUT_OF_BOUNDS, label=LABEL, writes=("fault-drill",))
            return
        stream.declare(LABEL, writes=("fault-drill",))
        stream.owner.synchronized(_illegal_address, f"synchronize {stream.name} ({LABEL})")


def _illegal_address() -> None:
    raise CudaError("cuStreamSynchronize", cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")
