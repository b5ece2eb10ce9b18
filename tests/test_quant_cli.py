"""`ninfer-rt quantize`: a tiny bf16 checkpoint round-trips through int8/int4 files into the numpy executor;
bad requests are one line and exit status 2; the output appears whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from safetensors.numpy import load_file, save_file

from forward_helpers import make_runtime, random_tokens, relative_error
from ninfer_rt.cli import main
from ninfer_rt.model.weights import SHARD_INDEX, load_model_weights
from ninfer_rt.quantize.format import QUANT_METHOD, QuantizedWeight
from ninfer_rt.quantize.layouts import dequantize
from ninfer_rt.testing.tiny import make_tiny_model

# Every linear input dimension (128, 256) is a whole number of 128-groups.
TINY = dict(hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=512, layers=2)
TOKENS, STEPS, PAGES = 40, [30, 1, 1, 8], [0, 1, 2]
# Logits of the random tiny model vs bf16. int8's weight error (half a step of absmax/127.5) is ~0.2% of a
# weight; int4's is ~10% on Gaussian weights, which two random layers turn into ~30% of the logits.
LOGIT_ERROR = {8: 0.03, 4: 0.4}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bf16"), **TINY)


def quantize_cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["quantize", *args])


def logits(model_dir: Path) -> np.ndarray:
    return make_runtime(model_dir).run_sequence(random_tokens(TINY["vocab"], TOKENS, seed=3), STEPS, PAGES)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_checkpoint_logits_stay_close_to_bf16(bf16_model: Path, tmp_path: Path, bits: int) -> None:
    out = tmp_path / f"int{bits}"
    result = quantize_cli("--model", str(bf16_model), "--out", str(out), "--bits", str(bits))
    assert result.exit_code == 0, result.output
    assert relative_error(logits(out), logits(bf16_model)) < LOGIT_ERROR[bits]


def test_numpy_executor_on_quantized_files_equals_it_on_the_dequantized_weights(bf16_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "int4"
    assert quantize_cli("--model", str(bf16_model), "--out", str(out), "--bits", "4").exit_code == 0
    dense_dir = make_tiny_model(tmp_path / "dense", **TINY)  # same config and side files; weights replaced
    quantized = load_model_weights(out)
    tensors = load_file(str(dense_dir / "model.safetensors"))
    for i, layer in enumerate(quantized.layers):
        for name in LINEARS:
            tensors[f"model.layers.{i}.{name}.weight"] = dequantize(getattr(layer, name.split(".")[1]), np.float32)  # exact
    save_file(tensors, str(dense_dir / "model.safetensors"))
    np.testing.assert_array_equal(logits(out), logits(dense_dir))


def stored_layout(model_dir: Path) -> dict[str, tuple]:
    """Every stored tensor's dtype and shape, over all shards."""
    return {n: (t.dtype, t.shape) for shard in sorted(model_dir.glob("*.safetensors")) for n, t in load_file(str(shard)).items()}


def calibration_text(tmp_path: Path, words: int) -> Path:
    path = tmp_path / "calibration.txt"
    path.write_text(" ".join(f"w{i % 97} x{i % 13}" for i in range(words)))
    return path


def test_calibrated_checkpoint_has_the_same_layout_and_logits_stay_close(bf16_model: Path, tmp_path: Path) -> None:
    plain, calibrated = tmp_path / "plain", tmp_path / "calibrated"
    text = calibration_text(tmp_path, 4000)
    assert quantize_cli("--model", str(bf16_model), "--out", str(plain), "--bits", "4").exit_code == 0
    result = quantize_cli("--model", str(bf16_model), "--out", str(calibrated), "--bits", "4",
                          "--calibration-text", str(text), "--calibration-tokens", "1024")
    assert result.exit_code == 0, result.output
    assert stored_layout(calibrated) == stored_layout(plain)
    assert relative_error(logits(calibrated), logits(bf16_model)) < LOGIT_ERROR[4]


def test_calibration_text_shorter_than_a_window_is_refused(bf16_model: Path, tmp_path: Path) -> None:
    result = quantize_cli("--model", str(bf16_model), "--out", str(tmp_path / "q"),
                          "--calibration-text", str(calibration_text(tmp_path, 10)))
    assert result.exit_code == 2 and "fewer than one 512-token window" in result.output


def test_output_documents_the_layout_and_keeps_side_files(bf16_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    assert quantize_cli("--model", str(bf16_model), "--out", str(out), "--bits", "8", "--group-size", "64").exit_code == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == QUANT_METHOD and config["bits"] == 8 and config["group_size"] == 64
    assert "scales" in config["layout"] and "2^(bits-1)" in config["layout"]
    for side_file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / side_file).read_bytes() == (bf16_model / side_file).read_bytes()
    weights = load_model_weights(out)
    assert isinstance(weights.layers[0].q_proj, QuantizedWeight) and weights.layers[0].q_proj.group_size == 64
    assert weights.embed.dtype.name == "bfloat16" and weights.layers[0].input_norm.dtype.name == "bfloat16"
    assert not isinstance(weights.lm_head, QuantizedWeight)  # lm_head stays bf16 unless asked
    assert not list(tmp_path.glob(".q.*"))  # no staging directory left behind


def test_quantize_lm_head_unties_a_tied_head(tmp_path: Path) -> None:
    tied = make_tiny_model(tmp_path / "tied", **TINY, tie=True)
    out = tmp_path / "q"
    result = quantize_cli("--model", str(tied), "--out", str(out), "--quantize-lm-head")
    assert result.exit_code == 0, result.output
    weights = load_model_weights(out)
    assert not weights.config.tie_word_embeddings and isinstance(weights.lm_head, QuantizedWeight)
    embed = weights.embed.astype(np.float64)
    # Norm-relative, not max-abs: the scale search clips a group's largest weights to shrink everyone's error.
    assert np.linalg.norm(dequantize(weights.lm_head, np.float64) - embed) / np.linalg.norm(embed) < 0.15


def test_force_replaces_a_non_empty_output(bf16_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    result = quantize_cli("--model", str(bf16_model), "--out", str(out), "--force")
    assert result.exit_code == 0, result.output
    assert not (out / "stale.txt").exists() and (out / SHARD_INDEX).is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bits", "3"], "'3' is not one of '4', '8'"),
        (["--group-size", "100"], "group size 100 is not supported"),
        (["--group-size", "512"], "not a multiple of --group-size 512"),
    ],
)
def test_bad_requests_are_one_line_and_exit_2(bf16_model: Path, tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "q"
    result = quantize_cli("--model", str(bf16_model), "--out", str(out), *args)
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and message in result.output
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing half-written


def test_non_empty_output_without_force_is_refused(bf16_model: Path, tmp_path: Path) -> None:
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "keep.txt").write_text("mine")
    result = quantize_cli("--model", str(bf16_model), "--out", str(tmp_path / "q"))
    assert result.exit_code == 2 and "not empty (pass --force" in result.output
    assert (tmp_path / "q" / "keep.txt").read_text() == "mine"


def test_missing_model_and_already_quantized_model_are_refused(bf16_model: Path, tmp_path: Path) -> None:
    result = quantize_cli("--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "q"))
    assert result.exit_code == 2 and "not a model directory" in result.output
    assert quantize_cli("--model", str(bf16_model), "--out", str(tmp_path / "q")).exit_code == 0
    again = quantize_cli("--model", str(tmp_path / "q"), "--out", str(tmp_path / "q2"))
    assert again.exit_code == 2 and "already quantized" in again.output
