from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.weights import (
    ModelWeights,
    WeightsError,
    expected_tensors,
    load_checkpoint,
    load_model_weights,
)
from ninfer_rt.testing.tiny import make_tiny_model


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(model_dir: Path, edit) -> None:
    """Loads model.safetensors into memory, lets ``edit`` change the dict, writes it back."""
    path = model_dir / "model.safetensors"
    tensors = {name: np.array(array) for name, array in load_checkpoint(model_dir).items()}
    edit(tensors)
    save_file(tensors, str(path))


def _bf16(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, dtype=ml_dtypes.bfloat16)


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen3_mtp"])
def test_checkpoint_holds_exactly_the_expected_tensors_as_bf16(fixture: str, request: pytest.FixtureRequest) -> None:
    ckpt = load_checkpoint(request.getfixturevalue(fixture))
    expected = expected_tensors(ckpt.config)
    assert set(ckpt) == set(expected)
    for name, shape in expected.items():
        assert ckpt[name].shape == shape, name
        assert ckpt[name].dtype == ml_dtypes.bfloat16, name


def test_tensors_are_memory_mapped_not_copied(tiny_qwen3: Path) -> None:
    array = load_checkpoint(tiny_qwen3)["model.embed_tokens.weight"]
    assert not array.flags.owndata
    assert not array.flags.writeable


def test_qwen3_layers_have_qk_norm_and_llama_layers_do_not(tiny_qwen3: Path, tiny_llama: Path) -> None:
    assert "model.layers.0.self_attn.q_norm.weight" in expected_tensors(ModelConfig.from_dir(tiny_qwen3))
    assert not any("q_norm" in name for name in expected_tensors(ModelConfig.from_dir(tiny_llama)))


def test_tied_lm_head_is_the_embedding(tiny_llama: Path) -> None:
    weights = load_model_weights(tiny_llama)
    assert weights.lm_head is weights.embed
    assert weights.layers[0].q_norm is None


def test_structured_view_exposes_layers_and_mtp(tiny_qwen3_mtp: Path) -> None:
    ckpt = load_checkpoint(tiny_qwen3_mtp)
    weights = ModelWeights.from_checkpoint(ckpt)
    cfg = ckpt.config
    assert len(weights.layers) == cfg.num_hidden_layers
    assert weights.layers[1].down_proj is ckpt["model.layers.1.mlp.down_proj.weight"]
    assert weights.lm_head is ckpt["lm_head.weight"]
    assert weights.mtp is not None
    assert weights.mtp.fc.shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert weights.mtp.layer.q_proj is ckpt["mtp.layers.0.self_attn.q_proj.weight"]
    assert weights.mtp.norm_hidden is ckpt["mtp.pre_fc_norm_hidden.weight"]


def test_model_without_mtp_has_no_mtp_weights(tiny_qwen3: Path) -> None:
    assert load_model_weights(tiny_qwen3).mtp is None


def test_sharded_checkpoint_loads_the_same_tensors(tmp_path: Path) -> None:
    single = load_checkpoint(make_tiny_model(tmp_path / "single", seed=3))
    sharded_dir = make_tiny_model(tmp_path / "sharded", seed=3, shards=3)
    assert len(list(sharded_dir.glob("model-*-of-00003.safetensors"))) == 3
    sharded = load_checkpoint(sharded_dir)
    assert set(sharded) == set(single)
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name])


def test_all_layout_problems_are_reported_in_one_error(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = _copy_model(tiny_qwen3, tmp_path / "broken")

    def break_layout(tensors: dict[str, np.ndarray]) -> None:
        del tensors["model.layers.1.mlp.up_proj.weight"]
        del tensors["model.norm.weight"]
        tensors["model.layers.0.self_attn.k_proj.weight"] = _bf16((7, 64))
        tensors["model.layers.9.mlp.gate_proj.weight"] = _bf16((128, 64))

    _rewrite_weights(model_dir, break_layout)
    with pytest.raises(WeightsError) as excinfo:
        load_checkpoint(model_dir)
    message = str(excinfo.value)
    assert "2 missing" in message
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.norm.weight" in message
    assert "1 unexpected: model.layers.9.mlp.gate_proj.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight is [7, 64], expected [64, 64]" in message


def test_truncated_file_error_names_the_file(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = _copy_model(tiny_qwen3, tmp_path / "truncated")
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=r"model\.safetensors: truncated"):
        load_checkpoint(model_dir)


def test_truncated_shard_error_names_the_shard(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "sharded", shards=2)
    shard = model_dir / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(model_dir)


def test_missing_shard_file_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "sharded", shards=2)
    (model_dir / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00001-of-00002.safetensors"):
        load_checkpoint(model_dir)


def test_directory_without_weights_is_an_error(tiny_qwen3: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_qwen3 / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_tied_checkpoint_may_also_store_lm_head(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = _copy_model(tiny_llama, tmp_path / "tied_with_head")
    assert ModelConfig.from_dir(model_dir).tie_word_embeddings

    def add_lm_head(tensors: dict[str, np.ndarray]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    _rewrite_weights(model_dir, add_lm_head)
    weights = load_model_weights(model_dir)
    assert weights.lm_head is weights.embed


def _load_with_transformers(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_transformers_loads_tiny_checkpoint_without_missing_or_unexpected_weights(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(fixture)
    model, info = _load_with_transformers(model_dir)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    ckpt = load_checkpoint(model_dir)
    hf_embed = model.get_input_embeddings().weight.detach().float().numpy()
    np.testing.assert_array_equal(hf_embed, ckpt["model.embed_tokens.weight"].astype(np.float32))


def test_transformers_ignores_only_the_mtp_weights(tiny_qwen3_mtp: Path) -> None:
    _, info = _load_with_transformers(tiny_qwen3_mtp)
    assert not info["missing_keys"]
    assert info["unexpected_keys"]
    assert all(name.startswith("mtp.") for name in info["unexpected_keys"])
