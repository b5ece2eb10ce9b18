"""Launch wrapper for the prefill GEMM over groupwise-quantized weights: x @ W^T for any number of tokens, W
dequantized inside the GEMM's main loop from the decode GEMV's layout (LAYOUT_OCTETS), so no bf16 copy of the
weights is made. Two kernels over the same formats: gemm_quant.cu (mma.sync, every arch; the products q * x
exact, the scale applied in f32) and, on sm_90a from SM90_MIN_ROWS tokens on, gemm_quant_sm90.cu (wgmma,
128-token tiles; each weight rounded to the bf16 q * scale the dequantize + cuBLASLt path multiplies).

The constants below mirror the kernels' (tests/test_gemm_quant_compile.py reads them back from the sources):
the tiles, the pipeline stages and the raster order, which tests/gemm_quant_emulation.py and
tests/gemm_quant_sm90_emulation.py follow on the CPU.
The wrapper checks the weight, the shapes and the alignment before anything is enqueued and declares what the
kernel reads and writes.
"""

from __future__ import annotations

from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec, kernel_with_smem
from ninfer_rt.cuda.linear_ops import Epilogue, _require_device_bytes, residual_entry
from ninfer_rt.cuda.memory import Buffer
from ninfer_rt.cuda.ops import _require_positive
from ninfer_rt.cuda.quant_ops import _EPILOGUE_CODE, _SCALE_SUFFIX, CHUNK_BYTES, QuantizedDeviceWeight
from ninfer_rt.cuda.streams import require_stream
from ninfer_rt.quantize.format import ScaleFormat, column_inputs

WARPS = 8  # kGemmWarps
THREADS = 32 * WARPS
WARP_PAIRS = 2  # kWarpPairs: octet pairs (16-row mma tiles) per warp
TILE_OCTETS = 2 * WARP_PAIRS * WARPS  # kTileOctets: 256 weight rows per block
RASTER_TILES = 8  # kRasterTiles: row tiles per raster group
CHAINS = 2  # kChains: n8 tiles per pass over a segment's A fragments
STAGES_INT4, STAGES_INT8 = 2, 3  # kStagesInt4, kStagesInt8: pipeline stages
TOKEN_TILES = (32, 64)  # T: the _t32 and _t64 kernels
LANES = 32
# gemm_quant_sm90.cu: 2 warpgroups (kBlockThreads), 128 tokens (kTokens) by TILE_OCTETS octets a block (its
# kTileOctets, kRasterTiles are the mma.sync kernel's), SM90_STAGES stages (kStages) of 1 KiB-rounded bytes
SM90_THREADS = 256
SM90_TOKENS = 128
SM90_STAGES = 4
SM90_MIN_ROWS = 65  # below, the mma.sync kernel's 32- and 64-token tiles: a GEMM that short is bound by its weights
EPILOGUES = (Epilogue.STORE, Epilogue.RESIDUAL, Epilogue.STORE_F32)
_SIGNATURE = (Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32, Arg.I32, Arg.I32, Arg.I32)


def segments(bits: int, group_size: int) -> int:
    """SEGS: scale segments per column, 1 when a group covers the column (KC inputs), else KC / G."""
    return max(1, column_inputs(bits) // group_size)


def token_tile(rows: int) -> int:
    """T for `rows` tokens: 32 up to 32 rows (weight-bound GEMMs: a wider tile would only add mma work), else 64."""
    return TOKEN_TILES[0] if rows <= TOKEN_TILES[0] else TOKEN_TILES[1]


def stages(bits: int) -> int:
    return STAGES_INT4 if bits == 4 else STAGES_INT8


def stage_chunks(bits: int, group_size: int, tokens: int) -> tuple[int, int, int]:
    """(weight, x, scale) 16-byte chunks of one pipeline stage (gemm_quant.cu's StageLayout)."""
    return TILE_OCTETS * LANES, tokens * column_inputs(bits) // 8, TILE_OCTETS * segments(bits, group_size)


def smem_bytes(bits: int, group_size: int, tokens: int) -> int:
    """Dynamic shared memory of one block: stages(bits) stages (StageLayout::kBytes)."""
    return stages(bits) * sum(stage_chunks(bits, group_size, tokens)) * CHUNK_BYTES


def variant_name(bits: int, group_size: int, scale_format: ScaleFormat) -> str:
    """gemm_int<bits>[_g<group>][_f16s]: the group in the name when it is smaller than a column (a scale per
    segment), `_f16s` for fp16 scales; both kernels' entry points extend it."""
    group = f"_g{group_size}" if segments(bits, group_size) > 1 else ""
    return f"gemm_int{bits}{group}{_SCALE_SUFFIX[scale_format]}"


def gemm_spec(bits: int, group_size: int, tokens: int, scale_format: ScaleFormat = ScaleFormat.BF16) -> KernelSpec:
    """gemm_quant.cu's <variant>_t<tokens>."""
    if tokens not in TOKEN_TILES:
        raise ValueError(f"gemm_quant: token tiles are {TOKEN_TILES}, not {tokens}")
    return KernelSpec("gemm_quant", f"{variant_name(bits, group_size, scale_format)}_t{tokens}", _SIGNATURE)


def grid_blocks(w: QuantizedDeviceWeight, rows: int, tokens: int) -> int:
    """Row tiles (TILE_OCTETS octets each) x token tiles, one grid dimension."""
    return -(-w.octets // TILE_OCTETS) * -(-rows // tokens)


def sm90_spec(bits: int, group_size: int, scale_format: ScaleFormat = ScaleFormat.BF16) -> KernelSpec:
    """gemm_quant_sm90.cu's <variant>_sm90."""
    return KernelSpec("gemm_quant_sm90", f"{variant_name(bits, group_size, scale_format)}_sm90", _SIGNATURE)


def sm90_stage_bytes(bits: int, group_size: int) -> int:
    """Stage<BITS, SEGS>::kBytes: x (KC / 64 halves of 128 tokens x 128 bytes), weights, the segments' scales,
    rounded up to 1 KiB."""
    x = column_inputs(bits) // 64 * SM90_TOKENS * 128
    scales = TILE_OCTETS * segments(bits, group_size) * CHUNK_BYTES
    return -(-(x + TILE_OCTETS * LANES * CHUNK_BYTES + scales) // 1024) * 1024


def sm90_smem_bytes(bits: int, group_size: int) -> int:
    """Dynamic shared memory of an sm_90a block: SM90_STAGES stages and the 1 KiB that aligns them to the
    128-byte swizzle's atoms."""
    return SM90_STAGES * sm90_stage_bytes(bits, group_size) + 1024


def uses_sm90(arch: str, rows: int, wgmma: bool | None = None) -> bool:
    """Whether `gemm` runs gemm_quant_sm90.cu for `rows` tokens on `arch`: on sm_90a from SM90_MIN_ROWS rows on
    (None), on sm_90a whatever the rows (True: an error elsewhere), never (False)."""
    applies = arch == "sm_90a"
    if wgmma and not applies:
        raise ValueError(f"gemm_quant: the wgmma kernels need sm_90a ({arch})")
    return applies and (wgmma or (wgmma is None and rows >= SM90_MIN_ROWS))


def gemm(
    lib: KernelLibrary,
    stream: object,
    x: Buffer,
    w: QuantizedDeviceWeight,
    y: Buffer,
    rows: int,
    epilogue: Epilogue = Epilogue.STORE,
    residual: Buffer | None = None,
    *,
    label: str = "gemm_quant",
    lane: object = None,
    out_stride: int | None = None,
    wgmma: bool | None = None,
) -> None:
    """y[rows, N] = epilogue(x[rows, K] @ W^T), N = w.rows, W dequantized in the GEMM's registers: STORE (bf16),
    STORE_F32, or RESIDUAL (bf16(x @ W^T) + residual; y may alias residual). y's (and residual's) rows are
    `out_stride` elements apart (None: N), so the product may fill the first N columns of a wider output.
    `wgmma` picks the kernel (uses_sm90)."""
    stream = require_stream(stream)
    w.check("gemm_quant")
    _require_positive("gemm_quant", rows=rows)
    if epilogue not in EPILOGUES:
        raise ValueError(f"gemm_quant: the {epilogue.name} epilogue is the GEMV's; the GEMM has {[e.name for e in EPILOGUES]}")
    n = w.rows
    ldy = n if out_stride is None else out_stride
    if ldy < n:
        raise ValueError(f"gemm_quant: out rows {ldy} apart cannot hold the weight's {n} rows")
    span = (rows - 1) * ldy + n  # elements from y's first to its last
    _require_device_bytes(
        "gemm_quant", x=(x, rows * w.cols * 2), y=(y, span * epilogue.out_bytes),
        **residual_entry("gemm_quant", epilogue, residual, span * 2),
    )
    if uses_sm90(lib.target_arch, rows, wgmma):
        spec, smem = sm90_spec(w.bits, w.group_size, w.scale_format), sm90_smem_bytes(w.bits, w.group_size)
        tokens, threads = SM90_TOKENS, SM90_THREADS
    else:
        tokens, threads = token_tile(rows), THREADS
        spec, smem = gemm_spec(w.bits, w.group_size, tokens, w.scale_format), smem_bytes(w.bits, w.group_size, tokens)
    kernel = kernel_with_smem(lib, spec, smem)
    reads = (x.resource, w.qweight.resource, w.scales.resource) + ((residual.resource,) if residual is not None else ())
    kernel.launch(
        stream, grid_blocks(w, rows, tokens), threads,
        y, x, w.qweight, w.scales, residual.ptr if residual is not None else 0, rows, n, w.cols, w.group_log2,
        _EPILOGUE_CODE[epilogue], ldy,
        smem=smem, label=label, reads=reads, writes=(y.resource,), lane=lane,
    )
