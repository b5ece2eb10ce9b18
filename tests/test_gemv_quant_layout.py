"""The GPU layout of quantized weights (quantize/layouts.py, kernels_src/gemv_quant.cu) on the CPU: the
repacking round-trips, and a numpy emulation of the decode GEMV that follows the kernel literally (the
chunk a lane loads, the bit tricks that turn codes into bf16, the m16n8k16 fragment layout of PTX, the
scale per segment, the sum over warps, the epilogue's tile rows) reproduces x @ W^T. A mistake in the
layout, the index math or the dequantization shows here, without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.quant_ops import WARPS
from ninfer_rt.quantize.format import BF16, LAYOUT_OCTETS, QuantFormatError, QuantizedWeight, column_inputs
from ninfer_rt.quantize.layouts import concat_rows, dequantize, device_layout, rows_layout, stack_rows
from ninfer_rt.quantize.quantizer import quantize
from quant_fragments import bf16_halves, dequant_run, mma_m16n8k16


def quantized(seed: int, n: int, k: int, bits: int, group: int) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((n, k)) * rng.uniform(0.01, 10.0, (n, 1)), bits, group)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k", "group"), [(5, 256, 32), (16, 128, 128), (37, 512, 64), (24, 1024, 256)])
def test_device_layout_round_trips(bits: int, n: int, k: int, group: int) -> None:
    w = quantized(n + k, n, k, bits, group)
    d = device_layout(w)
    octets = -(-n // 8) + (-(-n // 8)) % 2
    assert d.layout == LAYOUT_OCTETS and d.shape == (n, k)
    assert d.qweight.shape == (octets, k // column_inputs(bits), 32, 16) and d.scales.shape == (octets, k // group, 8)
    back = rows_layout(d)
    np.testing.assert_array_equal(back.qweight, w.qweight)
    np.testing.assert_array_equal(back.scales.view(np.uint16), w.scales.view(np.uint16))
    np.testing.assert_array_equal(dequantize(d), dequantize(w))


def test_int4_chunk_puts_a_runs_inputs_in_the_documented_nibbles() -> None:
    """Row 0, column 0, lane 0 (g = t = 0): run 0 is inputs 0..7; input i sits in nibble i/2 + 4 (i%2)."""
    codes = np.arange(256) % 16  # input k has code k % 16
    w = QuantizedWeight(4, 128, (codes[0::2] | codes[1::2] << 4).astype(np.uint8)[None].repeat(16, 0),
                        np.ones((16, 2), BF16))
    word = int(device_layout(w).qweight[0, 0, 0, :4].view("<u4")[0])
    assert [(word >> (4 * n)) & 0xF for n in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_fused_parts_are_stacked_then_laid_out_for_the_gpu() -> None:
    a, b = quantized(1, 12, 256, 4, 128), quantized(2, 20, 256, 8, 128)
    fused = concat_rows([a, b])
    assert fused.layout == LAYOUT_OCTETS and fused.bits == 8 and fused.shape == (32, 256)
    np.testing.assert_array_equal(dequantize(fused), dequantize(stack_rows([a, b])))
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(a), dequantize(b)]))


def test_inputs_not_a_whole_column_are_refused() -> None:
    with pytest.raises(QuantFormatError, match="in_features % 128"):
        device_layout(quantized(0, 8, 192, 4, 64))


# -- the kernel, emulated -------------------------------------------------------------------------------------


def emulate_gemv(x: np.ndarray, w: QuantizedWeight, rows: int, swiglu: bool = False, warps: int = 8) -> np.ndarray:
    """gemv_quant<BITS, B=8, SEGS, warps> for every tile, in float64: y [rows, N] before rounding."""
    d = device_layout(w)
    bits, group = d.bits, d.group_size
    n_w, k = d.shape
    n = n_w // 2 if swiglu else n_w
    column_k = column_inputs(bits)
    runs = column_k // 32
    segments = max(1, column_k // group)
    qwords = np.ascontiguousarray(d.qweight).view("<u4")  # [octets, columns, 32, 4]
    scale_bits = d.scales.view(np.uint16)  # [octets, groups, 8]
    x_bits = np.ascontiguousarray(x.astype(BF16)).view(np.uint16).astype(np.uint32)  # [rows, K]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    x_row = np.minimum(g, rows - 1)
    y = np.full((rows, n), np.nan)
    for tile in range(n // 8 if swiglu else -(-n // 16)):
        octet_a, octet_b = (tile, n // 8 + tile) if swiglu else (2 * tile, 2 * tile + 1)
        partial = np.zeros((warps, 32, 4))
        for warp in range(warps):
            for column in range(warp, k // column_k, warps):
                for s in range(segments):
                    part = np.zeros((32, 4))
                    for r in range(runs // segments):
                        j = s * (runs // segments) + r
                        first = column * column_k + 32 * j + 8 * t  # [32]: the lane's run of x
                        xs = x_bits[x_row[:, None], first[:, None] + np.arange(8)]  # [32, 8] bf16 bits
                        xregs = [xs[:, 2 * i] | (xs[:, 2 * i + 1] << 16) for i in range(4)]
                        pa = dequant_run(qwords[octet_a, column], j, bits)
                        pb = dequant_run(qwords[octet_b, column], j, bits)
                        part = mma_m16n8k16(part, [pa[0], pb[0], pa[1], pb[1]], xregs[:2])
                        part = mma_m16n8k16(part, [pa[2], pb[2], pa[3], pb[3]], xregs[2:])
                    grp = (column * column_k + s * (column_k // segments)) // group
                    sa = bf16_halves(scale_bits[octet_a, grp, g].astype(np.uint32))[0]
                    sb = bf16_halves(scale_bits[octet_b, grp, g].astype(np.uint32))[0]
                    partial[warp] += part * np.stack([sa, sa, sb, sb], axis=1)
        total = partial.sum(axis=0)  # [32 lanes, 4]

        def value(r: int, b: int) -> float:
            return total[4 * (r & 7) + (b >> 1), (r >> 3) * 2 + (b & 1)]

        for b in range(rows):
            if swiglu:
                for r in range(8):
                    gate, up = value(r, b), value(r + 8, b)
                    y[b, 8 * tile + r] = gate / (1 + np.exp(-gate)) * up
            else:
                for r in range(16):
                    if 16 * tile + r < n:
                        y[b, 16 * tile + r] = value(r, b)
    return y


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k", "group", "rows"), [
    (21, 256, 128, 1),  # an odd octet count: the padding octet of the last tile
    (16, 1024, 128, 3),  # columns spread over all 8 warps (half of 16)
    (8, 128, 32, 8),  # groups smaller than a column: a scale per segment
    (40, 512, 64, 2),
    (9, 2048, 256, 5),  # a group spanning columns
])
@pytest.mark.parametrize("warps", WARPS)
def test_emulated_kernel_computes_x_times_w_transposed(bits: int, n: int, k: int, group: int, rows: int, warps: int) -> None:
    w = quantized(bits * n + k, n, k, bits, group)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(BF16).astype(np.float64)
    expected = x @ dequantize(w, np.float64).T
    np.testing.assert_allclose(emulate_gemv(x, w, rows, warps=warps), expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_emulated_swiglu_pairs_gate_row_i_with_up_row_n_plus_i(bits: int) -> None:
    inter, k, rows = 24, 256, 2  # 3 octets per half: up rows start mid-way through a 16-row tile
    w = quantized(bits, 2 * inter, k, bits, 128)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(BF16).astype(np.float64)
    h = x @ dequantize(w, np.float64).T
    gate, up = h[:, :inter], h[:, inter:]
    np.testing.assert_allclose(emulate_gemv(x, w, rows, swiglu=True), gate / (1 + np.exp(-gate)) * up, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bits", [4, 8])
def test_every_code_dequantizes_exactly(bits: int) -> None:
    """All 2^bits codes through the kernel's bit tricks give q = u - 2^(bits-1)."""
    half = 1 << (bits - 1)
    codes = np.resize(np.arange(1 << bits), column_inputs(bits) * 8).reshape(8, -1)  # 8 rows, one column
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4) if bits == 4 else codes
    w = QuantizedWeight(bits, 32, packed.astype(np.uint8), np.ones((8, column_inputs(bits) // 32), BF16))
    words = np.ascontiguousarray(device_layout(w).qweight).view("<u4")[0, 0]  # octet 0, column 0: [32, 4]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    for j in range(column_inputs(bits) // 32):
        regs = dequant_run(words, j, bits)
        for s, reg in enumerate(regs):
            low, high = bf16_halves(reg)
            first = 32 * j + 8 * t + 2 * s
            np.testing.assert_array_equal(low, codes[g, first] - half)
            np.testing.assert_array_equal(high, codes[g, first + 1] - half)
