"""Verification of drafted tokens against the target model, on host logits (docs/ARCHITECTURE.md, "MTP
drafting and verification").

Row i of a verify step holds the target's final logits (sampling.final_logits: penalties, temperature,
top-k/p, min-p) for the position of draft i, conditioned on the drafts before it; row k (one past the
last draft) is the bonus position.

- Greedy: accept drafts while each equals the target argmax, then emit the target argmax at the first
  mismatch (the correction) or at the bonus position. The emitted tokens are exactly what greedy decoding
  without drafts emits.
- Sampling: standard speculative rejection sampling. Draft i (drawn from the draft distribution q_i) is
  accepted with probability min(1, p_i(d)/q_i(d)); on rejection the token is drawn from
  norm(max(p_i - q_i, 0)) and verification stops; if all drafts pass, the bonus is drawn from p_k. Each
  emitted token is then distributed exactly as the target's p, whatever q is, as long as q(d) > 0 for the
  drafted d (which holds because d was drawn from q).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading drafts accepted
    tokens: list[int]  # the accepted drafts, then the correction or bonus token


def verify_greedy(drafts: Sequence[int], targets: Sequence[int]) -> Verdict:
    """`targets[i]` is the target argmax at draft i's position; len(targets) == len(drafts) + 1."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return Verdict(accepted, [*drafts[:accepted], int(targets[accepted])])


def verify_sampled(
    drafts: Sequence[int], draft_probs: np.ndarray, target_probs: np.ndarray, rng: np.random.Generator
) -> Verdict:
    """`draft_probs` [k, V]: the q each draft was drawn from; `target_probs` [k + 1, V]: the target's p."""
    for i, draft in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        if rng.random() * q[draft] < p[draft]:  # u < p/q without dividing by a tiny q
            continue
        return Verdict(i, [*drafts[:i], _draw(rng, _residual(p, q))])
    return Verdict(len(drafts), [*drafts, _draw(rng, target_probs[len(drafts)])])


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    # Zero only when p == q up to rounding, where rejection itself has probability ~0: p is then the answer.
    return residual / total if total > 0 else p


def _draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    return int(rng.choice(probs.shape[0], p=probs / probs.sum()))
