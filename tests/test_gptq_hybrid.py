"""GPTQ-Int4 checkpoints of the Qwen3.5 hybrid load through the GPTQ import, in both name layouts: every
linear of the Gated DeltaNet (in_proj_qkv, in_proj_z, out_proj), of the gated attention (q_proj with its
per-head q | gate rows, k/v/o) and of the MLPs and the MTP layer stored as qweight/qzeros/scales/g_idx,
in_proj_a/b kept in fp16 as published checkpoints keep them. The numpy logits equal transformers' float32
logits on the weights the stored integers define, written out as a plain checkpoint: W = scale * (q - 8) with
the fp16 scale rounded to bf16, as the import stores scales (a relative change of at most 2^-9, about 1/40 of
int4's own rounding step at the group's extreme)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from forward_helpers import hf_outputs, make_runtime, random_tokens, relative_error
from ninfer_rt.model.weights import SHARD_INDEX, load_model_weights
from ninfer_rt.quantize.format import QuantizedWeight
from test_quant import pack_int32_along_columns, pack_int32_along_rows

pytest.importorskip("transformers")

GROUP = 32
TOLERANCE = 1e-4
KEPT_IN_FP16 = ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")
NOT_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", *KEPT_IN_FP16)


def gptq_int4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [in, out] in 0..15, fp16 scales [in/GROUP, out]) of W [out, in]: absmax grid, zero 8."""
    grouped = weight.T.reshape(-1, GROUP, weight.shape[0]).astype(np.float64)
    scales = (np.abs(grouped).max(axis=1) / 7.5).astype(np.float16)
    codes = np.clip(np.rint(grouped / scales[:, None].astype(np.float64)) + 8, 0, 15)
    # C order: safetensors writes an array's memory as it lies
    return np.ascontiguousarray(codes.reshape(weight.shape[1], weight.shape[0]), np.uint8), np.ascontiguousarray(scales)


def is_quantized_linear(name: str, tensor: np.ndarray) -> bool:
    return tensor.ndim == 2 and name.endswith(".weight") and not name.endswith(NOT_QUANTIZED) and ".visual." not in name


def write_gptq_and_reference(model_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a GPTQ-Int4 copy of ``model_dir``, a float32 copy holding the weights its integers define)."""
    tensors = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    gptq, reference = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(KEPT_IN_FP16):
            tensor = tensor.astype(np.float16)
        if not is_quantized_linear(name, tensor):
            gptq[name] = reference[name] = tensor
            continue
        codes, scales = gptq_int4(tensor)
        base = name.removesuffix(".weight")
        gptq[f"{base}.qweight"] = pack_int32_along_rows(codes)
        gptq[f"{base}.qzeros"] = pack_int32_along_columns(np.full((scales.shape[0], codes.shape[1]), 7))  # zero - 1
        gptq[f"{base}.scales"] = scales
        gptq[f"{base}.g_idx"] = (np.arange(codes.shape[0]) // GROUP).astype(np.int32)
        imported_scales = scales.astype(ml_dtypes.bfloat16).astype(np.float64)
        dequantized = (codes - 8.0) * np.repeat(imported_scales, GROUP, axis=0)
        reference[name] = np.ascontiguousarray(dequantized.T, np.float32)
    config = json.loads((model_dir / "config.json").read_text())
    quantization = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False}
    return (
        copy_with(model_dir, tmp_path / "gptq", gptq, {**config, "quantization_config": quantization}),
        copy_with(model_dir, tmp_path / "reference", reference, config),
    )


def copy_with(model_dir: Path, out: Path, tensors: dict[str, np.ndarray], config: dict) -> Path:
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", SHARD_INDEX))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5", "tiny_qwen3_5_vl"])
def test_gptq_hybrid_logits_equal_transformers_on_the_dequantized_weights(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    gptq_dir, reference_dir = write_gptq_and_reference(request.getfixturevalue(fixture), tmp_path)
    tokens = random_tokens(512, 40)
    ours = make_runtime(gptq_dir).run_sequence(tokens, [33, 7], list(range(4)))
    reference, _ = hf_outputs(reference_dir, tokens)
    assert relative_error(ours, reference) < TOLERANCE


def test_every_hybrid_linear_but_the_gate_projections_loads_quantized(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    gptq_dir, _ = write_gptq_and_reference(tiny_qwen3_5, tmp_path)
    weights = load_model_weights(gptq_dir)
    linear, gated = weights.layers[0].mixer, weights.layers[3].mixer
    for quantized in (linear.in_proj_qkv, linear.in_proj_z, linear.out_proj, gated.q_proj, gated.gate_proj,
                      gated.k_proj, gated.o_proj, weights.layers[0].down_proj, weights.mtp.fc):
        assert isinstance(quantized, QuantizedWeight) and quantized.bits == 4
    assert linear.in_proj_a.dtype == np.float16 and linear.in_proj_b.dtype == np.float16
    assert gated.q_proj.shape == gated.gate_proj.shape == (4 * 32, 64)  # the q | gate rows split per head
