"""`.ninfer` grouped tensors bound as groupwise weights: Q4G64 as int4 at group 64, Q5G64 / Q6G64 / W8G32
widened to int8 at their group size, the fp16 multipliers kept; every bound weight dequantizes to exactly the
values the artifact reader decodes, and fp16 scales are honoured by every host operation on the format."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ninfer_rt.artifact import Artifact, ArtifactError, layouts
from ninfer_rt.artifact.container import ArtifactObject
from ninfer_rt.artifact.layouts import GROUPED_FORMATS, ROW_SPLIT, dequantize_row_split
from ninfer_rt.artifact.quantized import binds_quantized, quantized_weight
from ninfer_rt.artifact.writer import pack_row_split
from ninfer_rt.quantize.format import QuantFormatError, QuantizedWeight, ScaleFormat, signed, unpack
from ninfer_rt.quantize.layouts import dense_rows, dequantize, device_layout, rows_layout, split_rows, stack_rows
from test_ninfer_artifact import EXPECTED, TINY, needs_fixture

BOUND = {"Q4G64_F16S": (4, 64), "Q5G64_F16S": (8, 64), "Q6G64_F16S": (8, 64), "W8G32_F16S": (8, 32)}


def oracle(weight: QuantizedWeight) -> np.ndarray:
    """float64 codes times float64 multipliers, then NInfer's one rounding to bfloat16, as float32."""
    weight = rows_layout(weight)
    q = signed(unpack(weight.qweight, weight.bits), weight.bits).astype(np.float64)
    products = q * np.repeat(weight.scales.astype(np.float64), weight.group_size, axis=1)
    return products.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)  # f32 step exact: 19 bits


def extreme_payload(fmt: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    """Codes over the format's whole range (its most negative code included) and fp16 multipliers of both
    signs, subnormal ones included, packed as NInfer lays them out."""
    rng = np.random.default_rng(seed)
    spec = GROUPED_FORMATS[fmt]
    half = 1 << (spec.code_bits - 1)
    padded = -(-cols // 128) * 128
    codes = rng.integers(-half, half, (rows, padded)).astype(np.int8)
    codes[:, cols:] = 0
    codes[0, : 2 * half] = np.arange(-half, half)
    scales = (rng.standard_normal((rows, padded // spec.group)) * 0.02).astype(np.float16)
    scales[0, 0], scales[-1, -1] = np.float16(6e-8), np.float16(-3e-6)  # subnormal multipliers
    return codes, scales, pack_row_split(fmt, codes, scales, cols)


def bound(fmt: str, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, np.ndarray, np.ndarray, bytes]:
    """The weight bound from an extreme payload, with that payload's codes, multipliers and bytes."""
    codes, scales, payload = extreme_payload(fmt, rows, cols, seed)
    obj = ArtifactObject("w", "tensor", 0, len(payload), (rows, cols), fmt, ROW_SPLIT)
    return quantized_weight(obj, memoryview(payload)), codes, scales, payload


@pytest.mark.parametrize("cols", [256, 192, 320])  # K whole, and padded to 256 / 384
@pytest.mark.parametrize("fmt", list(BOUND))
def test_each_grouped_format_binds_to_its_kernel_format_and_decodes_as_the_reader_does(fmt: str, cols: int) -> None:
    weight, _, _, payload = bound(fmt, 24, cols, cols)
    assert (weight.bits, weight.group_size) == BOUND[fmt]
    assert weight.scale_format is ScaleFormat.FP16 and weight.shape == (24, cols)
    want = dequantize_row_split(fmt, (24, cols), memoryview(payload))
    np.testing.assert_array_equal(oracle(weight), want)
    np.testing.assert_array_equal(dequantize(weight, np.float64), want)


@pytest.mark.parametrize("fmt", list(BOUND))
def test_codes_and_multipliers_are_the_stored_ones_unchanged(fmt: str) -> None:
    weight, codes, scales, _ = bound(fmt, 16, 320, 7)
    assert np.array_equal(signed(unpack(weight.qweight, weight.bits), weight.bits), codes[:, :320])
    assert np.array_equal(weight.scales.view(np.uint16), scales[:, : 320 // weight.group_size].view(np.uint16))


@needs_fixture
def test_the_ninfer_written_fixture_binds_to_the_values_its_decoder_reads() -> None:
    expected = np.load(EXPECTED)
    with Artifact(TINY) as artifact:
        grouped = [obj for obj in artifact.objects.values() if obj.format in GROUPED_FORMATS]
        assert {obj.name for obj in grouped if not binds_quantized(obj)} == {"text/q4"}  # K = 200: not whole groups
        for obj in grouped:
            if not binds_quantized(obj):
                with pytest.raises(ArtifactError, match="no groupwise binding"):
                    quantized_weight(obj, artifact.payload(obj.name))
                continue
            weight = quantized_weight(obj, artifact.payload(obj.name))
            np.testing.assert_array_equal(oracle(weight), expected[obj.name.replace("/", "__")], err_msg=obj.name)


def fp16_weight(rng: np.random.Generator, rows: int = 16, cols: int = 128, bits: int = 8, group: int = 64) -> QuantizedWeight:
    codes = rng.integers(0, 1 << bits, (rows, cols)).astype(np.uint8)
    packed = codes if bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = (rng.standard_normal((rows, cols // group)) * 0.05).astype(np.float16)
    return QuantizedWeight(bits, group, np.ascontiguousarray(packed), scales)


def test_fp16_scale_values_are_the_products_rounded_once_to_bf16_and_bf16_scale_values_are_exact() -> None:
    rng = np.random.default_rng(0)
    weight = fp16_weight(rng)
    exact = signed(unpack(weight.qweight, 8), 8) * np.repeat(weight.scales.astype(np.float64), 64, axis=1)
    assert not np.array_equal(exact.astype(np.float32), dequantize(weight)), "the test needs products bf16 rounds"
    np.testing.assert_array_equal(dequantize(weight, np.float64), exact.astype(np.float32).astype(ml_dtypes.bfloat16))
    as_bf16 = QuantizedWeight(8, 64, weight.qweight, weight.scales.astype(ml_dtypes.bfloat16))
    exact_bf16 = signed(unpack(as_bf16.qweight, 8), 8) * np.repeat(as_bf16.scales.astype(np.float64), 64, axis=1)
    np.testing.assert_array_equal(dequantize(as_bf16, np.float64), exact_bf16)


def test_layouts_splits_and_fusions_keep_fp16_multipliers_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    q4, q8 = fp16_weight(rng, 24, 256, 4), fp16_weight(rng, 40, 256, 8)
    fused = stack_rows([q4, q8])  # the int4 rows widened to int8
    assert fused.bits == 8 and fused.scale_format is ScaleFormat.FP16
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(q4), dequantize(q8)]))
    top, bottom = split_rows(fused, 24, 40)
    np.testing.assert_array_equal(dequantize(top), dequantize(q4))
    octets = device_layout(fused)
    assert octets.scales.dtype == np.float16
    np.testing.assert_array_equal(rows_layout(octets).scales.view(np.uint16), fused.scales.view(np.uint16))
    np.testing.assert_array_equal(dense_rows(q8, np.array([5, 1])), dequantize(q8)[[5, 1]])
    with pytest.raises(QuantFormatError, match="different scale formats"):
        stack_rows([q8, QuantizedWeight(8, 64, q8.qweight, q8.scales.astype(ml_dtypes.bfloat16))])
    with pytest.raises(QuantFormatError, match="bf16 or float16"):
        QuantizedWeight(8, 64, q8.qweight, q8.scales.astype(np.float32))


@pytest.mark.parametrize("fmt", list(BOUND))
def test_row_blocks_bind_and_decode_what_one_block_does(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Large tensors are decoded a block of rows at a time (the 27B's 248k-row embedding would otherwise need
    # ~20 GB of temporaries); a block of one or three rows must change nothing.
    weight, _, _, payload = bound(fmt, 24, 320, 11)
    whole = dequantize_row_split(fmt, (24, 320), memoryview(payload))
    for block_codes in (1, 3 * 384):
        monkeypatch.setattr(layouts, "ROW_BLOCK_CODES", block_codes)
        blocked, _, _, _ = bound(fmt, 24, 320, 11)
        np.testing.assert_array_equal(blocked.qweight, weight.qweight)
        np.testing.assert_array_equal(dequantize_row_split(fmt, (24, 320), memoryview(payload)), whole)
        bf16 = dequantize_row_split(fmt, (24, 320), memoryview(payload), ml_dtypes.bfloat16)
        np.testing.assert_array_equal(bf16.astype(np.float32), whole)
