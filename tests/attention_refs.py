"""float64 numpy references for the attention families (kernels_src/{rope_kv,decode_attention,prefill_attention}.cu)
and the paged-KV scenarios their tests run on.

The references compute the math of each kernel's header comment without intermediate rounding; paged
attention reads K/V through the block tables exactly as the kernels do, so a kernel that reads the wrong
page, slot or head disagrees with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ninfer_rt.exec.numpy_gated_attention import gate_output

BF16 = np.dtype(ml_dtypes.bfloat16)
PAGE = 64


def rms_normalize_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return weight.astype(np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def neox_rope_ref(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, attention_scaling: float) -> np.ndarray:
    """x [T, H, D]: dims i and i + D/2 rotate together by positions[t] * inv_freq[i]; cos/sin scaled."""
    angles = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    cos = (np.cos(angles) * attention_scaling)[:, None, :]
    sin = (np.sin(angles) * attention_scaling)[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def quantize_int8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., D] -> (int8 [..., D], scale [...]): symmetric absmax/127, scale 1 for an all-zero row."""
    absmax = np.abs(x).max(axis=-1)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0)
    return np.clip(np.rint(x / scale[..., None]), -127, 127).astype(np.int8), scale


REF_SCORE_ELEMENTS = 1 << 23  # float64 scores per row block of the reference (64 MB): bounds its memory


def paged_attention_ref(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start: np.ndarray,
    scale: float,
) -> np.ndarray:
    """q [T, Hq, D]; k/v_pages float64 [num_pages, 64, Hkv, D] -> [T, Hq, D]. Row j of a sequence with Q
    rows and L keys attends to keys [0, L - Q + j]. Blocks of rows go through batched matrix products (BLAS)
    with the keys a row does not see masked to -inf: a 131-row chunk over 30k keys takes seconds, not minutes."""
    out = np.full(q.shape, np.nan)
    n_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    n_q_heads = q.shape[1]
    group = n_q_heads // n_kv_heads  # q head h reads kv head h // group
    for seq, length in enumerate(context_lens):
        start, stop = int(query_start[seq]), int(query_start[seq + 1])
        pages = block_tables[seq, : math.ceil(length / PAGE)]
        keys = k_pages[pages].reshape(-1, n_kv_heads, head_dim)[:length].transpose(1, 2, 0)  # [Hkv, D, L]
        values = v_pages[pages].reshape(-1, n_kv_heads, head_dim)[:length].transpose(1, 0, 2)  # [Hkv, L, D]
        block = max(1, REF_SCORE_ELEMENTS // (n_q_heads * int(length)))
        for first in range(start, stop, block):
            last = min(stop, first + block)
            rows = last - first
            q_rows = q[first:last].astype(np.float64).reshape(rows, n_kv_heads, group, head_dim)
            scores = q_rows.transpose(1, 0, 2, 3).reshape(n_kv_heads, rows * group, head_dim) @ keys * scale
            visible = length - (stop - start) + np.arange(first - start, last - start) + 1  # keys row j sees
            hidden = np.repeat(np.arange(length)[None, :] >= visible[:, None], group, axis=0)  # [rows * group, L]
            scores[:, hidden] = -np.inf
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            block_out = (probs @ values).reshape(n_kv_heads, rows, group, head_dim).transpose(1, 0, 2, 3)
            out[first:last] = block_out.reshape(rows, n_q_heads, head_dim)
    return out


def gated_reference(expected: np.ndarray, gates: np.ndarray | None) -> np.ndarray:
    """[T, Hq, D] output times sigmoid(gates [T, Hq D]) as the numpy executor gates it
    (exec/numpy_gated_attention.py), or as it is without gates."""
    if gates is None:
        return expected
    return gate_output(expected.reshape(expected.shape[0], -1), gates).reshape(expected.shape)


def p_rounding_slack(q: np.ndarray, k_pages: np.ndarray, v_pages: np.ndarray, *tables: np.ndarray | float, unit: float) -> np.ndarray:
    """unit * sum_k p_k |v_k| per output element: the worst-case effect of rounding each softmax weight to a
    16-bit float of unit roundoff `unit` (bf16 2^-8, f16 2^-11) before P.V, as the prefill kernel does (its row
    sums stay f32). `tables`: paged_attention_ref's block_tables, context_lens, query_start and scale. Where the
    weighted values cancel (|out| << sum_k p_k |v_k|: few keys, large |v|) this exceeds any bound relative to
    |out|: e.g. 3 keys with v = -2.1, -2.2, 4.3 and out = -0.056 give 0.0037 of honest bf16 rounding."""
    return unit * paged_attention_ref(q, k_pages, np.abs(v_pages), *tables)


@dataclass
class PagedKV:
    """One layer's K or V pages as the kernels see them (raw) and as the reference does (float64)."""

    raw: np.ndarray  # bf16 or int8 [num_pages, 64, Hkv, D]
    scale: np.ndarray | None  # f32 [num_pages, 64, Hkv] for int8
    values: np.ndarray  # float64 [num_pages, 64, Hkv, D], NaN where no token was written


@dataclass
class Batch:
    """B sequences: Q_b new rows (the last Q_b of L_b positions) and block tables over shuffled pages."""

    query_lens: np.ndarray
    context_lens: np.ndarray
    query_start: np.ndarray
    block_tables: np.ndarray  # int32 [B, max_pages], -1 past each sequence's pages
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int32 [T]
    num_pages: int

    @property
    def num_rows(self) -> int:
        return int(self.query_start[-1])

    def slots_before_step(self) -> np.ndarray:
        """Slots of every token already cached (positions below each sequence's first new row)."""
        slots = []
        for seq, (length, queries) in enumerate(zip(self.context_lens, self.query_lens)):
            positions = np.arange(length - queries)
            slots.append(self.block_tables[seq, positions // PAGE] * PAGE + positions % PAGE)
        return np.concatenate(slots).astype(np.int64)

    def all_slots(self) -> np.ndarray:
        return np.concatenate([self.slots_before_step(), self.slot_mapping.astype(np.int64)])


def make_batch(rng: np.random.Generator, query_lens: list[int], context_lens: list[int], spare_pages: int = 3) -> Batch:
    """Pages of all sequences drawn from one shuffled pool (with spares no table uses)."""
    pages_needed = [math.ceil(length / PAGE) for length in context_lens]
    num_pages = sum(pages_needed) + spare_pages
    pool = rng.permutation(num_pages)
    tables = np.full((len(context_lens), max(pages_needed) + 1), -1, np.int32)
    used = 0
    for seq, count in enumerate(pages_needed):
        tables[seq, :count] = pool[used : used + count]
        used += count
    positions, slots = [], []
    for seq, (queries, length) in enumerate(zip(query_lens, context_lens)):
        assert 0 <= queries <= length
        pos = np.arange(length - queries, length)
        positions.append(pos)
        slots.append(tables[seq, pos // PAGE] * PAGE + pos % PAGE)
    return Batch(
        query_lens=np.asarray(query_lens, np.int32),
        context_lens=np.asarray(context_lens, np.int32),
        query_start=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
        block_tables=tables,
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        num_pages=num_pages,
    )


def make_pages(rng: np.random.Generator, num_pages: int, n_kv_heads: int, head_dim: int, kv_dtype: str, slots: np.ndarray) -> PagedKV:
    """Random K or V at `slots`; every other byte 0xFF (NaN in bf16 and in int8 scales), so a kernel that
    reads past a context or into a foreign page produces NaN."""
    shape = (num_pages * PAGE, n_kv_heads, head_dim)
    values = np.full(shape, np.nan)
    if kv_dtype == "int8":
        raw = np.full(shape, -1, np.int8)
        scale = np.full(shape[:2], np.nan, np.float32)
        raw[slots] = rng.integers(-127, 128, (len(slots), n_kv_heads, head_dim), dtype=np.int8)
        scale[slots] = (np.abs(rng.standard_normal((len(slots), n_kv_heads))) * 0.02 + 1e-3).astype(np.float32)
        values[slots] = raw[slots].astype(np.float64) * scale[slots][..., None].astype(np.float64)
        return PagedKV(raw.reshape(num_pages, PAGE, n_kv_heads, head_dim), scale.reshape(num_pages, PAGE, n_kv_heads),
                       values.reshape(num_pages, PAGE, n_kv_heads, head_dim))
    raw = np.full(shape, np.nan, BF16)
    raw[slots] = rng.standard_normal((len(slots), n_kv_heads, head_dim)).astype(BF16)
    values[slots] = raw[slots].astype(np.float64)
    return PagedKV(raw.reshape(num_pages, PAGE, n_kv_heads, head_dim), None, values.reshape(num_pages, PAGE, n_kv_heads, head_dim))


def dequantized(raw: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    values = raw.astype(np.float64)
    return values if scale is None else values * scale[..., None].astype(np.float64)


def bf16_rounded(values: np.ndarray) -> np.ndarray:
    """float64 values rounded to the nearest bf16 (ties to even), back in float64; NaN stays NaN."""
    return values.astype(np.float32).astype(BF16).astype(np.float64)


def staged_bf16(pages: PagedKV) -> np.ndarray:
    """bf16 pages as they are; int8 pages dequantized in f32 (value * scale) and rounded to bf16: what a
    kernel that stages dequantized int8 as bf16 computes with. (prefill_attention no longer does: it
    multiplies the exact int8 values and applies the scales in f32, so its reference is `values`.)"""
    if pages.scale is None:
        return pages.values
    product = pages.raw.astype(np.float32) * pages.scale[..., None]  # f32 product, rounded as on the GPU
    return product.astype(BF16).astype(np.float64)


def closeness_report(actual: np.ndarray, expected: np.ndarray, rtol: float, slack: np.ndarray | float = 0.0) -> tuple[float, str | None]:
    """(relative L2 error, None if every element is within rtol * (|e| + rms(e)) + slack else a diagnostic)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    rms = float(np.sqrt(np.mean(expected**2)))
    error = np.abs(actual - expected)
    bad = ~(error <= rtol * (np.abs(expected) + rms) + slack)  # NaN counts as bad
    rel_l2 = float(np.linalg.norm(np.nan_to_num(actual - expected, nan=1e30)) / np.linalg.norm(expected))
    if not bad.any():
        return rel_l2, None
    first = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return rel_l2, (
        f"{int(bad.sum())}/{bad.size} elements off (NaN: {int(np.isnan(actual).sum())}); rel L2 {rel_l2:.3e}; "
        f"max abs err {float(np.nanmax(error)) if not np.isnan(error).all() else float('nan'):.3e}; first bad index {tuple(int(i) for i in first)}: "
        f"got {actual[first]!r}, expected {expected[first]!r}"
    )
