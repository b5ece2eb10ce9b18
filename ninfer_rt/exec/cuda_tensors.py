"""The CUDA executor's tensors: activations from a pool of fixed buffers, and the shape of a step.

A `DeviceTensor` is bf16 (or f32 logits, int32 ids) row-major [rows, cols] in a device buffer. Activations
come from an `ActivationPool` sized per (cols, dtype, capacity rows) and go back to it when Python drops
the tensor; the pool never frees, so the addresses a captured graph holds stay valid. `StepShape` is what
decides a step's launches: the key of its captured graph (exec/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.model.executor import StepBatch

ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4}


class ActivationPool:
    """Activation buffers by (cols, dtype, capacity rows), handed out again once their tensor is dropped."""

    def __init__(self, streams: StreamSet) -> None:
        self._streams = streams
        self._free: dict[tuple[int, str, int], list[DeviceBuffer]] = {}
        self.allocated = 0  # buffers ever made: constant in steady state (a test checks it)

    def take(self, cols: int, dtype: str, capacity: int) -> DeviceBuffer:
        free = self._free.setdefault((cols, dtype, capacity), [])
        if free:
            return free.pop()
        self.allocated += 1
        return DeviceBuffer(self._streams, capacity * cols * ITEMSIZE[dtype], f"act[{cols}x{dtype}]#{self.allocated}")

    def give(self, buffer: DeviceBuffer, cols: int, dtype: str, capacity: int) -> None:
        self._free[(cols, dtype, capacity)].append(buffer)


@dataclass(eq=False)
class DeviceTensor:
    """[rows, cols] row-major on the device. Pooled tensors give their buffer back when dropped."""

    buffer: DeviceBuffer
    rows: int
    cols: int
    dtype: str = "bf16"
    _pool: tuple[ActivationPool, int] | None = field(default=None, repr=False)  # (pool, capacity rows)

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * ITEMSIZE[self.dtype]

    def __del__(self) -> None:
        if self._pool is not None:
            pool, capacity = self._pool
            pool.give(self.buffer, self.cols, self.dtype, capacity)


@dataclass(frozen=True)
class StepShape:
    """Everything host-side that decides which launches a step makes (a captured graph's key)."""

    query_lens: tuple[int, ...]  # new rows per sequence: also picks each sequence's attention kernel
    logit_rows: int
    state_targets: int = 0  # states kept per sequence (linear attention; a verify pass keeps one per row)


def step_shape(batch: StepBatch) -> StepShape:
    targets = int(batch.state_targets.shape[1]) if batch.state_slots.size else 0
    return StepShape(tuple(int(n) for n in np.diff(batch.query_start)), int(len(batch.logit_rows)), targets)
