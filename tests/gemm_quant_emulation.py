"""The prefill GEMM over quantized weights (kernels_src/gemm_quant.cu) emulated in numpy, following the kernel's
index math literally: the raster order of the blocks, each thread's cp.async copies into the stages of the
shared-memory ring (weights, scales, x with its swizzle; zero-filled past M and past the weight), the ring's
order of copies and reads, which chunk each lane reads and dequantizes (quant_fragments: the bit tricks, PTX's
m16n8k16 fragments), which token column each B fragment covers, the scale per segment and the epilogue's
bounds. Products and sums are float64, so the result is x @ W^T up to float64 rounding when the mapping is
right; the values each output would be stored from come back unrounded (NaN where nothing was stored), with
the number of stores per output.

All 256 threads of a block and the 32 lanes of each warp are numpy axes; the constants are the host's mirror
(ninfer_rt/cuda/gemm_quant_ops.py), which tests/test_gemm_quant_compile.py checks against the kernel source.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.cuda import gemm_quant_ops as plan
from ninfer_rt.quantize.format import LAYOUT_OCTETS, QuantizedWeight, ScaleFormat
from quant_fragments import G, LANE, T, bf16_halves, dequant_run, mma_m16n8k16

TID = np.arange(plan.THREADS)


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int
    bits: int
    group: int
    tokens: int  # T

    @property
    def octets(self) -> int:
        octets = -(-self.n // 8)
        return octets + octets % 2

    @property
    def column_k(self) -> int:
        return 4 * 16 * 8 // self.bits

    @property
    def row_chunks(self) -> int:
        return self.column_k // 8

    @property
    def segs(self) -> int:
        return plan.segments(self.bits, self.group)


def x_slot(row: np.ndarray | int, chunk: np.ndarray | int) -> np.ndarray:
    """gemm_quant.cu's x_slot: chunk q of token row r at q ^ 4 on odd rows."""
    return np.asarray(chunk) ^ ((np.asarray(row) & 1) << 2)


def b_slot(g: np.ndarray, j: int, t: np.ndarray) -> np.ndarray:
    """The slot of its token row whose 16 bytes lane (g, t) takes as run j's B fragments: chunk 4j + t, swizzled."""
    return x_slot(g, 4 * j + t)


def segment_group(column: int, segment: np.ndarray, s: Shape) -> np.ndarray:
    """The group of a column's scale segment: with SEGS > 1 the groups are KC / SEGS inputs, so consecutive."""
    return (column * s.column_k) // s.group + segment


def gemm_tile(block: int, row_tiles: int, token_tiles: int, tokens: int) -> tuple[int, int]:
    """(first octet, first token) of a block: groups of RASTER_TILES row tiles, the row tile fastest."""
    group_blocks = plan.RASTER_TILES * token_tiles
    group, first = block // group_blocks, block // group_blocks * plan.RASTER_TILES
    rows_in_group = min(plan.RASTER_TILES, row_tiles - first)
    i = block - group * group_blocks
    return (first + i % rows_in_group) * plan.TILE_OCTETS, (i // rows_in_group) * tokens


@dataclass(frozen=True)
class Globals:
    """The kernel's global arrays as 16-byte chunks of 4 little-endian words."""

    qweight: np.ndarray  # [octets * columns * 32, 4]
    scales: np.ndarray  # [octets * groups, 4]: 8 rows' 16-bit scales per chunk
    x: np.ndarray  # [M * K / 8, 4]: 8 bf16 inputs per chunk


def as_chunks(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view("<u4").reshape(-1, 4)


def copy_stage(stage: np.ndarray, src: Globals, s: Shape, octet0: int, token0: int, column: int, weights: bool, x: bool) -> None:
    """One stage's cp.async copies, every thread's (CopyPlan, copy_weights, copy_x): invalid ones zero-fill."""
    weight_chunks, x_chunks, _ = plan.stage_chunks(s.bits, s.group, s.tokens)
    columns, groups = s.k // s.column_k, s.k // s.group

    def copy(dst: np.ndarray, index: np.ndarray, valid: np.ndarray, table: np.ndarray) -> None:
        stage[dst] = np.where(valid[:, None], table[np.where(valid, index, 0)], 0)

    if weights:
        octet_step = plan.THREADS // 32
        for u in range(weight_chunks // plan.THREADS):
            octet = octet0 + TID // 32 + u * octet_step
            copy(TID + u * plan.THREADS, (octet * columns + column) * 32 + TID % 32, octet < s.octets, src.qweight)
        scale_threads = TID[: plan.TILE_OCTETS * s.segs]
        octet = octet0 + scale_threads // s.segs
        group = segment_group(column, scale_threads % s.segs, s)
        copy(weight_chunks + x_chunks + scale_threads, octet * groups + group, octet < s.octets, src.scales)
    if x:
        token_step = plan.THREADS // s.row_chunks
        row0, chunk = TID // s.row_chunks, TID % s.row_chunks
        x_chunk = row0 * s.row_chunks + x_slot(row0, chunk)  # CopyPlan::x_chunk: token_step is even
        for u in range(x_chunks // plan.THREADS):
            token = token0 + row0 + u * token_step
            copy(weight_chunks + x_chunk + u * plan.THREADS, (token * s.k + column * s.column_k) // 8 + chunk, token < s.m, src.x)


def gemm_column(acc: np.ndarray, stage: np.ndarray, s: Shape, f16s: bool) -> np.ndarray:
    """gemm_column for every warp at once: acc [warps, pairs, T / 8, 32 lanes, 4] + this column."""
    weight_chunks, x_chunks, _ = plan.stage_chunks(s.bits, s.group, s.tokens)
    scale_bits = stage[weight_chunks + x_chunks :].view("<u2").reshape(-1)  # (octet, segment, row g)
    warp = np.arange(plan.WARPS)[:, None, None]
    pair = np.arange(plan.WARP_PAIRS)[None, :, None]
    octet_a = 2 * (plan.WARP_PAIRS * warp + pair)  # [warps, pairs, 1]
    chunk_a, chunk_b = stage[octet_a * 32 + LANE], stage[(octet_a + 1) * 32 + LANE]  # [warps, pairs, 32, 4]
    runs_per_segment = s.column_k // 32 // s.segs
    n8 = np.arange(s.tokens // 8)[:, None]
    for seg in range(s.segs):
        scale_a = scale_value(scale_bits[(octet_a * s.segs + seg) * 8 + G], f16s)  # [warps, pairs, 32]
        scale_b = scale_value(scale_bits[((octet_a + 1) * s.segs + seg) * 8 + G], f16s)
        part = np.zeros_like(acc)
        for r in range(runs_per_segment):
            j = seg * runs_per_segment + r
            qa, qb = dequant_run(chunk_a, j, s.bits), dequant_run(chunk_b, j, s.bits)
            # B: lane (g, t) of n8 tile i reads token 8i + g's chunk 4j + t, at its swizzled slot.
            xv = stage[weight_chunks + (8 * n8 + G) * s.row_chunks + b_slot(G, j, T)]  # [T / 8, 32, 4]
            a = [r_[:, :, None] for r_ in (qa[0], qb[0], qa[1], qb[1])]
            part = mma_m16n8k16(part, a, [xv[..., 0], xv[..., 1]])
            a = [r_[:, :, None] for r_ in (qa[2], qb[2], qa[3], qb[3])]
            part = mma_m16n8k16(part, a, [xv[..., 2], xv[..., 3]])
        scale = np.stack([scale_a, scale_a, scale_b, scale_b], axis=-1)[:, :, None]  # [warps, pairs, 1, 32, 4]
        acc = acc + scale * part
    return acc


def scale_value(bits: np.ndarray, f16s: bool) -> np.ndarray:
    """scale_to_float: bf16 by a shift, fp16 widened."""
    if f16s:
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return bf16_halves(bits.astype(np.uint32))[0]


def store_tile(y: np.ndarray, stores: np.ndarray, acc: np.ndarray, s: Shape, octet0: int, token0: int) -> None:
    """store_tile: lane (g, t) of pair p, n8 tile i holds rows g, g + 8 of the pair at tokens 8i + 2t + e."""
    warp = np.arange(plan.WARPS)[:, None, None, None]
    pair = np.arange(plan.WARP_PAIRS)[None, :, None, None]
    i = np.arange(s.tokens // 8)[None, None, :, None]
    row_a = 8 * (octet0 + 2 * (plan.WARP_PAIRS * warp + pair)) + G
    idle = octet0 + 2 * plan.WARP_PAIRS * warp >= s.octets  # such warps never store
    for e in range(2):
        token = token0 + 8 * i + 2 * T + e
        for row, reg in ((row_a, e), (row_a + 8, 2 + e)):
            ok = np.broadcast_to((token < s.m) & (row < s.n) & ~idle, acc.shape[:-1])
            rows, tokens = np.broadcast_to(row, ok.shape)[ok], np.broadcast_to(token, ok.shape)[ok]
            y[tokens, rows] = acc[..., reg][ok]
            np.add.at(stores, (tokens, rows), 1)


def emulate_gemm(x: np.ndarray, w: QuantizedWeight, tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """gemm_quant<BITS, SEGS, T, F16S> over every block: (y [M, N] float64 before rounding, stores per output).
    x is bf16 [M, K]; w in LAYOUT_OCTETS."""
    assert w.layout == LAYOUT_OCTETS
    (m, k), n = x.shape, w.shape[0]
    s = Shape(m, n, k, w.bits, w.group_size, tokens or plan.token_tile(m))
    f16s = w.scale_format is ScaleFormat.FP16
    src = Globals(as_chunks(w.qweight), as_chunks(w.scales), as_chunks(x))
    stages, columns = plan.stages(s.bits), k // s.column_k
    row_tiles, token_tiles = -(-s.octets // plan.TILE_OCTETS), -(-m // s.tokens)
    y, stores = np.full((m, n), np.nan), np.zeros((m, n), np.int64)
    for block in range(row_tiles * token_tiles):
        octet0, token0 = gemm_tile(block, row_tiles, token_tiles, s.tokens)
        ring = np.full((stages, sum(plan.stage_chunks(s.bits, s.group, s.tokens)), 4), 0xDEADBEEF, np.uint32)
        for c in range(min(stages - 1, columns)):  # the prologue: weights, then x
            copy_stage(ring[c], src, s, octet0, token0, c, weights=True, x=False)
        for c in range(min(stages - 1, columns)):
            copy_stage(ring[c], src, s, octet0, token0, c, weights=False, x=True)
        acc = np.zeros((plan.WARPS, plan.WARP_PAIRS, s.tokens // 8, 32, 4))
        for c in range(columns):
            if c + stages - 1 < columns:
                copy_stage(ring[(c + stages - 1) % stages], src, s, octet0, token0, c + stages - 1, weights=True, x=True)
            acc = gemm_column(acc, ring[c % stages], s, f16s)
        store_tile(y, stores, acc, s, octet0, token0)
    return y, stores
