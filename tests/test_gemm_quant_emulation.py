"""The quantized prefill GEMM's index math (tests/gemm_quant_emulation.py, kernels_src/gemm_quant.cu followed
literally in numpy) against x @ W^T in float64, on random codes and odd shapes: M not a multiple of the token
tile, N leaving padding octets and idle warps, K of one column up to several with an odd count against the
stage ring, groups below, at and above a column, bf16 and fp16 scales. Every output is stored exactly once. A
deliberate mistake in the mapping (the B fragment's slot, a segment's scale group, the raster's last group)
makes the same checks fail."""

from __future__ import annotations

import numpy as np
import pytest

import gemm_quant_emulation as emulation
from gemm_quant_emulation import emulate_gemm
from ninfer_rt.cuda import gemm_quant_ops as plan
from ninfer_rt.cuda.quant_ops import F16S_FORMATS
from ninfer_rt.quantize.format import BF16, QuantizedWeight, signed, unpack
from ninfer_rt.quantize.layouts import device_layout

EXACT = 1e-12  # float64 sums of exact products, in another order than the oracle's


def random_weight(rng: np.random.Generator, n: int, k: int, bits: int, group: int, fp16: bool) -> QuantizedWeight:
    """Codes over the whole range; scales of both signs over 3 decades of row magnitude (bf16 or fp16)."""
    codes = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    packed = codes if bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = rng.standard_normal((n, k // group)) * rng.uniform(1e-3, 1.0, (n, 1))
    return QuantizedWeight(bits, group, np.ascontiguousarray(packed), scales.astype(np.float16 if fp16 else BF16))


def oracle(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """x @ (q * scale)^T in float64, the products unrounded (what the kernel sums, fp16 scales included)."""
    q = signed(unpack(w.qweight, w.bits), w.bits).astype(np.float64)
    return x.astype(np.float64) @ (q * np.repeat(w.scales.astype(np.float64), w.group_size, axis=1)).T


def check(m: int, n: int, k: int, bits: int, group: int, fp16: bool = False, tokens: int | None = None) -> None:
    rng = np.random.default_rng(m * 7919 + n * 31 + k + bits + group)
    w = random_weight(rng, n, k, bits, group, fp16)
    x = rng.standard_normal((m, k)).astype(BF16)
    y, stores = emulate_gemm(x, device_layout(w), tokens)
    np.testing.assert_array_equal(stores, 1)
    expected = oracle(x, w)
    np.testing.assert_allclose(y, expected, rtol=EXACT, atol=EXACT * np.abs(expected).max())


@pytest.mark.parametrize(("m", "n", "k", "group"), [
    (9, 16, 128, 128),  # the smallest prefill: one octet pair, one column, one 32-token tile
    (33, 21, 256, 32),  # a 64-token tile of 33; 3 octets padded to 4; 4 segments a column
    (70, 300, 512, 64),  # two token tiles; a second row tile of 6 octets (warps 2..7 idle)
    (131, 40, 512, 256),  # three token tiles; a group spanning two columns
])
def test_int4_gemm_computes_x_times_w_transposed(m: int, n: int, k: int, group: int) -> None:
    check(m, n, k, 4, group)


@pytest.mark.parametrize(("m", "n", "k", "group"), [
    (9, 8, 64, 64),  # one int8 column: the 3-stage ring's prologue runs past the columns
    (40, 77, 192, 32),  # three columns (one per stage), 2 segments a column
    (65, 264, 384, 128),  # a group spanning two columns, six round the ring; 33 octets: two row tiles
])
def test_int8_gemm_computes_x_times_w_transposed(m: int, n: int, k: int, group: int) -> None:
    check(m, n, k, 8, group)


@pytest.mark.parametrize(("bits", "group"), F16S_FORMATS)  # Q4G64; Q5G64 / Q6G64 as int8 g64; W8G32
def test_fp16_scales_are_applied_unrounded(bits: int, group: int) -> None:
    check(45, 24, 256, bits, group, fp16=True)


def test_32_token_tiles_cover_more_tokens_than_32() -> None:
    check(75, 16, 128, 4, 128, tokens=32)  # three 32-token tiles, the last of 11


@pytest.mark.parametrize("token_tiles", [1, 2, 9, 128])
@pytest.mark.parametrize("row_tiles", [1, 5, 8, 17, 136])
def test_the_raster_visits_every_tile_once(row_tiles: int, token_tiles: int) -> None:
    tiles = [emulation.gemm_tile(b, row_tiles, token_tiles, 64) for b in range(row_tiles * token_tiles)]
    assert sorted(tiles) == [(r * plan.TILE_OCTETS, t * 64) for r in range(row_tiles) for t in range(token_tiles)]
    # the blocks of a raster group share its row tiles
    first = tiles[: plan.RASTER_TILES * token_tiles]
    assert {octet for octet, _ in first} == {r * plan.TILE_OCTETS for r in range(min(plan.RASTER_TILES, row_tiles))}


def wrong_b_slot(g: np.ndarray, j: int, t: np.ndarray) -> np.ndarray:
    return 4 * j + t  # the copies swizzle, the read does not


def wrong_segment_group(column: int, segment: np.ndarray, s: emulation.Shape) -> np.ndarray:
    return (column * s.column_k) // s.group  # every segment takes the column's first group


def wrong_gemm_tile(block: int, row_tiles: int, token_tiles: int, tokens: int) -> tuple[int, int]:
    i = block % (plan.RASTER_TILES * token_tiles)  # the last, partial group taken as a full one
    group = block // (plan.RASTER_TILES * token_tiles)
    return (group * plan.RASTER_TILES + i % plan.RASTER_TILES) * plan.TILE_OCTETS, (i // plan.RASTER_TILES) * tokens


@pytest.mark.parametrize(("name", "mistake"), [
    ("b_slot", wrong_b_slot), ("segment_group", wrong_segment_group), ("gemm_tile", wrong_gemm_tile),
])
def test_a_mistake_in_the_mapping_fails_the_check(name: str, mistake: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulation, name, mistake)
    with pytest.raises(AssertionError):
        check(70, plan.RASTER_TILES * plan.TILE_OCTETS * 8 + 16, 128, 4, 32)  # 9 x 2 tiles: a partial raster group
