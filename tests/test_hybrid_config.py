"""config.json of the Qwen3.5/3.6 hybrids -> ModelConfig, against the published shapes and transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.model.config import ModelConfig, ModelConfigError
from ninfer_rt.model.hybrid_config import FULL_ATTENTION, LINEAR_ATTENTION
from ninfer_rt.model.rope import rope_inv_freq

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_6_27B = FIXTURES / "qwen3_6_27b_config.json"
QWEN3_5_0_8B = FIXTURES / "qwen3_5_0_8b_config.json"


def _composite(path: Path) -> dict:
    return json.loads(path.read_text())


def _text_only(path: Path) -> dict:
    """The same model as a Qwen3_5ForCausalLM checkpoint would declare it."""
    raw = _composite(path)
    return {**raw["text_config"], "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}


def _refused(raw: dict) -> str:
    with pytest.raises(ModelConfigError) as excinfo:
        ModelConfig.from_dict(raw)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_qwen3_6_27b_config_reads_as_published() -> None:
    cfg = ModelConfig.from_dict(_composite(QWEN3_6_27B))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (64, 5120, 17408, 248320)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 256)
    assert cfg.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,) + cfg.layer_types[4:]
    assert cfg.full_attention_layers == tuple(range(3, 64, 4))
    assert len(cfg.linear_attention_layers) == 48
    linear = cfg.linear_attention
    assert linear is not None
    assert (linear.num_key_heads, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim) == (16, 48, 128, 128)
    assert linear.conv_kernel_size == 4 and linear.conv_state_columns == 3
    assert linear.value_heads_per_key_head == 3
    assert linear.conv_channels == 2 * 16 * 128 + 48 * 128
    assert linear.state_shape == (48, 128, 128)
    assert cfg.partial_rotary_factor == 0.25 and cfg.rotary_dim == 64
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None
    assert cfg.attention_output_gate and cfg.zero_centered_norms and cfg.qk_norm
    assert cfg.mtp_layers == 1
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 262144
    assert not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (248044,)


def test_qwen3_5_0_8b_config_is_tied_and_derives_its_pattern_from_the_interval() -> None:
    raw = _composite(QWEN3_5_0_8B)
    assert "layer_types" not in raw["text_config"]
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 1024, 8, 2)
    assert cfg.full_attention_layers == (3, 7, 11, 15, 19, 23)
    assert cfg.linear_attention is not None and cfg.linear_attention.value_heads_per_key_head == 1
    assert cfg.tie_word_embeddings


@pytest.mark.parametrize("path", [QWEN3_6_27B, QWEN3_5_0_8B])
def test_text_only_and_composite_forms_describe_the_same_model(path: Path) -> None:
    composite = ModelConfig.from_dict(_composite(path))
    text = ModelConfig.from_dict(_text_only(path))
    assert text.architecture == "Qwen3_5ForCausalLM" and text.model_type == "qwen3_5_text"
    assert composite.model_type == "qwen3_5"
    same = ("architecture", "model_type")
    assert {k: v for k, v in vars(text).items() if k not in same} == {
        k: v for k, v in vars(composite).items() if k not in same
    }


@pytest.mark.parametrize("path", [QWEN3_6_27B, QWEN3_5_0_8B])
@pytest.mark.parametrize("form", [_composite, _text_only])
def test_config_agrees_with_transformers(path: Path, form, tmp_path: Path) -> None:
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(form(path)))
    hf = AutoConfig.from_pretrained(tmp_path)
    hf_text = hf.get_text_config()
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.layer_types == tuple(hf_text.layer_types)
    linear = cfg.linear_attention
    assert linear is not None
    assert linear.num_key_heads == hf_text.linear_num_key_heads
    assert linear.num_value_heads == hf_text.linear_num_value_heads
    assert linear.key_head_dim == hf_text.linear_key_head_dim
    assert linear.value_head_dim == hf_text.linear_value_head_dim
    assert linear.conv_kernel_size == hf_text.linear_conv_kernel_dim
    assert cfg.head_dim == hf_text.head_dim
    assert cfg.rope_theta == hf_text.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == hf_text.rope_parameters["partial_rotary_factor"]
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings  # the top-level flag for the composite form


def test_rope_inverse_frequencies_cover_the_rotary_dims_only_as_transformers() -> None:
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    raw = _text_only(QWEN3_6_27B)
    cfg = ModelConfig.from_dict(raw)
    hf_inv_freq, _ = Qwen3_5TextRotaryEmbedding.compute_default_rope_parameters(Qwen3_5TextConfig(**raw))
    assert rope_inv_freq(cfg).shape == (cfg.rotary_dim // 2,)
    np.testing.assert_allclose(rope_inv_freq(cfg), hf_inv_freq.numpy(), rtol=1e-6)


def test_multimodal_rope_sections_collapse_to_plain_rope_for_text_positions() -> None:
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    raw = _text_only(QWEN3_6_27B)
    cfg = ModelConfig.from_dict(raw)
    rotary = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**raw))
    positions = torch.tensor([[0, 1, 2, 17, 1000, 200_000]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    # transformers' own float32 angles (its frequencies are checked against ours above), so that only the
    # section recomposition could differ from plain RoPE
    assert rotary.inv_freq.shape == (cfg.rotary_dim // 2,)
    angles = positions[0].numpy()[:, None].astype(np.float32) * rotary.inv_freq.numpy()[None, :]
    plain = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    np.testing.assert_allclose(cos[0].numpy(), np.cos(plain), atol=1e-6)
    np.testing.assert_allclose(sin[0].numpy(), np.sin(plain), atol=1e-6)


def test_gate_fields_of_the_config_are_ignored() -> None:
    raw = _composite(QWEN3_6_27B)
    reference = ModelConfig.from_dict(raw)
    for fields in ({"attn_output_gate": False}, {"output_gate_type": "sigmoid"}, {"output_gate_type": "none"}):
        edited = {**raw, "text_config": {**raw["text_config"], **fields}}
        assert ModelConfig.from_dict(edited) == reference


def test_dense_configs_keep_their_meaning(tiny_qwen3: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_qwen3)
    assert not cfg.is_hybrid and cfg.layer_types == () and cfg.linear_attention is None
    assert cfg.rotary_dim == cfg.head_dim and not cfg.zero_centered_norms and not cfg.attention_output_gate
    assert cfg.full_attention_layers == tuple(range(cfg.num_hidden_layers))


def _edit_text(path: Path, **fields) -> dict:
    raw = _composite(path)
    return {**raw, "text_config": {**raw["text_config"], **fields}}


def test_moe_variant_is_refused_naming_it() -> None:
    raw = {**_composite(QWEN3_6_27B), "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]}
    assert "qwen3_5_moe" in _refused(raw)
    assert "num_experts" in _refused(_edit_text(QWEN3_6_27B, num_experts=256))


def test_unknown_layer_type_is_refused_naming_its_index() -> None:
    layer_types = _composite(QWEN3_6_27B)["text_config"]["layer_types"]
    message = _refused(_edit_text(QWEN3_6_27B, layer_types=[*layer_types[:5], "sliding_attention", *layer_types[6:]]))
    assert "layer_types[5]" in message and "sliding_attention" in message


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"layer_types": ["full_attention"] * 63}, "layer_types"),
        ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval"),
        ({"linear_num_value_heads": 40}, "linear_num_value_heads"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.005}}, "partial_rotary_factor"),
        ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings"),
        ({"mtp_num_hidden_layers": 2}, "MTP"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_hybrid_configs_are_one_line_naming_the_field(fields: dict, named: str) -> None:
    assert named in _refused(_edit_text(QWEN3_6_27B, **fields))
