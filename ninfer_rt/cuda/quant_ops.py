"""Launch wrappers for groupwise-quantized weights (kernels_src/gemv_quant.cu): the decode GEMV with
in-register dequantization on the tensor cores (optionally followed, in the same launch, by a bf16 tail of
rows: a projection whose last rows are kept bf16), and dequantization to bf16 for the prefill GEMM
(cuBLASLt).

The weights are in the GPU layout (quantize.layouts.device_layout, LAYOUT_OCTETS: documented at the top of
gemv_quant.cu). Each wrapper checks shapes, group size and alignment before anything is enqueued and
declares what the kernel reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec
from ninfer_rt.cuda.linear_ops import Epilogue, _require_device_bytes, gemv_bucket, residual_entry
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.ops import _require_positive
from ninfer_rt.cuda.streams import require_stream
from ninfer_rt.quantize.format import ScaleFormat

_TILE_ROWS = 16  # weight rows per block (two octets: the rows of an m16n8k16 mma)
_OCTET_ROWS = 8
WARPS = (8, 16)  # the GEMV's warps per block (W in gemv_quant.cu): gemv_warps picks
_DEQUANT_THREADS = 256
_MAX_DEQUANT_BLOCKS = 4096  # grid-stride: enough blocks to fill any current GPU
CHUNK_BYTES = 16  # one vector load of weights
MIN_GROUP_SIZE = 32  # a run of 32 inputs (8 per lane of an mma's 4) shares one scale
# The kernel's epilogue argument (gemv_common.cuh's Epilogue, plus kStoreF32 = 3 in gemv_quant.cu).
_EPILOGUE_CODE = {Epilogue.STORE: 0, Epilogue.RESIDUAL: 1, Epilogue.SWIGLU: 2, Epilogue.STORE_F32: 3}
_GEMV_SIGNATURE = (
    Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32, Arg.I32, Arg.I32, Arg.PTR, Arg.I32,
)
_DEQUANT_SIGNATURE = (Arg.PTR, Arg.PTR, Arg.PTR, Arg.I64, Arg.I32, Arg.I32, Arg.I32)
# (bits, group size) with fp16-scale kernels: the `.ninfer` formats as bound (Q4G64; Q5G64 / Q6G64 widened to
# int8; W8G32).
F16S_FORMATS = ((4, 64), (8, 64), (8, 32))
_SCALE_SUFFIX = {ScaleFormat.BF16: "", ScaleFormat.FP16: "_f16s"}


@dataclass(eq=False)
class QuantizedDeviceWeight:
    """A quantized weight [rows, cols] on the device: codes and scales in the GPU layout (LAYOUT_OCTETS)."""

    qweight: DeviceBuffer  # uint8 [octets, cols / column_inputs, 32, 16]
    scales: DeviceBuffer  # bf16 or fp16 (scale_format) [octets, cols / group_size, 8]
    rows: int
    cols: int
    bits: int
    group_size: int
    scale_format: ScaleFormat = ScaleFormat.BF16

    @property
    def buffer(self) -> DeviceBuffer:
        """The codes: the buffer that names the weight (labels) and keys its role in the executor."""
        return self.qweight

    @property
    def column_inputs(self) -> int:
        """Inputs per column of the layout: 4 lanes x one 16-byte chunk (int4: 128, int8: 64)."""
        return 4 * CHUNK_BYTES * 8 // self.bits

    @property
    def octets(self) -> int:
        """Octets of 8 rows the layout holds: the rows padded to an even number of octets."""
        octets = -(-self.rows // _OCTET_ROWS)
        return octets + octets % 2

    @property
    def group_log2(self) -> int:
        """log2(group_size), the kernels' group argument."""
        return self.group_size.bit_length() - 1

    @property
    def nbytes(self) -> int:
        return self.code_bytes + self.scale_bytes

    @property
    def code_bytes(self) -> int:
        return self.octets * _OCTET_ROWS * self.cols * self.bits // 8

    @property
    def scale_bytes(self) -> int:
        return self.octets * _OCTET_ROWS * (self.cols // self.group_size) * 2

    def check(self, op: str) -> None:
        _require_positive(op, rows=self.rows, cols=self.cols)
        if self.bits not in (4, 8):
            raise ValueError(f"{op}: {self.bits}-bit weights are not supported (4 or 8)")
        if self.group_size < MIN_GROUP_SIZE or self.group_size & (self.group_size - 1) or self.cols % self.group_size:
            raise ValueError(
                f"{op}: group size {self.group_size} must be a power of two >= {MIN_GROUP_SIZE} dividing cols={self.cols}"
            )
        if self.cols % self.column_inputs:
            raise ValueError(f"{op}: int{self.bits} weights need cols % {self.column_inputs} == 0, got cols={self.cols}")
        if self.scale_format is ScaleFormat.FP16 and (self.bits, self.group_size) not in F16S_FORMATS:
            raise ValueError(
                f"{op}: fp16 scales have kernels for (bits, group) in {F16S_FORMATS}, not ({self.bits}, {self.group_size})"
            )
        _require_device_bytes(op, qweight=(self.qweight, self.code_bytes), scales=(self.scales, self.scale_bytes))


def gemv_spec(
    bits: int, rows: int, group_size: int = 128, warps: int = WARPS[0], scale_format: ScaleFormat = ScaleFormat.BF16
) -> KernelSpec:
    """gemv_int<bits>_b<bucket> for groups of at least a column; gemv_int<bits>_g<group> (rows <= 8) for
    smaller groups, which need a scale per segment of a column; then `_f16s` for fp16 scales, `_w16` for 16
    warps per block."""
    bucket = gemv_bucket("gemv_quant", rows, "dequantize + cuBLASLt above")
    if warps not in WARPS:
        raise ValueError(f"gemv_quant: {warps} warps per block, kernels exist for {WARPS}")
    suffix = _SCALE_SUFFIX[scale_format] + ("" if warps == WARPS[0] else f"_w{warps}")
    if group_size < 4 * CHUNK_BYTES * 8 // bits:
        return KernelSpec("gemv_quant", f"gemv_int{bits}_g{group_size}{suffix}", _GEMV_SIGNATURE)
    return KernelSpec("gemv_quant", f"gemv_int{bits}_b{bucket}{suffix}", _GEMV_SIGNATURE)


@dataclass(frozen=True)
class DenseTail:
    """bf16 rows [rows, cols] that follow a quantized weight's rows in one projection: the GEMV computes them
    in the same launch, into the columns after the quantized weight's (gemv_quant.cu, "Dense tail")."""

    weight: Buffer
    rows: int


def _outputs(w: QuantizedDeviceWeight, epilogue: Epilogue) -> int:
    """n: the GEMV's outputs per row from the quantized weight (SWIGLU pairs gate row i with up row n + i)."""
    return w.rows // 2 if epilogue is Epilogue.SWIGLU else w.rows


def tail_tiles(tail: DenseTail | None) -> int:
    """Blocks of 16 tail rows, launched ahead of the quantized tiles (0 without a tail)."""
    return 0 if tail is None else -(-tail.rows // _TILE_ROWS)


def gemv_launch(
    w: QuantizedDeviceWeight, rows: int, epilogue: Epilogue, sm_count: int, warps: int | None = None,
    tail: DenseTail | None = None,
) -> tuple[KernelSpec, int, int]:
    """(kernel, blocks, threads per block) of gemv for `w`: one block per 16 output rows (per 8 gate/up pairs
    for SWIGLU), plus one per 16 rows of a dense tail; `warps` per block, gemv_warps' choice if None."""
    n = _outputs(w, epilogue)
    tiles = (n // _OCTET_ROWS if epilogue is Epilogue.SWIGLU else -(-n // _TILE_ROWS)) + tail_tiles(tail)
    warps = gemv_warps(tiles, sm_count) if warps is None else warps
    return gemv_spec(w.bits, rows, w.group_size, warps, w.scale_format), tiles, 32 * warps


def gemv_warps(tiles: int, sm_count: int) -> int:
    """Warps per block for a grid of `tiles` blocks: 16 when every block fits in one wave at two 512-thread
    blocks per SM (the grid would otherwise leave each SM a quarter of its warps), else 8 (a grid that
    would need a second wave of 16-warp blocks runs faster with 8; gemv_quant.cu's header has the figures)."""
    return WARPS[1] if tiles <= 2 * sm_count else WARPS[0]


def dequantize_spec(bits: int, scale_format: ScaleFormat = ScaleFormat.BF16) -> KernelSpec:
    return KernelSpec("gemv_quant", f"dequantize_int{bits}{_SCALE_SUFFIX[scale_format]}_bf16", _DEQUANT_SIGNATURE)


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
    warps: int | None = None,
    tail: DenseTail | None = None,
) -> None:
    """y[rows, n] = epilogue(x[rows, K] @ W^T) with W dequantized in registers; n = w.rows, or w.rows / 2
    for SWIGLU (W = [gate; up], n % 8 == 0). With a dense `tail` (STORE only) y is [rows, n + tail.rows]:
    row b = [x_b @ W^T | x_b @ tail^T], one launch. `warps` per block: gemv_warps' choice unless given (tests)."""
    stream = require_stream(stream)
    w.check("gemv_quant")
    _require_positive("gemv_quant", rows=rows)
    n = _outputs(w, epilogue)
    if epilogue is Epilogue.SWIGLU and (w.rows % 2 or n % _OCTET_ROWS):
        raise ValueError(
            f"gemv_quant: a SwiGLU weight has 2N rows (gate, then up) with N % {_OCTET_ROWS} == 0, got {w.rows}"
        )
    y_cols = n + _check_tail(tail, epilogue)
    _require_device_bytes(
        "gemv_quant", x=(x, rows * w.cols * 2), y=(y, rows * y_cols * epilogue.out_bytes),
        **residual_entry("gemv_quant", epilogue, residual, rows * n * 2),
        **({"tail": (tail.weight, tail.rows * w.cols * 2)} if tail is not None else {}),
    )
    weights = (w.qweight, w.scales) + ((tail.weight,) if tail is not None else ())
    reads = (x.resource, *(b.resource for b in weights)) + ((residual.resource,) if residual is not None else ())
    spec, tiles, threads = gemv_launch(w, rows, epilogue, lib.device.sm_count, warps, tail)
    lib.kernel(spec).launch(
        stream, tiles, threads,
        y, x, w.qweight, w.scales, residual.ptr if residual is not None else 0, rows, n, w.cols, w.group_log2,
        _EPILOGUE_CODE[epilogue], tail.weight if tail is not None else 0, tail.rows if tail is not None else 0,
        label=label, reads=reads, writes=(y.resource,), lane=lane,
    )


def _check_tail(tail: DenseTail | None, epilogue: Epilogue) -> int:
    """The tail's rows (0 without one); it is refused with any epilogue but STORE, or without rows."""
    if tail is None:
        return 0
    if epilogue is not Epilogue.STORE:
        raise ValueError(f"gemv_quant: a dense tail is computed with the STORE epilogue only, not {epilogue.name}")
    _require_positive("gemv_quant", tail_rows=tail.rows)
    return tail.rows


def dequantize(
    lib: KernelLibrary, stream: object, w: QuantizedDeviceWeight, out: Buffer, *, label: str = "dequantize",
    lane: object = None,
) -> None:
    """out bf16 [w.rows, w.cols] = the dequantized weight (each value rounded to bf16 once, which for fp16
    scales is the value their format defines): the prefill path multiplies it with cuBLASLt."""
    stream = require_stream(stream)
    w.check("dequantize")
    _require_device_bytes("dequantize", out=(out, w.rows * w.cols * 2))
    chunks = w.code_bytes // CHUNK_BYTES  # padding rows included; the kernel skips them
    blocks = min(_MAX_DEQUANT_BLOCKS, -(-chunks // _DEQUANT_THREADS))
    lib.kernel(dequantize_spec(w.bits, w.scale_format)).launch(
        stream, blocks, _DEQUANT_THREADS, out, w.qweight, w.scales, chunks, w.rows, w.cols, w.group_log2,
        label=label, reads=(w.qweight.resource, w.scales.resource), writes=(out.resource,), lane=lane,
    )
