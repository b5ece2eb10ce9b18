"""tools/profile_decode.py's accounting: a step's GPU ops become marginal times that add up to the step,
with programmatic dependent launch's overlapping durations counted once."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from profile_decode import GpuOp, kernel_totals, label_step, split_steps, summarize  # noqa: E402 -- lives in tools/

from ninfer_rt.model.shapes import SHAPES  # noqa: E402

LAYER = ["rmsnorm", "gemv_bf16_b1", "rope", "attention", "gemv_bf16_b1", "rmsnorm", "gemv_swiglu_bf16_b1", "gemv_bf16_b1"]
HEAD = ["rmsnorm", "gemv_f32_b1", "argmax"]


def timeline(layers: int, steps: int, gap: float = 5.0, early: float = 2.0) -> list[GpuOp]:
    """Each op lasts 10 us after its predecessor ends and starts `early` us before that (as with PDL)."""
    ops, clock = [], 0.0
    for _ in range(steps):
        for name in ["gather"] + LAYER * layers + HEAD:
            ops.append(GpuOp(name, clock - early, clock + 10.0))
            clock += 10.0
        clock += gap
    return ops


def by_label(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {str(r["kernel"]): r for r in rows}


def test_marginal_times_add_up_to_the_step_and_overlap_is_counted_once() -> None:
    rows = summarize(split_steps(timeline(2, 3), 3), SHAPES["qwen3-8b"], 2, "bf16", 4.0e12)
    ops_per_step = 1 + len(LAYER) * 2 + len(HEAD)
    period = 10.0 * ops_per_step + 5.0  # the timeline repeats every period: the ops, then the gap
    assert abs(sum(r["ms_per_step"] for r in rows) * 1e3 - period) < 1e-9
    named = by_label(rows)
    assert named["attention"]["marginal_us"] == 10.0 and named["attention"]["duration_us"] == 12.0
    assert named["(between steps)"]["marginal_us"] == 5.0 - 2.0


def test_gemvs_are_named_by_their_place_in_the_layer_and_the_lm_head() -> None:
    step = split_steps(timeline(2, 1), 1)[0]
    labels = label_step(step, layers=2)
    gemvs = [label for label in labels if label.startswith("gemv")]
    assert gemvs == [
        "gemv_bf16_b1 [qkv]", "gemv_bf16_b1 [o_proj]", "gemv_swiglu_bf16_b1 [gate_up]", "gemv_bf16_b1 [down]",
        "gemv_bf16_b1 [qkv]", "gemv_bf16_b1 [o_proj]", "gemv_swiglu_bf16_b1 [gate_up]", "gemv_bf16_b1 [down]",
        "gemv_f32_b1 [lm_head]",
    ]
    assert labels[1] == "rmsnorm #0" and labels[6] == "rmsnorm #1"


def test_a_gemv_row_reports_its_weight_bytes_against_the_bandwidth() -> None:
    named = by_label(summarize(split_steps(timeline(2, 2), 2), SHAPES["qwen3-8b"], 2, "int4", 4.0e12))
    down = named["gemv_bf16_b1 [down]"]
    expected_bytes = 4096 * 12288 // 2 + 4096 * (12288 // 128) * 2  # int4 codes + bf16 group scales
    assert down["weight_MB"] * 1e6 == expected_bytes
    assert abs(down["roofline_fraction"] - expected_bytes / 10e-6 / 4.0e12) < 1e-12


def test_a_timeline_that_does_not_split_into_whole_steps_is_refused() -> None:
    ops = timeline(1, 2)[:-1]
    try:
        split_steps(ops, 2)
    except SystemExit as stop:
        assert "incomplete" in str(stop)
    else:
        raise AssertionError("a partial timeline was split")


def test_a_hybrid_s_rows_are_by_kernel_name_alone() -> None:
    # its layers differ (linear attention, full attention), so places in "the" layer mean nothing
    rows = summarize(split_steps(timeline(2, 2), 2), SHAPES["qwen3.6-27b"], 2, "int4", 4.0e12, hybrid=True)
    named = by_label(rows)
    assert named["gemv_bf16_b1"]["per_step"] == 6 and named["rmsnorm"]["per_step"] == 5
    assert all(r["weight_MB"] == 0.0 for r in rows)
    assert abs(sum(r["ms_per_step"] for r in rows) * 1e3 - (10.0 * (1 + 2 * len(LAYER) + len(HEAD)) + 5.0)) < 1e-9


def test_a_turns_kernels_add_up_to_the_time_the_gpu_was_busy_and_idle_gaps_count_for_none() -> None:
    ops = [
        GpuOp("gemm", 0.0, 100.0),
        GpuOp("attention", 90.0, 400.0),  # launched early (PDL): its first 10 us overlap the GEMM
        GpuOp("gemm", 1400.0, 1500.0),  # 1 ms of host time before it: the GPU idle
        GpuOp("copy", 1450.0, 1460.0),  # wholly inside the GEMM: no marginal time
    ]
    busy_ms, rows = kernel_totals(ops)
    assert abs(busy_ms - (100.0 + 300.0 + 100.0) / 1e3) < 1e-12
    named = by_label(rows)
    assert [r["kernel"] for r in rows] == ["attention", "gemm", "copy"]  # heaviest first
    assert named["gemm"]["launches"] == 2 and abs(named["gemm"]["busy_ms"] - 0.2) < 1e-12
    assert abs(named["attention"]["busy_ms"] - 0.3) < 1e-12 and abs(named["attention"]["duration_ms"] - 0.31) < 1e-12
    assert named["copy"]["busy_ms"] == 0.0 and abs(named["copy"]["duration_ms"] - 0.01) < 1e-12
