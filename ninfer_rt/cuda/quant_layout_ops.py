"""Launch wrapper for kernels_src/quant_layout.cu: a quantized weight's codes, uploaded as the checkpoint
stores them (LAYOUT_ROWS), rearranged into the GPU's octet layout on the device. quantize.layouts.device_layout
defines the result; this is the same rearrangement at the device's bandwidth instead of numpy's."""

from __future__ import annotations

from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec
from ninfer_rt.cuda.linear_ops import _require_device_bytes
from ninfer_rt.cuda.memory import Buffer
from ninfer_rt.cuda.streams import require_stream
from ninfer_rt.quantize.format import LANES, column_inputs
from ninfer_rt.quantize.layouts import padded_octets

_THREADS = 256
_MAX_BLOCKS = 4096  # grid-stride: enough blocks to fill any current GPU
_CHUNK_BYTES = 16
_SIGNATURE = (Arg.PTR, Arg.PTR, Arg.I64, Arg.I32, Arg.I32)


def octets_from_rows_spec(bits: int) -> KernelSpec:
    return KernelSpec("quant_layout", f"octets_from_rows_int{bits}", _SIGNATURE)


def octet_code_bytes(bits: int, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight's codes in the GPU layout, its padding rows included."""
    return padded_octets(rows) * (cols // column_inputs(bits)) * LANES * _CHUNK_BYTES


def octets_from_rows(
    lib: KernelLibrary, stream: object, row_codes: Buffer, octets: Buffer, bits: int, rows: int, cols: int, *,
    label: str = "octets_from_rows", lane: object = None,
) -> None:
    """octets = the codes of row_codes (uint8 [rows, cols * bits / 8], as stored) in the GPU layout."""
    stream = require_stream(stream)
    if bits not in (4, 8) or rows <= 0 or cols <= 0 or cols % column_inputs(bits):
        raise ValueError(
            f"octets_from_rows: int{bits} [{rows}, {cols}] does not fit the GPU layout "
            f"(int4 or int8, inputs a multiple of {column_inputs(bits) if bits in (4, 8) else 'a column'})"
        )
    out_bytes = octet_code_bytes(bits, rows, cols)
    _require_device_bytes("octets_from_rows", row_codes=(row_codes, rows * cols * bits // 8), octets=(octets, out_bytes))
    chunks = out_bytes // _CHUNK_BYTES
    blocks = min(_MAX_BLOCKS, -(-chunks // _THREADS))
    lib.kernel(octets_from_rows_spec(bits)).launch(
        stream, blocks, _THREADS, octets, row_codes, chunks, rows, cols,
        label=label, reads=(row_codes.resource,), writes=(octets.resource,), lane=lane,
    )
