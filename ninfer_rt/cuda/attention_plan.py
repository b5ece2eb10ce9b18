"""Attention geometry: the constants and kernels every attention family shares, RoPE's table and grid, and
decode's splits, row groups and workspace; attention_prefill_plan.py holds prefill's (and the widening's).

Pure functions of shapes, arch and occupancy; nothing here touches the device. The constants mirror the
`constexpr`s of kernels_src/{attention_common.cuh,decode_attention,prefill_attention,rope_kv}.cu (a test
parses the sources and checks them). attention_ops launches what these modules decide; exec/cuda_attention.py
decides it once per step.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ninfer_rt.cuda.kernels import Arg, KernelSpec
from ninfer_rt.cuda.ops import _require_positive

PAGE_SIZE = 64  # kPageSize
ROPE_HEAD_DIMS = (64, 128, 256)
DECODE_HEAD_DIMS = (64, 128, 256)
THREADS = 128  # kDecodeThreads, kPrefillThreads and rope_kv's block: 4 warps
ROPE_HEADS_PER_BLOCK = 4  # kRopeWarps: a warp per head
DECODE_ROWS_PER_BLOCK = 8  # kRowsPerBlock: q rows (queries x GQA group) per block
DECODE_MAX_ROWS = 64  # rows per (sequence, kv head) the decode path takes: 8 row groups
DECODE_MAX_QUERIES = 8  # new rows per sequence up to which decode attention is used (spec verify width)
MAX_SPLITS = 256  # kMaxSplits
MIN_PAGES_PER_SPLIT = 2  # below this a split's fixed cost outweighs the parallelism it adds
MAX_BLOCKS_PER_SM = 2048 // THREADS  # the hardware's resident-thread limit, for sizing scratch
SMEM_DEFAULT_LIMIT = 48 * 1024
BF16_BYTES = 2
F32_BYTES = 4

_ROPE_SIGNATURE = (Arg.PTR,) * 8 + (Arg.F32, Arg.PTR, Arg.PTR, Arg.PTR) + (Arg.I32,) * 5
_DECODE_SIGNATURE = (Arg.PTR,) * 8 + (Arg.I32, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32, Arg.F32, Arg.I32)
DECODE_COMBINE = KernelSpec("decode_attention", "decode_attention_combine", (Arg.PTR,) * 4 + (Arg.I32,) * 5 + (Arg.PTR, Arg.I32))


class KVVariant(enum.Enum):
    """The form of the K/V pages a kernel is instantiated for (the suffix of its name): the cache's bf16 or
    int8 pages, or int8 pages widened to f16 for one prefill step (kv_widen.cu). rope_kv and decode
    attention read the cache's pages only."""

    BF16 = "bf16"
    INT8 = "int8"
    WIDENED = "widened"


CACHE_VARIANTS = (KVVariant.BF16, KVVariant.INT8)


class Heads(Protocol):
    """Head geometry of an attention layer (model.executor.AttentionShape is one)."""

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def scale(self) -> float: ...


# -- kernels --------------------------------------------------------------------------------------------


def rope_kv_spec(head_dim: int, variant: KVVariant) -> KernelSpec:
    return KernelSpec("rope_kv", f"rope_kv_d{head_dim}_{cache_variant(variant).value}", _ROPE_SIGNATURE)


def decode_spec(head_dim: int, variant: KVVariant) -> KernelSpec:
    return KernelSpec("decode_attention", f"decode_attention_d{head_dim}_{cache_variant(variant).value}", _DECODE_SIGNATURE)


def cache_variant(variant: KVVariant) -> KVVariant:
    """`variant`, checked to be one of the cache's: only prefill kernels also read widened pages."""
    if variant not in CACHE_VARIANTS:
        raise ValueError(f"only the prefill kernels read widened pages, not {variant}")
    return variant


# -- rope -----------------------------------------------------------------------------------------------


def rope_table(inv_freq: np.ndarray, attention_scaling: float, max_pos: int) -> np.ndarray:
    """cos/sin table f32 [max_pos, 2, D/2] as rope_kv.cu reads it: row p holds cos(p * inv_freq), then
    sin(p * inv_freq), both times `attention_scaling` (YaRN's mscale; 1.0 for plain RoPE). Angles in
    float64 so large positions keep full precision before the f32 rounding."""
    inv_freq = np.asarray(inv_freq, np.float64)
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.stack([np.cos(angles), np.sin(angles)], axis=1) * attention_scaling).astype(np.float32)


def check_rotary_dim(head_dim: int, rotary_dim: int) -> None:
    """rope_kv.cu turns all of a head, or (partial RoPE) at most half of it in whole per-lane slices."""
    per_lane = head_dim // 64
    if rotary_dim == head_dim:
        return
    if not (0 < rotary_dim <= head_dim // 2 and rotary_dim % 2 == 0 and (rotary_dim // 2) % per_lane == 0):
        raise ValueError(
            f"rope_kv: rotary_dim {rotary_dim} of head_dim {head_dim}: need all of it, or an even count of at most"
            f" {head_dim // 2} whose half is a multiple of {per_lane}"
        )


def rope_grid(heads: Heads, num_tokens: int) -> tuple[int, int]:
    return (math.ceil((heads.num_heads + heads.num_kv_heads) / ROPE_HEADS_PER_BLOCK), num_tokens)


# -- decode ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodePlan:
    """A decode launch's shape: KV splits per (sequence, kv head, row group) and row groups per split."""

    num_splits: int
    row_groups: int


def decode_num_splits(
    num_seqs: int, n_kv_heads: int, sm_count: int, blocks_per_sm: int, max_context_len: int | None = None, row_groups: int = 1
) -> int:
    """KV splits per (sequence, kv head, row group) so the decode grid is one full wave: sm_count *
    blocks_per_sm resident blocks. A second, partial wave would double the time of a memory-bound kernel
    for a few blocks, so the count rounds down. With `max_context_len` no split gets fewer than
    MIN_PAGES_PER_SPLIT pages. Captured graphs call it without a context length, so the grid does not
    depend on it (the kernel divides each sequence's pages among the splits it is given; surplus splits
    exit at once)."""
    _require_positive(
        "decode_num_splits", num_seqs=num_seqs, n_kv_heads=n_kv_heads, sm_count=sm_count, blocks_per_sm=blocks_per_sm, row_groups=row_groups
    )
    splits = sm_count * blocks_per_sm // (num_seqs * n_kv_heads * row_groups)
    if max_context_len is not None:
        pages = math.ceil(max_context_len / PAGE_SIZE)
        splits = min(splits, max(1, pages // MIN_PAGES_PER_SPLIT))
    return max(1, min(splits, MAX_SPLITS))


def decode_max_queries(n_q_heads: int, n_kv_heads: int) -> int:
    """Longest per-sequence row count the decode kernel takes: DECODE_MAX_QUERIES, fewer when a GQA group
    is so wide that group * rows would exceed DECODE_MAX_ROWS."""
    group = gqa_group(n_q_heads, n_kv_heads)
    return max(1, min(DECODE_MAX_QUERIES, DECODE_MAX_ROWS // group))


def decode_lens(heads: Heads, query_lens: Sequence[int]) -> list[int]:
    """The new-row counts of the sequences decode attention takes (1..decode_max_queries rows)."""
    max_queries = decode_max_queries(heads.num_heads, heads.num_kv_heads)
    return [n for n in query_lens if 1 <= n <= max_queries]


def has_prefill(heads: Heads, query_lens: Sequence[int]) -> bool:
    """Whether a sequence has more new rows than decode attention takes (prefill attention's)."""
    return max(query_lens, default=0) > decode_max_queries(heads.num_heads, heads.num_kv_heads)


def decode_row_groups(rows: int) -> int:
    """Blocks per (split, kv head, sequence) for `rows` = queries * GQA group rows: one per 8 rows (each
    re-reads the split's K/V; verify steps only)."""
    if not 1 <= rows <= DECODE_MAX_ROWS:
        raise ValueError(f"decode attention holds 1..{DECODE_MAX_ROWS} rows per kv head, got {rows}")
    return math.ceil(rows / DECODE_ROWS_PER_BLOCK)


def decode_plan(
    heads: Heads, query_lens: Sequence[int], sm_count: int, blocks_per_sm: int, max_context_len: int | None = None
) -> DecodePlan:
    """The row groups of the step's widest decode sequence and the splits that fill one wave beside them."""
    lens = decode_lens(heads, query_lens)
    if not lens:
        raise ValueError(f"decode_attention: no sequence has 1..{decode_max_queries(heads.num_heads, heads.num_kv_heads)} new rows ({list(query_lens)})")
    row_groups = decode_row_groups(max(lens) * gqa_group(heads.num_heads, heads.num_kv_heads))
    splits = decode_num_splits(len(query_lens), heads.num_kv_heads, sm_count, blocks_per_sm, max_context_len, row_groups)
    return DecodePlan(splits, row_groups)


def decode_workspace_bytes(num_splits: int, num_seqs: int, max_queries: int, n_q_heads: int, head_dim: int) -> tuple[int, int]:
    """(acc bytes, ml bytes) of a DecodeWorkspace."""
    rows = num_splits * num_seqs * max_queries * n_q_heads
    return rows * head_dim * F32_BYTES, rows * 2 * F32_BYTES


def decode_scratch_splits(sm_count: int, n_kv_heads: int, max_seqs: int) -> int:
    """Splits (of one sequence) a decode workspace holds for any step: splits * sequences never exceeds one
    wave of the most blocks an SM can hold (or max_seqs sequences of one split each), whatever the batch
    size and kernel occupancy."""
    return max(sm_count * MAX_BLOCKS_PER_SM // n_kv_heads, max_seqs)


def gqa_group(n_q_heads: int, n_kv_heads: int) -> int:
    _require_positive("attention", n_q_heads=n_q_heads, n_kv_heads=n_kv_heads)
    if n_q_heads % n_kv_heads:
        raise ValueError(f"attention: {n_q_heads} q heads are not a multiple of {n_kv_heads} kv heads")
    return n_q_heads // n_kv_heads
