"""attention_plan's and attention_prefill_plan's constants are the kernels' own: each is read from the
`constexpr int` that defines it in kernels_src, so a kernel change that is not mirrored in the host-side
geometry fails here, on the CPU."""

from __future__ import annotations

import re

import pytest

from kernel_source import KERNELS, constexpr_int

from ninfer_rt.cuda import attention_plan as plan
from ninfer_rt.cuda import attention_prefill_plan as prefill_plan

# (source file, constexpr name, the Python constant it must equal)
MIRRORED = [
    ("attention_common.cuh", "kPageSize", plan.PAGE_SIZE),
    ("decode_attention.cu", "kDecodeThreads", plan.THREADS),
    ("decode_attention.cu", "kRowsPerBlock", plan.DECODE_ROWS_PER_BLOCK),
    ("decode_attention.cu", "kMaxSplits", plan.MAX_SPLITS),
    ("prefill_attention.cu", "kPrefillThreads", plan.THREADS),
    ("prefill_attention.cu", "kCombineRows", prefill_plan.PREFILL_COMBINE_ROWS),
    ("prefill_common.cuh", "kFlashRows", prefill_plan.PREFILL_TILE_ROWS),
    ("prefill_common.cuh", "kFlashRowsD256", prefill_plan.PREFILL_TILE_ROWS_D256),
    ("prefill_attention_sm90.cu", "kBlockThreads", prefill_plan.PREFILL_SM90_BF16_THREADS),
    ("prefill_attention_sm90_int8.cu", "kBlockThreads", prefill_plan.PREFILL_SM90_INT8_THREADS),
    ("prefill_attention_sm90_int8.cu", "kStages", prefill_plan.PREFILL_SM90_INT8_STAGES),
    ("prefill_attention_sm90_int8.cu", "kLookahead", prefill_plan.PREFILL_SM90_INT8_LOOKAHEAD),
    ("rope_kv.cu", "kRopeWarps", plan.ROPE_HEADS_PER_BLOCK),
    ("kv_widen.cu", "kWidenThreads", prefill_plan.WIDEN_THREADS),
]


@pytest.mark.parametrize(("source", "name", "value"), MIRRORED, ids=[f"{s}:{n}" for s, n, _ in MIRRORED])
def test_python_constant_equals_the_kernel_constexpr(source: str, name: str, value: int) -> None:
    assert constexpr_int(source, name) == value


def test_rope_kv_runs_a_warp_per_head_in_the_shared_block_size() -> None:
    # rope_kv.cu launches kRopeWarps warps per block: the block size the wrapper uses
    assert constexpr_int("rope_kv.cu", "kRopeWarps") * 32 == plan.THREADS


def test_the_prefill_key_tile_is_one_page() -> None:
    text = (KERNELS / "prefill_common.cuh").read_text()
    assert re.search(r"^constexpr int kKeyTile = kPageSize;", text, flags=re.MULTILINE)


def test_the_prefill_tile_rows_per_head_dim_are_the_kernels() -> None:
    # prefill_attention.cu: kTileRows<D> is kFlashRowsD256 at D = 256, else kFlashRows; so is mma_sync_tile_rows.
    # The combines: one per head dim at those rows, and one of kFlashRows at 256 (the sm_90a kernel's tiles).
    text = (KERNELS / "prefill_attention.cu").read_text()
    assert re.search(r"^constexpr int kTileRows = D == 256 \? kFlashRowsD256 : kFlashRows;", text, flags=re.MULTILINE)
    assert [prefill_plan.mma_sync_tile_rows(d) for d in prefill_plan.PREFILL_HEAD_DIMS] == [128, 128, 64]
    combines = re.findall(r"^PREFILL_COMBINE\((\w+), (\d+), (kTileRows<\d+>|kFlashRows)\)", text, flags=re.MULTILINE)
    assert combines == [
        *((prefill_plan.prefill_combine_spec(d, prefill_plan.mma_sync_tile_rows(d)).name, str(d), f"kTileRows<{d}>")
          for d in prefill_plan.PREFILL_HEAD_DIMS),
        *((prefill_plan.prefill_combine_spec(d, prefill_plan.PREFILL_TILE_ROWS).name, str(d), "kFlashRows")
          for d in prefill_plan.PREFILL_SM90_HEAD_DIMS if prefill_plan.mma_sync_tile_rows(d) != prefill_plan.PREFILL_TILE_ROWS),
    ]


@pytest.mark.parametrize(
    ("source", "macro", "dims"),
    [
        ("rope_kv.cu", "ROPE_KV_KERNEL", plan.ROPE_HEAD_DIMS),
        ("decode_attention.cu", "DECODE_KERNEL", plan.DECODE_HEAD_DIMS),
        ("prefill_attention.cu", "PREFILL_KERNEL", prefill_plan.PREFILL_HEAD_DIMS),
        ("prefill_attention_sm90.cu", "PREFILL_SM90_KERNEL", prefill_plan.PREFILL_SM90_HEAD_DIMS),
    ],
)
def test_head_dims_are_the_instantiated_ones(source: str, macro: str, dims: tuple[int, ...]) -> None:
    text = (KERNELS / source).read_text()
    instantiated = {int(d) for d in re.findall(rf"^{macro}\((?:[a-z_0-9]+, [a-z_0-9]+, )?(\d+),", text, flags=re.MULTILINE)}
    assert instantiated == set(dims)
