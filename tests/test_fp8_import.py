"""FP8 block-scaled checkpoints (``quant_method: fp8``, ``weight_block_size``) load, dequantized to bf16:
W = weight * weight_scale_inv per block, partial edge blocks included. A tiny FP8 hybrid's numpy logits equal
transformers' on the weights its FP8 values and block scales define; configs it cannot hold are refused."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from forward_helpers import hf_outputs, make_runtime, random_tokens, relative_error
from ninfer_rt.model.weights import load_model_weights
from ninfer_rt.quantize.format import QuantFormatError
from ninfer_rt.quantize.scheme import scheme_from_config
from test_gptq_hybrid import copy_with

BLOCK = (48, 32)  # not dividing the tiny model's 64/128/160/256 rows: partial edge blocks
E4M3_MAX = 448.0
TOLERANCE = 1e-4
NOT_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")


def block_scales(weight: np.ndarray) -> np.ndarray:
    """Per-block absmax / 448 [ceil(out/48), ceil(in/32)], the value stored as weight_scale_inv."""
    rows, cols = -(-weight.shape[0] // BLOCK[0]), -(-weight.shape[1] // BLOCK[1])
    padded = np.zeros((rows * BLOCK[0], cols * BLOCK[1]))
    padded[: weight.shape[0], : weight.shape[1]] = np.abs(weight)
    return (padded.reshape(rows, BLOCK[0], cols, BLOCK[1]).max(axis=(1, 3)) / E4M3_MAX).astype(np.float32)


def per_element(scales: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return np.kron(scales.astype(np.float64), np.ones(BLOCK))[: shape[0], : shape[1]]


def write_fp8_and_reference(model_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    tensors = load_file(str(model_dir / "model.safetensors"))
    fp8, reference = {}, {}
    for name, tensor in tensors.items():
        if tensor.ndim != 2 or name.endswith(NOT_QUANTIZED):
            fp8[name] = reference[name] = tensor
            continue
        scales = block_scales(tensor)
        values = (tensor / per_element(scales, tensor.shape)).astype(ml_dtypes.float8_e4m3fn)
        fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = values, scales
        weight = values.astype(np.float64) * per_element(scales, tensor.shape)
        reference[name] = weight.astype(ml_dtypes.bfloat16).astype(np.float32)  # the import's bf16 rounding
    config = json.loads((model_dir / "config.json").read_text())
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    return (
        copy_with(model_dir, tmp_path / "fp8", fp8, {**config, "quantization_config": quantization}),
        copy_with(model_dir, tmp_path / "reference", reference, config),
    )


def test_fp8_hybrid_logits_equal_transformers_on_the_dequantized_weights(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    fp8_dir, reference_dir = write_fp8_and_reference(tiny_qwen3_5, tmp_path)
    tokens = random_tokens(512, 40)
    ours = make_runtime(fp8_dir).run_sequence(tokens, [40], list(range(4)))
    reference, _ = hf_outputs(reference_dir, tokens)
    assert relative_error(ours, reference) < TOLERANCE


def test_fp8_weights_load_as_bf16_and_the_unquantized_as_stored(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    fp8_dir, reference_dir = write_fp8_and_reference(tiny_qwen3_5, tmp_path)
    loaded, expected = load_model_weights(fp8_dir), load_model_weights(reference_dir)
    qkv = loaded.layers[0].mixer.in_proj_qkv  # 160 rows: three full row blocks and a partial one
    assert qkv.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(qkv.astype(np.float32), expected.layers[0].mixer.in_proj_qkv)
    assert loaded.layers[0].mixer.in_proj_a.dtype == np.float32


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "fp8"}, "weight_block_size=None is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
    ],
)
def test_fp8_without_block_scales_is_refused(config: dict, message: str) -> None:
    with pytest.raises(QuantFormatError, match=message.replace("[", r"\[")):
        scheme_from_config(config)
