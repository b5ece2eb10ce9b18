"""The quantized prefill GEMM on the GPU against float64 numpy at the 27B's matrices, both kernels: gemm_quant.cu
(mma.sync; the products q * x exact) and, on sm_90a, gemm_quant_sm90.cu (wgmma; each weight the bf16 q * scale of
the dequantize path), the default picking by arch, format and token count and "portable" forcing the mma.sync
one; and the CUDA executor's prefill with NINFER_QUANT_GEMM=fused against =dequant (dequantize + cuBLASLt) and
against the numpy executor on int4/int8 checkpoints written by `ninfer-rt quantize`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ml_dtypes

from forward_helpers import relative_error
from gpu_session import OneStream
from ninfer_rt.cuda import gemm_quant_ops
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.quantize.format import QuantizedWeight, ScaleFormat
from test_cuda_exec_gpu import PROMPT, STEPS, TOLERANCE, runtime, sequence
from test_gemv_gpu import BF16, bf16_random, gpu, relative_l2  # noqa: F401 - gpu is the fixture
from test_gemv_quant_gpu import exact_products, fp16_scaled, quantized_tiny, upload  # noqa: F401 - quantized_tiny: fixture

pytestmark = pytest.mark.gpu

# The 27B's quantized matrices (N, K): the GDN's [q | k | v] (10240) and z (6144) projections and its output
# (5120 x 6144); the attention's [q | gate] (12288) and [k | v] (1024) projections; gate_up (2 x 17408) and down.
SHAPES_27B = [(10240, 5120), (6144, 5120), (5120, 6144), (12288, 5120), (1024, 5120), (34816, 5120), (5120, 17408)]
TOKENS = (9, 17, 64, 531, 1000)  # a 32-token tile; both tiles at their edges; the agent turn's 531 new tokens
# (bits, group, scale format): int4 g128 and int8 g128 with bf16 scales, Q4G64's fp16 multipliers
FORMATS = [(4, 128, ScaleFormat.BF16), (8, 128, ScaleFormat.BF16), (4, 64, ScaleFormat.FP16)]
BF16_OUT = 4e-3  # bf16 output rounding is 2^-9 relative (the GEMV tests' bound)
F32_OUT = 1e-5  # f32 sums of exact products
FUSED_VS_DEQUANT = 1e-2  # frozen, not yet measured: the dequant path rounds each q * scale to bf16 first


def bf16_scaled(rng: np.random.Generator, n: int, k: int, bits: int, group: int) -> QuantizedWeight:
    """Codes over the whole range, bf16 scales of both signs over 3 decades of row magnitude."""
    weight = fp16_scaled(rng, n, k, bits, group)
    return QuantizedWeight(bits, group, weight.qweight, weight.scales.astype(np.float32).astype(BF16))


def random_weight(rng: np.random.Generator, n: int, k: int, bits: int, group: int, scales: ScaleFormat) -> QuantizedWeight:
    return (fp16_scaled if scales is ScaleFormat.FP16 else bf16_scaled)(rng, n, k, bits, group)


def products(gpu: OneStream, w: QuantizedWeight, m: int, wgmma: bool | None) -> np.ndarray:
    """The weight as the kernel gemm_quant_ops.gemm runs for M tokens multiplies it: q * scale exact (mma.sync) or
    rounded to bf16 (wgmma)."""
    exact = exact_products(w)
    if not gemm_quant_ops.uses_sm90(gpu.lib.target_arch, m, wgmma):
        return exact
    return exact.astype(ml_dtypes.bfloat16).astype(np.float64)


KERNELS = pytest.mark.parametrize("wgmma", [None, False], ids=["default", "portable"])


@KERNELS
@pytest.mark.parametrize(("bits", "group", "scales"), FORMATS, ids=["int4-g128", "int8-g128", "q4g64-f16s"])
@pytest.mark.parametrize(("n", "k"), SHAPES_27B)
def test_gemm_matches_float64_at_the_27b_shapes(
    gpu: OneStream, n: int, k: int, bits: int, group: int, scales: ScaleFormat, wgmma: bool | None
) -> None:
    rng = np.random.default_rng(n + k + bits + group)
    w = random_weight(rng, n, k, bits, group, scales)
    x = bf16_random(rng, max(TOKENS), k)
    x_dev, w_dev = gpu.upload(x), upload(gpu, w)
    for m in TOKENS:
        expected = x[:m].astype(np.float64) @ products(gpu, w, m, wgmma).T
        y = gpu.poisoned((m + 1) * n * 2)  # one spare row: must stay poisoned
        gemm_quant_ops.gemm(gpu.lib, gpu.stream, x_dev, w_dev, y, m, wgmma=wgmma)
        out = gpu.download(y, BF16, (m + 1, n)).astype(np.float64)
        assert not np.isnan(out[:m]).any(), f"M={m}: outputs never stored"
        assert relative_l2(out[:m], expected) < BF16_OUT, f"M={m}"
        assert np.isnan(out[m]).all(), f"M={m}: a store past the last token"


@KERNELS
@pytest.mark.parametrize(("bits", "group", "scales"), [*FORMATS, (8, 32, ScaleFormat.FP16), (8, 64, ScaleFormat.FP16), (4, 32, ScaleFormat.BF16)])
@pytest.mark.parametrize("m", [9, 45, 131])
def test_f32_epilogue_keeps_the_f32_sums(gpu: OneStream, m: int, bits: int, group: int, scales: ScaleFormat, wgmma: bool | None) -> None:
    """Odd N (a padding octet, a partial row tile), every fp16 format, a scale per 32 inputs."""
    rng = np.random.default_rng(m + bits + group)
    n, k = 517, 1024
    w, x = random_weight(rng, n, k, bits, group, scales), bf16_random(rng, m, k)
    y, w_dev = gpu.poisoned(m * n * 4), upload(gpu, w)
    gemm_quant_ops.gemm(gpu.lib, gpu.stream, gpu.upload(x), w_dev, y, m, Epilogue.STORE_F32, wgmma=wgmma)
    expected = x.astype(np.float64) @ products(gpu, w, m, wgmma).T
    assert relative_l2(gpu.download(y, np.float32, (m, n)), expected) < F32_OUT


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [9, 70])
def test_residual_epilogue_adds_in_place(gpu: OneStream, bits: int, m: int) -> None:
    rng = np.random.default_rng(m + bits)
    n, k = 257, 512
    w, x, r = bf16_scaled(rng, n, k, bits, 128), bf16_random(rng, m, k), bf16_random(rng, m, n)
    y, w_dev = gpu.upload(r), upload(gpu, w)  # y aliases the residual
    gemm_quant_ops.gemm(gpu.lib, gpu.stream, gpu.upload(x), w_dev, y, m, Epilogue.RESIDUAL, residual=y)
    expected = x.astype(np.float64) @ products(gpu, w, m, None).T + r.astype(np.float64)
    assert relative_l2(gpu.download(y, BF16, (m, n)), expected) < BF16_OUT


@pytest.mark.parametrize("steps", [STEPS, [20, PROMPT - 20] + STEPS[1:]], ids=["prefill", "chunks-of-20-and-25"])
def test_executor_prefill_with_the_fused_gemm_matches_dequantize_then_cublaslt(
    quantized_tiny: Path, steps: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole forward on a quantized checkpoint: prefill (a 64- or 32-token tile), then decode (the GEMV)."""
    tokens = sequence(quantized_tiny)
    logits = {}
    for form in ("fused", "dequant"):
        monkeypatch.setenv("NINFER_QUANT_GEMM", form)
        logits[form] = runtime(quantized_tiny, device=True).run(tokens, steps)
    reference = runtime(quantized_tiny, device=False).run(tokens, steps)
    assert relative_error(logits["fused"][:PROMPT], logits["dequant"][:PROMPT]) < FUSED_VS_DEQUANT
    assert relative_error(logits["fused"][:PROMPT], reference[:PROMPT]) < TOLERANCE
    assert relative_error(logits["fused"][PROMPT:], reference[PROMPT:]) < TOLERANCE


@pytest.mark.parametrize(("bits", "scales"), [(4, ScaleFormat.BF16), (8, ScaleFormat.BF16), (8, ScaleFormat.FP16)])
def test_the_wgmma_gemm_strided_into_a_wider_output_leaves_the_other_columns(gpu: OneStream, bits: int, scales: ScaleFormat) -> None:
    """The quantized rows of a split-format weight: y's rows wider than N (out_stride), the columns past N untouched."""
    group = 64 if scales is ScaleFormat.FP16 else 128
    rng = np.random.default_rng(bits + 7)
    m, n, k, wide = 300, 200, 640, 232
    w, x = random_weight(rng, n, k, bits, group, scales), bf16_random(rng, m, k)
    w_dev = upload(gpu, w)
    if not gemm_quant_ops.uses_sm90(gpu.lib.target_arch, m):
        pytest.skip(f"the wgmma kernel runs on sm_90a (this GPU: {gpu.lib.target_arch})")
    y = gpu.poisoned(m * wide * 2)
    gemm_quant_ops.gemm(gpu.lib, gpu.stream, gpu.upload(x), w_dev, y, m, out_stride=wide)
    out = gpu.download(y, BF16, (m, wide)).astype(np.float64)
    assert relative_l2(out[:, :n], x.astype(np.float64) @ products(gpu, w, m, None).T) < BF16_OUT
    assert np.isnan(out[:, n:]).all(), "a store past the weight's rows"
