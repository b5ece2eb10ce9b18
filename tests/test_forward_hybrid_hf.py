"""The numpy forward of the Qwen3.5 hybrid (Gated DeltaNet + gated attention) equals transformers' float32
forward on tiny random checkpoints that transformers itself wrote, in both name layouts: whole prompts,
uneven prefill chunks (the state carried through its slot between chunks), decode steps, and a batch
that mixes sequences."""

from __future__ import annotations

from pathlib import Path

import pytest

from forward_helpers import SeqStep, hf_outputs, make_runtime, random_tokens, relative_error
from ninfer_rt.model.config import ModelConfig

pytest.importorskip("transformers")

TOLERANCE = 1e-4
PAGES = list(range(8))  # room for 128 tokens at 16 a page


def vocab(model_dir: Path) -> int:
    return ModelConfig.from_dir(model_dir).vocab_size


def logits_error(model_dir: Path, step_sizes: list[int]) -> float:
    tokens = random_tokens(vocab(model_dir), sum(step_sizes))
    ours = make_runtime(model_dir).run_sequence(tokens, step_sizes, PAGES)
    reference, _ = hf_outputs(model_dir, tokens)
    return relative_error(ours, reference)


@pytest.fixture(params=["tiny_qwen3_5", "tiny_qwen3_5_vl"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_whole_prompt_logits_match_transformers(model_dir: Path) -> None:
    assert logits_error(model_dir, [70]) < TOLERANCE


def test_prefill_chunks_and_32_decode_steps_match_transformers(model_dir: Path) -> None:
    assert logits_error(model_dir, [7, 64, 9] + [1] * 32) < TOLERANCE


def test_final_hidden_states_match_transformers(tiny_qwen3_5: Path) -> None:
    tokens = random_tokens(vocab(tiny_qwen3_5), 45)
    runtime = make_runtime(tiny_qwen3_5)
    hidden = runtime.executor.to_host(runtime.step([SeqStep(tokens, 0, PAGES)]).hidden)
    _, reference = hf_outputs(tiny_qwen3_5, tokens)
    assert relative_error(hidden, reference) < TOLERANCE


def test_a_mixed_batch_gives_each_sequence_its_solo_logits(tiny_qwen3_5: Path) -> None:
    decoding = random_tokens(vocab(tiny_qwen3_5), 21, seed=1)
    prefilling = random_tokens(vocab(tiny_qwen3_5), 25, seed=2)
    solo_decode = make_runtime(tiny_qwen3_5).run_sequence(decoding, [20, 1], [0, 1])[-1:]
    solo_prefill = make_runtime(tiny_qwen3_5).run_sequence(prefilling, [25], [2, 3])

    mixed = make_runtime(tiny_qwen3_5)
    mixed.step([SeqStep(decoding[:20], 0, [0, 1], state_slot=1)])
    out = mixed.step([SeqStep(decoding[20:], 20, [0, 1], state_slot=1), SeqStep(prefilling, 0, [2, 3], state_slot=2)])
    logits = mixed.executor.to_host(out.logits)

    assert relative_error(logits[:1], solo_decode) < 1e-6
    assert relative_error(logits[1:], solo_prefill) < 1e-6
