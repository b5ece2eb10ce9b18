"""Launch wrappers for groupwise-quantized weights (kernels_src/gemv_quant.cu): the decode GEMV with
in-register dequantization, and dequantization to bf16 for the prefill GEMM (cuBLASLt).

The weight layout is quant.py's (documented at the top of gemv_quant.cu). Each wrapper checks shapes,
group size and alignment before anything is enqueued and declares what the kernel reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec
from ninfer_rt.cuda.linear_ops import Epilogue, _require_device_bytes, gemv_bucket, residual_entry
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.ops import _require_positive
from ninfer_rt.cuda.streams import require_stream

_ROWS_PER_WARP = 4  # kRowsPerWarp in gemv_quant.cu
_WARPS_PER_BLOCK = 4  # kWarpsPerBlock in gemv_quant.cu
_DEQUANT_THREADS = 256
_MAX_DEQUANT_BLOCKS = 4096  # grid-stride: enough blocks to fill any current GPU
CHUNK_BYTES = 16  # one vector load of weights
# The kernel's epilogue argument (gemv_common.cuh's Epilogue, plus kStoreF32 = 3 in gemv_quant.cu).
_EPILOGUE_CODE = {Epilogue.STORE: 0, Epilogue.RESIDUAL: 1, Epilogue.SWIGLU: 2, Epilogue.STORE_F32: 3}
_GEMV_SIGNATURE = (Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32, Arg.I32, Arg.I32)
_DEQUANT_SIGNATURE = (Arg.PTR, Arg.PTR, Arg.PTR, Arg.I64, Arg.I32, Arg.I32)


@dataclass(eq=False)
class QuantizedDeviceWeight:
    """A quantized weight [rows, cols] on the device: codes and scales in quant.py's layout."""

    qweight: DeviceBuffer  # uint8 [rows, cols * bits / 8]
    scales: DeviceBuffer  # bf16 [rows, cols / group_size]
    rows: int
    cols: int
    bits: int
    group_size: int

    @property
    def buffer(self) -> DeviceBuffer:
        """The codes: what names the weight (the executor recognises a fused gate_up by its name)."""
        return self.qweight

    @property
    def values_per_chunk(self) -> int:
        return CHUNK_BYTES * 8 // self.bits

    @property
    def group_shift(self) -> int:
        """log2(chunks per group), the kernels' scale index shift."""
        return (self.group_size // self.values_per_chunk).bit_length() - 1

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.bits // 8 + self.rows * (self.cols // self.group_size) * 2

    def check(self, op: str) -> None:
        _require_positive(op, rows=self.rows, cols=self.cols)
        if self.bits not in (4, 8):
            raise ValueError(f"{op}: {self.bits}-bit weights are not supported (4 or 8)")
        chunk = self.values_per_chunk
        if self.group_size < chunk or self.group_size & (self.group_size - 1) or self.cols % self.group_size:
            raise ValueError(
                f"{op}: group size {self.group_size} must be a power of two >= {chunk} dividing cols={self.cols}"
            )
        _require_device_bytes(
            op, qweight=(self.qweight, self.rows * self.cols * self.bits // 8),
            scales=(self.scales, self.rows * (self.cols // self.group_size) * 2),
        )


def gemv_spec(bits: int, rows: int) -> KernelSpec:
    bucket = gemv_bucket("gemv_quant", rows, "dequantize + cuBLASLt above")
    return KernelSpec("gemv_quant", f"gemv_int{bits}_b{bucket}", _GEMV_SIGNATURE)


def dequantize_spec(bits: int) -> KernelSpec:
    return KernelSpec("gemv_quant", f"dequantize_int{bits}_bf16", _DEQUANT_SIGNATURE)


def gemv(
    lib: KernelLibrary,
    stream: object,
    x: Buffer,
    w: QuantizedDeviceWeight,
    y: Buffer,
    rows: int,
    epilogue: Epilogue = Epilogue.STORE,
    residual: Buffer | None = None,
    *,
    label: str = "gemv_quant",
    lane: object = None,
) -> None:
    """y[rows, n] = epilogue(x[rows, K] @ W^T) with W dequantized in registers; n = w.rows, or w.rows / 2
    for SWIGLU (W = [gate; up])."""
    stream = require_stream(stream)
    w.check("gemv_quant")
    _require_positive("gemv_quant", rows=rows)
    n = w.rows // 2 if epilogue is Epilogue.SWIGLU else w.rows
    if epilogue is Epilogue.SWIGLU and w.rows % 2:
        raise ValueError(f"gemv_quant: a SwiGLU weight has an even number of rows (gate, then up), got {w.rows}")
    _require_device_bytes(
        "gemv_quant", x=(x, rows * w.cols * 2), y=(y, rows * n * epilogue.out_bytes),
        **residual_entry("gemv_quant", epilogue, residual, rows * n * 2),
    )
    outputs_per_warp = _ROWS_PER_WARP // 2 if epilogue is Epilogue.SWIGLU else _ROWS_PER_WARP
    warps = -(-n // outputs_per_warp)
    reads = (x.resource, w.qweight.resource, w.scales.resource) + ((residual.resource,) if residual is not None else ())
    lib.kernel(gemv_spec(w.bits, rows)).launch(
        stream, -(-warps // _WARPS_PER_BLOCK), 32 * _WARPS_PER_BLOCK,
        y, x, w.qweight, w.scales, residual.ptr if residual is not None else 0, rows, n, w.cols, w.group_shift,
        _EPILOGUE_CODE[epilogue],
        label=label, reads=reads, writes=(y.resource,), lane=lane,
    )


def dequantize(
    lib: KernelLibrary, stream: object, w: QuantizedDeviceWeight, out: Buffer, *, label: str = "dequantize",
    lane: object = None,
) -> None:
    """out bf16 [w.rows, w.cols] = the dequantized weight (each value rounded to bf16 once): the prefill
    path multiplies it with cuBLASLt."""
    stream = require_stream(stream)
    w.check("dequantize")
    _require_device_bytes("dequantize", out=(out, w.rows * w.cols * 2))
    chunks_per_row = w.cols // w.values_per_chunk
    chunks = w.rows * chunks_per_row
    blocks = min(_MAX_DEQUANT_BLOCKS, -(-chunks // _DEQUANT_THREADS))
    lib.kernel(dequantize_spec(w.bits)).launch(
        stream, blocks, _DEQUANT_THREADS, out, w.qweight, w.scales, chunks, chunks_per_row, w.group_shift,
        label=label, reads=(w.qweight.resource, w.scales.resource), writes=(out.resource,), lane=lane,
    )
