"""Qwen3.5 hybrid checkpoints (both layouts, written by transformers) -> the loader's tensors and weight views."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ninfer_rt.model.config import ModelConfig, ModelConfigError
from ninfer_rt.model.hybrid_weights import GatedAttentionWeights, LinearAttentionWeights
from ninfer_rt.model.safetensors_file import SafetensorsFile
from ninfer_rt.model.weights import (
    CheckpointMismatchError,
    HybridLayerWeights,
    ModelWeights,
    WeightsError,
    expected_tensors,
    load_checkpoint,
    load_model_weights,
)

torch = pytest.importorskip("torch")


def _stored_names(model_dir: Path) -> set[str]:
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        names.update(load_file(str(path)))
    return names


def _hf_causal_lm(model_dir: Path):  # noqa: ANN202 -- a transformers model
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_both_layouts_load_to_the_same_tensors(tiny_qwen3_5: Path, tiny_qwen3_5_vl: Path) -> None:
    causal, vl = load_checkpoint(tiny_qwen3_5), load_checkpoint(tiny_qwen3_5_vl)
    assert (tiny_qwen3_5_vl / "model.safetensors.index.json").exists()  # the sharded form
    assert set(causal) == set(vl) == set(expected_tensors(causal.config))
    for name in causal:
        np.testing.assert_array_equal(causal[name], vl[name], err_msg=name)
    assert any(name.startswith("model.language_model.") for name in _stored_names(tiny_qwen3_5_vl))


def test_vision_tower_is_never_read(tiny_qwen3_5_vl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requested: list[str] = []
    real_tensor = SafetensorsFile.tensor

    def recording_tensor(self: SafetensorsFile, name: str) -> np.ndarray:
        requested.append(name)
        return real_tensor(self, name)

    monkeypatch.setattr(SafetensorsFile, "tensor", recording_tensor)
    ckpt = load_checkpoint(tiny_qwen3_5_vl)
    visual = {name for name in _stored_names(tiny_qwen3_5_vl) if name.startswith("model.visual.")}
    assert visual  # the checkpoint has a vision tower to skip
    assert len(requested) == len(ckpt) and not visual & set(requested)


def test_linear_attention_weights_are_transformers_parameters(tiny_qwen3_5: Path) -> None:
    weights = load_model_weights(tiny_qwen3_5)
    hf = _hf_causal_lm(tiny_qwen3_5)
    cfg = weights.config
    for i in cfg.linear_attention_layers:
        layer = weights.layers[i]
        assert isinstance(layer, HybridLayerWeights) and isinstance(layer.mixer, LinearAttentionWeights)
        ours, theirs = layer.mixer, hf.model.layers[i].linear_attn
        np.testing.assert_array_equal(ours.in_proj_qkv, theirs.in_proj_qkv.weight.detach().numpy())
        np.testing.assert_array_equal(ours.conv_weight, theirs.conv1d.weight.detach().numpy()[:, 0, :])
        for field, param in (("A_log", theirs.A_log), ("dt_bias", theirs.dt_bias), ("norm", theirs.norm.weight)):
            np.testing.assert_array_equal(getattr(ours, field), param.detach().numpy(), err_msg=field)
        np.testing.assert_array_equal(layer.input_norm, hf.model.layers[i].input_layernorm.weight.detach().numpy())
    assert cfg.linear_attention is not None and cfg.linear_attention.value_heads_per_key_head >= 3


def test_gains_are_kept_as_stored_and_away_from_their_initial_values(tiny_qwen3_5: Path) -> None:
    weights = load_model_weights(tiny_qwen3_5)
    linear, full = weights.layers[0], weights.layers[weights.config.full_attention_layers[0]]
    assert isinstance(linear.mixer, LinearAttentionWeights) and isinstance(full.mixer, GatedAttentionWeights)
    # zero-centred gains (applied as 1 + w) start at 0; the gated norm's plain gain at 1; dt_bias at 1
    for zero_centred in (weights.norm, linear.input_norm, linear.post_norm, full.mixer.q_norm, full.mixer.k_norm):
        assert np.abs(zero_centred).mean() > 0.02 and np.abs(zero_centred).mean() < 0.5
    assert np.abs(linear.mixer.norm - 1.0).mean() > 0.02
    assert np.abs(linear.mixer.dt_bias - 1.0).mean() > 0.1


def test_query_and_gate_rows_are_split_as_transformers_splits_the_projection(tiny_qwen3_5: Path) -> None:
    weights = load_model_weights(tiny_qwen3_5)
    hf = _hf_causal_lm(tiny_qwen3_5)
    cfg = weights.config
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for i in cfg.full_attention_layers:
        mixer = weights.layers[i].mixer
        assert isinstance(mixer, GatedAttentionWeights)
        projected = hf.model.layers[i].self_attn.q_proj(x).view(5, cfg.num_attention_heads, 2 * cfg.head_dim)
        query, gate = (t.reshape(5, -1).detach().numpy() for t in torch.chunk(projected, 2, dim=-1))
        np.testing.assert_allclose(x.numpy() @ mixer.q_proj.T, query, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(x.numpy() @ mixer.gate_proj.T, gate, rtol=1e-5, atol=1e-6)
        assert mixer.q_proj.shape == mixer.gate_proj.shape == (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)


def test_mtp_layer_is_a_gated_attention_layer_with_the_vllm_names(tiny_qwen3_5_vl: Path) -> None:
    ckpt = load_checkpoint(tiny_qwen3_5_vl)
    weights = ModelWeights.from_checkpoint(ckpt)
    cfg = weights.config
    assert cfg.mtp_layers == 1 and weights.mtp is not None
    assert weights.mtp.fc is ckpt["mtp.fc.weight"] and weights.mtp.fc.shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert weights.mtp.norm_embedding is ckpt["mtp.pre_fc_norm_embedding.weight"]
    assert weights.mtp.norm_hidden is ckpt["mtp.pre_fc_norm_hidden.weight"]
    assert weights.mtp.norm is ckpt["mtp.norm.weight"]
    assert isinstance(weights.mtp.layer, HybridLayerWeights) and isinstance(weights.mtp.layer.mixer, GatedAttentionWeights)
    assert weights.mtp.layer.down_proj is ckpt["mtp.layers.0.mlp.down_proj.weight"]


def test_tied_checkpoint_uses_the_embedding_as_lm_head(tmp_path: Path) -> None:
    from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5

    model_dir = make_tiny_qwen3_5(tmp_path, layout="conditional_generation", tie=True, layers=4, mtp=False)
    weights = load_model_weights(model_dir)
    assert weights.config.tie_word_embeddings and weights.lm_head is weights.embed and weights.mtp is None


# --- bad checkpoints: one line naming the tensor or field --------------------------------------------------


def _single_file_copy(src: Path, dst: Path, edit) -> Path:
    """``src`` rewritten as one model.safetensors after ``edit`` changed the stored tensors."""
    shutil.copytree(src, dst)
    tensors: dict[str, np.ndarray] = {}
    for path in list(dst.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
        path.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _mismatch(model_dir: Path) -> str:
    with pytest.raises(CheckpointMismatchError) as excinfo:
        load_checkpoint(model_dir)
    assert isinstance(excinfo.value, WeightsError)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_missing_tensor_is_named_as_the_checkpoint_stores_it(tiny_qwen3_5_vl: Path, tmp_path: Path) -> None:
    name = "model.language_model.layers.1.linear_attn.A_log"
    model_dir = _single_file_copy(tiny_qwen3_5_vl, tmp_path / "m", lambda t: t.pop(name))
    message = _mismatch(model_dir)
    assert "1 missing" in message and name in message


def test_wrong_shape_is_named_with_both_shapes(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    name = "model.layers.0.linear_attn.conv1d.weight"
    model_dir = _single_file_copy(tiny_qwen3_5, tmp_path / "m", lambda t: t.update({name: t[name][..., :3].copy()}))
    message = _mismatch(model_dir)
    assert f"{name} is [160, 1, 3], expected [160, 1, 4]" in message


def test_text_weights_outside_the_layouts_prefix_are_unexpected(tiny_qwen3_5_vl: Path, tmp_path: Path) -> None:
    stray = "model.layers.0.linear_attn.A_log"
    source = "model.language_model.layers.0.linear_attn.A_log"
    model_dir = _single_file_copy(tiny_qwen3_5_vl, tmp_path / "m", lambda t: t.update({stray: t.pop(source)}))
    message = _mismatch(model_dir)
    assert f"missing: {source}" in message and f"unexpected: {stray}" in message


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda text: text.update(layer_types=[*text["layer_types"][:-1], "sparse_attention"]), "layer_types[7]"),
        (lambda text: text.update(num_experts=8), "num_experts"),
        (lambda text: text.update(linear_num_value_heads=5), "linear_num_value_heads"),
    ],
)
def test_unsupported_config_is_refused_at_load_naming_the_field(tiny_qwen3_5_vl: Path, tmp_path: Path, edit, named: str) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_qwen3_5_vl, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    edit(config["text_config"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=named.replace("[", r"\[")):
        load_checkpoint(model_dir)


def test_moe_checkpoint_is_refused_naming_the_model_type(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_qwen3_5 / "config.json").read_text())
    config.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    with pytest.raises(ModelConfigError, match="qwen3_5_moe_text"):
        ModelConfig.from_dict(config)


def _without(name: str):  # noqa: ANN202 -- an edit of the stored tensors
    return lambda tensors: tensors.pop(name)


def _truncated_conv(name: str):  # noqa: ANN202
    return lambda tensors: tensors.update({name: tensors[name][..., :3].copy()})


def _config_edit(**fields):  # noqa: ANN202 -- an edit of config.json's text fields
    return lambda config: (config.get("text_config") or config).update(fields)


@pytest.mark.parametrize(
    ("tensor_edit", "config_edit", "named"),
    [
        (_without("model.language_model.layers.4.linear_attn.in_proj_b.weight"), None, "model.language_model.layers.4.linear_attn.in_proj_b.weight"),
        (_truncated_conv("model.language_model.layers.0.linear_attn.conv1d.weight"), None, "model.language_model.layers.0.linear_attn.conv1d.weight is [160, 1, 3]"),
        (None, _config_edit(layer_types=["linear_attention"] * 7 + ["mamba"]), "layer_types[7]='mamba'"),
        (None, lambda config: config.update(model_type="qwen3_5_moe"), "qwen3_5_moe"),
    ],
)
def test_generate_on_a_bad_checkpoint_exits_2_with_one_line_naming_it(
    tiny_qwen3_5_vl: Path, tmp_path: Path, tensor_edit, config_edit, named: str
) -> None:
    from click.testing import CliRunner

    from ninfer_rt.cli import main

    model_dir = _single_file_copy(tiny_qwen3_5_vl, tmp_path / "m", tensor_edit or (lambda tensors: None))
    if config_edit:
        config = json.loads((model_dir / "config.json").read_text())
        config_edit(config)
        (model_dir / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt", "x", "--kv-capacity", "16"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and named in lines[0], result.stderr
