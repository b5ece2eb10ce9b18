"""Quantized decode GEMV and dequantization on the GPU against float64 numpy (kernels_src/gemv_quant.cu),
and the CUDA executor against the numpy executor on int4/int8 checkpoints written by `ninfer-rt quantize`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from forward_helpers import relative_error
from ninfer_rt.cli import main
from ninfer_rt.cuda import ops, quant_ops
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.quantize.format import QuantizedWeight, ScaleFormat, signed, unpack
from ninfer_rt.quantize.layouts import concat_rows, dequantize
from ninfer_rt.quantize.quantizer import quantize
from ninfer_rt.testing.tiny import make_tiny_model
from test_cuda_exec_gpu import GPU_TINY, PROMPT, STEPS, TOLERANCE, runtime, sequence
from gpu_session import OneStream
from test_gemv_gpu import BF16, bf16_random, gpu, relative_l2  # noqa: F401 - gpu is the fixture

pytestmark = pytest.mark.gpu

# (n, k, group): odd n leaves rows of the last 16-row tile unused (and, 131 / 515 / 77, a padding octet);
# k from one int4 column (128) to 96 (int8: 192) columns, i.e. several batches per warp (12288), and column
# counts that leave some of the 8 or 16 warps idle (640: 5 int4 / 10 int8 columns); groups below a column
# (32, 64: a scale per segment), equal to it, and spanning columns (256). Each with 8 and with 16 warps per
# block (on its own, quant_ops picks 16 for all of these small grids).
SHAPES = [
    (64, 128, 128), (131, 256, 64), (1000, 4096, 128), (4096, 4096, 128), (515, 1024, 32), (77, 640, 128),
    (100, 12288, 128), (40, 2048, 256),
]


def quantized(rng: np.random.Generator, n: int, k: int, bits: int, group: int) -> QuantizedWeight:
    # Row magnitudes spread over 3 decades: per-row scales must follow the rows.
    return quantize(rng.standard_normal((n, k)) * rng.uniform(0.01, 10.0, (n, 1)), bits, group)


def upload(gpu: OneStream, w: QuantizedWeight) -> QuantizedDeviceWeight:
    """As the CUDA executor does: the weight in the GPU layout (concat_rows of one part)."""
    d = concat_rows([w])
    n, k = d.shape
    return QuantizedDeviceWeight(gpu.upload(d.qweight), gpu.upload(d.scales), n, k, d.bits, d.group_size, d.scale_format)


def reference(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    return x.astype(np.float64) @ dequantize(w, np.float64).T


@pytest.mark.parametrize("warps", quant_ops.WARPS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_gemv_matches_float64_and_writes_only_its_rows(
    gpu: OneStream, bits: int, rows: int, n: int, k: int, group: int, warps: int
) -> None:
    rng = np.random.default_rng(rows * 7919 + n + bits)
    x, w = bf16_random(rng, rows, k), quantized(rng, n, k, bits, group)
    y = gpu.poisoned((rows + 1) * n * 2)  # one spare row: must stay poisoned
    quant_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), upload(gpu, w), y, rows, warps=warps)
    out = gpu.download(y, BF16, (rows + 1, n)).astype(np.float64)
    assert relative_l2(out[:rows], reference(x, w)) < 4e-3  # bf16 output rounding is 2^-9 relative
    assert np.isnan(out[rows]).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_f32_epilogue_keeps_the_f32_accumulation(gpu: OneStream, bits: int, rows: int) -> None:
    rng = np.random.default_rng(rows + bits)
    x, w = bf16_random(rng, rows, 1024), quantized(rng, 517, 1024, bits, 128)
    y = gpu.poisoned(rows * 517 * 4)
    quant_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), upload(gpu, w), y, rows, Epilogue.STORE_F32)
    assert relative_l2(gpu.download(y, np.float32, (rows, 517)), reference(x, w)) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_residual_epilogue_adds_in_place(gpu: OneStream, bits: int, rows: int) -> None:
    rng = np.random.default_rng(rows + bits)
    x, w, r = bf16_random(rng, rows, 512), quantized(rng, 257, 512, bits, 128), bf16_random(rng, rows, 257)
    y = gpu.upload(r)  # y aliases the residual
    quant_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), upload(gpu, w), y, rows, Epilogue.RESIDUAL, residual=y)
    expected = reference(x, w) + r.astype(np.float64)
    assert relative_l2(gpu.download(y, BF16, (rows, 257)), expected) < 4e-3


@pytest.mark.parametrize("warps", quant_ops.WARPS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "inter", "group"), [(1, 384, 128), (2, 392, 128), (5, 136, 32), (8, 384, 64), (3, 24, 128)])
def test_swiglu_epilogue_is_bit_identical_to_gemv_then_silu_mul(
    gpu: OneStream, bits: int, rows: int, inter: int, group: int, warps: int
) -> None:
    """inter % 16 == 8 (392, 136, 24): the up rows start mid-way through a 16-row tile of the plain product."""
    rng = np.random.default_rng(rows + bits)
    k = 256
    x, w = gpu.upload(bf16_random(rng, rows, k)), upload(gpu, quantized(rng, 2 * inter, k, bits, group))
    gate_up, unfused, fused = gpu.poisoned(rows * 2 * inter * 2), gpu.poisoned(rows * inter * 2), gpu.poisoned(rows * inter * 2)
    quant_ops.gemv(gpu.lib, gpu.stream, x, w, gate_up, rows, warps=warps)
    ops.silu_mul(gpu.lib, gpu.stream, gate_up, unfused, rows, inter)
    quant_ops.gemv(gpu.lib, gpu.stream, x, w, fused, rows, Epilogue.SWIGLU, warps=warps)
    a, b = gpu.download(fused, np.uint16, (rows, inter)), gpu.download(unfused, np.uint16, (rows, inter))
    np.testing.assert_array_equal(a, b)


def fp16_scaled(rng: np.random.Generator, n: int, k: int, bits: int, group: int) -> QuantizedWeight:
    """Codes over the whole int range (widened Q5/Q6/W8 codes lie inside it) and fp16 multipliers of both
    signs over 3 decades of row magnitude, as a `.ninfer` artifact's weights are bound."""
    codes = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    packed = codes if bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = rng.standard_normal((n, k // group)) * rng.uniform(1e-4, 1e-1, (n, 1))
    return QuantizedWeight(bits, group, np.ascontiguousarray(packed), scales.astype(np.float16))


def exact_products(w: QuantizedWeight) -> np.ndarray:
    """q * multiplier in float64, unrounded: the GEMV applies each multiplier, widened exactly to f32, to
    the f32 sums of q * x (the format's values, dequantize(), round each product to bf16 besides)."""
    q = signed(unpack(w.qweight, w.bits), w.bits).astype(np.float64)
    return q * np.repeat(w.scales.astype(np.float64), w.group_size, axis=1)


@pytest.mark.parametrize("warps", quant_ops.WARPS)
@pytest.mark.parametrize(("bits", "group"), quant_ops.F16S_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(131, 256), (1000, 4096), (77, 640), (100, 12288)])
def test_fp16_scale_gemv_matches_float64_and_writes_only_its_rows(
    gpu: OneStream, bits: int, group: int, rows: int, n: int, k: int, warps: int
) -> None:
    rng = np.random.default_rng(rows * 7919 + n + bits + group)
    x, w = bf16_random(rng, rows, k), fp16_scaled(rng, n, k, bits, group)
    y = gpu.poisoned((rows + 1) * n * 2)
    quant_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), upload(gpu, w), y, rows, warps=warps)
    out = gpu.download(y, BF16, (rows + 1, n)).astype(np.float64)
    assert relative_l2(out[:rows], x.astype(np.float64) @ exact_products(w).T) < 4e-3
    assert np.isnan(out[rows]).all()


@pytest.mark.parametrize(("bits", "group"), quant_ops.F16S_FORMATS)
def test_fp16_scale_gemv_f32_epilogue_keeps_the_exact_products(gpu: OneStream, bits: int, group: int) -> None:
    rng = np.random.default_rng(bits + group)
    x, w = bf16_random(rng, 3, 1024), fp16_scaled(rng, 517, 1024, bits, group)
    y = gpu.poisoned(3 * 517 * 4)
    quant_ops.gemv(gpu.lib, gpu.stream, gpu.upload(x), upload(gpu, w), y, 3, Epilogue.STORE_F32)
    assert relative_l2(gpu.download(y, np.float32, (3, 517)), x.astype(np.float64) @ exact_products(w).T) < 1e-5


DEQUANTIZE_CASES = [
    *[(bits, n, k, group, quantized) for bits in (4, 8) for n, k, group in [(131, 256, 64), (1000, 4096, 128), (7, 256, 32), (24, 640, 128)]],
    *[(bits, n, k, group, fp16_scaled) for bits, group in quant_ops.F16S_FORMATS for n, k in [(131, 256), (1000, 4096), (24, 640)]],
]


@pytest.mark.parametrize(("bits", "n", "k", "group", "make"), DEQUANTIZE_CASES)
def test_dequantize_is_the_reference_rounded_to_bf16(gpu: OneStream, bits: int, n: int, k: int, group: int, make) -> None:  # noqa: ANN001
    """Bit for bit; with fp16 scales that is the format's own value, bf16(q * multiplier), which NInfer's
    decoder gives and the numpy executor computes with."""
    rng = np.random.default_rng(n + bits + group)
    w = make(rng, n, k, bits, group)
    out = gpu.poisoned((n + 1) * k * 2)
    quant_ops.dequantize(gpu.lib, gpu.stream, upload(gpu, w), out)
    got = gpu.download(out, np.uint16, ((n + 1) * k,))
    np.testing.assert_array_equal(got[: n * k].reshape(n, k), dequantize(w, np.float32).astype(BF16).view(np.uint16))
    assert (got[n * k :] == 0xFFFF).all()


@pytest.fixture(scope="module", params=[8, 4], ids=["int8", "int4"])
def quantized_tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    bf16 = make_tiny_model(tmp_path_factory.mktemp("bf16"), **GPU_TINY)
    out = tmp_path_factory.mktemp("quantized") / "model"
    result = CliRunner().invoke(main, ["quantize", "--model", str(bf16), "--out", str(out), "--bits", str(request.param),
                                       "--quantize-lm-head"])
    assert result.exit_code == 0, result.output
    return out


def test_cuda_executor_matches_the_numpy_executor_on_a_quantized_checkpoint(quantized_tiny: Path) -> None:
    """Prefill (dequantize + cuBLASLt) then 64 decode steps (GEMV, fused SwiGLU, quantized lm_head)."""
    tokens = sequence(quantized_tiny)
    ours = runtime(quantized_tiny, device=True).run(tokens, STEPS)
    reference = runtime(quantized_tiny, device=False).run(tokens, STEPS)
    assert relative_error(ours[:PROMPT], reference[:PROMPT]) < TOLERANCE
    assert relative_error(ours[PROMPT:], reference[PROMPT:]) < TOLERANCE
