from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.model.config import ModelConfig, ModelConfigError
from ninfer_rt.model.rope import rope_attention_scaling, rope_inv_freq
from ninfer_rt.testing.tiny import make_tiny_model


def _raw_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _hf_rope(model_dir: Path) -> tuple[np.ndarray, float]:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(model_dir)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        inv_freq, scaling = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.numpy(), float(scaling)


def _write_config(tmp_path: Path, raw: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen3_mtp"])
def test_config_agrees_with_transformers_autoconfig(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoConfig

    model_dir = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_dir(model_dir)
    hf = AutoConfig.from_pretrained(model_dir)
    assert cfg.head_dim == hf.head_dim
    assert cfg.num_key_value_heads == hf.num_key_value_heads
    assert cfg.num_attention_heads == hf.num_attention_heads
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.eos_token_ids == (hf.eos_token_id,)


def test_qwen3_has_qk_norm_and_llama_does_not(tiny_qwen3: Path, tiny_llama: Path) -> None:
    assert ModelConfig.from_dir(tiny_qwen3).qk_norm
    assert not ModelConfig.from_dir(tiny_llama).qk_norm


def test_mtp_layer_count_read_from_either_field(tiny_qwen3: Path, tiny_qwen3_mtp: Path) -> None:
    assert ModelConfig.from_dir(tiny_qwen3).mtp_layers == 0
    assert ModelConfig.from_dir(tiny_qwen3_mtp).mtp_layers == 1
    raw = _raw_config(tiny_qwen3)
    assert ModelConfig.from_dict({**raw, "num_nextn_predict_layers": 1}).mtp_layers == 1


def test_head_dim_defaults_like_transformers(tiny_qwen3: Path, tiny_llama: Path) -> None:
    qwen3 = {k: v for k, v in _raw_config(tiny_qwen3).items() if k != "head_dim"}
    llama = {k: v for k, v in _raw_config(tiny_llama).items() if k != "head_dim"}
    assert ModelConfig.from_dict(qwen3).head_dim == 128  # Qwen3Config's default
    assert ModelConfig.from_dict(llama).head_dim == llama["hidden_size"] // llama["num_attention_heads"]


def test_unsupported_architecture_is_one_line_naming_it_and_the_supported_ones(tiny_qwen3: Path) -> None:
    raw = {**_raw_config(tiny_qwen3), "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ModelConfigError) as excinfo:
        ModelConfig.from_dict(raw)
    message = str(excinfo.value)
    assert "\n" not in message
    assert "MixtralForCausalLM" in message
    assert "Qwen3ForCausalLM" in message and "LlamaForCausalLM" in message


def test_attention_bias_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ModelConfigError, match="attention_bias"):
        ModelConfig.from_dict({**_raw_config(tiny_llama), "attention_bias": True})


def test_missing_config_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_plain_rope_matches_transformers(tiny_qwen3: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_qwen3)
    hf_inv_freq, hf_scaling = _hf_rope(tiny_qwen3)
    assert cfg.rope_scaling is None
    np.testing.assert_allclose(rope_inv_freq(cfg), hf_inv_freq, rtol=1e-6)
    assert rope_attention_scaling(cfg) == hf_scaling == 1.0


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"type": "yarn", "factor": 2.0},
    ],
)
@pytest.mark.filterwarnings("ignore")
def test_yarn_inv_freq_and_attention_scaling_match_transformers(
    tiny_qwen3: Path, tmp_path: Path, rope_scaling: dict
) -> None:
    raw = {**_raw_config(tiny_qwen3), "max_position_embeddings": 16384, "rope_scaling": rope_scaling}
    model_dir = _write_config(tmp_path, raw)
    cfg = ModelConfig.from_dir(model_dir)
    hf_inv_freq, hf_scaling = _hf_rope(model_dir)
    assert cfg.rope_scaling is not None
    np.testing.assert_allclose(rope_inv_freq(cfg), hf_inv_freq, rtol=1e-6)
    assert rope_attention_scaling(cfg) == pytest.approx(hf_scaling, rel=1e-12)


def test_yarn_from_newer_rope_parameters_form_matches_transformers(tiny_qwen3: Path, tmp_path: Path) -> None:
    raw = {k: v for k, v in _raw_config(tiny_qwen3).items() if k != "rope_theta"}
    raw["max_position_embeddings"] = 16384
    raw["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    }
    model_dir = _write_config(tmp_path, raw)
    cfg = ModelConfig.from_dir(model_dir)
    hf_inv_freq, hf_scaling = _hf_rope(model_dir)
    assert cfg.rope_theta == 50000.0
    np.testing.assert_allclose(rope_inv_freq(cfg), hf_inv_freq, rtol=1e-6)
    assert rope_attention_scaling(cfg) == pytest.approx(hf_scaling, rel=1e-12)


def test_yarn_factor_flag_of_tiny_model_reaches_the_config(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(make_tiny_model(tmp_path, yarn=4.0))
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling.factor == 4.0
    assert rope_attention_scaling(cfg) > 1.0


def test_unsupported_rope_type_is_refused(tiny_qwen3: Path) -> None:
    raw = {**_raw_config(tiny_qwen3), "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}
    with pytest.raises(ModelConfigError, match="longrope"):
        ModelConfig.from_dict(raw)
