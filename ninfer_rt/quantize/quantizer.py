"""The quantizer: a float weight -> QuantizedWeight, by a scale search and, with calibration, GPTQ.

quantize() searches each group's scale (clipping, grid orientation, least-squares refit) instead of taking
absmax; given calibration statistics (`ninfer-rt quantize --calibration-text`,
quantize_checkpoint/calibration.py) it weights that search by the inputs' mean square and picks the codes by GPTQ.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ninfer_rt.quantize.format import BF16, QuantFormatError, QuantizedWeight, check_group_size, pack

# Scale search (search_scales): clip 1.0 puts a group's extreme on code 2^(bits-1) - 1 (or, flipped, on
# 1 - 2^(bits-1)); 0.6 is past every optimum measured on the tiny model's int4 weights.
CLIP_RATIOS = np.linspace(0.6, 1.0, 11)
LEAST_SQUARES_REFITS = 2
SEARCH_BLOCK_VALUES = 1 << 18  # weights per block of the scale search (1 MiB of float32: stays in cache)
# More threads stop paying off (H200 host, 16 cores, 4096x12288: 1.3 s at 4, 1.2 s at 8, 1.7 s at 16).
MAX_SEARCH_THREADS = 8


def quantize(
    weight: np.ndarray, bits: int, group_size: int, hessian: np.ndarray | None = None
) -> QuantizedWeight:
    """Groupwise quantization with searched scales (search_scales); with ``hessian`` (the mean x x^T of the
    layer's inputs, from calibration) the scales minimise the activation-weighted error and the codes are
    chosen by GPTQ (gptq_codes) instead of rounding to nearest."""
    grouped = _grouped(weight, group_size)
    importance = None if hessian is None else np.diag(hessian).reshape(1, grouped.shape[1], group_size)
    scales = search_scales(grouped, bits, importance)
    half = 1 << (bits - 1)
    if hessian is None:
        codes = np.empty(grouped.shape, np.uint8)

        def round_block(rows: slice) -> None:
            codes[rows] = _round_codes(grouped[rows], scales[rows].astype(np.float32), bits) + half

        _for_row_blocks(grouped, round_block)
        codes = codes.reshape(weight.shape)
    else:
        codes = (gptq_codes(np.asarray(weight, np.float64), scales, hessian, bits) + half).astype(np.uint8)
    return QuantizedWeight(bits, group_size, pack(codes, bits), scales)


def absmax_scales(grouped: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ's symmetric grid: scale = absmax / (2^(bits-1) - 0.5), rounded *up* to bf16, so q in
    [-2^(bits-1), 2^(bits-1) - 1] uses all 2^bits levels (absmax/7 would waste one int4 level) and
    |W - dequantize| <= scale / 2 everywhere (no value is clipped by more than rounding would move it)."""
    half = 1 << (bits - 1)
    return _bf16_round_up(np.abs(grouped).max(axis=-1) / (half - 0.5))


def search_scales(grouped: np.ndarray, bits: int, importance: np.ndarray | None = None) -> np.ndarray:
    """bf16 scales [out, groups] minimising each group's (importance-weighted) squared reconstruction error
    over candidates: absmax_scales; +-clip * absmax / (2^(bits-1) - 1) for clip in CLIP_RATIOS (clipping the
    few largest weights buys a finer step for all the others; a negative scale flips the grid so the group's
    extreme may land on the code -2^(bits-1), which has no positive twin); then least-squares refits of the
    best scale for its codes. The absmax candidate is kept unless another is strictly better, so no group's
    error exceeds plain absmax's. ``importance`` [1, groups, group_size] weights each input (mean x^2).

    Groups are independent: blocks of rows (SEARCH_BLOCK_VALUES, cache-sized) are searched on
    search_threads() threads (numpy's loops release the GIL), each with the same float32 operations in the
    same order as a whole-matrix search, so the result does not depend on the blocking or thread count."""
    weights = None if importance is None else np.asarray(importance, np.float32)
    out = np.empty(grouped.shape[:2], BF16)

    def search(rows: slice) -> None:
        out[rows] = _search_block(grouped[rows], bits, weights)

    _for_row_blocks(grouped, search)
    return out


def search_threads() -> int:
    """Threads for the scale search: the CPUs this process may run on, at most MAX_SEARCH_THREADS
    (NINFER_QUANT_THREADS overrides)."""
    configured = os.environ.get("NINFER_QUANT_THREADS")
    if configured:
        return max(1, int(configured))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, MAX_SEARCH_THREADS)


def _for_row_blocks(grouped: np.ndarray, work: Callable[[slice], None]) -> None:
    """work(rows) over blocks of about SEARCH_BLOCK_VALUES weights of grouped [out, groups, group_size], on
    search_threads() threads."""
    rows_per_block = max(1, SEARCH_BLOCK_VALUES // max(1, grouped.shape[1] * grouped.shape[2]))
    blocks = [slice(start, start + rows_per_block) for start in range(0, grouped.shape[0], rows_per_block)]
    threads = min(search_threads(), len(blocks))
    if threads <= 1:
        for rows in blocks:
            work(rows)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, blocks))


def _search_block(grouped: np.ndarray, bits: int, weights: np.ndarray | None) -> np.ndarray:
    """search_scales on a block of rows; weights None means every input weighs 1."""
    scratch = [np.empty(grouped.shape, np.float32) for _ in range(3)]
    best = absmax_scales(grouped, bits).astype(np.float32)
    best_error = _group_error(grouped, best, bits, weights, scratch)
    top = np.abs(grouped).max(axis=-1) / ((1 << (bits - 1)) - 1)
    candidates = (sign * clip * top for clip in CLIP_RATIOS for sign in (1.0, -1.0))
    for candidate in (*candidates, *(None,) * LEAST_SQUARES_REFITS):
        if candidate is None:  # refit: the scale that best reproduces the group with the current codes
            candidate = _least_squares_scale(grouped, best, bits, weights)
        candidate = candidate.astype(BF16).astype(np.float32)
        error = _group_error(grouped, candidate, bits, weights, scratch)
        better = error < best_error
        best = np.where(better, candidate, best)
        best_error = np.where(better, error, best_error)
    return best.astype(BF16)


def _grouped(weight: np.ndarray, group_size: int) -> np.ndarray:
    """[out, in] float32 -> [out, in / group_size, group_size], after checking the group size fits."""
    check_group_size(group_size)
    w = np.asarray(weight, dtype=np.float32)
    out, in_features = w.shape
    if in_features % group_size:
        raise QuantFormatError(f"input dimension {in_features} is not a multiple of the group size {group_size}")
    return w.reshape(out, in_features // group_size, group_size)


def _round_codes(grouped: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """Signed codes nearest to grouped / scales, clipped to the grid; zero where the scale is 0."""
    half = 1 << (bits - 1)
    safe = np.where(scales != 0, scales, 1.0)[..., None]
    return np.clip(np.rint(grouped / safe), -half, half - 1)


def _group_error(
    grouped: np.ndarray, scales: np.ndarray, bits: int, weights: np.ndarray | None,
    scratch: list[np.ndarray] | None = None,
) -> np.ndarray:
    """Each group's sum of weights * (grouped - q * scale)^2, q = _round_codes: the values of the plain
    expression (weights * residual * residual).sum(-1), computed in place in ``scratch`` (three float32
    arrays of grouped's shape) with every scale spread over its group first (numpy's broadcast loops over
    128-value rows are several times slower than flat ones)."""
    residual, spread, safe = scratch if scratch is not None else [np.empty(grouped.shape, np.float32) for _ in range(3)]
    half = np.float32(1 << (bits - 1))
    np.copyto(spread, scales[..., None])
    if (scales == 0).any():
        np.copyto(safe, np.where(scales != 0, scales, 1.0)[..., None])
    else:
        safe = spread
    np.divide(grouped, safe, out=residual)
    np.rint(residual, out=residual)
    np.clip(residual, -half, half - 1, out=residual)
    np.multiply(residual, spread, out=residual)
    np.subtract(grouped, residual, out=residual)
    if weights is not None:
        np.multiply(weights, residual, out=spread)
        np.multiply(spread, residual, out=residual)
        return residual.sum(axis=-1)
    np.multiply(residual, residual, out=residual)  # 1 * r * r == r * r exactly
    return residual.sum(axis=-1)


def _least_squares_scale(grouped: np.ndarray, scales: np.ndarray, bits: int, weights: np.ndarray | None) -> np.ndarray:
    q = _round_codes(grouped, scales, bits)
    if weights is None:
        num, den = (grouped * q).sum(axis=-1), (q * q).sum(axis=-1)
    else:
        num, den = (weights * grouped * q).sum(axis=-1), (weights * q * q).sum(axis=-1)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), scales)


def gptq_codes(
    weight: np.ndarray, scales: np.ndarray, hessian: np.ndarray, bits: int, damp: float = 0.1, block: int = 128
) -> np.ndarray:
    """Signed codes [out, in] for fixed ``scales`` chosen by GPTQ (Frantar et al. 2022): inputs are rounded
    in order and each rounding error is pushed onto the inputs not yet rounded, through the inverse of
    ``hessian`` (mean x x^T), so the layer's *outputs* on the calibration inputs stay close rather than each
    weight. ``damp`` (a fraction of the mean diagonal) keeps the inverse well conditioned; ``block`` columns
    are updated lazily together (the GPTQ paper's batching: same result, BLAS-sized updates)."""
    w = weight.copy()
    out, in_features = w.shape
    half = 1 << (bits - 1)
    step = np.repeat(scales.astype(np.float64), in_features // scales.shape[1], axis=1)
    h = np.array(hessian, dtype=np.float64)
    dead = np.diag(h) == 0  # inputs never active: their weights cannot matter, so they absorb nothing
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(in_features)
    inverse = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky factor of H^-1, as in GPTQ
    codes = np.zeros((out, in_features))
    for start in range(0, in_features, block):
        stop = min(start + block, in_features)
        errors = _gptq_block(w[:, start:stop], step[:, start:stop], inverse[start:stop, start:stop], half, codes[:, start:stop])
        w[:, stop:] -= errors @ inverse[start:stop, stop:]
    return codes


def _gptq_block(w: np.ndarray, step: np.ndarray, inverse: np.ndarray, half: int, codes: np.ndarray) -> np.ndarray:
    """Rounds the block's columns in order into ``codes``, compensating within the block; returns the
    scaled errors the caller applies to the later blocks."""
    errors = np.zeros_like(w)
    for i in range(w.shape[1]):
        safe = np.where(step[:, i] != 0, step[:, i], 1.0)
        codes[:, i] = np.clip(np.rint(w[:, i] / safe), -half, half - 1)
        errors[:, i] = (w[:, i] - codes[:, i] * step[:, i]) / inverse[i, i]
        w[:, i:] -= np.outer(errors[:, i], inverse[i, i:])
    return errors


def _bf16_round_up(values: np.ndarray) -> np.ndarray:
    """The smallest bf16 >= each (non-negative, finite) value."""
    rounded = values.astype(BF16)
    low = rounded.astype(np.float32) < values
    bits = rounded.view(np.uint16)
    bits[low] += 1  # the next bf16 up, for positive values
    return rounded
