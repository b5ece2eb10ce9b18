"""The host side of on-device sampling (CPU): the shared definition of the support and of the draw, the
parameter rows sent to the device, which passes run, and which rows go to the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from ninfer_rt.cuda import sampling_ops
from ninfer_rt.engine import sampling
from ninfer_rt.engine.request import Request, SamplingParams
from ninfer_rt.exec.numpy_exec import ReadyRead
from ninfer_rt.engine.sampling import (
    GREEDY, MIN_P, TOP_K, TOP_P, inverse_cdf, on_device, pack_device_params, restrict_support, sample, softmax, start_sampling,
)


def test_the_flag_bits_and_word_layout_agree_with_the_kernel_wrapper() -> None:
    assert (GREEDY, TOP_K, TOP_P, MIN_P) == (sampling_ops.GREEDY, sampling_ops.TOP_K, sampling_ops.TOP_P, sampling_ops.MIN_P)
    assert sampling.DEVICE_PARAM_WORDS == sampling_ops.PARAM_WORDS
    source = (sampling_ops.__file__.rsplit("/ninfer_rt/", 1)[0] + "/kernels_src/sampling.cu")
    text = open(source).read()
    for name, value in (("kGreedy", 1), ("kTopK", 2), ("kTopP", 4), ("kMinP", 8)):
        assert f"{name} = {value}," in text
    for name, value in (("kThreads", sampling_ops.THREADS), ("kMaxSlices", sampling_ops.MAX_SLICES)):
        assert f"constexpr int {name} = {value};" in text


def test_inverse_cdf_draws_what_generator_choice_drew() -> None:
    """The host path used Generator.choice(p=softmax); a seeded request keeps its tokens."""
    logits = np.random.default_rng(0).standard_normal(1000) * 2
    final = restrict_support(logits, SamplingParams(temperature=0.8, top_p=0.9))
    chosen, drawn = np.random.default_rng(42), np.random.default_rng(42)
    for _ in range(500):
        assert int(chosen.choice(final.shape[0], p=softmax(final))) == inverse_cdf(final, drawn.random())


def test_inverse_cdf_ends_and_dead_rows() -> None:
    final = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf])
    assert inverse_cdf(final, 0.0) == 1
    assert inverse_cdf(final, 0.5) == 3
    assert inverse_cdf(final, np.nextafter(1.0, 0.0)) == 3
    assert inverse_cdf(np.full(4, -np.inf), 0.3) == 0


def test_top_p_keeps_or_drops_tied_tokens_together() -> None:
    logits = np.array([1.0, 3.0, 3.0, 3.0, 0.0])
    # each leader holds ~0.31: the mass strictly above any of them is 0 < 0.2, so all three stay
    kept = np.isfinite(restrict_support(logits, SamplingParams(top_p=0.2)))
    assert kept.tolist() == [False, True, True, True, False]
    kept = np.isfinite(restrict_support(logits, SamplingParams(top_p=0.98)))
    assert kept.tolist() == [True, True, True, True, False]


def test_top_k_keeps_ties_with_the_kth_and_nan_is_minus_infinity() -> None:
    logits = np.array([5.0, np.nan, 4.0, 4.0, 1.0])
    final = restrict_support(logits, SamplingParams(top_k=2))
    assert np.isfinite(final).tolist() == [True, False, True, True, False]
    draws = {sample(logits, SamplingParams(top_p=0.999), np.random.default_rng(s)).token_id for s in range(200)}
    assert 1 not in draws


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.05, 0.15]))
    final = restrict_support(logits, SamplingParams(min_p=0.3))
    assert np.isfinite(final).tolist() == [True, True, False, True]


def test_packed_rows() -> None:
    rows = [
        (SamplingParams(temperature=0.6, top_k=20, top_p=0.95), 0.25),
        (SamplingParams(temperature=1.0, top_k=100, min_p=0.1), 0.5),  # top_k >= vocab: no top-k
        (SamplingParams(temperature=0), 0.0),
        (None, 0.0),  # a host row: greedy, ignored
        (SamplingParams(temperature=1.0, top_k=-1), 0.75),
    ]
    packed = pack_device_params(rows, vocab=100)
    floats = packed.view(np.float32)
    assert packed.shape == (5, sampling_ops.PARAM_WORDS) and packed.dtype == np.int32
    assert packed[:, sampling_ops.FLAGS_WORD].tolist() == [TOP_K | TOP_P, MIN_P, GREEDY, GREEDY, 0]
    assert floats[0, [0, 2, 4]].tolist() == pytest.approx([0.6, 0.95, 0.25]) and packed[0, 1] == 20
    assert packed[1, 1] == 0 and floats[1, 3] == pytest.approx(0.1)
    assert packed[4, 1] == 0
    with pytest.raises(ValueError, match="u must be"):
        pack_device_params([(SamplingParams(), 1.0)], vocab=100)


def test_passes_launched_follow_the_rows_needs() -> None:
    launches = sampling_ops.sample_launches
    assert launches(np.array([GREEDY, GREEDY])) == [("begin", 0)]
    assert launches(np.array([0, GREEDY])) == [("begin", 0), ("draw", 0)]
    assert launches(np.array([MIN_P])) == [("begin", 0), ("draw", 0)]
    assert launches(np.array([TOP_K, GREEDY])) == [("begin", 0), ("radix", 1), ("radix", 2), ("draw", 0)]
    assert launches(np.array([TOP_P])) == [("begin", 0), ("radix", 4), ("radix", 5), ("radix", 6), ("draw", 0)]
    assert len(launches(np.array([TOP_K | TOP_P | MIN_P]))) == 7


@pytest.mark.parametrize("vocab", [1, 3, 4, 1000, 2048, 2049, 4099, 151_935, 151_936, 1 << 23])
def test_slicing_covers_the_row_with_aligned_slices(vocab: int) -> None:
    blocks, per_block = sampling_ops.slicing(vocab)
    assert 1 <= blocks <= sampling_ops.MAX_SLICES
    assert per_block % 4 == 0
    assert (blocks - 1) * per_block < vocab <= blocks * per_block


# -- routing ------------------------------------------------------------------------------------------------


@dataclass
class HostTensor:
    values: np.ndarray

    @property
    def cols(self) -> int:
        return self.values.shape[1]


class FakeDeviceExecutor:
    """Stands in for the CUDA executor: sample_tokens applies the shared definition to the packed rows."""

    def __init__(self) -> None:
        self.device_rows: list[int] = []
        self.full_copies = 0

    def device_sampler(self) -> Callable[[HostTensor, np.ndarray], HostTensor] | None:
        return self.sample_tokens

    def sample_tokens(self, logits: HostTensor, packed: np.ndarray) -> HostTensor:
        floats = packed.view(np.float32)
        tokens = []
        for i, row in enumerate(logits.values):
            flags = packed[i, sampling_ops.FLAGS_WORD]
            if flags & GREEDY:
                tokens.append(int(np.argmax(row)))
                continue
            self.device_rows.append(i)
            params = SamplingParams(
                temperature=float(floats[i, 0]), top_k=int(packed[i, 1]), top_p=float(floats[i, 2]), min_p=float(floats[i, 3])
            )
            tokens.append(inverse_cdf(restrict_support(row.astype(np.float64), params), float(floats[i, 4])))
        return HostTensor(np.array(tokens, np.int32)[:, None])

    def to_host(self, x: HostTensor) -> np.ndarray:
        if x.values.dtype != np.int32:
            self.full_copies += 1
        return x.values

    def read_later(self, x: HostTensor) -> ReadyRead:
        return ReadyRead(self.to_host(x))


class HostOnlyExecutor(FakeDeviceExecutor):
    def device_sampler(self) -> None:  # as the numpy executor: no sampling on the device
        return None


def sample_rows(executor: object, logits: HostTensor, batch: list[Request]) -> list:
    return start_sampling(executor, logits, batch, feed=False).result()


def requests(params: list[SamplingParams]) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]


def test_rows_needing_penalties_or_logprobs_stay_on_the_host() -> None:
    assert on_device(SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.1))
    assert on_device(SamplingParams(temperature=0))
    assert not on_device(SamplingParams(logprobs=True))
    assert not on_device(SamplingParams(repetition_penalty=1.1))
    assert not on_device(SamplingParams(presence_penalty=0.5))
    assert not on_device(SamplingParams(frequency_penalty=-0.5))


def test_device_rows_return_only_tokens_and_host_rows_get_the_full_rows() -> None:
    logits = HostTensor(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    batch = requests([
        SamplingParams(temperature=0.7, top_k=10, seed=1),
        SamplingParams(temperature=0.7, logprobs=True, seed=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_p=0.8, seed=3),
    ])
    executor = FakeDeviceExecutor()
    samples = sample_rows(executor, logits, batch)
    assert executor.device_rows == [0, 3]
    assert executor.full_copies == 1  # row 1 (logprobs) needs the rows
    assert samples[1].logprobs is not None and samples[0].logprobs is None
    assert samples[2].token_id == int(np.argmax(logits.values[2]))
    only_device = FakeDeviceExecutor()
    sample_rows(only_device, HostTensor(logits.values[:2]), requests([SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0)]))
    assert only_device.full_copies == 0  # 4 bytes per row come back, never the rows


def test_a_seeded_request_draws_the_same_tokens_on_either_path() -> None:
    rng = np.random.default_rng(3)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11), SamplingParams(temperature=1.2, min_p=0.05, seed=12)]
    device_batch, host_batch = requests(params), requests(params)
    for _ in range(50):
        logits = HostTensor((2 * rng.standard_normal((2, 200))).astype(np.float32))
        on_device_tokens = [s.token_id for s in sample_rows(FakeDeviceExecutor(), logits, device_batch)]
        on_host_tokens = [s.token_id for s in sample_rows(HostOnlyExecutor(), logits, host_batch)]
        assert on_device_tokens == on_host_tokens


def test_no_sampling_rows_touch_nothing() -> None:
    executor = FakeDeviceExecutor()
    assert sample_rows(executor, HostTensor(np.zeros((0, 8), np.float32)), []) == []
    assert executor.full_copies == 0 and executor.device_rows == []
