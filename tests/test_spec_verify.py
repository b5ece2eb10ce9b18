"""Verification of drafts on scripted logits: greedy is exact, rejection sampling keeps the target distribution.

The sampling tests draw many seeded verify steps with fixed target (p) and draft (q) distributions over a
small vocabulary and compare the emitted tokens with p by a chi-square test at significance 0.001.
"""

from __future__ import annotations

import math

import numpy as np

from ninfer_rt.engine.spec_verify import verify_greedy, verify_sampled

SIGNIFICANCE = 0.001
TRIALS = 20000


def chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """P(chi2 >= statistic) with len - 1 degrees of freedom (regularized upper incomplete gamma)."""
    expected = expected_probs * observed.sum()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    s, x = (len(observed) - 1) / 2, statistic / 2
    term = total = 1.0 / s
    for n in range(1, 2000):  # lower incomplete gamma series: x^s e^-x sum x^n / (s (s+1) ... (s+n))
        term *= x / (s + n)
        total += term
    lower = math.exp(s * math.log(x) - x - math.lgamma(s)) * total if x > 0 else 0.0
    return max(0.0, 1.0 - lower)


def one_hot(size: int, index: int) -> np.ndarray:
    row = np.zeros(size)
    row[index] = 1.0
    return row


# p_i and q_i per draft position over a 5-token vocabulary; q puts mass where p has none and vice versa.
TARGET = np.array(
    [
        [0.40, 0.30, 0.20, 0.10, 0.00],
        [0.05, 0.05, 0.60, 0.20, 0.10],
        [0.25, 0.25, 0.25, 0.25, 0.00],
        [0.10, 0.20, 0.30, 0.40, 0.00],  # the bonus position
    ]
)
DRAFT = np.array(
    [
        [0.10, 0.10, 0.10, 0.20, 0.50],
        [0.30, 0.30, 0.20, 0.10, 0.10],
        [0.60, 0.10, 0.10, 0.10, 0.10],
    ]
)


def emitted_per_position(trials: int) -> list[list[int]]:
    """Tokens emitted at each position over `trials` independent seeded verify steps."""
    by_position: list[list[int]] = [[] for _ in range(len(TARGET))]
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        drafts = [int(rng.choice(5, p=q)) for q in DRAFT]
        verdict = verify_sampled(drafts, DRAFT, TARGET, rng)
        for position, token in enumerate(verdict.tokens):
            by_position[position].append(token)
    return by_position


def test_greedy_accepts_matching_drafts_then_emits_the_target_at_the_first_mismatch() -> None:
    verdict = verify_greedy([7, 3, 9], targets=[7, 3, 4, 1])
    assert (verdict.accepted, verdict.tokens) == (2, [7, 3, 4])


def test_greedy_emits_the_bonus_token_when_every_draft_matches() -> None:
    verdict = verify_greedy([7, 3], targets=[7, 3, 5])
    assert (verdict.accepted, verdict.tokens) == (2, [7, 3, 5])


def test_greedy_without_drafts_emits_the_target_argmax() -> None:
    assert verify_greedy([], targets=[6]).tokens == [6]


def test_rejection_sampling_emits_every_position_with_the_target_distribution() -> None:
    for position, tokens in enumerate(emitted_per_position(TRIALS)):
        support = TARGET[position] > 0
        observed = np.bincount(tokens, minlength=5)
        assert not observed[~support].any(), f"position {position} emitted a token the target never emits"
        p_value = chi_square_p_value(observed[support], TARGET[position][support])
        assert p_value > SIGNIFICANCE, f"position {position}: chi-square p = {p_value:.2g}"


def test_a_draft_is_accepted_with_probability_sum_of_min_p_q() -> None:
    accepted = 0
    for seed in range(TRIALS):
        rng = np.random.default_rng(seed)
        draft = int(rng.choice(5, p=DRAFT[0]))
        accepted += verify_sampled([draft], DRAFT[:1], TARGET[:2], rng).accepted
    expected = np.minimum(TARGET[0], DRAFT[0]).sum()  # 0.4
    assert abs(accepted / TRIALS - expected) < 4 * math.sqrt(expected * (1 - expected) / TRIALS)


def test_a_draft_the_target_never_emits_is_always_rejected() -> None:
    rng = np.random.default_rng(0)
    verdicts = [verify_sampled([4], DRAFT[:1], TARGET[:2], rng) for _ in range(200)]
    assert all(v.accepted == 0 and v.tokens[0] != 4 for v in verdicts)


def test_a_draft_equal_to_the_target_distribution_is_always_accepted() -> None:
    rng = np.random.default_rng(0)
    p = np.stack([TARGET[0], TARGET[3]])
    verdicts = [verify_sampled([int(rng.choice(5, p=TARGET[0]))], TARGET[:1], p, rng) for _ in range(200)]
    assert all(v.accepted == 1 for v in verdicts)


def test_a_one_hot_target_is_emitted_whatever_was_drafted() -> None:
    rng = np.random.default_rng(0)
    target = np.stack([one_hot(5, 2), one_hot(5, 0)])
    verdict = verify_sampled([1], DRAFT[1:2], target, rng)
    assert verdict.tokens == [2]
