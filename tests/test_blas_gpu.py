"""cuBLASLt bf16 GEMM (fp32 accumulate) on the GPU against float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda import linear_ops
from ninfer_rt.cuda.blas import Blas, GemmShape
from ninfer_rt.cuda.memory import DeviceView
from gpu_session import OneStream
from test_gemv_gpu import BF16, bf16_random, gpu, relative_l2  # noqa: F401 - gpu is a fixture

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def blas(gpu: OneStream) -> Blas:
    return Blas(gpu.streams)


@pytest.mark.parametrize(("m", "n", "k"), [(9, 64, 64), (37, 200, 136), (512, 1024, 4096), (1, 8, 8)])
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
def test_gemm_matches_float64(gpu: OneStream, blas: Blas, m: int, n: int, k: int, out_dtype: str) -> None:
    rng = np.random.default_rng(m + n + k)
    x, w = bf16_random(rng, m, k), bf16_random(rng, n, k)
    itemsize = 2 if out_dtype == "bf16" else 4
    out = gpu.poisoned((m + 1) * n * itemsize)  # a spare row that must stay poisoned
    blas.gemm(gpu.stream, gpu.upload(x), gpu.upload(w), out, GemmShape(m, n, k, out_dtype))
    got = gpu.download(out, BF16 if out_dtype == "bf16" else np.float32, (m + 1, n)).astype(np.float64)
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_l2(got[:m], expected) < (4e-3 if out_dtype == "bf16" else 1e-5)
    assert np.isnan(got[m]).all()


def test_gemm_accumulates_into_its_output(gpu: OneStream, blas: Blas) -> None:
    rng = np.random.default_rng(3)
    m, n, k = 16, 64, 128
    x, w, c = bf16_random(rng, m, k), bf16_random(rng, n, k), rng.standard_normal((m, n)).astype(np.float32)
    out = gpu.upload(c)
    blas.gemm(gpu.stream, gpu.upload(x), gpu.upload(w), out, GemmShape(m, n, k, "f32", accumulate=True))
    expected = c + x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_l2(gpu.download(out, np.float32, (m, n)), expected) < 1e-5


def test_gemm_and_gemv_agree_at_the_8_row_boundary(gpu: OneStream, blas: Blas) -> None:
    rng = np.random.default_rng(4)
    m, n, k = 8, 512, 1024
    x, w = gpu.upload(bf16_random(rng, m, k)), gpu.upload(bf16_random(rng, n, k))
    by_gemm, by_gemv = gpu.poisoned(m * n * 4), gpu.poisoned(m * n * 4)
    blas.gemm(gpu.stream, x, w, by_gemm, GemmShape(m, n, k, "f32"))
    linear_ops.gemv(gpu.lib, gpu.stream, x, w, by_gemv, m, n, k, linear_ops.Epilogue.STORE_F32)
    a, b = gpu.download(by_gemm, np.float32, (m, n)), gpu.download(by_gemv, np.float32, (m, n))
    assert relative_l2(a, b) < 1e-5  # both accumulate in f32; only the summation order differs


def test_plans_are_cached_per_shape(gpu: OneStream, blas: Blas) -> None:
    rng = np.random.default_rng(5)
    x, w = gpu.upload(bf16_random(rng, 16, 64)), gpu.upload(bf16_random(rng, 64, 64))
    out = gpu.poisoned(16 * 64 * 2)
    shape = GemmShape(16, 64, 64)
    blas.gemm(gpu.stream, x, w, out, shape)
    plan = blas._plans[shape]
    blas.gemm(gpu.stream, x, w, out, shape)
    assert blas._plans[shape] is plan


@pytest.mark.parametrize(("m", "column", "n", "stride"), [(9, 768, 8, 776), (531, 16384, 96, 16480), (64, 0, 64, 200)])
def test_a_strided_output_fills_only_its_column_range(gpu: OneStream, blas: Blas, m: int, column: int, n: int, stride: int) -> None:
    """out rows `stride` apart from column `column` on (a view of the wider output): the other columns and the
    spare row stay poisoned."""
    rng = np.random.default_rng(m + n)
    k = 256
    x, w = bf16_random(rng, m, k), bf16_random(rng, n, k)
    out = gpu.poisoned((m + 1) * stride * 2)
    view = DeviceView(out, 2 * column, out.nbytes - 2 * column, "out[:, column:]")
    blas.gemm(gpu.stream, gpu.upload(x), gpu.upload(w), view, GemmShape(m, n, k, out_stride=stride))
    got = gpu.download(out, BF16, (m + 1, stride)).astype(np.float64)
    assert relative_l2(got[:m, column : column + n], x.astype(np.float64) @ w.astype(np.float64).T) < 4e-3
    outside = np.ones(got.shape, bool)
    outside[:m, column : column + n] = False
    assert np.isnan(got[outside]).all()
