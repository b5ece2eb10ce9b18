"""A projection whose parts have different formats (a quantized Gated DeltaNet's [q|k|v|z] beside its bf16
[b|a]) is one weight: the model prepares it in one call, the numpy executor stacks the dequantized parts, and
the CUDA executor's weights keep it one SplitFormatWeight (quantized rows, then bf16 rows), on the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.exec.cuda_weights import DeviceWeights, SplitFormatWeight
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.model.executor import WeightRole
from ninfer_rt.model.hybrid_layers import linear_attention_shape
from ninfer_rt.model.layers import prepare_model
from ninfer_rt.model.mixers import PreparedLinearAttention
from ninfer_rt.model.weights import load_model_weights
from ninfer_rt.quantize.format import QuantizedWeight
from ninfer_rt.quantize.layouts import dequantize
from ninfer_rt.quantize.quantizer import quantize
from ninfer_rt.quantize_checkpoint.writer import quantize_checkpoint

BF16 = np.dtype(ml_dtypes.bfloat16)


def device_weights() -> DeviceWeights:
    streams = StreamSet()  # logical buffers: uploads land in host memory
    return DeviceWeights(streams, streams.create("compute"), None)  # type: ignore[arg-type]


def parts(rng: np.random.Generator) -> list[object]:
    """[q|k|v] and z quantized (int4 g128), then b and a as arrays."""
    return [quantize(rng.standard_normal((32, 256)), 4, 128), quantize(rng.standard_normal((16, 256)), 4, 128),
            rng.standard_normal((4, 256)), rng.standard_normal((4, 256))]


def test_quantized_then_dense_parts_are_one_split_format_weight() -> None:
    weights, rng = device_weights(), np.random.default_rng(0)
    made = parts(rng)
    w = weights.prepare("in_proj", made, WeightRole.LINEAR)
    assert isinstance(w, SplitFormatWeight) and (w.rows, w.cols) == (56, 256)
    assert (w.quantized.rows, w.dense.rows, w.tail.rows) == (48, 8, 8) and w.tail.weight is w.dense.buffer
    dense = w.dense.buffer.view(np.uint16, (8, 256)).view(BF16)
    np.testing.assert_array_equal(dense, np.concatenate(made[2:]).astype(BF16))
    assert weights.role(w) is WeightRole.LINEAR and w.buffer is w.quantized.qweight


def test_single_format_parts_keep_their_own_weight_types() -> None:
    weights, rng = device_weights(), np.random.default_rng(1)
    made = parts(rng)
    assert isinstance(weights.prepare("q", made[:2], WeightRole.LINEAR), QuantizedDeviceWeight)
    assert isinstance(weights.prepare("d", made[2:], WeightRole.LINEAR), DeviceTensor)


def test_dense_rows_before_quantized_ones_are_refused() -> None:
    made = parts(np.random.default_rng(2))
    with pytest.raises(ValueError, match="quantized rows after dense ones"):
        device_weights().prepare("in_proj", [made[2], made[0]], WeightRole.LINEAR)


def test_quantized_rows_off_a_multiple_of_8_are_refused() -> None:
    """The dense rows' outputs would start mid-way through a 16-byte chunk of the row (cuBLASLt's strided output)."""
    rng, weights = np.random.default_rng(3), device_weights()
    with pytest.raises(ValueError, match="20 quantized rows"):
        weights.prepare("w", [quantize(rng.standard_normal((20, 256)), 4, 128), rng.standard_normal((4, 256))], WeightRole.LINEAR)


class PartsRecorder(NumpyExecutor):
    def __init__(self) -> None:
        super().__init__(StreamSet())
        self.parts: dict[str, list[type]] = {}

    def prepare_weight(self, name: str, parts: Sequence[object], role: WeightRole) -> np.ndarray:
        self.parts[name] = [type(part) for part in parts]
        return super().prepare_weight(name, parts, role)


@pytest.fixture(scope="module")
def quantized_hybrid(tiny_qwen3_5: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_checkpoint(tiny_qwen3_5, tmp_path_factory.mktemp("q") / "int8", bits=8, group_size=32)


def test_the_model_prepares_a_quantized_gdn_projection_in_one_call(quantized_hybrid: Path) -> None:
    weights = load_model_weights(quantized_hybrid)
    executor = PartsRecorder()
    model = prepare_model(executor, weights)
    assert executor.parts["layers.0.in_proj"] == [QuantizedWeight, QuantizedWeight, np.ndarray, np.ndarray]
    mixer = model.layers[0].mixer
    assert isinstance(mixer, PreparedLinearAttention)
    source = weights.layers[0].mixer
    stacked = np.concatenate([dequantize(source.in_proj_qkv), dequantize(source.in_proj_z), source.in_proj_b, source.in_proj_a])
    assert mixer.in_proj.shape == (linear_attention_shape(weights.config).projection_rows, weights.config.hidden_size)
    np.testing.assert_array_equal(mixer.in_proj, stacked.astype(np.float32))  # the numpy executor: one dense matrix
