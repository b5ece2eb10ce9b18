"""The load-time rearrangement of quantized codes on the GPU (kernels_src/quant_layout.cu) is byte for byte
quantize.layouts.device_layout, its definition; and the CUDA executor's weights, uploaded as stored and
rearranged there, are the ones numpy would have uploaded."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_session import OneStream
from ninfer_rt.cuda import quant_layout_ops
from ninfer_rt.exec.cuda_weights import DeviceWeights
from ninfer_rt.model.executor import WeightRole
from ninfer_rt.quantize.format import QuantizedWeight, pack
from ninfer_rt.quantize.layouts import concat_rows, device_layout
from test_gemv_gpu import gpu  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu
BF16 = np.dtype(ml_dtypes.bfloat16)

# rows: one octet, a padding octet (24 -> 32), an odd count (201); inputs: one column and several
SHAPES = {4: [(8, 128), (24, 384), (201, 1024)], 8: [(8, 64), (24, 192), (201, 1024)]}


def random_weight(rng: np.random.Generator, bits: int, rows: int, cols: int) -> QuantizedWeight:
    codes = rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8)
    scales = rng.standard_normal((rows, cols // 64)).astype(BF16)
    return QuantizedWeight(bits, 64, pack(codes, bits), scales)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape_index", range(3))
def test_octets_from_rows_is_device_layout_byte_for_byte(gpu: OneStream, bits: int, shape_index: int) -> None:  # noqa: F811
    rows, cols = SHAPES[bits][shape_index]
    weight = random_weight(np.random.default_rng(rows + bits), bits, rows, cols)
    expected = device_layout(weight).qweight.reshape(-1)
    out = gpu.poisoned(quant_layout_ops.octet_code_bytes(bits, rows, cols))
    quant_layout_ops.octets_from_rows(gpu.lib, gpu.stream, gpu.upload(weight.qweight), out, bits, rows, cols)
    assert out.nbytes == expected.nbytes
    np.testing.assert_array_equal(gpu.download(out, np.uint8, expected.shape), expected)


def test_a_layout_the_kernel_cannot_take_is_refused_before_launch(gpu: OneStream) -> None:  # noqa: F811
    codes = gpu.upload(np.zeros(8 * 96, np.uint8))
    with pytest.raises(ValueError, match=r"int8 \[8, 96\] does not fit the GPU layout"):
        quant_layout_ops.octets_from_rows(gpu.lib, gpu.stream, codes, gpu.poisoned(4096), 8, 8, 96)


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_parts_uploaded_as_stored_are_the_numpy_layout(gpu: OneStream, bits: int) -> None:  # noqa: F811
    rng = np.random.default_rng(bits)
    cols = 256
    parts = [random_weight(rng, bits, rows, cols) for rows in (40, 8, 24)]  # a fused q|k|v: 72 rows, 80 padded
    weights = DeviceWeights(gpu.streams, gpu.stream, gpu.lib)
    prepared = weights.prepare("qkv", parts, WeightRole.LINEAR)
    expected = concat_rows(parts)
    assert (prepared.rows, prepared.cols, prepared.bits) == (72, cols, bits)
    codes, scales = expected.qweight.reshape(-1), expected.scales.reshape(-1)
    np.testing.assert_array_equal(gpu.download(prepared.qweight, np.uint8, codes.shape), codes)
    np.testing.assert_array_equal(gpu.download(prepared.scales, BF16, scales.shape).view(np.uint16), scales.view(np.uint16))


def test_parts_of_different_widths_are_widened_on_the_host_as_before(gpu: OneStream) -> None:  # noqa: F811
    rng = np.random.default_rng(7)
    parts = [random_weight(rng, 8, 16, 128), random_weight(rng, 4, 16, 128)]
    weights = DeviceWeights(gpu.streams, gpu.stream, gpu.lib)
    prepared = weights.prepare("mixed", parts, WeightRole.LINEAR)
    expected = concat_rows(parts).qweight.reshape(-1)
    assert prepared.bits == 8
    np.testing.assert_array_equal(gpu.download(prepared.qweight, np.uint8, expected.shape), expected)
