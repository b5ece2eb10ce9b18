"""Next-token sampling on the host (numpy), one logits row per request.

Order, as in vLLM: penalties on the raw logits (repetition over prompt + output; presence and frequency
over the output only, as OpenAI defines them), then temperature, then top-k, top-p and min-p restrict the
support, then a draw from the request's own seeded Generator. Temperature 0 is argmax of the penalised
logits. Logprobs describe the final distribution the token was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ninfer_rt.engine.request import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprobs: TokenLogprobs | None


def apply_penalties(
    logits: np.ndarray, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams
) -> np.ndarray:
    logits = logits.astype(np.float64, copy=True)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)]))
        values = logits[seen]
        # dividing a negative logit would raise it; multiplying pushes both signs toward "less likely"
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=logits.shape[0])[: logits.shape[0]]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def restrict_support(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature-scaled logits with -inf outside the top-k / top-p / min-p support."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    if params.top_p < 1.0:
        scaled = _top_p(scaled, params.top_p)
    if params.min_p > 0.0:
        probs = softmax(scaled)
        scaled = np.where(probs >= params.min_p * probs.max(), scaled, -np.inf)
    return scaled


def final_logits(
    logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
) -> np.ndarray:
    """The logits a token is chosen from: penalised, then (when sampling) temperature-scaled and restricted.
    Greedy picks their argmax; sampling draws from their softmax."""
    penalised = apply_penalties(logits, prompt_ids, output_ids, params)
    return penalised if params.greedy else restrict_support(penalised, params)


def argmax_decides(params: SamplingParams) -> bool:
    """Whether the token is the argmax of the raw logits: greedy with no penalties and no logprobs (which
    describe the whole distribution). Such a request needs only the executor's argmax on the host."""
    penalised = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    return params.greedy and not params.logprobs and not penalised


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    generator: np.random.Generator,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> Sample:
    final = final_logits(logits, params, prompt_ids, output_ids)
    if params.greedy:
        token = int(np.argmax(final))
    else:
        token = int(generator.choice(final.shape[0], p=softmax(final)))
    return described(final, token, params)


def described(final: np.ndarray, token: int, params: SamplingParams) -> Sample:
    """`token` as a Sample, with logprobs from `final` (the distribution it came from) when asked for."""
    return Sample(token, _logprobs(final, token, params) if params.logprobs else None)


def _top_p(scaled: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-scaled, kind="stable")
    probs = softmax(scaled)[order]
    mass_before = np.cumsum(probs) - probs
    # keep every token whose predecessors hold less than top_p: the smallest set reaching top_p
    keep = np.zeros(scaled.shape[0], dtype=bool)
    keep[order[mass_before < top_p]] = True
    return np.where(keep, scaled, -np.inf)


def softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - np.max(x))
    return shifted / shifted.sum()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    finite_max = np.max(x)
    return x - finite_max - np.log(np.sum(np.exp(x - finite_max)))


def _logprobs(final: np.ndarray, token: int, params: SamplingParams) -> TokenLogprobs:
    logp = _log_softmax(final)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        best = np.argsort(-logp, kind="stable")[: params.top_logprobs]
        top = tuple((int(t), float(logp[t])) for t in best)
    return TokenLogprobs(token, float(logp[token]), top)
