"""`ninfer-rt check`: a good checkpoint (dense, both hybrid layouts, quantized) passes every check with its
logits equal to transformers'; a broken copy (missing tensor, wrong shape or dtype, bad config field,
broken template) fails the check it breaks, naming the tensor or field, and exits 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from safetensors.numpy import load_file, save_file

from ninfer_rt.cli import main
from ninfer_rt.cli.checkpoint_checks import FAIL, OK, check_logits
from ninfer_rt.model.weights import Checkpoint, load_checkpoint
from ninfer_rt.quantize_checkpoint.writer import quantize_checkpoint

CHECKS = ("config", "tensors", "chat template", "tokenizer", "logits")


def run_check(model_dir: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["check", "--model", str(model_dir), *args])


def statuses(result: Result) -> dict[str, str]:
    """check name -> status, from the report's lines ("STATUS  name: detail")."""
    lines = [line for line in result.stdout.splitlines() if line.split(" ", 1)[0] in ("OK", "FAIL", "SKIPPED")]
    return {line.split(None, 1)[1].split(":", 1)[0]: line.split(" ", 1)[0] for line in lines}


def report_line(result: Result, check: str) -> str:
    return next(line for line in result.stdout.splitlines() if line.split(None, 1)[-1].startswith(check + ":"))


def broken_copy(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "broken"))


def rewrite_tensors(model_dir: Path, edit: callable) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def rewrite_config(model_dir: Path, edit: callable) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    edit(raw)
    (model_dir / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen3_5", "tiny_qwen3_5_vl"])
def test_a_good_checkpoint_passes_every_check_with_transformers_logits(fixture: str, request: pytest.FixtureRequest) -> None:
    pytest.importorskip("transformers")
    result = run_check(request.getfixturevalue(fixture))
    assert result.exit_code == 0, result.output
    assert statuses(result) == dict.fromkeys(CHECKS, OK)
    assert "first 16 tokens" in report_line(result, "logits")


def test_a_quantized_hybrid_is_compared_as_its_dequantized_weights(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    quantized = quantize_checkpoint(tiny_qwen3_5, tmp_path / "int4", bits=4, group_size=32)
    result = run_check(quantized, "--tokens", "8")
    assert result.exit_code == 0, result.output
    assert statuses(result) == dict.fromkeys(CHECKS, OK)
    assert "quantized linears" in report_line(result, "tensors")


def test_tokens_0_skips_the_comparison(tiny_qwen3: Path) -> None:
    result = run_check(tiny_qwen3, "--tokens", "0")
    assert result.exit_code == 0
    assert statuses(result)["logits"] == "SKIPPED"


def test_weights_that_differ_from_transformers_fail_the_logits_check(tiny_qwen3_5: Path) -> None:
    pytest.importorskip("transformers")
    checkpoint = load_checkpoint(tiny_qwen3_5)
    tensors = dict(checkpoint.items())
    name = "model.layers.3.self_attn.q_norm.weight"  # a zero-centred gain: (1 + w) read as w would do this
    tensors[name] = np.asarray(tensors[name]) + 1.0
    result = check_logits(tiny_qwen3_5, Checkpoint(checkpoint.config, tensors), list(range(8)))
    assert result.status == FAIL and "max relative error" in result.detail


def test_a_missing_tensor_is_named(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    model_dir = broken_copy(tiny_qwen3_5, tmp_path)
    rewrite_tensors(model_dir, lambda t: t.pop("model.layers.1.linear_attn.in_proj_z.weight"))
    result = run_check(model_dir, "--tokens", "0")
    assert result.exit_code == 2
    assert statuses(result)["tensors"] == FAIL
    assert "1 missing: model.layers.1.linear_attn.in_proj_z.weight" in report_line(result, "tensors")
    assert statuses(result)["logits"] == "SKIPPED"


def test_a_misshapen_tensor_is_named_with_both_shapes(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = broken_copy(tiny_qwen3, tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_tensors(model_dir, lambda t: t.update({name: t[name][:-1]}))
    result = run_check(model_dir, "--tokens", "0")
    assert result.exit_code == 2
    assert f"{name} is [127, 64], expected [128, 64]" in report_line(result, "tensors")


def test_an_integer_tensor_where_floats_belong_is_named(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = broken_copy(tiny_qwen3, tmp_path)
    name = "model.norm.weight"
    rewrite_tensors(model_dir, lambda t: t.update({name: np.ones(t[name].shape, np.int32)}))
    result = run_check(model_dir, "--tokens", "0")
    assert result.exit_code == 2
    assert f"{name} is int32" in report_line(result, "tensors")


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda raw: raw.pop("hidden_size"), "'hidden_size'"),
        (lambda raw: raw.update(layer_types=["linear_attention"] * 7 + ["sliding_attention"]), "layer_types[7]"),
        (lambda raw: raw.update(linear_num_value_heads=5), "linear_num_value_heads=5"),
    ],
)
def test_a_bad_config_field_is_named(tiny_qwen3_5: Path, tmp_path: Path, edit: callable, named: str) -> None:
    model_dir = broken_copy(tiny_qwen3_5, tmp_path)
    rewrite_config(model_dir, edit)
    result = run_check(model_dir)
    assert result.exit_code == 2
    assert statuses(result)["config"] == FAIL and named in report_line(result, "config")


def test_a_template_that_does_not_compile_fails_the_template_check(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = broken_copy(tiny_qwen3, tmp_path)
    (model_dir / "chat_template.jinja").write_text("{% for message in messages %}{{ message.content }")
    result = run_check(model_dir, "--tokens", "0")
    assert result.exit_code == 2
    assert statuses(result) == {**dict.fromkeys(CHECKS[:2], OK), "chat template": FAIL, "logits": "SKIPPED"}
    assert "does not compile" in report_line(result, "chat template")


def test_a_template_that_fails_on_a_conversation_fails_the_template_check(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = broken_copy(tiny_qwen3, tmp_path)
    (model_dir / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    result = run_check(model_dir, "--tokens", "0")
    assert result.exit_code == 2
    assert "roles must alternate" in report_line(result, "chat template")


def test_not_a_model_directory_is_one_line(tmp_path: Path) -> None:
    result = run_check(tmp_path)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"Error: --model {tmp_path}: not a model directory (no config.json)"]


def test_an_fp8_block_checkpoint_passes_compared_as_its_bf16_weights(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from test_fp8_import import write_fp8_and_reference

    fp8_dir, _ = write_fp8_and_reference(tiny_qwen3_5, tmp_path)
    result = run_check(fp8_dir, "--tokens", "8")
    assert result.exit_code == 0, result.output
    assert statuses(result) == dict.fromkeys(CHECKS, OK)
