"""The Gated DeltaNet kernels against the numpy reference on the GPU (`pytest -m gpu`): the conv + SiLU
with its windows, the recurrent and chunked delta rule with their saved states (the chunked form fused in
one kernel and split in three passes over a NaN-poisoned workspace), the gated output norm.

Each case runs the three launches over one layer of a state-slot pool whose other bytes are NaN poison:
odd lengths and lengths that are not multiples of 64, random initial states, several sequences, in-place
decode targets, k+1-row verification targets (the state after 0..k+1 rows) and chunks cut at requested
row counts. Each kernel is judged on its own inputs as the GPU produced them (the delta rule's reference
starts from the GPU's bf16 conv output), so a failure names the kernel.

Tolerances (frozen): the conv and the norm round their f32 result to bf16 once (2^-9 relative), so they
are held to 2^-8 per element; the delta rule computes in f32 against a float64 reference, so its output
and states are held to 1e-4 relative L2 (numpy's own f32 chunked form is within 1.5e-6 of the float64
recurrent one on these cases: the margin covers the kernels' summation orders and fast exp/rsqrt, while an
indexing or gating mistake is off by O(1)). Windows are copies of bf16 inputs: exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from gpu_session import POISON, OneStream
from ninfer_rt.cuda import gdn_split_plan
from ninfer_rt.cuda import linear_attn_ops as ops
from ninfer_rt.cuda.linear_attn_ops import DeltaRuleArgs, GdnHeads, GdnStep, StateLayer
from ninfer_rt.cuda.memory import Buffer, StagingRing
from ninfer_rt.exec import numpy_delta_rule
from ninfer_rt.exec.numpy_hybrid_norms import gated_rms_norm
from ninfer_rt.exec.numpy_linear_attn import causal_conv_silu, gating, normalize_qk
from ninfer_rt.exec.numpy_state_slots import saved_row_counts
from ninfer_rt.kv.states import StateSlotPool, StateSpec

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
CONV_RTOL = 2.0**-8
NORM_RTOL = 2.0**-8
DELTA_RTOL = 1e-4
LAYER = 1  # the second linear layer: its offset inside each slot is exercised
SLOTS = 12
GEOMETRIES = [GdnHeads(2, 4, 128, 64, 1e-6), GdnHeads(1, 3, 64, 128, 1e-6)]


@dataclass(frozen=True)
class Case:
    query_lens: tuple[int, ...]
    sources: tuple[int, ...]
    targets: tuple[tuple[int, ...], ...]  # [B, S], -1 pads at the front


CASES = {
    "decode_in_place": Case((1, 1, 1), (0, 1, 2), ((0,), (1,), (2,))),
    "verify_k_plus_1": Case((4, 3), (0, 1), ((5, 6, 7, 0), (8, 9, 10, 1))),  # seq 1 also keeps the state after 0 rows
    "prefill_mixed": Case((531, 77, 1), (0, 1, 2), ((3,), (4,), (2,))),
    "prefill_cut_at_requests": Case((130, 9), (0, 1), ((-1, 3), (4, 5))),  # seq 1: states after 8 and 9 rows
    # odd lengths around the 64-grid beside a decode row; three targets each (the states after len-2..len rows)
    "prefill_odd_lengths": Case((299, 1, 63, 65, 190), (0, 1, 2, 6, 7), (
        (3, 4, 0), (-1, -1, 1), (5, -1, 2), (8, 9, 6), (-1, 10, 11))),
}
FORMS = ("fused", "split")


@pytest.fixture(scope="module")
def gpu() -> Iterator[OneStream]:
    one = OneStream.open()
    yield one
    one.session.close()


class HostPool:
    """The pool's bytes on the host: NaN poison, with random states in the sources' slots of LAYER."""

    def __init__(self, spec: StateSpec, rng: np.random.Generator, sources: tuple[int, ...]) -> None:
        self.spec = spec
        self.raw = np.full(SLOTS * spec.slot_bytes, POISON, np.uint8)
        for slot in sources:
            self.window(slot)[...] = (rng.standard_normal(spec.conv_shape) * 2).astype(BF16)
            self.recurrent(slot)[...] = (rng.standard_normal(spec.recurrent_shape) * 0.3).astype(np.float32)

    def _at(self, raw: np.ndarray, slot: int, extra: int, nbytes: int) -> np.ndarray:
        start = slot * self.spec.slot_bytes + self.spec.layer_offset(LAYER) + extra
        return raw[start : start + nbytes]

    def window(self, slot: int, raw: np.ndarray | None = None) -> np.ndarray:
        chunk = self._at(self.raw if raw is None else raw, slot, 0, self.spec.conv_window_bytes)
        return chunk.view(BF16).reshape(self.spec.conv_shape)

    def recurrent(self, slot: int, raw: np.ndarray | None = None) -> np.ndarray:
        chunk = self._at(self.raw if raw is None else raw, slot, self.spec.conv_bytes, self.spec.recurrent_bytes)
        return chunk.view(np.float32).reshape(self.spec.recurrent_shape)


@dataclass
class Layer:
    """One layer's inputs on the host (bf16 projection rows, f32 parameters) and on the device."""

    x: np.ndarray
    conv_weight: np.ndarray
    a_log: np.ndarray
    dt_bias: np.ndarray
    norm: np.ndarray


def random_layer(rng: np.random.Generator, heads: GdnHeads, rows: int) -> Layer:
    x = rng.standard_normal((rows, heads.projection_stride))
    x[:, heads.gate_column :] *= 2.0  # b and a spread over the gates' useful range
    return Layer(
        x.astype(BF16),
        (rng.standard_normal((heads.conv_channels, ops.CONV_KERNEL)) * 0.5).astype(np.float32),
        np.log(rng.uniform(0.01, 16.0, heads.value_heads)).astype(np.float32),
        rng.standard_normal(heads.value_heads).astype(np.float32),
        (1.0 + 0.3 * rng.standard_normal(heads.value_dim)).astype(np.float32),
    )


def fill(gpu: OneStream, buffer: Buffer, raw: np.ndarray) -> None:
    ring = StagingRing(gpu.streams, 1, raw.size)
    ring.publish(gpu.stream, buffer, raw, label="fill state slots")
    ring.free()


def relative_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def assert_elementwise(name: str, got: np.ndarray, ref: np.ndarray, rtol: float) -> None:
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: {np.count_nonzero(~np.isfinite(got))} elements not written"
    bound = rtol * np.abs(ref) + 1e-5
    worst = np.unravel_index(int(np.argmax(np.abs(got - ref) - bound)), ref.shape)
    assert np.all(np.abs(got - ref) <= bound), f"{name}: at {worst} got {got[worst]}, expected {ref[worst]}"


def assert_relative(name: str, got: np.ndarray, ref: np.ndarray) -> None:
    assert np.isfinite(got).all(), f"{name}: {np.count_nonzero(~np.isfinite(got))} elements not written"
    error = relative_l2(got.astype(np.float64), ref)
    assert error < DELTA_RTOL, f"{name}: relative L2 error {error:.2e}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("columns", [32, 16])
@pytest.mark.parametrize("heads", GEOMETRIES, ids=lambda h: f"hk{h.key_heads}_hv{h.value_heads}_dk{h.key_dim}_dv{h.value_dim}")
@pytest.mark.parametrize("case_name", list(CASES))
def test_conv_delta_rule_and_gated_norm_match_the_reference(
    gpu: OneStream, case_name: str, heads: GdnHeads, columns: int, form: str
) -> None:
    case = CASES[case_name]
    rng = np.random.default_rng(len(case_name) * 31 + heads.key_dim + columns)
    spec = StateSpec(2, heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim)
    host, layer = HostPool(spec, rng, case.sources), random_layer(rng, heads, sum(case.query_lens))
    pool = StateSlotPool(gpu.streams, spec, SLOTS)
    fill(gpu, pool.buffer, host.raw)
    query_start = np.cumsum([0, *case.query_lens]).astype(np.int32)
    targets = np.array(case.targets, np.int32)
    written = sorted({int(t) for t in targets.reshape(-1) if t >= 0})
    step = GdnStep(
        gpu.upload(query_start), gpu.upload(np.array(case.sources, np.int32)), gpu.upload(targets), case.query_lens,
        targets.shape[1], tuple(pool.resource(s) for s in case.sources), tuple(pool.resource(t) for t in written),
    )
    states = StateLayer(pool.buffer, spec.layer_offset(LAYER), spec.slot_bytes, spec.conv_bytes)
    rows = step.num_rows
    x = gpu.upload(layer.x)
    conv, o, y = gpu.poisoned(rows * heads.conv_channels * 2), gpu.poisoned(rows * heads.value_size * 4), gpu.poisoned(rows * heads.value_size * 2)
    args = DeltaRuleArgs(conv, x, gpu.upload(layer.a_log), gpu.upload(layer.dt_bias), o)

    ops.conv_silu(gpu.lib, gpu.stream, step, heads, x, gpu.upload(layer.conv_weight), conv, states)
    ops.delta_rule(gpu.lib, gpu.stream, step, heads, args, states, columns, poisoned_workspace(gpu, step, heads) if form == "split" else None)
    ops.gated_norm(gpu.lib, gpu.stream, heads, o, x, gpu.upload(layer.norm), y, rows)

    after = gpu.download(pool.buffer, np.uint8, (pool.buffer.nbytes,))
    counts = saved_row_counts(query_start, targets)
    xs = layer.x.astype(np.float64)
    windows = np.stack([host.window(s).T for s in case.sources]).astype(np.float64)
    conv_ref = causal_conv_silu(xs[:, : heads.conv_channels], layer.conv_weight.astype(np.float64), query_start, windows)
    conv_gpu = gpu.download(conv, BF16, (rows, heads.conv_channels))
    assert_elementwise("conv out", conv_gpu, conv_ref.out, CONV_RTOL)

    mixed = delta_rule_ref(heads, conv_gpu.astype(np.float64), xs, layer, query_start, host, case, counts)
    o_gpu = gpu.download(o, np.float32, (rows, heads.value_heads, heads.value_dim))
    assert_relative("delta rule out", o_gpu, mixed.out)
    for seq, seq_targets in enumerate(targets):
        kept = [int(t) for t in seq_targets if t >= 0]
        for index, slot in enumerate(kept):
            np.testing.assert_array_equal(
                host.window(slot, after).astype(np.float64).T, conv_ref.windows_after(seq, [counts[seq][index]])[0],
                err_msg=f"conv window of target slot {slot}",
            )
            assert_relative(f"state in target slot {slot}", host.recurrent(slot, after), mixed.saved_states[seq][index])
    assert_only_targets_written(host, after, written)

    z = xs[:, heads.conv_channels : heads.conv_channels + heads.value_size].reshape(o_gpu.shape)
    norm_ref = gated_rms_norm(o_gpu.astype(np.float64), z, layer.norm.astype(np.float64), heads.norm_eps)
    assert_elementwise("gated norm", gpu.download(y, BF16, (rows, heads.value_size)), norm_ref.reshape(rows, -1), NORM_RTOL)


def poisoned_workspace(gpu: OneStream, step: GdnStep, heads: GdnHeads) -> ops.SplitWorkspace:
    """The split form's arrays, NaN-poisoned: a pass reading what no pass wrote shows up in the outputs."""
    chunks = gdn_split_plan.chunk_bases(step.query_lens, step.num_targets)[-1]
    shape = gdn_split_plan.SplitWorkspace(step.num_rows, chunks, heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim)
    # a step of decode or verify rows has no chunk: its arrays are empty, yet a buffer must hold a byte
    return ops.SplitWorkspace(*(gpu.poisoned(max(nbytes, 16)) for nbytes in shape.sizes().values()))


def delta_rule_ref(
    heads: GdnHeads, conv: np.ndarray, xs: np.ndarray, layer: Layer, query_start: np.ndarray, host: HostPool, case: Case,
    counts: list[list[int]],
) -> numpy_delta_rule.DeltaRuleResult:
    """The float64 recurrent form over the GPU's conv output, from the sources' initial states."""
    rows, key = conv.shape[0], (conv.shape[0], heads.key_heads, heads.key_dim)
    q, k = normalize_qk(conv[:, : heads.key_size].reshape(key), conv[:, heads.key_size : 2 * heads.key_size].reshape(key))
    v = conv[:, 2 * heads.key_size :].reshape(rows, heads.value_heads, heads.value_dim)
    b = xs[:, heads.gate_column : heads.gate_column + heads.value_heads]
    a = xs[:, heads.gate_column + heads.value_heads :]
    g, beta = gating(a, b, layer.a_log.astype(np.float64), layer.dt_bias.astype(np.float64))
    initial = np.stack([host.recurrent(s) for s in case.sources]).astype(np.float64)
    inputs = numpy_delta_rule.DeltaRuleInputs(q, k, v, g, beta, query_start, initial)
    return numpy_delta_rule.recurrent_gated_delta_rule(inputs, counts)


def assert_only_targets_written(host: HostPool, after: np.ndarray, written: list[int]) -> None:
    """Every byte outside the targets' windows and states of LAYER is as it was (sources included)."""
    spec, expected = host.spec, host.raw.copy()
    for slot in written:
        host.window(slot, expected)[...] = host.window(slot, after)
        host.recurrent(slot, expected)[...] = host.recurrent(slot, after)
    changed = np.flatnonzero(expected != after)
    assert changed.size == 0, f"{changed.size} bytes written outside the targets, first at slot {changed[0] // spec.slot_bytes}"
