"""The qwen3.6-27b shape and its random-weight checkpoint (ninfer_rt.testing.shaped): the shape's config is
the real 27B config.json's model; a shrunken variant written directly in int4 g128 (no bf16 copy) loads
with ninfer-rt's loader as groupwise weights where `ninfer-rt quantize` would put them, and runs a forward
on the numpy executor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from forward_helpers import make_runtime, random_tokens
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.shapes import SHAPES, hybrid_text_config
from ninfer_rt.model.weights import load_model_weights
from ninfer_rt.quantize.format import QuantizedWeight
from ninfer_rt.testing.shaped import Quantized, make_shaped_model

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_6_27b_config.json"
# 4 layers (3 linear : 1 full), every quantized matrix's inputs a multiple of the 128-wide groups
SHRUNKEN = dict(SHAPES["qwen3.6-27b"], num_hidden_layers=4, hidden_size=256, intermediate_size=256, vocab_size=640,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)


def test_the_27b_shape_is_the_model_of_the_real_config() -> None:
    ours = dataclasses.asdict(ModelConfig.from_dict(hybrid_text_config(SHAPES["qwen3.6-27b"]) | {"max_position_embeddings": 262144}))
    real = dataclasses.asdict(ModelConfig.from_dict(json.loads(FIXTURE.read_text())))
    differing = {key for key in ours if ours[key] != real[key]}
    assert differing == {"architecture", "model_type", "eos_token_ids"}  # the text model alone; no tokenizer ids


@pytest.fixture(scope="module")
def shrunken_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shaped_model(tmp_path_factory.mktemp("shaped_hybrid"), SHRUNKEN, seed=1, quantized=Quantized(4))


def test_the_int4_checkpoint_holds_codes_and_scales_never_a_bf16_copy(shrunken_int4: Path) -> None:
    weights = load_model_weights(shrunken_int4)
    cfg = weights.config
    assert cfg.is_hybrid and cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.max_position_embeddings == 262144  # the 27B's: served with the seed's --max-context 262144
    linear, full = weights.layers[0], weights.layers[3]
    for matrix in (linear.mixer.in_proj_qkv, linear.mixer.out_proj, full.mixer.q_proj, linear.gate_proj, full.down_proj):
        assert isinstance(matrix, QuantizedWeight) and (matrix.bits, matrix.group_size) == (4, 128)
    assert not isinstance(linear.mixer.in_proj_a, QuantizedWeight)  # kept as stored, as the quantizer does
    assert not isinstance(weights.lm_head, QuantizedWeight) and not isinstance(weights.embed, QuantizedWeight)
    stored = json.loads((shrunken_int4 / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.linear_attn.in_proj_qkv.qweight" in stored
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" not in stored


def test_the_int4_checkpoint_runs_a_forward_on_the_numpy_executor(shrunken_int4: Path) -> None:
    rt = make_runtime(shrunken_int4, num_pages=4)
    tokens = random_tokens(SHRUNKEN["vocab_size"], 12, seed=2)
    logits = rt.run_sequence(tokens, [10, 1, 1], pages=[0, 1])
    assert logits.shape == (12, SHRUNKEN["vocab_size"]) and np.all(np.isfinite(logits))
    assert logits.std() > 0
