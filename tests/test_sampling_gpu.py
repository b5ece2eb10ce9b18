"""Greedy argmax and top-k / top-p / min-p sampling on the GPU (kernels_src/sampling.cu) against the host path
(ninfer_rt/engine/sampling.py: restrict_support + inverse_cdf, float64), which is the reference: a row given
the same u must draw the host's token, up to float rounding at a CDF boundary."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_session import OneStream

from ninfer_rt.cuda import sampling_ops
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.engine.sampling import inverse_cdf, pack_device_params, restrict_support, softmax

pytestmark = pytest.mark.gpu
VOCAB = 151_936
ODD_VOCABS = (1, 3, 1000, 4099, 151_935)  # scalar loads (not a multiple of 4), fewer blocks than MAX_SLICES


@pytest.fixture(scope="module")
def gpu() -> OneStream:
    return OneStream.open()


def argmax_on_device(gpu: OneStream, logits: np.ndarray) -> np.ndarray:
    rows, vocab = logits.shape
    scratch = sampling_ops.zeroed_scratch(gpu.streams, gpu.stream, sampling_ops.argmax_scratch_bytes(rows), "scratch")
    out = gpu.poisoned(rows * 4)
    data = gpu.upload(logits)
    first = None
    for _ in range(3):  # again on the same scratch: each launch leaves it clean for the next
        sampling_ops.argmax(gpu.lib, gpu.stream, data, out, rows, vocab, scratch)
        result = gpu.download(out, np.int32, (rows,))
        if first is not None:
            np.testing.assert_array_equal(result, first)
        first = result
    return first


def expected_argmax(logits: np.ndarray) -> np.ndarray:
    """np.argmax's rule with NaN skipped; an all-NaN row gives 0."""
    return np.array([int(np.nanargmax(row)) if not np.isnan(row).all() else 0 for row in logits])


@pytest.mark.parametrize("rows", range(1, 9))
def test_argmax_matches_numpy_and_breaks_ties_to_the_lowest_index(gpu: OneStream, rows: int) -> None:
    rng = np.random.default_rng(rows)
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32)
    logits[0, [70_000, 7, 151_935]] = 100.0  # a three-way tie across blocks: the lowest index wins
    if rows > 1:
        logits[1, :] = -np.inf
        logits[1, 123] = -1e30
    if rows > 2:
        logits[2, 10] = np.nan  # NaN is skipped, not chosen
        logits[2, 11] = np.inf
    if rows > 3:
        logits[3, :] = np.nan  # all NaN: 0
    if rows > 4:
        logits[4, :] = 5.0  # all tied: 0
    if rows > 5:
        logits[5, 151_935] = 50.0  # the last element (the last block's tail)
    result = argmax_on_device(gpu, logits)
    np.testing.assert_array_equal(result, expected_argmax(logits))
    assert result[0] == 7


@pytest.mark.parametrize("vocab", ODD_VOCABS)
def test_argmax_on_odd_vocab_sizes(gpu: OneStream, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    logits[1, -1] = 9.0
    logits[2, 0] = 9.0
    np.testing.assert_array_equal(argmax_on_device(gpu, logits), expected_argmax(logits))


# -- sampling ---------------------------------------------------------------------------------------------


def sample_on_device(gpu: OneStream, logits: np.ndarray, params: list[SamplingParams], us: list[float], repeats: int = 2) -> np.ndarray:
    """Tokens per row; the call is repeated on the same scratch (self-cleaning) and must agree with itself."""
    rows, vocab = logits.shape
    packed = pack_device_params(list(zip(params, us)), vocab)
    scratch = sampling_ops.zeroed_scratch(gpu.streams, gpu.stream, sampling_ops.sample_scratch_bytes(rows), "scratch")
    data, device_params, out = gpu.upload(logits), gpu.upload(packed), gpu.poisoned(rows * 4)
    first = None
    for _ in range(repeats):
        sampling_ops.sample(
            gpu.lib, gpu.stream, data, out, rows, vocab, device_params, packed[:, sampling_ops.FLAGS_WORD], scratch
        )
        result = gpu.download(out, np.int32, (rows,))
        if first is not None:
            np.testing.assert_array_equal(result, first)
        first = result
    return first


def check_inverse_cdf(row: np.ndarray, params: SamplingParams, u: float, token: int) -> None:
    """`token` is the host's draw for u, or (rounding) a neighbour across a CDF boundary within 1e-5."""
    if params.greedy:
        assert token == expected_argmax(row[None])[0]
        return
    final = restrict_support(row.astype(np.float64), params)
    host = inverse_cdf(final, u)
    if token == host:
        return
    probs = softmax(final)
    assert 0 <= token < row.size and probs[token] > 0, f"device drew token {token}, outside the support"
    cdf = np.cumsum(probs)
    before, after = cdf[token] - probs[token], cdf[token]
    assert before - 1e-5 <= u <= after + 1e-5, f"u={u}: device {token} [{before}, {after}], host {host}"


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=200, top_p=0.5, min_p=0.01),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=2.0, top_k=5000),
]


@pytest.mark.parametrize("rows", range(1, 9))
def test_sampling_draws_the_host_token_for_the_same_u(gpu: OneStream, rows: int) -> None:
    rng = np.random.default_rng(100 + rows)
    logits = (3 * rng.standard_normal((rows, VOCAB))).astype(np.float32)
    logits[:, rng.integers(0, VOCAB, 8)] += 12  # a few likely tokens, as a model's rows have
    params = [PARAMS[(i + rows) % len(PARAMS)] for i in range(rows)]
    for trial in range(4):
        us = list(rng.random(rows))
        tokens = sample_on_device(gpu, logits, params, us)
        for row, p, u, token in zip(logits, params, us, tokens):
            check_inverse_cdf(row, p, u, int(token))


@pytest.mark.parametrize("u", [0.0, 1e-9, 0.5, 1 - 2**-53])
def test_the_ends_of_the_cdf_draw_the_first_and_last_kept_tokens(gpu: OneStream, u: float) -> None:
    rng = np.random.default_rng(7)
    logits = (2 * rng.standard_normal((3, VOCAB))).astype(np.float32)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=50), SamplingParams(temperature=1.0, top_p=0.3)]
    tokens = sample_on_device(gpu, logits, params, [u] * 3)
    for row, p, token in zip(logits, params, tokens):
        check_inverse_cdf(row, p, u, int(token))


def test_ties_nan_and_infinities(gpu: OneStream) -> None:
    vocab = 4099
    rows = []
    tied = np.zeros(vocab, np.float32)  # all tied: top-k keeps all, top-p keeps all (ties go together)
    rows.append((tied, SamplingParams(temperature=1.0, top_k=10, top_p=0.5)))
    plateau = np.full(vocab, -5.0, np.float32)
    plateau[[3, 500, 4000, 4098]] = 2.0  # four tied leaders: top_k=2 keeps all four
    rows.append((plateau, SamplingParams(temperature=1.0, top_k=2)))
    rows.append((plateau, SamplingParams(temperature=0.1, top_p=0.3)))  # one leader's mass < 0.3: all four kept
    nans = np.random.default_rng(1).standard_normal(vocab).astype(np.float32)
    nans[::7] = np.nan  # NaN is -inf: never drawn
    rows.append((nans, SamplingParams(temperature=1.0, top_p=0.9)))
    dead = np.full(vocab, -np.inf, np.float32)  # no mass: token 0
    rows.append((dead, SamplingParams(temperature=1.0, top_k=3)))
    infinite = np.zeros(vocab, np.float32)
    infinite[[17, 99]] = np.inf  # +inf leaders share the mass
    rows.append((infinite, SamplingParams(temperature=1.0)))
    logits = np.stack([r for r, _ in rows])
    params = [p for _, p in rows]
    for u in (0.0, 0.26, 0.74, 0.999):
        tokens = sample_on_device(gpu, logits, params, [u] * len(rows))
        for row, p, token in zip(logits, params, tokens):
            check_inverse_cdf(row, p, u, int(token))
        assert tokens[1] in (3, 500, 4000, 4098) and tokens[2] in (3, 500, 4000, 4098)
        assert not np.isnan(nans[tokens[3]])
        assert tokens[4] == 0
        assert tokens[5] in (17, 99)


@pytest.mark.parametrize("vocab", ODD_VOCABS)
def test_sampling_on_odd_vocab_sizes(gpu: OneStream, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    logits = (2 * rng.standard_normal((4, vocab))).astype(np.float32)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3, top_p=0.9),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.2)]
    for u in (0.1, 0.6, 0.95):
        tokens = sample_on_device(gpu, logits, params, [u] * 4)
        for row, p, token in zip(logits, params, tokens):
            check_inverse_cdf(row, p, u, int(token))


def test_sampled_frequencies_follow_the_target_distribution(gpu: OneStream) -> None:
    """Chi-square of 8192 device draws (fresh uniform u each) against the host's restricted softmax."""
    vocab, rows, launches = 50, 64, 128
    rng = np.random.default_rng(5)
    row = (1.5 * rng.standard_normal(vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02)
    logits = np.repeat(row[None], rows, axis=0)
    counts = np.zeros(vocab)
    for _ in range(launches):
        tokens = sample_on_device(gpu, logits, [params] * rows, list(rng.random(rows)), repeats=1)
        counts += np.bincount(tokens, minlength=vocab)
    expected = softmax(restrict_support(row.astype(np.float64), params)) * rows * launches
    assert counts[expected == 0].sum() == 0, "a token outside the support was drawn"
    kept = expected > 0
    chi2 = float((((counts - expected) ** 2)[kept] / expected[kept]).sum())
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), f"chi2 {chi2:.1f} for {dof} degrees of freedom"


# -- in the engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from ninfer_rt.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_sampling"), head_dim=64)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, seed=4, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    ],
    ids=["top_k_top_p", "min_p", "greedy"],
)
def test_engine_draws_the_same_tokens_on_the_device_as_on_the_host(tiny_model, params: SamplingParams, monkeypatch) -> None:
    """Same GPU logits, same seeds: the device sampler and the host sampler agree token for token."""
    from ninfer_rt.engine.engine import Engine, EngineConfig

    prompts = [np.random.default_rng(s).integers(0, 500, n).tolist() for s, n in ((1, 70), (2, 9), (3, 130))]

    def run(device_sampling: bool) -> list[list[int]]:
        eng = Engine.load(tiny_model, EngineConfig(device="cuda", kv_capacity="64", token_budget=64))
        calls = []
        original = eng.runner.executor.sample_tokens
        sampler = (lambda *a: calls.append(1) or original(*a)) if device_sampling else None
        monkeypatch.setattr(eng.runner.executor, "device_sampler", lambda: sampler)
        tokens: dict[str, list[int]] = {}
        for out in eng.generate(prompts, params):
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        assert bool(calls) == device_sampling
        return [tokens[key] for key in sorted(tokens, key=lambda k: int(k.split("-")[-1]))]

    on_device, on_host = run(True), run(False)
    assert all(len(t) == 16 for t in on_device)
    assert on_device == on_host
