"""The CUDA executor's linear layers: which kernel computes x @ W^T for a dense (bf16) or groupwise-quantized
weight, on the executor's compute stream.

Up to linear_ops.GEMV_MAX_ROWS rows, the decode GEMV (memory bound: gemv.cu; gemv_quant.cu for int4/int8
weights, dequantized in registers). Above, a GEMM: cuBLASLt for bf16 weights; for quantized weights
NINFER_QUANT_GEMM picks the form, `dequant` (the default: the weight dequantized into the one bf16 scratch
matrix of exec/cuda_weights.py, then cuBLASLt) or `fused` (gemm_quant.cu: dequantized inside the GEMM's main
loop from the GEMV's layout, no scratch and no bf16 round trip through memory).

A SplitFormatWeight (quantized rows, then bf16 rows: a quantized Gated DeltaNet's input projection) is one
launch at decode widths, gemv_quant.cu's GEMV with the bf16 rows as its dense tail; above, two GEMMs, the
quantized one into the output's first columns and cuBLASLt into the rest (a strided output), no concat.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ninfer_rt.cuda import gemm_quant_ops, linear_ops, quant_ops
from ninfer_rt.cuda.blas import Blas, GemmShape
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.memory import Buffer, DeviceView
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import Stream
from ninfer_rt.exec.cuda_tensors import ITEMSIZE, DeviceTensor
from ninfer_rt.exec.cuda_weights import DeviceWeights, SplitFormatWeight, Weight

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

    def matmul(self, x: DeviceTensor, weight: Weight, out: DeviceTensor, lane: object) -> None:
        """out = x @ weight^T (bf16, or f32 for an f32 `out`): the GEMV at decode widths, GEMMs above."""
        label = f"linear {weight.buffer.name}"
        if x.rows <= linear_ops.GEMV_MAX_ROWS:
            self.gemv(x, weight, out, Epilogue.STORE_F32 if out.dtype == "f32" else Epilogue.STORE, label, lane)
            return
        if not isinstance(weight, SplitFormatWeight):
            self._gemm(x, weight, out.buffer, out, label, lane)
            return
        # The quantized rows' outputs into out's first columns, the dense rows' into the columns after them.
        self._gemm(x, weight.quantized, out.buffer, out, label, lane)
        offset = weight.quantized.rows * ITEMSIZE[out.dtype]
        columns = DeviceView(out.buffer, offset, out.buffer.nbytes - offset, f"{out.buffer.name}[:, {weight.quantized.rows}:]")
        self._gemm(x, weight.dense, columns, out, f"{label} (dense rows)", lane)

    def gemv(self, x: DeviceTensor, weight: Weight, out: DeviceTensor, epilogue: Epilogue, label: str, lane: object) -> None:
        quantized, tail = (weight.quantized, weight.tail) if isinstance(weight, SplitFormatWeight) else (weight, None)
        if isinstance(quantized, QuantizedDeviceWeight):  # a split-format weight's dense rows: the GEMV's tail
            quant_ops.gemv(
                self.library, self.compute, x.buffer, quantized, out.buffer, x.rows, epilogue, label=label, lane=lane, tail=tail,
            )
            return
        linear_ops.gemv(
            self.library, self.compute, x.buffer, weight.buffer, out.buffer, x.rows, out.cols, x.cols, epilogue,
            label=label, lane=lane,
        )

    def _gemm(
        self, x: DeviceTensor, weight: DeviceTensor | QuantizedDeviceWeight, target: Buffer, out: DeviceTensor, label: str,
        lane: object,
    ) -> None:
        """target (out's buffer, or a view of its columns from some column on) = x @ weight^T, its rows out.cols
        elements apart."""
        dense = weight.buffer
        if isinstance(weight, QuantizedDeviceWeight):
            if self.quant_gemm == "fused":
                epilogue = Epilogue.STORE_F32 if out.dtype == "f32" else Epilogue.STORE
                gemm_quant_ops.gemm(
                    self.library, self.compute, x.buffer, weight, target, x.rows, epilogue, label=label, lane=lane,
                    out_stride=out.cols,
                )
                return
            dense = self.weights.dequantized(weight, label, lane)
        stride = None if out.cols == weight.rows else out.cols  # a packed output shares the plain GEMM's plan
        shape = GemmShape(x.rows, weight.rows, x.cols, out.dtype, out_stride=stride)
        self.blas.gemm(self.compute, x.buffer, dense, target, shape, label=label, lane=lane)
