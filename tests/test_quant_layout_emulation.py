"""kernels_src/quant_layout.cu emulated in numpy, step by step as a thread computes its chunk (the chunk's
octet, column and lane; a stored word per run; the int4 nibble or int8 byte permutation), against
quantize.layouts.device_layout: the kernel's index arithmetic checked on the CPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ninfer_rt.cuda.quant_layout_ops import octet_code_bytes
from ninfer_rt.quantize.format import QuantizedWeight, column_inputs, pack
from ninfer_rt.quantize.layouts import device_layout

BF16 = np.dtype(ml_dtypes.bfloat16)


def int4_run_word(stored: np.ndarray) -> np.ndarray:
    word = np.zeros_like(stored)
    for n in range(8):
        source = 2 * n if n < 4 else 2 * (n - 4) + 1
        word |= ((stored >> np.uint32(4 * source)) & np.uint32(0xF)) << np.uint32(4 * n)
    return word


def byte_perm_3120(word: np.ndarray) -> np.ndarray:
    """__byte_perm(word, 0, 0x3120): bytes (0 2 1 3) of the word."""
    b = [(word >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
    return b[0] | (b[2] << np.uint32(8)) | (b[1] << np.uint32(16)) | (b[3] << np.uint32(24))


def octets_from_rows(stored: np.ndarray, bits: int, n_w: int, k: int) -> np.ndarray:
    chunks = octet_code_bytes(bits, n_w, k) // 16
    runs, column_k = 128 // bits // 8, column_inputs(bits)
    chunk = np.arange(chunks)
    lane, octet_column = chunk & 31, chunk >> 5
    g, t = lane >> 2, lane & 3
    octet, column = octet_column // (k // column_k), octet_column % (k // column_k)
    row = 8 * octet + g
    padding = np.uint32(0x88888888 if bits == 4 else 0x80808080)
    flat, row_bytes, inside = stored.reshape(-1), k * bits // 8, row < n_w

    def stored_word(byte_offset: np.ndarray) -> np.ndarray:
        offsets = np.where(inside, byte_offset, 0)[:, None] + np.arange(4)
        word = flat[offsets].astype(np.uint32) @ (np.uint32(1) << np.uint32(8) * np.arange(4, dtype=np.uint32))
        return np.where(inside, word, padding).astype(np.uint32)

    words = []
    for j in range(runs):
        k0 = column * column_k + 32 * j + 8 * t
        if bits == 4:
            words.append(int4_run_word(stored_word(row * row_bytes + k0 // 2)))
        else:
            words += [byte_perm_3120(stored_word(row * row_bytes + k0)), byte_perm_3120(stored_word(row * row_bytes + k0 + 4))]
    return np.stack(words, axis=1).astype("<u4").view(np.uint8).reshape(-1)


@pytest.mark.parametrize(("bits", "rows", "cols"), [(4, 8, 128), (4, 24, 384), (4, 201, 1024), (8, 8, 64), (8, 201, 192)])
def test_the_kernel_s_arithmetic_is_device_layout(bits: int, rows: int, cols: int) -> None:
    rng = np.random.default_rng(rows * bits)
    weight = QuantizedWeight(bits, 64, pack(rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8), bits),
                             np.ones((rows, cols // 64), BF16))
    expected = device_layout(weight).qweight.reshape(-1)
    np.testing.assert_array_equal(octets_from_rows(weight.qweight, bits, rows, cols), expected)
