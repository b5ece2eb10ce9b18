"""Random-weight matrices made on the GPU for the benchmarks' models (tools/bench_decode.py's dense builder,
tools/bench_hybrid_model.py's hybrid one): every value is tiled from one random device buffer by DtoD copies,
so no host copy of a model (a bf16 27B is ~54 GB) is ever made. Values do not change the speed of a
memory-bound step.

Quantized matrices are written directly in the device format (cuda/quant_ops.py QuantizedDeviceWeight):
random bytes as codes, every group's bf16 scale 1e-3, never through a bf16 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import WeightRole
from ninfer_rt.model.layers import PreparedModel

RANDOM_SOURCE_BYTES = 256 << 20
QUANT_GROUP = 128
QUANT_SCALE = 1e-3


@dataclass
class RandomModel:
    executor: CudaExecutor
    model: PreparedModel
    weight_bytes_per_step: int  # every matrix once, plus one embedding row
    states: StateSlotPool | None = None  # a hybrid's: one slot (BENCH_SLOT), zeroed before each measurement


BENCH_SLOT = 0  # the only slot of a benchmark's one-slot state pool


class RandomWeights:
    """Weights ~ N(0, 0.02) (bf16) or random codes (int4/int8) on `executor`'s device; `close` once the
    model is built frees the random source."""

    def __init__(self, executor: CudaExecutor, seed: int = 0) -> None:
        self.executor = executor
        rng = np.random.default_rng(seed)
        self.source = DeviceBuffer(executor.streams, RANDOM_SOURCE_BYTES, "random_source")
        values = (rng.standard_normal(RANDOM_SOURCE_BYTES // 2) * 0.02).astype(ml_dtypes.bfloat16)
        executor.upload(self.source, values, label="random")

    def fill(self, buffer: DeviceBuffer, name: str) -> None:
        for offset in range(0, buffer.nbytes, RANDOM_SOURCE_BYTES):
            size = min(RANDOM_SOURCE_BYTES, buffer.nbytes - offset)
            self.executor.compute.copy(buffer, self.source, size, dst_offset=offset, label=f"fill {name}")

    def dense(self, name: str, rows: int, cols: int, role: WeightRole) -> DeviceTensor:
        tensor = self.executor.empty_weight(name, rows, cols, role=role)
        self.fill(tensor.buffer, name)
        return tensor

    def quantized(self, name: str, rows: int, cols: int, bits: int, role: WeightRole) -> QuantizedDeviceWeight:
        """Group-QUANT_GROUP codes; rows a multiple of 16, where the device layout (octets of 8 rows, padded
        to an even count) holds exactly rows * cols codes."""
        groups = rows * cols // QUANT_GROUP
        weight = QuantizedDeviceWeight(
            DeviceBuffer(self.executor.streams, rows * cols * bits // 8, f"w.{name}"),
            DeviceBuffer(self.executor.streams, groups * 2, f"w.{name}.scales"), rows, cols, bits, QUANT_GROUP,
        )
        self.fill(weight.qweight, name)
        self.executor.upload(weight.scales, np.full(groups, QUANT_SCALE, ml_dtypes.bfloat16), label=f"scales {name}")
        return self.executor.adopt_weight(weight, role)

    def close(self) -> None:
        """Wait for every fill, then free the source."""
        self.executor.compute.synchronize()
        self.source.free()
