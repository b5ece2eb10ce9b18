"""--lm-head-draft's reduced vocabulary: from the frequency file beside the model, else counted online;
the draft head follows a refresh in place."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.engine.spec import DraftHead
from ninfer_rt.engine.spec_vocab import FREQUENCY_FILE, REFRESH_TOKENS, DraftVocab, load_token_frequencies
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.model.layers import prepare_model
from ninfer_rt.model.weights import load_model_weights


def test_the_frequency_file_picks_the_most_frequent_tokens(tmp_path: Path) -> None:
    counts = [0] * 16
    counts[7], counts[3], counts[9], counts[1] = 50, 40, 1, 30
    (tmp_path / FREQUENCY_FILE).write_text(json.dumps({"vocab_size": 16, "counts": counts}))
    vocab = DraftVocab(3, 16, load_token_frequencies(tmp_path, 16))
    assert vocab.ids.tolist() == [1, 3, 7]


def test_a_model_without_a_frequency_file_has_no_frequencies(tmp_path: Path) -> None:
    assert load_token_frequencies(tmp_path, 16) is None


def test_a_frequency_file_for_another_vocabulary_is_refused(tmp_path: Path) -> None:
    (tmp_path / FREQUENCY_FILE).write_text(json.dumps({"vocab_size": 99, "counts": [5] * 99}))
    with pytest.raises(ValueError, match="99 counts for a vocabulary of 16"):
        load_token_frequencies(tmp_path, 16)


def test_a_fixed_set_from_the_file_never_changes() -> None:
    vocab = DraftVocab(2, 16, np.arange(16))
    assert not vocab.observe([0] * REFRESH_TOKENS)
    assert vocab.ids.tolist() == [14, 15]


def test_online_counting_starts_from_the_lowest_ids_and_follows_emitted_tokens() -> None:
    vocab = DraftVocab(2, 16)
    assert vocab.ids.tolist() == [0, 1]
    assert not vocab.observe([9, 12] * 10)  # not yet time to refresh
    assert vocab.observe([9, 12] * (REFRESH_TOKENS // 2))
    assert vocab.ids.tolist() == [9, 12]


def test_a_set_larger_than_the_vocabulary_is_the_whole_vocabulary() -> None:
    assert DraftVocab(100, 8).ids.tolist() == list(range(8))


def test_an_online_refresh_rewrites_the_draft_head_in_place(tiny_qwen3_mtp: Path) -> None:
    # On the GPU a fresh tensor per refresh leaked its device buffer (buffers are freed explicitly) and
    # would strand the draft graphs captured over the old address: the head must be rewritten, not replaced.
    weights = load_model_weights(tiny_qwen3_mtp)
    executor = NumpyExecutor(StreamSet())
    head = DraftHead(executor, prepare_model(executor, weights), weights, DraftVocab(4, weights.config.vocab_size))
    prepared: list[str] = []
    prepare = executor.prepare_weight
    executor.prepare_weight = lambda name, parts, role: (prepared.append(name), prepare(name, parts, role))[1]
    before = head.tensor
    head.observe([9, 12, 30, 31] * (REFRESH_TOKENS // 4))
    assert head.vocab.ids.tolist() == [9, 12, 30, 31]
    assert head.tensor is before and not prepared
    np.testing.assert_array_equal(head.tensor, np.asarray(weights.lm_head, np.float32)[[9, 12, 30, 31]])
    assert [head.token(column) for column in range(4)] == [9, 12, 30, 31]
