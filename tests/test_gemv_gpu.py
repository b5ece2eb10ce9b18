"""Decode GEMV and row gather on the GPU against float64 numpy (kernels_src/{gemv,embedding}.cu); argmax and
sampling are in test_sampling_gpu.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from gpu_session import OneStream

from ninfer_rt.cuda import linear_ops, ops
from ninfer_rt.cuda.linear_ops import Epilogue, RowLayout

pytestmark = pytest.mark.gpu
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def gpu() -> OneStream:
    return OneStream.open()


def bf16_random(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(BF16)


def relative_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


SHAPES = [(64, 64), (131, 72), (1000, 4104), (4096, 4096)]  # (n, k): odd n leaves a warp's second row unused


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemv_matches_float64_and_writes_only_its_rows(gpu: OneStream, rows: int, n: int, k: int) -> None:
    rng = np.random.default_rng(rows * 7919 + n)
    x, w = bf16_random(rng, rows, k), bf16_random(rng, n, k)
    y = gpu.poisoned((rows + 1) * n * 2)  # one spare row: must stay poisoned
    linear_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), gpu.upload(w), y, rows, n, k)
    out = gpu.download(y, BF16, (rows + 1, n)).astype(np.float64)
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_l2(out[:rows], expected) < 4e-3  # bf16 output rounding is 2^-9 relative
    assert np.isnan(out[rows]).all()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_f32_output_keeps_the_f32_accumulation(gpu: OneStream, rows: int) -> None:
    rng = np.random.default_rng(rows)
    n, k = 515, 1024
    x, w = bf16_random(rng, rows, k), bf16_random(rng, n, k)
    y = gpu.poisoned(rows * n * 4)
    linear_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), gpu.upload(w), y, rows, n, k, Epilogue.STORE_F32)
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_l2(gpu.download(y, np.float32, (rows, n)), expected) < 1e-5


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_gemv_residual_epilogue_adds_in_place(gpu: OneStream, rows: int) -> None:
    rng = np.random.default_rng(rows)
    n, k = 257, 512
    x, w, r = bf16_random(rng, rows, k), bf16_random(rng, n, k), bf16_random(rng, rows, n)
    y = gpu.upload(r)  # y aliases the residual: h += o_proj(attn)
    linear_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), gpu.upload(w), y, rows, n, k, Epilogue.RESIDUAL, residual=y)
    expected = x.astype(np.float64) @ w.astype(np.float64).T + r.astype(np.float64)
    assert relative_l2(gpu.download(y, BF16, (rows, n)), expected) < 4e-3


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_swiglu_epilogue_is_bit_identical_to_gemv_then_silu_mul(gpu: OneStream, rows: int) -> None:
    rng = np.random.default_rng(rows)
    inter, k = 384, 256
    x, w = gpu.upload(bf16_random(rng, rows, k)), gpu.upload(bf16_random(rng, 2 * inter, k) * BF16.type(0.1))
    gate_up, unfused, fused = gpu.poisoned(rows * 2 * inter * 2), gpu.poisoned(rows * inter * 2), gpu.poisoned(rows * inter * 2)
    linear_ops.gemv(gpu.lib, gpu.stream, x, w, gate_up, rows, 2 * inter, k)
    ops.silu_mul(gpu.lib, gpu.stream, gate_up, unfused, rows, inter)
    linear_ops.gemv(gpu.lib, gpu.stream, x, w, fused, rows, inter, k, Epilogue.SWIGLU)
    a, b = gpu.download(fused, np.uint16, (rows, inter)), gpu.download(unfused, np.uint16, (rows, inter))
    np.testing.assert_array_equal(a, b)


def test_gemv_rejects_k_not_a_multiple_of_8(gpu: OneStream) -> None:
    buf = gpu.poisoned(4096)
    with pytest.raises(ValueError, match="multiple of 8"):
        linear_ops.gemv(gpu.lib, gpu.stream, buf, buf, buf, 1, 4, 12)


def test_gemv_rejects_more_than_8_rows_pointing_to_the_gemm(gpu: OneStream) -> None:
    buf = gpu.poisoned(1 << 16)
    with pytest.raises(ValueError, match="cuBLASLt"):
        linear_ops.gemv(gpu.lib, gpu.stream, buf, buf, buf, 9, 8, 8)


def test_gather_rows_picks_embedding_rows(gpu: OneStream) -> None:
    rng = np.random.default_rng(0)
    table = bf16_random(rng, 100, 72)
    ids = np.array([5, 0, 99, 5, 42], np.int32)
    out = gpu.poisoned(len(ids) * 72 * 2)
    linear_ops.gather_rows(gpu.lib, gpu.stream, gpu.upload(table), 100, out, len(ids), 72, ids=gpu.upload(ids))
    np.testing.assert_array_equal(gpu.download(out, BF16, (len(ids), 72)), table[ids])


@pytest.mark.parametrize("widths", [(64, 64), (3, 5)], ids=["vectorised", "elementwise"])
def test_gather_rows_concatenates_features(gpu: OneStream, widths: tuple[int, int]) -> None:
    rng = np.random.default_rng(1)
    rows = 6
    parts = [bf16_random(rng, rows, w) for w in widths]
    total = sum(widths)
    out = gpu.poisoned(rows * total * 2)
    column = 0
    for part in parts:
        layout = RowLayout(total, column)
        linear_ops.gather_rows(gpu.lib, gpu.stream, gpu.upload(part), rows, out, rows, part.shape[1], out_layout=layout)
        column += part.shape[1]
    np.testing.assert_array_equal(gpu.download(out, BF16, (rows, total)), np.concatenate(parts, axis=1))
