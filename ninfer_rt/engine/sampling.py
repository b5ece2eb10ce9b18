"""Next-token sampling, one logits row per request: on the device where the executor can
(`start_sampling`), else on the host (numpy) from the full logits row.

Order, as in vLLM: penalties on the raw logits (repetition over prompt + output; presence and frequency
over the output only, as OpenAI defines them), then temperature, then top-k, top-p and min-p restrict the
support, then a draw from the request's own seeded Generator. Temperature 0 is argmax of the penalised
logits. Logprobs describe the final distribution the token was drawn from.

The support, exactly (kernels_src/sampling.cu implements the same definition; NaN logits count as -inf):
- top-k (0 < k < vocab): the logits >= the k-th largest (every token tied with it is kept);
- top-p (p < 1): a token is kept when the probability of the tokens strictly more likely than it, within
  the top-k set, is < p (so tied tokens are kept or dropped together);
- min-p (m > 0): a token is kept when its probability is >= m times the largest.
The draw is an inverse CDF over the vocabulary in index order with one uniform u = generator.random():
the first token whose cumulative probability exceeds u (numpy's Generator.choice(p=...) rule, so the
draws are those choice made). A row routed to the device draws its u the same way and sends it with the
row's parameters, so a seeded request draws the same tokens on the host and on the device; they can
differ only where u falls within float rounding (~1e-6 relative, f32 on the device, f64 here) of a
boundary of the CDF or a probability sits that close to a top-p / min-p threshold.

Rows go to the device (`on_device`) unless they need the host: penalties (token histories) or logprobs
(the whole distribution). Speculative verification (spec.py) samples on the host from its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import numpy as np

from ninfer_rt.engine.request import Request, SamplingParams
from ninfer_rt.model.executor import Executor, PendingRead, Tensor

# The device's parameter rows (ninfer_rt/cuda/sampling_ops.py, SampleParams in kernels_src/sampling.cu):
# int32 words temperature, top_k, top_p, min_p, u (the floats as f32 bits), flags, 2 unused.
DEVICE_PARAM_WORDS = 8
GREEDY, TOP_K, TOP_P, MIN_P = 1, 2, 4, 8


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
    """Temperature-scaled logits with -inf outside the top-k / top-p / min-p support (module docstring)."""
    logits = np.where(np.isnan(logits), -np.inf, logits)
    if 0 < params.top_k < logits.shape[0]:
        # on the unscaled logits: the same order, and no ties made by rounding the division
        kth = np.partition(logits, -params.top_k)[-params.top_k]
        logits = np.where(logits >= kth, logits, -np.inf)
    scaled = logits / params.temperature
    if params.top_p < 1.0:
        scaled = _top_p(scaled, params.top_p)
    if params.min_p > 0.0:
        scaled = np.where(_weights(scaled) >= params.min_p, scaled, -np.inf)
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
    return params.greedy and on_device(params)


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    generator: np.random.Generator,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> Sample:
    final = final_logits(logits, params, prompt_ids, output_ids)
    token = int(np.argmax(final)) if params.greedy else inverse_cdf(final, generator.random())
    return described(final, token, params)


def inverse_cdf(final: np.ndarray, u: float) -> int:
    """The token a uniform `u` in [0, 1) picks from softmax(final): the first index (in index order) whose
    cumulative probability exceeds u. A row without probability mass (all -inf) gives token 0."""
    cdf = np.cumsum(_weights(final))
    total = cdf[-1]
    if not total > 0:
        return 0
    token = int(np.searchsorted(cdf, u * total, side="right"))
    return min(token, int(np.flatnonzero(np.diff(cdf, prepend=0.0) > 0)[-1]))


def described(final: np.ndarray, token: int, params: SamplingParams) -> Sample:
    """`token` as a Sample, with logprobs from `final` (the distribution it came from) when asked for."""
    return Sample(token, _logprobs(final, token, params) if params.logprobs else None)


def _top_p(scaled: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-scaled, kind="stable")
    values, weights = scaled[order], _weights(scaled)[order]
    mass_before = np.cumsum(weights) - weights
    # the mass strictly above a token is what precedes the first token of its tie group
    above = mass_before[np.searchsorted(-values, -values, side="left")]
    # keep every token whose strictly more likely tokens hold less than top_p: the smallest value
    # threshold reaching top_p
    keep = np.zeros(scaled.shape[0], dtype=bool)
    keep[order[above < top_p * weights.sum()]] = True
    return np.where(keep, scaled, -np.inf)


def _weights(x: np.ndarray) -> np.ndarray:
    """exp(x - max(x)): 1 at the maximum (also an infinite one), 0 at -inf; all 0 for an all -inf row."""
    top = np.max(x)
    if top == -np.inf:
        return np.zeros(x.shape, np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(x == top, 1.0, np.exp(x - top))


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


# -- sampling on the device ------------------------------------------------------------------------------


def on_device(params: SamplingParams) -> bool:
    """Whether a row can be sampled on the device: no penalties (they need the token history) and no
    logprobs (they need the whole distribution on the host)."""
    return (
        not params.logprobs
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def device_flags(params: SamplingParams | None, vocab: int) -> int:
    """The kernel's SampleFlags for a row (None: a row the host samples, run as greedy and ignored)."""
    if params is None or params.greedy:
        return GREEDY
    return (
        (TOP_K if 0 < params.top_k < vocab else 0)
        | (TOP_P if params.top_p < 1.0 else 0)
        | (MIN_P if params.min_p > 0.0 else 0)
    )


def pack_device_params(rows: Sequence[tuple[SamplingParams | None, float]], vocab: int) -> np.ndarray:
    """int32 [rows, DEVICE_PARAM_WORDS]: per row (params or None for a host row, u) as SampleParams."""
    packed = np.zeros((len(rows), DEVICE_PARAM_WORDS), np.int32)
    floats = packed.view(np.float32)
    for i, (params, u) in enumerate(rows):
        packed[i, 5] = device_flags(params, vocab)
        if params is None or params.greedy:
            floats[i, 0] = 0.0
            continue
        if not 0.0 <= u < 1.0:
            raise ValueError(f"u must be in [0, 1), got {u}")
        floats[i, 0] = params.temperature
        packed[i, 1] = params.top_k if packed[i, 5] & TOP_K else 0
        floats[i, 2] = params.top_p
        floats[i, 3] = params.min_p
        floats[i, 4] = u
    return packed


@dataclass
class PendingSamples:
    """A step's samples: token ids still on their way from the device, or already drawn on the host."""

    samples: list[Sample | None]
    device_ids: PendingRead | None = None  # Executor.read_later of the device-sampled rows' ids, None once all are here

    def result(self) -> list[Sample]:
        if self.device_ids is not None:
            tokens = self.device_ids.result().reshape(-1)
            self.samples = [Sample(int(token), None) for token in tokens]
            self.device_ids = None
        return self.samples  # type: ignore[return-value]


def start_sampling(executor: Executor, logits: Tensor, requests: Sequence[Request], feed: bool) -> PendingSamples:
    """Sample request i from logits row i. Rows `on_device` go through the executor's device sampler
    (when it has one: the CUDA executor) and only their ids come back; the others are sampled here from
    the full rows, copied only when some row needs them. When every row is sampled on the device, nothing
    waits here: the ids are read back later (PendingSamples.result). `feed`: the ids also go to
    Executor.feed, so the next step can embed them before the host has seen them."""
    device = executor.device_sampler()
    routed = [device is not None and on_device(r.params) for r in requests]
    samples: list[Sample | None] = [None] * len(requests)
    if any(routed):
        vocab = int(logits.cols)
        rows = [
            (r.params if d else None, r.generator.random() if d and not r.params.greedy else 0.0)
            for r, d in zip(requests, routed)
        ]
        device_ids = device(logits, pack_device_params(rows, vocab))
        if all(routed):
            if feed:
                executor.feed(device_ids)
            return PendingSamples(samples, executor.read_later(device_ids))
        tokens = executor.to_host(device_ids).reshape(-1)
        for i, d in enumerate(routed):
            if d:
                samples[i] = Sample(int(tokens[i]), None)
    if not all(routed):
        host = executor.to_host(logits)
        for i, (request, d) in enumerate(zip(requests, routed)):
            if not d:
                samples[i] = sample(host[i], request.params, request.generator, request.prompt_vocab, request.output_ids)
    if feed and requests:
        executor.feed(np.array([s.token_id for s in samples], np.int32))  # type: ignore[union-attr]
    return PendingSamples(samples)
