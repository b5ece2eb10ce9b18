"""The numpy forward over paged f32 KV equals Hugging Face transformers on the same random tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from forward_helpers import SeqStep, hf_outputs, make_runtime, random_tokens, relative_error
from ninfer_rt.testing.tiny import make_tiny_model

pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPT_LEN = 45
PAGES = [0, 1, 2, 3]  # enough for PROMPT_LEN + decode steps at 16 tokens a page


@pytest.fixture(params=["tiny_qwen3", "tiny_llama"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def logits_error(model_dir: Path, step_sizes: list[int], pages: list[int] = PAGES) -> float:
    tokens = random_tokens(vocab(model_dir), sum(step_sizes))
    ours = make_runtime(model_dir).run_sequence(tokens, step_sizes, pages)
    reference, _ = hf_outputs(model_dir, tokens)
    return relative_error(ours, reference)


def test_whole_prompt_logits_match_transformers(model_dir: Path) -> None:
    assert logits_error(model_dir, [PROMPT_LEN]) < TOLERANCE


def test_prefill_in_uneven_chunks_matches_transformers(model_dir: Path) -> None:
    assert logits_error(model_dir, [7, 29, 9]) < TOLERANCE


def test_decode_steps_after_prefill_match_transformers(model_dir: Path) -> None:
    assert logits_error(model_dir, [PROMPT_LEN] + [1] * 10) < TOLERANCE


def test_final_hidden_states_match_transformers(tiny_qwen3: Path) -> None:
    tokens = random_tokens(vocab(tiny_qwen3), PROMPT_LEN)
    runtime = make_runtime(tiny_qwen3)
    hidden = runtime.executor.to_host(runtime.step([SeqStep(tokens, 0, PAGES)]).hidden)
    _, reference = hf_outputs(tiny_qwen3, tokens)
    assert relative_error(hidden, reference) < TOLERANCE


def test_shuffled_pages_give_the_same_logits_as_contiguous_pages(tiny_qwen3: Path) -> None:
    tokens = random_tokens(vocab(tiny_qwen3), PROMPT_LEN + 3)
    steps = [20, PROMPT_LEN - 20, 1, 1, 1]
    contiguous = make_runtime(tiny_qwen3).run_sequence(tokens, steps, [0, 1, 2, 3])
    shuffled = make_runtime(tiny_qwen3).run_sequence(tokens, steps, [11, 4, 9, 2])
    np.testing.assert_array_equal(shuffled, contiguous)


def test_a_mixed_batch_gives_each_sequence_its_solo_logits(tiny_qwen3: Path) -> None:
    decoding = random_tokens(vocab(tiny_qwen3), 21, seed=1)
    prefilling = random_tokens(vocab(tiny_qwen3), 25, seed=2)
    decode_pages, prefill_pages = [0, 1], [2, 3]
    solo_decode = make_runtime(tiny_qwen3).run_sequence(decoding, [20, 1], decode_pages)[-1:]
    solo_prefill = make_runtime(tiny_qwen3).run_sequence(prefilling, [25], prefill_pages)

    mixed = make_runtime(tiny_qwen3)
    mixed.run_sequence(decoding[:20], [20], decode_pages)
    out = mixed.step([SeqStep(decoding[20:], 20, decode_pages), SeqStep(prefilling, 0, prefill_pages)])
    logits = mixed.executor.to_host(out.logits)

    assert relative_error(logits[:1], solo_decode) < 1e-6
    assert relative_error(logits[1:], solo_prefill) < 1e-6


def test_yarn_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, arch="qwen3", yarn=4.0)
    config = json.loads((model_dir / "config.json").read_text())
    # A short original context puts the prompt's positions beyond it, where YaRN changes the rotation.
    config["rope_scaling"]["original_max_position_embeddings"] = 16
    config["max_position_embeddings"] = 64
    (model_dir / "config.json").write_text(json.dumps(config))
    assert logits_error(model_dir, [30, 10, 1, 1]) < TOLERANCE


def test_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, arch="qwen3", tie=True)
    assert logits_error(model_dir, [PROMPT_LEN, 1, 1]) < TOLERANCE
