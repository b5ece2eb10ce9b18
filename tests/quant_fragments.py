"""The register-level primitives of the quantized kernels (kernels_src/quant_common.cuh) in numpy, for the CPU
emulations of the decode GEMV (tests/test_gemv_quant_layout.py) and the prefill GEMM
(tests/gemm_quant_emulation.py): bf16x2 registers, the bit tricks that dequantize a chunk's run, and PTX's
m16n8k16 fragment layout. Every function takes the 32 lanes of a warp on the last axis (before a register's
words), any leading axes being independent warps or tiles."""

from __future__ import annotations

import numpy as np

LANE = np.arange(32)
G, T = LANE // 4, LANE % 4  # a lane's group (row of A, column of B) and thread in the group


def bf16_halves(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint32 bf16x2 registers -> (low, high) as float64."""
    words = words.astype(np.uint32)
    low = ((words & 0xFFFF) << 16).view(np.float32).astype(np.float64)
    high = (words & 0xFFFF0000).view(np.float32).astype(np.float64)
    return low, high


def bf16x2_fma_exact(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma.rn.bf16x2 where every result is exact in bf16 (dequantization): returns the uint32 registers."""
    out = []
    for x, y, z in zip(bf16_halves(a), bf16_halves(b), bf16_halves(c)):
        value = (x * y + z).astype(np.float32)
        bits = value.view(np.uint32)
        assert np.all(bits & 0xFFFF == 0), "a dequantized value is not exact in bf16"
        out.append(bits >> 16)
    return (out[0] | (out[1] << 16)).astype(np.uint32)


def dequant_run(words: np.ndarray, j: int, bits: int) -> list[np.ndarray]:
    """quant_common.cuh's dequant_chunk_run: chunk words [..., 4] -> run j's 4 bf16x2 registers [...]."""
    one = np.uint32(0x3F803F80)
    if bits == 4:
        word = words[..., j]
        return [bf16x2_fma_exact(((word >> (4 * s)) & 0x000F000F) | 0x43004300, one, np.uint32(0xC308C308)) for s in range(4)]

    def pair(v: np.ndarray) -> np.ndarray:
        return bf16x2_fma_exact((v & 0x007F007F) | 0x43004300, one, (v & 0x00800080) ^ 0xC380C380)

    w0, w1 = words[..., 2 * j], words[..., 2 * j + 1]
    return [pair(w0), pair(w0 >> 8), pair(w1), pair(w1 >> 8)]


def mma_m16n8k16(d: np.ndarray, a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """PTX's m16n8k16 .row.col fragments (a: 4 registers [..., 32], b: 2, d: [..., 32, 4]) -> d + A @ B."""
    a_lead = np.broadcast_shapes(*(r.shape[:-1] for r in a))
    b_lead = np.broadcast_shapes(*(r.shape[:-1] for r in b))
    A, Bm = np.zeros((*a_lead, 16, 16)), np.zeros((*b_lead, 16, 8))
    for reg, (row, col) in enumerate([(G, 2 * T), (G + 8, 2 * T), (G, 2 * T + 8), (G + 8, 2 * T + 8)]):
        low, high = bf16_halves(a[reg])
        A[..., row, col], A[..., row, col + 1] = low, high
    for reg, row in enumerate([2 * T, 2 * T + 8]):
        low, high = bf16_halves(b[reg])
        Bm[..., row, G], Bm[..., row + 1, G] = low, high
    D = A @ Bm
    out = np.array(d, np.float64, copy=True)
    out[..., 0] += D[..., G, 2 * T]
    out[..., 1] += D[..., G, 2 * T + 1]
    out[..., 2] += D[..., G + 8, 2 * T]
    out[..., 3] += D[..., G + 8, 2 * T + 1]
    return out
