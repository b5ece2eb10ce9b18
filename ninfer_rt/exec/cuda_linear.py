"""The CUDA executor's linear layers: which kernel computes x @ W^T for a dense (bf16) or groupwise-quantized
weight, on the executor's compute stream.

Up to linear_ops.GEMV_MAX_ROWS rows, the decode GEMV (memory bound: gemv.cu; gemv_quant.cu for int4/int8
weights, dequantized in registers). Above, a GEMM: cuBLASLt for bf16 weights; for quantized weights
NINFER_QUANT_GEMM picks the form, `dequant` (the default: the weight dequantized into the one bf16 scratch
matrix of exec/cuda_weights.py, then cuBLASLt) or `fused` (gemm_quant.cu: dequantized inside the GEMM's main
loop from the GEMV's layout, no scratch and no bf16 round trip through memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ninfer_rt.cuda import gemm_quant_ops, linear_ops, quant_ops
from ninfer_rt.cuda.blas import Blas, GemmShape
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import Stream
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.exec.cuda_weights import DeviceWeights

QUANT_GEMM_ENV = "NINFER_QUANT_GEMM"
QUANT_GEMM_FORMS = ("dequant", "fused")


def quant_gemm_from_env() -> str:
    form = os.environ.get(QUANT_GEMM_ENV, QUANT_GEMM_FORMS[0])
    if form not in QUANT_GEMM_FORMS:
        raise ValueError(f"{QUANT_GEMM_ENV}={form!r}: expected one of {', '.join(QUANT_GEMM_FORMS)}")
    return form


@dataclass(eq=False)
class LinearOps:
    """x @ W^T into a given output tensor; `quant_gemm` is the quantized GEMM's form (QUANT_GEMM_FORMS)."""

    library: KernelLibrary
    compute: Stream
    blas: Blas
    weights: DeviceWeights
    quant_gemm: str = QUANT_GEMM_FORMS[0]

    def __post_init__(self) -> None:
        if self.quant_gemm not in QUANT_GEMM_FORMS:
            raise ValueError(f"quant_gemm={self.quant_gemm!r}: expected one of {', '.join(QUANT_GEMM_FORMS)}")

    def matmul(self, x: DeviceTensor, weight: DeviceTensor | QuantizedDeviceWeight, out: DeviceTensor, lane: object) -> None:
        """out = x @ weight^T (bf16, or f32 for an f32 `out`): the GEMV at decode widths, a GEMM above."""
        label = f"linear {weight.buffer.name}"
        if x.rows <= linear_ops.GEMV_MAX_ROWS:
            self.gemv(x, weight, out, Epilogue.STORE_F32 if out.dtype == "f32" else Epilogue.STORE, label, lane)
            return
        dense = weight.buffer
        if isinstance(weight, QuantizedDeviceWeight):
            if self.quant_gemm == "fused":
                epilogue = Epilogue.STORE_F32 if out.dtype == "f32" else Epilogue.STORE
                gemm_quant_ops.gemm(self.library, self.compute, x.buffer, weight, out.buffer, x.rows, epilogue, label=label, lane=lane)
                return
            dense = self.weights.dequantized(weight, label, lane)
        self.blas.gemm(
            self.compute, x.buffer, dense, out.buffer, GemmShape(x.rows, weight.rows, x.cols, out.dtype), label=label, lane=lane,
        )

    def gemv(
        self, x: DeviceTensor, weight: DeviceTensor | QuantizedDeviceWeight, out: DeviceTensor, epilogue: Epilogue, label: str,
        lane: object,
    ) -> None:
        if isinstance(weight, QuantizedDeviceWeight):
            quant_ops.gemv(self.library, self.compute, x.buffer, weight, out.buffer, x.rows, epilogue, label=label, lane=lane)
            return
        linear_ops.gemv(
            self.library, self.compute, x.buffer, weight.buffer, out.buffer, x.rows, out.cols, x.cols, epilogue,
            label=label, lane=lane,
        )
