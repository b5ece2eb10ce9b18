"""A quantized Gated DeltaNet's input projection on the GPU, [q|k|v|z] int4/int8 beside [b|a] bf16, against
float64 numpy: at decode widths one gemv_quant launch with a dense tail (kernels_src/gemv_quant.cu) at the
27B's shapes, its quantized columns bit for bit those of the launch without a tail; above the GEMV, the two
products into the column ranges of one output (the fused quantized GEMM's out_stride, cuBLASLt's strided
output), nothing written outside them."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_session import OneStream
from ninfer_rt.cuda import gemm_quant_ops, quant_ops
from ninfer_rt.cuda.blas import Blas, GemmShape
from ninfer_rt.cuda.memory import DeviceView
from ninfer_rt.cuda.quant_ops import DenseTail
from ninfer_rt.quantize.format import ScaleFormat
from test_blas_gpu import blas  # noqa: F401 - fixture
from test_gemm_quant_gpu import FORMATS, random_weight
from test_gemv_gpu import BF16, bf16_random, gpu, relative_l2  # noqa: F401 - gpu is the fixture
from test_gemv_quant_gpu import exact_products, upload

pytestmark = pytest.mark.gpu

QKVZ_27B, BA_27B, HIDDEN_27B = 2 * 16 * 128 + 2 * 48 * 128, 2 * 48, 5120  # in_proj_qkvz 16384 rows, [b|a] 96
BF16_OUT = 4e-3  # bf16 output rounding is 2^-9 relative (the GEMV tests' bound)
FORMAT_IDS = ["int4-g128", "int8-g128", "q4g64-f16s"]


def fused_gemv(gpu: OneStream, x: np.ndarray, w: object, tail: np.ndarray, warps: int | None = None) -> np.ndarray:
    """The one launch, into a poisoned [rows + 1, N + tail rows] output (the spare row must stay NaN)."""
    rows, cols = x.shape[0], w.shape[0] + tail.shape[0]
    y = gpu.poisoned((rows + 1) * cols * 2)
    dense = DenseTail(gpu.upload(tail), tail.shape[0])
    quant_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), upload(gpu, w), y, rows, warps=warps, tail=dense)
    out = gpu.download(y, BF16, (rows + 1, cols)).astype(np.float64)
    assert np.isnan(out[rows]).all(), "a store past the last row"
    return out[:rows]


@pytest.mark.parametrize(("bits", "group", "scales"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_27b_projection_in_one_launch_matches_float64(
    gpu: OneStream, rows: int, bits: int, group: int, scales: ScaleFormat
) -> None:
    rng = np.random.default_rng(rows + bits + group)
    w = random_weight(rng, QKVZ_27B, HIDDEN_27B, bits, group, scales)
    tail, x = bf16_random(rng, BA_27B, HIDDEN_27B), bf16_random(rng, rows, HIDDEN_27B)
    out = fused_gemv(gpu, x, w, tail)
    x64 = x.astype(np.float64)
    assert relative_l2(out[:, :QKVZ_27B], x64 @ exact_products(w).T) < BF16_OUT
    assert relative_l2(out[:, QKVZ_27B:], x64 @ tail.astype(np.float64).T) < BF16_OUT  # the tail on its own


@pytest.mark.parametrize("warps", quant_ops.WARPS)
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.parametrize(("n", "tail_rows", "k"), [(768, 8, 128), (1000, 21, 4096), (64, 96, 640), (16, 40, 12288)])
def test_tail_tiles_match_float64_and_leave_the_quantized_columns_bit_identical(
    gpu: OneStream, n: int, tail_rows: int, k: int, rows: int, warps: int
) -> None:
    """Half-used and partial tail tiles (8, 21, 40 rows), runs that leave warps idle (k = 128: 4 runs), many
    batches per warp (12288: 384 runs); the quantized tiles' stores equal those of a launch without a tail."""
    rng = np.random.default_rng(n + tail_rows + k + rows)
    w = random_weight(rng, n, k, 4, 128, ScaleFormat.BF16)
    tail, x = bf16_random(rng, tail_rows, k), bf16_random(rng, rows, k)
    out = fused_gemv(gpu, x, w, tail, warps)
    assert relative_l2(out[:, n:], x.astype(np.float64) @ tail.astype(np.float64).T) < BF16_OUT
    plain = gpu.poisoned(rows * n * 2)
    quant_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), upload(gpu, w), plain, rows, warps=warps)
    np.testing.assert_array_equal(out[:, :n].astype(BF16).view(np.uint16), gpu.download(plain, np.uint16, (rows, n)))


@pytest.mark.parametrize(("bits", "group", "scales"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("m", [9, 64, 531])
def test_prefill_products_fill_the_column_ranges_of_one_output(
    gpu: OneStream, blas: Blas, m: int, bits: int, group: int, scales: ScaleFormat
) -> None:
    rng = np.random.default_rng(m + bits + group)
    w = random_weight(rng, QKVZ_27B, HIDDEN_27B, bits, group, scales)
    tail, x = bf16_random(rng, BA_27B, HIDDEN_27B), bf16_random(rng, m, HIDDEN_27B)
    cols = QKVZ_27B + BA_27B
    y, x_dev = gpu.poisoned((m + 1) * cols * 2), gpu.upload(x)
    gemm_quant_ops.gemm(gpu.lib, gpu.stream, x_dev, upload(gpu, w), y, m, out_stride=cols)
    columns = DeviceView(y, QKVZ_27B * 2, y.nbytes - QKVZ_27B * 2, "y[:, qkvz:]")
    blas.gemm(gpu.stream, x_dev, gpu.upload(tail), columns, GemmShape(m, BA_27B, HIDDEN_27B, out_stride=cols))
    out = gpu.download(y, BF16, (m + 1, cols)).astype(np.float64)
    x64 = x.astype(np.float64)
    assert relative_l2(out[:m, :QKVZ_27B], x64 @ exact_products(w).T) < BF16_OUT
    assert relative_l2(out[:m, QKVZ_27B:], x64 @ tail.astype(np.float64).T) < BF16_OUT
    assert np.isnan(out[m]).all()
