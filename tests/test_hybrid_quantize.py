"""`ninfer-rt quantize` on a Qwen3.5 hybrid: the layout's names survive, the gate projections stay as stored."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.quantize_checkpoint.writer import quantize_checkpoint
from ninfer_rt.model.hybrid_weights import GatedAttentionWeights, LinearAttentionWeights, split_query_gate
from ninfer_rt.quantize.format import QuantizedWeight
from ninfer_rt.quantize.layouts import dequantize
from ninfer_rt.model.weights import ModelWeights, load_checkpoint

GROUP = 32  # the tiny model's hidden size is 64


@pytest.fixture(scope="module")
def quantized_vl(tiny_qwen3_5_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_checkpoint(tiny_qwen3_5_vl, tmp_path_factory.mktemp("q") / "int4", bits=4, group_size=GROUP)


def test_quantized_checkpoint_keeps_the_vision_language_names(quantized_vl: Path, tiny_qwen3_5_vl: Path) -> None:
    stored = json.loads((quantized_vl / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.qweight" in stored
    assert not any(name.startswith("model.layers.") for name in stored)
    assert set(load_checkpoint(quantized_vl)) >= {n for n in load_checkpoint(tiny_qwen3_5_vl) if not n.endswith("_proj.weight")}


def test_linears_are_quantized_but_the_decay_and_beta_projections_are_not(quantized_vl: Path) -> None:
    weights = ModelWeights.from_checkpoint(load_checkpoint(quantized_vl))
    linear = weights.layers[0].mixer
    assert isinstance(linear, LinearAttentionWeights)
    for quantized in (linear.in_proj_qkv, linear.in_proj_z, linear.out_proj, weights.layers[0].down_proj):
        assert isinstance(quantized, QuantizedWeight)
    for kept in (linear.in_proj_a, linear.in_proj_b, linear.conv_weight, linear.A_log, linear.dt_bias):
        assert isinstance(kept, np.ndarray)


def test_quantized_query_gate_split_equals_the_split_of_the_dequantized_rows(quantized_vl: Path) -> None:
    ckpt = load_checkpoint(quantized_vl)
    cfg = ckpt.config
    layer = cfg.full_attention_layers[0]
    fused = ckpt[f"model.layers.{layer}.self_attn.q_proj.weight"]
    assert isinstance(fused, QuantizedWeight)
    mixer = GatedAttentionWeights.from_checkpoint(ckpt, f"model.layers.{layer}.", cfg)
    query, gate = split_query_gate(dequantize(fused), cfg.num_attention_heads, cfg.head_dim)
    assert isinstance(mixer.q_proj, QuantizedWeight) and isinstance(mixer.gate_proj, QuantizedWeight)
    np.testing.assert_array_equal(dequantize(mixer.q_proj), query)
    np.testing.assert_array_equal(dequantize(mixer.gate_proj), gate)
