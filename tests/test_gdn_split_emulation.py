"""The split chunked delta rule's decomposition (tests/gdn_split_emulation.py, the passes of
kernels_src/gdn_chunked_split.cu in float32) against numpy_delta_rule's float64 recurrent and chunked forms:
outputs, final states, the states the targets ask for, and the per-chunk states passed between the passes.
Also the closed-form chunk points the kernels use against numpy_delta_rule.plan_chunks."""

from __future__ import annotations

import numpy as np
import pytest

from gdn_split_emulation import chunks_of, split_delta_rule
from ninfer_rt.cuda import gdn_split_plan as plan
from ninfer_rt.exec.numpy_delta_rule import DeltaRuleInputs, chunked_gated_delta_rule, plan_chunks, recurrent_gated_delta_rule
from ninfer_rt.exec.numpy_linear_attn import gating, normalize_qk

HK, HV, DK, DV = 2, 4, 16, 8
EXACT = 1e-12  # the passes in float64: the same math as the references, other summation orders
F32_RTOL = 1e-4  # the passes in float32, as the kernels compute: the GPU tests' tolerance (measured 3e-5)


def target_counts(length: int, num_targets: int) -> list[int]:
    return list(range(length - num_targets + 1, length + 1))


def random_rows(rng: np.random.Generator, lengths: tuple[int, ...], initial_scale: float) -> DeltaRuleInputs:
    rows = sum(lengths)
    q, k = normalize_qk(rng.standard_normal((rows, HK, DK)), rng.standard_normal((rows, HK, DK)))
    a, b = rng.standard_normal((rows, HV)) * 2.0, rng.standard_normal((rows, HV)) * 2.0
    g, beta = gating(a, b, np.log(rng.uniform(0.01, 16.0, HV)), rng.standard_normal(HV))
    initial = rng.standard_normal((len(lengths), HV, DK, DV)) * initial_scale
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return DeltaRuleInputs(q, k, rng.standard_normal((rows, HV, DV)), g, beta, starts, initial)


def as_f32(x: DeltaRuleInputs) -> DeltaRuleInputs:
    f32 = (y.astype(np.float32) for y in (x.q, x.k, x.v, x.g, x.beta))
    return DeltaRuleInputs(*f32, x.query_start, x.initial_states.astype(np.float32))


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


@pytest.mark.parametrize("num_targets", [1, 2, 8])
def test_chunk_points_are_the_64_grid_and_every_target_count(num_targets: int) -> None:
    lengths = tuple(range(9, 301))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    reference = plan_chunks(starts, [target_counts(n, num_targets) for n in lengths])
    ours = [c for chunks in chunks_of(starts, num_targets) for c in chunks]
    assert [c.first for c in ours] == reference.start.tolist()
    assert [c.first + c.rows for c in ours] == reference.end.tolist()
    assert [c.index for c in ours] == list(range(len(ours))) == list(range(plan.chunk_bases(lengths, num_targets)[-1]))
    assert plan.max_chunks(lengths, num_targets) == max(reference.local) + 1


@pytest.mark.parametrize("num_targets", [1, 4, 8])
def test_a_step_never_has_more_chunks_than_the_reserved_bound(num_targets: int) -> None:
    rng = np.random.default_rng(num_targets)
    for _ in range(500):
        seqs = int(rng.integers(1, 6))
        lengths = tuple(int(n) for n in rng.integers(1, 400, seqs))
        total = plan.chunk_bases(lengths, num_targets)[-1]
        assert total <= plan.max_step_chunks(sum(lengths), seqs, num_targets), lengths


def test_short_sequences_have_no_chunks_and_take_no_chunk_numbers() -> None:
    assert plan.chunk_bases((8, 70, 1, 9), 2) == [0, 0, 3, 3, 5]  # 70 rows: cut at 64 and 69
    assert plan.max_chunks((1, 8), 1) == 0


def check_against_references(x: DeltaRuleInputs, lengths: tuple[int, ...], num_targets: int, rtol: float, f32: bool = False) -> None:
    """The passes (in float32 if f32) against both float64 forms."""
    counts = [target_counts(n, num_targets) if plan.is_chunked(n) else [] for n in lengths]
    recurrent = recurrent_gated_delta_rule(x, counts)
    chunked = chunked_gated_delta_rule(x, counts)
    split = split_delta_rule(as_f32(x) if f32 else x, num_targets)
    for b, n in enumerate(lengths):
        rows = slice(x.query_start[b], x.query_start[b + 1])
        if not plan.is_chunked(n):
            assert not split.out[rows].any(), "a short sequence's rows are the recurrent kernel's"
            continue
        for reference in (recurrent, chunked):
            assert rel_l2(split.out[rows], reference.out[rows]) < rtol, n
        assert rel_l2(split.final_states[b], recurrent.final_states[b]) < rtol, n
        for i, count in enumerate(counts[b]):
            assert rel_l2(split.saved[b, i], recurrent.saved_states[b][i]) < rtol, (n, count)


@pytest.mark.parametrize("num_targets", [1, 8])
@pytest.mark.parametrize("initial_scale", [0.0, 0.5])
def test_split_passes_equal_the_recurrent_and_chunked_forms_for_every_length_to_300(
    num_targets: int, initial_scale: float
) -> None:
    """One batch of sequences of 1..300 rows in random order, float64."""
    rng = np.random.default_rng(num_targets * 10 + int(initial_scale * 2))
    lengths = tuple(int(n) for n in rng.permutation(np.arange(1, 301)))
    check_against_references(random_rows(rng, lengths, initial_scale), lengths, num_targets, EXACT)


@pytest.mark.parametrize("num_targets", [1, 3])
def test_split_passes_in_float32_stay_within_the_kernels_tolerance(num_targets: int) -> None:
    rng = np.random.default_rng(num_targets)
    lengths = (300, 9, 131, 4, 199, 65, 127)
    check_against_references(random_rows(rng, lengths, 0.5), lengths, num_targets, F32_RTOL, f32=True)


def test_the_state_stored_before_each_chunk_is_the_state_after_the_rows_before_it() -> None:
    rng = np.random.default_rng(7)
    lengths = (130, 5, 77)
    x = random_rows(rng, lengths, 0.5)
    per_seq = chunks_of(np.asarray(x.query_start), 3)
    starts = [[c.end_count - c.rows for c in chunks] for chunks in per_seq]
    reference = recurrent_gated_delta_rule(x, starts)
    split = split_delta_rule(x, 3)
    assert split.workspace.h.shape[0] == sum(len(c) for c in per_seq) == 2 + 2 + 2 + 2
    for b, chunks in enumerate(per_seq):
        for i, chunk in enumerate(chunks):
            assert rel_l2(split.workspace.h[chunk.index], reference.saved_states[b][i]) < EXACT, (b, i)


def test_a_full_context_at_the_27b_shape_needs_11_gib_of_workspace_in_one_step() -> None:
    """Why the executor's steps bound the split path's rows: 114,812 rows in one step would take 11.4 GiB
    (w and u 2.6 GiB each, the 1,794 chunk states 5.3 GiB); 8,192 rows take 0.81 GiB."""
    def gib(rows: int) -> float:
        chunks = plan.chunk_bases((rows,), 1)[-1]
        return plan.SplitWorkspace(rows, chunks, 16, 48, 128, 128).nbytes / 2**30

    assert plan.chunk_bases((114_812,), 1)[-1] == 1794
    assert 11.4 < gib(114_812) < 11.5 and 0.81 < gib(8192) < 0.82
