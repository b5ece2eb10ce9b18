"""The shipped default model (ninfer_rt/shipped/tiny-qwen3-code): transformers reads it as a Qwen3 with the numpy
executor's logits, and `ninfer-rt generate` without --model uses it, deterministically and fast on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import ninfer_rt.shipped
from forward_helpers import hf_outputs, make_runtime, relative_error
from ninfer_rt.cli import main
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.shipped import DEFAULT_MODEL_NAME, DefaultModelMissing, default_model_dir, shipped_model_names

MAX_CHECKPOINT_BYTES = 16_000_000
GENERATE_SECONDS = 10.0
TOLERANCE = 1e-4


def shipped() -> Path | None:
    try:
        return default_model_dir()
    except DefaultModelMissing:
        return None


needs_shipped_model = pytest.mark.skipif(
    shipped() is None,
    reason="the default model is not shipped yet: train it with tools/train_tiny_model.py on a GPU and copy its "
    "output into ninfer_rt/shipped/tiny-qwen3-code",
)


def generate_fibonacci() -> tuple[str, float]:
    """`ninfer-rt generate` in a fresh interpreter, as a new user runs it: (stdout, wall seconds)."""
    command = [sys.executable, "-c", "from ninfer_rt.cli import main; main()", "generate"]
    command += ["--prompt", "def fibonacci(n):", "--max-tokens", "64", "--temperature", "0"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    return result.stdout, time.perf_counter() - start


def test_without_a_shipped_model_generate_says_so_and_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ninfer_rt.shipped, "DEFAULT_MODEL_NAME", "no-such-model")
    result = CliRunner().invoke(main, ["generate", "--prompt", "x"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "default model is not installed" in lines[0] and "--model" in lines[0]


@needs_shipped_model
def test_the_shipped_checkpoint_is_one_small_bf16_file_with_one_mtp_layer() -> None:
    model_dir = default_model_dir()
    config = json.loads((model_dir / "config.json").read_text())
    assert (model_dir / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert config["tie_word_embeddings"] and config["torch_dtype"] == "bfloat16"


@needs_shipped_model
def test_transformers_loads_it_as_qwen3_and_its_logits_match_the_numpy_executor() -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = default_model_dir()
    assert type(transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))).__name__ == "Qwen3ForCausalLM"
    tokens = Tokenizer(model_dir).encode((Path(__file__).parents[1] / "ninfer_rt" / "model" / "layers.py").read_text())[:40]
    ours = make_runtime(model_dir).run_sequence(tokens, [32, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 2])
    reference, _ = hf_outputs(model_dir, tokens)
    assert relative_error(ours, reference) < TOLERANCE


@needs_shipped_model
def test_generate_without_model_prints_the_same_code_like_text_every_time_in_under_10_seconds() -> None:
    first, first_seconds = generate_fibonacci()
    second, second_seconds = generate_fibonacci()
    assert first == second
    assert first.strip() and any(marker in first for marker in ("return", "(", "=", ":"))
    assert max(first_seconds, second_seconds) < GENERATE_SECONDS


@needs_shipped_model
def test_a_shipped_model_is_named_by_its_name_and_generates_as_the_default_does() -> None:
    flags = ["--prompt", "def add(a, b):", "--max-tokens", "8", "--temperature", "0"]
    by_name = CliRunner().invoke(main, ["generate", "--model", DEFAULT_MODEL_NAME, *flags])
    default = CliRunner().invoke(main, ["generate", *flags])
    assert by_name.exit_code == default.exit_code == 0, by_name.output
    assert by_name.stdout == default.stdout and by_name.stdout.strip()
    assert DEFAULT_MODEL_NAME in shipped_model_names()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_model_that_is_neither_a_path_nor_a_shipped_name_is_one_line_naming_the_shipped_ones(command: str) -> None:
    args = [command, "--model", "no-such-model"] + (["--prompt", "x"] if command == "generate" else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert "--model no-such-model: not a model directory" in line and "nor a shipped model" in line
    assert all(name in line for name in shipped_model_names())
