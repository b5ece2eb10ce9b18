"""The reduced draft vocabulary of `--lm-head-draft N`: the N most frequent tokens.

Drafting scores only these N rows of the lm_head (the draft's largest matmul for a 150k vocabulary);
verification always scores the full vocabulary, so outputs stay exact and a token outside the set can
still be emitted (as a correction or bonus token), just never drafted.

Where the frequencies come from (in this order):
1. `token_freq.json` beside the model (tools/train_tiny_model.py writes one): {"vocab_size": V,
   "counts": [count of token 0, ..., count of token V-1], ...}, counted over the training corpus. The set
   is then fixed for the server's lifetime.
2. Otherwise they are counted online from the tokens the server emits, and the set is recomputed every
   `REFRESH_TOKENS` emitted tokens. Until tokens arrive, the N lowest ids stand in: byte-level BPE gives
   the lowest ids to single bytes and the earliest (most frequent) merges. Ties keep the lower id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FREQUENCY_FILE = "token_freq.json"
REFRESH_TOKENS = 4096
DEFAULT_DRAFT_VOCAB = 32768


def load_token_frequencies(model_dir: str | Path, vocab_size: int) -> np.ndarray | None:
    """Counts per token id from the model's frequency file, or None when it ships none."""
    path = Path(model_dir) / FREQUENCY_FILE
    if not path.is_file():
        return None
    counts = np.asarray(json.loads(path.read_text())["counts"], np.int64)
    if counts.shape != (vocab_size,):
        raise ValueError(f"{path}: {counts.size} counts for a vocabulary of {vocab_size} tokens")
    return counts


class DraftVocab:
    """Which token ids the draft head scores; `ids[j]` is the token of draft logit column j."""

    def __init__(self, size: int, vocab_size: int, frequencies: np.ndarray | None = None) -> None:
        self.size = min(size, vocab_size)
        self.online = frequencies is None
        self.counts = np.zeros(vocab_size, np.int64) if frequencies is None else frequencies
        self._since_refresh = 0
        self.ids = self._most_frequent()

    def observe(self, tokens: Iterable[int]) -> bool:
        """Count emitted tokens (online mode); True when the set changed and the draft head must be rebuilt."""
        if not self.online:
            return False
        for token in tokens:
            self.counts[token] += 1
            self._since_refresh += 1
        if self._since_refresh < REFRESH_TOKENS:
            return False
        self._since_refresh = 0
        ids = self._most_frequent()
        changed = not np.array_equal(ids, self.ids)
        self.ids = ids
        return changed

    def _most_frequent(self) -> np.ndarray:
        top = np.argsort(-self.counts, kind="stable")[: self.size]
        return np.sort(top).astype(np.int64)
