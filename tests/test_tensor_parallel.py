"""Tensor parallelism on simulated ranks: the sharded forward equals the unsharded one to float64 rounding,
for the dense and the hybrid model, over prefill and decode steps, with the MTP module; the plan splits
what it must and refuses what it cannot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forward_helpers import Runtime, main_then_mtp_steps, random_tokens, relative_error, runtime_for
from ninfer_rt.model.mtp import prepare_mtp
from ninfer_rt.model.tensor_parallel import TensorParallelError, plan_for
from ninfer_rt.model.weights import ModelWeights, load_model_weights
from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5

FLOAT64_ROUNDING = 1e-12
PAGES = [3, 0, 5]
STEP_SIZES = [9, 1, 1]  # a prompt, then two decode steps


@pytest.fixture(scope="module")
def tiny_qwen3_5_four_value_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny hybrid with 4 value heads over 2 key heads: it splits over 4 ranks (key heads replicated)."""
    pytest.importorskip("transformers")
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5_4v"), linear_value_heads=4)


def main_and_mtp_logits(runtime: Runtime, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the main model over its tokens and the MTP module over the same rows (tokens shifted by
    one): (main logits, MTP logits) of every row."""
    mtp = prepare_mtp(runtime.executor, runtime.weights, runtime.model)
    steps = list(main_then_mtp_steps(runtime, mtp, tokens, STEP_SIZES, PAGES))
    to_host = runtime.executor.to_host
    main_logits = np.concatenate([to_host(main.logits) for main, _ in steps])
    return main_logits, np.concatenate([to_host(draft.logits) for _, draft in steps])


def assert_sharded_equals_unsharded(weights: ModelWeights, ranks: int) -> None:
    tokens = random_tokens(weights.config.vocab_size, sum(STEP_SIZES) + 1)
    expected = main_and_mtp_logits(runtime_for(weights, dtype=np.float64), tokens)
    sharded = main_and_mtp_logits(runtime_for(weights, dtype=np.float64, ranks=ranks), tokens)
    for actual, reference in zip(sharded, expected, strict=True):
        assert relative_error(actual, reference) < FLOAT64_ROUNDING


@pytest.mark.parametrize("ranks", [2, 4])
def test_dense_sharded_logits_equal_unsharded(tiny_qwen3_mtp: Path, ranks: int) -> None:
    # 4 ranks over 2 KV heads: each KV head is replicated on the two ranks whose q heads read it
    assert_sharded_equals_unsharded(load_model_weights(tiny_qwen3_mtp), ranks)


def test_hybrid_sharded_logits_equal_unsharded_on_two_ranks(tiny_qwen3_5: Path) -> None:
    assert_sharded_equals_unsharded(load_model_weights(tiny_qwen3_5), 2)


def test_hybrid_sharded_logits_equal_unsharded_on_four_ranks(tiny_qwen3_5_four_value_heads: Path) -> None:
    assert_sharded_equals_unsharded(load_model_weights(tiny_qwen3_5_four_value_heads), 4)


def test_heads_that_do_not_split_are_refused(tiny_qwen3_5: Path, tiny_qwen3: Path) -> None:
    with pytest.raises(TensorParallelError, match="6 linear-attention value heads do not split evenly"):
        plan_for(load_model_weights(tiny_qwen3_5).config, 4)
    with pytest.raises(TensorParallelError, match="4 attention heads do not split evenly"):
        plan_for(load_model_weights(tiny_qwen3).config, 3)
