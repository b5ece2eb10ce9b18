"""The wgmma prefill GEMM's index math (tests/gemm_quant_sm90_emulation.py, kernels_src/gemm_quant_sm90.cu followed
literally in numpy) against x @ bf16(q * scale)^T in float64, on random codes and odd shapes: M not a multiple of
the 128-token tile, N leaving padding octets and a partial row tile, K of one column up to several, int4 and int8
with bf16 scales and int8 with fp16 ones. Every output is stored exactly once. A deliberate mistake in the mapping
(x's words copied in input order instead of k-slot order, the swizzle left out of the places, an A fragment's
registers swapped) makes the same checks fail."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import gemm_quant_sm90_emulation as emulation
from gemm_quant_sm90_emulation import emulate_gemm_sm90
from ninfer_rt.quantize.format import BF16, signed, unpack
from ninfer_rt.quantize.layouts import device_layout
from quant_fragments import G, T
from test_gemm_quant_emulation import random_weight

EXACT = 1e-12  # float64 sums of the same bf16 weights, in another order than the oracle's


def oracle(x: np.ndarray, w) -> np.ndarray:  # noqa: ANN001 -- QuantizedWeight
    """x @ Wq^T in float64, Wq = q * scale rounded to bf16 (the value the dequantize kernel writes)."""
    q = signed(unpack(w.qweight, w.bits), w.bits).astype(np.float64)
    products = q * np.repeat(w.scales.astype(np.float64), w.group_size, axis=1)
    return x.astype(np.float64) @ products.astype(ml_dtypes.bfloat16).astype(np.float64).T


def check(m: int, n: int, k: int, bits: int, group: int, fp16: bool = False) -> None:
    rng = np.random.default_rng(m * 7919 + n * 31 + k + bits + group)
    w = random_weight(rng, n, k, bits, group, fp16)
    x = rng.standard_normal((m, k)).astype(BF16)
    y, stores = emulate_gemm_sm90(x, device_layout(w))
    np.testing.assert_array_equal(stores, 1)
    expected = oracle(x, w)
    np.testing.assert_allclose(y, expected, rtol=EXACT, atol=EXACT * np.abs(expected).max())


@pytest.mark.parametrize(("m", "n", "k", "group", "fp16"), [
    (9, 16, 128, 128, False),  # one octet pair, one column, a mostly empty token tile
    (131, 300, 384, 128, False),  # two token tiles; a second row tile of 6 octets; three columns
    (70, 40, 512, 256, False),  # a group spanning two columns
    (33, 21, 256, 32, False),  # 4 scale segments a column
    (70, 40, 256, 64, True),  # NInfer's Q4G64: 2 segments, fp16 scales, each product formed in f32 and rounded
])
def test_int4_gemm_computes_x_times_the_bf16_weights_transposed(m: int, n: int, k: int, group: int, fp16: bool) -> None:
    check(m, n, k, 4, group, fp16)


@pytest.mark.parametrize(("m", "n", "k", "group", "fp16"), [
    (65, 77, 192, 64, False),  # three int8 columns; 10 octets
    (129, 264, 128, 128, False),  # a group spanning two columns; 33 octets: two row tiles, two token tiles
    (40, 24, 256, 64, True),  # Q5G64 / Q6G64 as bound: fp16 scales
    (40, 24, 256, 32, True),  # W8G32: 2 segments a column
])
def test_int8_gemm_computes_x_times_the_bf16_weights_transposed(m: int, n: int, k: int, group: int, fp16: bool) -> None:
    check(m, n, k, 8, group, fp16)


def x_places_in_input_order(s: emulation.Shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunk, first, places = X_PLACES(s)
    run, a = chunk >> 2, chunk & 3
    words = np.arange(4)
    # word w of chunk a at word w of chunk 4 run + a: x as it lies in memory, swizzled
    at = (run >> 1)[:, None] * emulation.X_HALF + first[:, None] * emulation.ROW_BYTES + 4 * words
    return chunk, first, at + ((((4 * (run & 1) + a)[:, None]) ^ (first[:, None] & 7)) << 4)


def x_places_unswizzled(s: emulation.Shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunk, first, _ = X_PLACES(s)
    run = chunk >> 2
    at = (run >> 1) * emulation.X_HALF + first * emulation.ROW_BYTES + 4 * (chunk & 3)
    return chunk, first, at[:, None] + ((4 * (run[:, None] & 1) + np.arange(4)) << 4)


X_PLACES = emulation.x_places
SWAPPED_A_SLOTS = [(G, 2 * T), (G, 2 * T + 8), (G + 8, 2 * T), (G + 8, 2 * T + 8)]  # registers 1 and 2 exchanged


@pytest.mark.parametrize(("name", "mistake"), [
    ("x_places", x_places_in_input_order), ("x_places", x_places_unswizzled), ("A_SLOTS", SWAPPED_A_SLOTS),
])
def test_a_mistake_in_the_mapping_fails_the_check(name: str, mistake: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulation, name, mistake)
    with pytest.raises(AssertionError):
        check(70, 40, 256, 4, 128)
