"""Sampling: penalties, temperature, top-k/top-p/min-p support, seeding, logprobs (against numpy math)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.engine.request import Request, SamplingParams
from ninfer_rt.engine.sampling import apply_penalties, restrict_support, sample

VOCAB = 32


def random_logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32) * 3


def make_generator(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draw_many(logits: np.ndarray, params: SamplingParams, n: int = 3000) -> np.ndarray:
    rng = make_generator(1234)
    return np.array([sample(logits, params, rng).token_id for _ in range(n)])


def test_temperature_zero_is_argmax() -> None:
    for seed in range(10):
        logits = random_logits(seed)
        assert sample(logits, SamplingParams(temperature=0), make_generator(seed)).token_id == int(np.argmax(logits))


def test_requests_with_the_same_seed_draw_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = random_logits()

    def draws() -> list[int]:
        request = Request("r", [1], params)
        return [sample(logits, params, request.generator).token_id for _ in range(50)]

    first = draws()
    assert draws() == first
    assert len(set(first)) > 1  # actually random, not collapsed to argmax


def test_top_k_keeps_exactly_the_k_largest_logits() -> None:
    logits = random_logits()
    restricted = restrict_support(logits.astype(np.float64), SamplingParams(top_k=5))
    assert set(np.flatnonzero(np.isfinite(restricted))) == set(np.argsort(-logits)[:5])
    assert set(draw_many(logits, SamplingParams(top_k=5))) <= set(np.argsort(-logits)[:5])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = random_logits(3)
    probs = softmax(logits.astype(np.float64))
    order = np.argsort(-probs)
    needed = int(np.searchsorted(np.cumsum(probs[order]), 0.8) + 1)
    restricted = restrict_support(logits.astype(np.float64), SamplingParams(top_p=0.8))
    assert set(np.flatnonzero(np.isfinite(restricted))) == set(order[:needed])


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    logits = random_logits(5)
    probs = softmax(logits.astype(np.float64))
    restricted = restrict_support(logits.astype(np.float64), SamplingParams(min_p=0.1))
    assert set(np.flatnonzero(np.isfinite(restricted))) == set(np.flatnonzero(probs >= 0.1 * probs.max()))


def test_sampled_frequencies_follow_the_restricted_distribution() -> None:
    logits = random_logits(2)
    params = SamplingParams(temperature=0.7, top_k=6)
    expected = softmax(restrict_support(logits.astype(np.float64), params))
    counts = np.bincount(draw_many(logits, params, 6000), minlength=VOCAB) / 6000
    assert np.abs(counts - expected).max() < 0.03


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = np.array([2.0, -2.0, 1.0, -1.0], np.float32)
    out = apply_penalties(logits, prompt_ids=[0], output_ids=[1], params=SamplingParams(repetition_penalty=2.0))
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, -1.0])


def test_presence_and_frequency_penalties_subtract_on_generated_tokens_only() -> None:
    logits = np.zeros(4, np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, prompt_ids=[3, 3], output_ids=[1, 1, 1, 2], params=params)
    np.testing.assert_allclose(out, [0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0])


def test_penalties_change_the_greedy_choice() -> None:
    logits = np.array([5.0, 4.9, 0.0], np.float32)
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample(logits, params, make_generator(0), output_ids=[0]).token_id == 1


def test_logprobs_are_those_of_the_final_distribution() -> None:
    logits = random_logits(4)
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=3, seed=1)
    result = sample(logits, params, make_generator(1))
    with np.errstate(divide="ignore"):
        expected = np.log(softmax(restrict_support(logits.astype(np.float64), params)))
    assert result.logprobs is not None
    assert result.logprobs.logprob == pytest.approx(expected[result.token_id])
    assert [t for t, _ in result.logprobs.top] == list(np.argsort(-logits)[:3])
    assert sum(np.exp(lp) for _, lp in result.logprobs.top) == pytest.approx(1.0)


def test_no_logprobs_unless_asked() -> None:
    assert sample(random_logits(), SamplingParams(), make_generator(0)).logprobs is None
