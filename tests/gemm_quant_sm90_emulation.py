"""The wgmma prefill GEMM over quantized weights (kernels_src/gemm_quant_sm90.cu) emulated in numpy, following the
kernel's index math literally: the raster order of the blocks, each thread's copies into a stage (CopyPlan: the
weight and scale chunks, and x's 4-byte words to their k-slot places in the 128-byte swizzle; zero-filled past M
and past the weight), the stage's bytes as wgmma reads its B operand (x, K-major: logical byte b of token row n at
n * 128 + ((b / 16) ^ (n % 8)) * 16 + b % 16 of its 64-input half), each warp's A fragments (a chunk's run
dequantized with the bit tricks, each pair times its row's scale rounded to bf16, in PTX's register layout of
wgmma.m64nNk16's A: warp w's 16 rows as m16n8k16's A) and the epilogue's bounds. Products and sums are float64,
so the result is x @ bf16(q * scale)^T up to float64 rounding when the mapping is right; the values each output
would be stored from come back unrounded (NaN where nothing was stored), with the number of stores per output.

The constants are the host's mirror (ninfer_rt/cuda/gemm_quant_ops.py), which tests/test_gemm_quant_compile.py
checks against the kernel source.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from gemm_quant_emulation import Shape, as_chunks, gemm_tile, scale_value
from ninfer_rt.cuda import gemm_quant_ops as plan
from ninfer_rt.quantize.format import LAYOUT_OCTETS, QuantizedWeight, ScaleFormat
from quant_fragments import G, LANE, T, bf16_halves, dequant_run

TID = np.arange(plan.SM90_THREADS)
ROW_BYTES = 128  # kSwizzleRow
X_HALF = plan.SM90_TOKENS * ROW_BYTES  # kXHalf: 64 inputs of the block's tokens
A_SLOTS = [(G, 2 * T), (G + 8, 2 * T), (G, 2 * T + 8), (G + 8, 2 * T + 8)]  # m16n8k16 A: register -> (row, k slot) of its low half


def stage_offsets(s: Shape) -> tuple[int, int]:
    """Stage<BITS, SEGS>'s (kWeights, kScales) in bytes: x first."""
    weights = s.column_k // 64 * X_HALF
    return weights, weights + plan.TILE_OCTETS * 32 * 16


def x_places(s: Shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CopyPlan's x: per thread its chunk, first token, and the place of word w of its first copy, [threads, 4]."""
    chunk, first = TID % s.row_chunks, TID // s.row_chunks
    run = chunk >> 2
    x_place = (run >> 1) * X_HALF + first * ROW_BYTES + 4 * (chunk & 3)
    word = np.arange(4)
    places = x_place[:, None] + (((4 * (run[:, None] & 1) + word) ^ (first[:, None] & 7)) << 4)
    return chunk, first, places


def copy_column(stage: np.ndarray, qweight: np.ndarray, scales: np.ndarray, x_words: np.ndarray, s: Shape, octet0: int,
                token0: int, column: int) -> None:
    """copy_weights and copy_x: every thread's copies of one column into `stage` (uint32 words), invalid ones
    zero-filled."""
    weights_at, scales_at = stage_offsets(s)
    columns, groups = s.k // s.column_k, s.k // s.group

    def copy16(at: np.ndarray, index: np.ndarray, valid: np.ndarray, table: np.ndarray) -> None:
        words = at[:, None] // 4 + np.arange(4)
        stage[words] = np.where(valid[:, None], table[np.where(valid, index, 0)], 0)

    for u in range(plan.TILE_OCTETS * 32 // plan.SM90_THREADS):
        chunk = TID + u * plan.SM90_THREADS
        octet = octet0 + chunk // 32
        copy16(weights_at + 16 * chunk, (octet * columns + column) * 32 + chunk % 32, octet < s.octets, qweight)
    scale_threads = TID[: plan.TILE_OCTETS * s.segs]  # chunk (octet, segment): a column's groups are consecutive
    octet = octet0 + scale_threads // s.segs
    group = column * s.column_k // s.group + scale_threads % s.segs
    copy16(scales_at + 16 * scale_threads, octet * groups + group, octet < s.octets, scales)
    chunk, first, places = x_places(s)
    token_step = plan.SM90_THREADS // s.row_chunks
    for i in range(plan.SM90_TOKENS // token_step):
        token = token0 + first + i * token_step
        valid = token < s.m
        src = np.where(valid, token, 0)[:, None] * (s.k // 2) + column * s.column_k // 2 + 4 * chunk[:, None] + np.arange(4)
        stage[(places + i * token_step * ROW_BYTES) // 4] = np.where(valid[:, None], x_words[src], 0)


def b_operand(stage: np.ndarray, s: Shape) -> np.ndarray:
    """The column's x as wgmma reads it for its k16 steps: [128 tokens, KC k slots] float64."""
    halves = stage.view(np.uint16)
    n = np.arange(plan.SM90_TOKENS)[:, None]
    step, slot = np.divmod(np.arange(s.column_k), 16)
    logical = (step % 4) * 32 + 2 * slot  # byte within the token's 128-byte row of half step / 4
    at = (step // 4) * X_HALF + n * ROW_BYTES + (((logical >> 4) ^ (n & 7)) << 4) + (logical & 15)
    return (halves[at // 2].astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def a_operand(stage: np.ndarray, s: Shape, f16s: bool) -> np.ndarray:
    """The block's 256 rows of the column as its warps' A fragments hold them: [256 rows, KC k slots] float64,
    each q pair dequantized, times its row's scale of the run's segment and rounded to bf16 (dequant_fragments)."""
    weights_at, scales_at = stage_offsets(s)
    chunks = stage[weights_at // 4 : scales_at // 4].reshape(-1, 4)
    scale_bits = stage[scales_at // 4 :].view(np.uint16)
    rows = np.full((8 * plan.TILE_OCTETS, s.column_k), np.nan)
    for mg, i, warp in np.ndindex(2, 2, 4):
        octet = 2 * (8 * mg + 4 * i + warp)
        row0 = 128 * mg + 64 * i + 16 * warp  # the m64 tile's warp rows, as wgmma's A layout puts them
        for j in range(s.column_k // 32):
            seg = j * s.segs // (s.column_k // 32)
            scale = [scale_value(scale_bits[((octet + h) * s.segs + seg) * 8 + G], f16s) for h in (0, 1)]  # rows g, g + 8
            qa, qb = dequant_run(chunks[octet * 32 + LANE], j, s.bits), dequant_run(chunks[(octet + 1) * 32 + LANE], j, s.bits)
            for step, regs in ((0, (qa[0], qb[0], qa[1], qb[1])), (1, (qa[2], qb[2], qa[3], qb[3]))):
                for reg, ((row, col), halves) in enumerate(zip(A_SLOTS, regs)):
                    for e, value in enumerate(bf16_halves(halves)):
                        product = value * scale[reg % 2]
                        rows[row0 + row, 16 * (2 * j + step) + col + e] = product.astype(ml_dtypes.bfloat16).astype(np.float64)
    return rows


def store_rows(y: np.ndarray, stores: np.ndarray, acc: np.ndarray, s: Shape, octet0: int, token0: int) -> None:
    """store_rows: the accumulators of rows (8 octet0 + r) and tokens token0 + n, where both exist."""
    rows = 8 * octet0 + np.arange(8 * plan.TILE_OCTETS)[:, None]
    tokens = token0 + np.arange(plan.SM90_TOKENS)[None, :]
    ok = (rows < s.n) & (tokens < s.m)
    r, n = np.broadcast_to(rows, ok.shape)[ok], np.broadcast_to(tokens, ok.shape)[ok]
    y[n, r] = acc[ok]
    np.add.at(stores, (n, r), 1)


def emulate_gemm_sm90(x: np.ndarray, w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """gemm_quant_sm90<BITS, SEGS, F16S> over every block: (y [M, N] float64 before rounding, stores per output).
    x is bf16 [M, K]; w in LAYOUT_OCTETS."""
    assert w.layout == LAYOUT_OCTETS
    (m, k), n = x.shape, w.shape[0]
    s = Shape(m, n, k, w.bits, w.group_size, plan.SM90_TOKENS)
    f16s = w.scale_format is ScaleFormat.FP16
    qweight, scales, x_words = as_chunks(w.qweight), as_chunks(w.scales), np.ascontiguousarray(x).view("<u4").reshape(-1)
    row_tiles, token_tiles = -(-s.octets // plan.TILE_OCTETS), -(-m // s.tokens)
    y, stores = np.full((m, n), np.nan), np.zeros((m, n), np.int64)
    for block in range(row_tiles * token_tiles):
        octet0, token0 = gemm_tile(block, row_tiles, token_tiles, s.tokens)
        acc = np.zeros((8 * plan.TILE_OCTETS, plan.SM90_TOKENS))
        for column in range(k // s.column_k):
            stage = np.full(plan.sm90_stage_bytes(s.bits, s.group) // 4, 0xDEADBEEF, np.uint32)
            copy_column(stage, qweight, scales, x_words, s, octet0, token0, column)
            acc += a_operand(stage, s, f16s) @ b_operand(stage, s).T
        store_rows(y, stores, acc, s, octet0, token0)
    return y, stores
