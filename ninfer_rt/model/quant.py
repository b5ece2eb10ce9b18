"""Groupwise integer weights: the project's layout, its numpy reference, and GPTQ/AWQ import.

The layout (docs/ARCHITECTURE.md "Groupwise-int weights"; kernels_src/gemv_quant.cu reads it): a linear
weight W [out, in] is stored as
  ``<name>.qweight`` uint8 [out, in * bits / 8]: codes u = q + 2^(bits-1) (offset binary), row-major along
      the input. int4: byte j of a row holds input 2j in its low nibble and input 2j+1 in its high nibble.
  ``<name>.scales`` bf16 [out, in / group_size]
and W[o, i] = (u[o, i] - 2^(bits-1)) * scales[o, i // group_size]. Symmetric: no zero points. Offset binary
makes GPTQ's symmetric codes (zero point 8) the stored codes unchanged, and lets the GPU build floats
from codes with a single OR (see gemv_quant.cu). A scale may be negative: the grid then runs from
+2^(bits-1) steps down to -(2^(bits-1) - 1), which quantize() uses when a group's extreme is positive.

quantize() searches each group's scale (clipping, grid orientation, least-squares refit) instead of taking
absmax; given calibration statistics (`ninfer-rt quantize --calibration-text`) it weights that search by
the inputs' mean square and picks the codes by GPTQ.

On the GPU the codes and scales are rearranged once, at load time (device_layout(), LAYOUT_OCTETS): rows in
octets of 8, each row's inputs in 16-byte chunks of 8-input runs ordered so that the decode GEMV's
tensor-core fragments come straight out of a load (kernels_src/gemv_quant.cu documents it). concat_rows(),
which the CUDA executor calls on every quantized weight it uploads, returns that layout; dequantize()
reads either.

Imported checkpoints are converted when loaded: GPTQ (4-bit, sym, no act-order) into int4 as is; AWQ GEMM
4-bit into int4 when every zero point is 8, otherwise exactly into int8 (q - zero lies in [-15, 15], which
int4 symmetric cannot hold; int8 keeps the weights bit-exact at twice the bytes). Scales become bf16.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
QUANT_METHOD = "ninfer-groupwise"
SUPPORTED_BITS = (4, 8)
MIN_GROUP_SIZE = 32  # one 16-byte int4 chunk of the GEMV; groups are whole chunks
# AutoAWQ's GEMM packing puts output column ORDER[i] of each 8 in nibble i; REVERSE undoes it.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# Scale search (search_scales): clip 1.0 puts a group's extreme on code 2^(bits-1) - 1 (or, flipped, on
# 1 - 2^(bits-1)); 0.6 is past every optimum measured on the tiny model's int4 weights.
CLIP_RATIOS = np.linspace(0.6, 1.0, 11)
LEAST_SQUARES_REFITS = 2
SEARCH_BLOCK_VALUES = 1 << 18  # weights per block of the scale search (1 MiB of float32: stays in cache)
# More threads stop paying off (H200 host, 16 cores, 4096x12288: 1.3 s at 4, 1.2 s at 8, 1.7 s at 16).
MAX_SEARCH_THREADS = 8
LAYOUT_DOC = (
    "<name>.qweight uint8 [out, in*bits/8], row-major along in; codes u = q + 2^(bits-1); int4: byte j holds "
    "in-index 2j (low nibble) and 2j+1 (high nibble). <name>.scales bf16 [out, in/group_size]. "
    "W[o, i] = (u[o, i] - 2^(bits-1)) * scales[o, i // group_size]; symmetric, no zero points."
)

Shape = tuple[int, ...]

# Layouts of QuantizedWeight.qweight / .scales (module docstring): the checkpoint's, and the GPU GEMV's.
LAYOUT_ROWS = "rows"  # qweight uint8 [out, in * bits / 8], scales bf16 [out, in / group_size]
LAYOUT_OCTETS = "octets"  # qweight uint8 [octets, in / column_inputs, 32, 16], scales bf16 [octets, in / group_size, 8]
OCTET_ROWS = 8  # rows per octet; a GEMV tile is two octets (the 16 rows of an m16n8k16 mma)
RUN_INPUTS = 8  # inputs per run: one 16-byte load of bf16 x, one lane's share of two mmas
LANES = 32
# int4 run i (0..7) -> nibble of its word: (word >> 4s) & 0x000F000F is then the pair (i_2s, i_2s+1).
INT4_RUN_NIBBLE = np.array([0, 4, 1, 5, 2, 6, 3, 7])
_NIBBLE_INPUT = np.argsort(INT4_RUN_NIBBLE)  # nibble n of a run's word holds input _NIBBLE_INPUT[n]
_INT4_LOW_NIBBLES, _INT4_HIGH_NIBBLES = _NIBBLE_INPUT[0::2], _NIBBLE_INPUT[1::2]
# int8 run: byte b of the run's 8 bytes holds input INT8_RUN_ORDER[b]; a word's halves are then (i0, i1).
INT8_RUN_ORDER = np.array([0, 2, 1, 3, 4, 6, 5, 7])


class QuantFormatError(ValueError):
    """A quantized checkpoint (or quantization request) ninfer-rt cannot represent; one-line message."""


def column_inputs(bits: int) -> int:
    """Inputs per column of the octet layout: 4 lanes x one 16-byte chunk (int4: 128, int8: 64)."""
    return 4 * (128 // bits)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [out, in] in the project's groupwise layout (module docstring): LAYOUT_ROWS as
    checkpoints store it, or LAYOUT_OCTETS as the GPU reads it (``out_features`` then gives the rows the
    padded octets hold)."""

    bits: int
    group_size: int
    qweight: np.ndarray  # LAYOUT_ROWS: uint8 [out, in * bits / 8]
    scales: np.ndarray  # LAYOUT_ROWS: bf16 [out, in / group_size]
    layout: str = LAYOUT_ROWS
    out_features: int = 0  # LAYOUT_OCTETS only

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise QuantFormatError(f"{self.bits}-bit weights are not supported (only {SUPPORTED_BITS})")
        if self.qweight.dtype != np.uint8 or self.scales.dtype != BF16:
            raise QuantFormatError(f"qweight must be uint8 and scales bf16, got {self.qweight.dtype}, {self.scales.dtype}")
        out, in_features = self.shape
        if self.layout == LAYOUT_OCTETS:
            octets = self.qweight.shape[0]
            if (
                self.qweight.ndim != 4 or self.qweight.shape[2:] != (LANES, 16) or octets % 2
                or not 0 < out <= octets * OCTET_ROWS
                or self.scales.shape != (octets, in_features // self.group_size, OCTET_ROWS) or in_features % self.group_size
            ):
                raise QuantFormatError(
                    f"octet-layout arrays {list(self.qweight.shape)} / {list(self.scales.shape)} do not fit a "
                    f"[{out}, {in_features}] weight in groups of {self.group_size}"
                )
            return
        if self.layout != LAYOUT_ROWS:
            raise QuantFormatError(f"unknown layout {self.layout!r}")
        if self.scales.shape != (out, in_features // self.group_size) or in_features % self.group_size:
            raise QuantFormatError(
                f"scales {list(self.scales.shape)} do not fit a [{out}, {in_features}] weight in groups of {self.group_size}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == LAYOUT_OCTETS:
            return self.out_features, self.qweight.shape[1] * column_inputs(self.bits)
        return self.qweight.shape[0], self.qweight.shape[1] * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


Linear = np.ndarray | QuantizedWeight


def check_group_size(group_size: int) -> None:
    if group_size < MIN_GROUP_SIZE or group_size & (group_size - 1):
        raise QuantFormatError(f"group size {group_size} is not supported (a power of two >= {MIN_GROUP_SIZE})")


# -- codes and packing ------------------------------------------------------------------------------------


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [out, in] (0..2^bits-1) -> qweight uint8 [out, in * bits / 8]."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))


def unpack(qweight: np.ndarray, bits: int) -> np.ndarray:
    """qweight uint8 -> unsigned codes uint8 [out, in]."""
    if bits == 8:
        return np.asarray(qweight, dtype=np.uint8)
    codes = np.empty((qweight.shape[0], qweight.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = qweight & 0xF
    codes[:, 1::2] = qweight >> 4
    return codes


def signed(codes: np.ndarray, bits: int) -> np.ndarray:
    return codes.astype(np.int16) - (1 << (bits - 1))


# -- reference quantize / dequantize ----------------------------------------------------------------------


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


def dequantize(weight: QuantizedWeight, dtype: type = np.float32) -> np.ndarray:
    """W [out, in] in ``dtype`` (exact for float32 and wider: q and bf16 scales multiply exactly)."""
    weight = rows_layout(weight)
    out, in_features = weight.shape
    q = signed(unpack(weight.qweight, weight.bits), weight.bits).astype(dtype)
    scales = np.repeat(weight.scales.astype(dtype), weight.group_size, axis=1)
    return (q * scales).reshape(out, in_features)


def dense(part: Linear, dtype: type) -> np.ndarray:
    """A checkpoint array or a quantized weight as a dense array of ``dtype``."""
    return dequantize(part, dtype) if isinstance(part, QuantizedWeight) else np.asarray(part, dtype=dtype)


def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stack quantized weights along the output dimension (fused qkv / gate_up) into one weight in the GPU
    layout (device_layout: what the CUDA executor uploads). Parts of different widths are widened to the
    widest exactly (an int4 code re-centred as int8)."""
    return device_layout(stack_rows(parts))


def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """concat_rows in the checkpoint layout (LAYOUT_ROWS)."""
    parts = [rows_layout(p) for p in parts]
    group_sizes = {p.group_size for p in parts}
    if len(group_sizes) != 1:
        raise QuantFormatError(f"cannot fuse weights with different group sizes {sorted(group_sizes)}")
    bits = max(p.bits for p in parts)
    qweights = [p.qweight if p.bits == bits else _widen(p.qweight, p.bits, bits) for p in parts]
    return QuantizedWeight(
        bits, parts[0].group_size, np.concatenate(qweights, axis=0), np.concatenate([p.scales for p in parts], axis=0)
    )


# -- the GPU layout ---------------------------------------------------------------------------------------


def device_layout(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight in LAYOUT_OCTETS (kernels_src/gemv_quant.cu): rows padded with q = 0, scale 0 rows to an
    even number of octets; chunk (o, c, lane 4g + t) holds row 8o + g's runs j of inputs
    c * column_inputs + 32j + 8t + i, int4 nibbles in INT4_RUN_NIBBLE order, int8 bytes in INT8_RUN_ORDER.
    Needs in_features % column_inputs(bits) == 0 (the GPU GEMV's column)."""
    if weight.layout == LAYOUT_OCTETS:
        return weight
    bits, (out, in_features) = weight.bits, weight.shape
    column = column_inputs(bits)
    if in_features % column:
        raise QuantFormatError(f"the GPU layout needs in_features % {column} == 0 for int{bits}, got {in_features}")
    octets = -(-out // OCTET_ROWS)
    octets += octets % 2
    half = 1 << (bits - 1)
    codes = np.full((octets * OCTET_ROWS, in_features), half, np.uint8)
    codes[:out] = unpack(weight.qweight, bits)
    runs = 128 // bits // RUN_INPUTS
    # [octet, g, column, run j, t, i] -> [octet, column, g, t, j, i]: a chunk is (g, t)'s runs, in order.
    runs_of = codes.reshape(octets, OCTET_ROWS, in_features // column, runs, 4, RUN_INPUTS).transpose(0, 2, 1, 4, 3, 5)
    if bits == 4:  # byte b of a run's word: nibbles 2b (low) and 2b + 1 (high)
        chunks = runs_of[..., _INT4_LOW_NIBBLES] | (runs_of[..., _INT4_HIGH_NIBBLES] << 4)
    else:
        chunks = np.ascontiguousarray(runs_of[..., INT8_RUN_ORDER])
    qweight = chunks.reshape(octets, in_features // column, LANES, 16)
    scales = np.zeros((octets * OCTET_ROWS, weight.scales.shape[1]), BF16)
    scales[:out] = weight.scales
    scales = np.ascontiguousarray(scales.reshape(octets, OCTET_ROWS, -1).transpose(0, 2, 1))
    return QuantizedWeight(bits, weight.group_size, qweight, scales, LAYOUT_OCTETS, out)


def rows_layout(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight in LAYOUT_ROWS (the checkpoint's): device_layout's inverse."""
    if weight.layout == LAYOUT_ROWS:
        return weight
    bits, (out, in_features) = weight.bits, weight.shape
    octets, columns = weight.qweight.shape[:2]
    runs = 128 // bits // RUN_INPUTS
    if bits == 4:
        chunks = weight.qweight.reshape(octets, columns, OCTET_ROWS, 4, runs, 4)
        runs_of = np.empty((octets, columns, OCTET_ROWS, 4, runs, RUN_INPUTS), np.uint8)
        runs_of[..., _INT4_LOW_NIBBLES] = chunks & 0xF
        runs_of[..., _INT4_HIGH_NIBBLES] = chunks >> 4
    else:
        runs_of = np.empty((octets, columns, OCTET_ROWS, 4, runs, RUN_INPUTS), np.uint8)
        runs_of[..., INT8_RUN_ORDER] = weight.qweight.reshape(octets, columns, OCTET_ROWS, 4, runs, RUN_INPUTS)
    codes = runs_of.transpose(0, 2, 1, 4, 3, 5).reshape(octets * OCTET_ROWS, in_features)[:out]
    scales = weight.scales.transpose(0, 2, 1).reshape(octets * OCTET_ROWS, -1)[:out]
    return QuantizedWeight(bits, weight.group_size, pack(codes, bits), np.ascontiguousarray(scales))


def _widen(qweight: np.ndarray, bits: int, to_bits: int) -> np.ndarray:
    q = signed(unpack(qweight, bits), bits)
    return pack((q + (1 << (to_bits - 1))).astype(np.uint8), to_bits)


# -- GPTQ / AWQ ------------------------------------------------------------------------------------------


def _unpack_int32_nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 8 nibbles (nibble p = bits 4p..4p+3), expanded along ``axis`` in nibble order."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    nibbles = ((words[..., None] >> shifts) & 0xF).astype(np.uint8)  # [..., 8] after the packed axis
    if axis == 0:  # [rows/8, cols, 8] -> [rows, cols]
        return nibbles.transpose(0, 2, 1).reshape(words.shape[0] * 8, words.shape[1])
    return nibbles.reshape(words.shape[0], words.shape[1] * 8)


def from_gptq(
    qweight: np.ndarray,
    qzeros: np.ndarray,
    scales: np.ndarray,
    g_idx: np.ndarray | None,
    group_size: int,
    zero_stored_minus_one: bool,
) -> QuantizedWeight:
    """GPTQ 4-bit symmetric -> int4. qweight int32 [in/8, out] packs 8 consecutive inputs per word (input
    8r+p in nibble p); qzeros int32 [in/group, out/8] packs 8 consecutive outputs; scales fp16
    [in/group, out]; W = scale * (q - zero). The original GPTQ format stores zero - 1
    (``zero_stored_minus_one``); gptq_v2 stores the zero itself. Symmetric means every zero is 8."""
    codes = _unpack_int32_nibbles(qweight, axis=0)  # [in, out], 0..15
    in_features = codes.shape[0]
    zeros = _unpack_int32_nibbles(qzeros, axis=1).astype(np.int16) + int(zero_stored_minus_one)
    if not np.all(zeros == 8):
        found = sorted(set(np.unique(zeros).tolist()))[:4]
        raise QuantFormatError(f"GPTQ zero points are not all 8 (found {found}): asymmetric GPTQ is not supported")
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(in_features) // group_size):
        raise QuantFormatError("GPTQ g_idx is not sequential (act-order / desc_act checkpoints are not supported)")
    return QuantizedWeight(4, group_size, pack(codes.T, 4), np.ascontiguousarray(scales.T).astype(BF16))


def from_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int) -> QuantizedWeight:
    """AWQ GEMM 4-bit -> int4 (every zero 8) or int8 (exact). qweight int32 [in, out/8] and qzeros int32
    [in/group, out/8] pack 8 outputs per word in AWQ_ORDER; scales fp16 [in/group, out]; W = scale * (q - zero)."""
    codes = _awq_unpack(qweight)  # [in, out]
    zeros = _awq_unpack(qzeros)  # [in/group, out]
    scales_t = np.ascontiguousarray(scales.T).astype(BF16)
    if np.all(zeros == 8):
        return QuantizedWeight(4, group_size, pack(codes.T, 4), scales_t)
    q = codes.astype(np.int16) - np.repeat(zeros.astype(np.int16), group_size, axis=0)
    return QuantizedWeight(8, group_size, pack((q.T + 128).astype(np.uint8), 8), scales_t)


def _awq_unpack(packed: np.ndarray) -> np.ndarray:
    nibbles = _unpack_int32_nibbles(packed, axis=1)
    columns = np.arange(nibbles.shape[1]).reshape(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    return nibbles[:, columns]


# -- checkpoints ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's ``quantization_config`` says, validated."""

    method: str  # QUANT_METHOD | "gptq" | "awq"
    bits: int
    group_size: int
    zero_stored_minus_one: bool = False  # GPTQ's original format

    def tensor_shapes(self, out: int, in_features: int) -> dict[str, Shape]:
        """The stored tensors (suffix -> shape) of one quantized [out, in] linear weight."""
        groups = in_features // self.group_size
        if self.method == QUANT_METHOD:
            return {"qweight": (out, in_features * self.bits // 8), "scales": (out, groups)}
        if self.method == "gptq":
            return {"qweight": (in_features // 8, out), "qzeros": (groups, out // 8), "scales": (groups, out)}
        return {"qweight": (in_features, out // 8), "qzeros": (groups, out // 8), "scales": (groups, out)}

    def convert(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight:
        if self.method == QUANT_METHOD:
            return QuantizedWeight(self.bits, self.group_size, stored["qweight"], stored["scales"])
        if self.method == "gptq":
            return from_gptq(
                stored["qweight"], stored["qzeros"], stored["scales"], stored.get("g_idx"), self.group_size,
                self.zero_stored_minus_one,
            )
        return from_awq(stored["qweight"], stored["qzeros"], stored["scales"], self.group_size)


def scheme_from_dir(model_dir: str | Path) -> QuantScheme | None:
    """The checkpoint's quantization scheme, or None for a plain (bf16) checkpoint."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    return None if config is None else scheme_from_config(config)


def scheme_from_config(config: Mapping[str, Any]) -> QuantScheme:
    method = str(config.get("quant_method", "")).lower()
    bits = int(config.get("bits", config.get("w_bit", 0)))
    group_size = int(config.get("group_size", config.get("q_group_size", 0)))
    if method == QUANT_METHOD:
        if bits not in SUPPORTED_BITS:
            raise QuantFormatError(f"{QUANT_METHOD} checkpoint with bits={bits} (supported: {SUPPORTED_BITS})")
    elif method == "gptq":
        _check_gptq(config, bits)
    elif method == "awq":
        _check_awq(config, bits)
    else:
        raise QuantFormatError(f"quant_method {method!r} is not supported (supported: {QUANT_METHOD}, gptq, awq)")
    check_group_size(group_size)
    zero_minus_one = method == "gptq" and str(config.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
    return QuantScheme(method, bits, group_size, zero_minus_one)


def _check_gptq(config: Mapping[str, Any], bits: int) -> None:
    if bits != 4:
        raise QuantFormatError(f"GPTQ with bits={bits} is not supported (only 4-bit)")
    if config.get("desc_act"):
        raise QuantFormatError("GPTQ with desc_act=true (act-order) is not supported")
    if not config.get("sym", True):
        raise QuantFormatError("GPTQ with sym=false (asymmetric) is not supported")


def _check_awq(config: Mapping[str, Any], bits: int) -> None:
    if bits != 4:
        raise QuantFormatError(f"AWQ with bits={bits} is not supported (only 4-bit)")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantFormatError(f"AWQ version {version!r} is not supported (only the GEMM layout)")


def quantized_layout(
    scheme: QuantScheme, expected: Mapping[str, Shape], found: Mapping[str, Shape]
) -> tuple[dict[str, Shape], list[str]]:
    """(expected tensors of the stored checkpoint, names of the linear weights stored quantized).

    A linear ``X.weight`` counts as quantized when ``X.qweight`` is stored, so checkpoints that keep some
    modules in bf16 (lm_head, GPTQ's modules_to_not_convert) load too. Embeddings are never quantized."""
    stored: dict[str, Shape] = {}
    quantized: list[str] = []  # in checkpoint order, so a refusal names the first offending tensor
    for name, shape in expected.items():
        base = name.removesuffix(".weight")
        if len(shape) != 2 or f"{base}.qweight" not in found or name == "model.embed_tokens.weight":
            stored[name] = shape
            continue
        quantized.append(name)
        if shape[1] % scheme.group_size:
            stored[name] = shape  # reported as a misshapen weight; the kernels need whole groups
            continue
        stored.update({f"{base}.{suffix}": s for suffix, s in scheme.tensor_shapes(*shape).items()})
        if scheme.method == "gptq" and f"{base}.g_idx" in found:
            stored[f"{base}.g_idx"] = (shape[1],)
    return stored, quantized


def convert_quantized(
    scheme: QuantScheme, tensors: Mapping[str, np.ndarray], quantized: Sequence[str]
) -> dict[str, np.ndarray | QuantizedWeight]:
    """Stored tensors -> name -> array, with each quantized linear as one QuantizedWeight under X.weight."""
    out: dict[str, np.ndarray | QuantizedWeight] = {}
    for name in quantized:
        base = name.removesuffix(".weight")
        prefix = base + "."
        stored = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix) and "." not in key[len(prefix):]}
        try:
            out[name] = scheme.convert(stored)
        except QuantFormatError as err:
            raise QuantFormatError(f"{base}: {err}") from None
    owned = {f"{n.removesuffix('.weight')}.{s}" for n in quantized for s in ("qweight", "qzeros", "scales", "g_idx")}
    out.update({name: value for name, value in tensors.items() if name not in owned})
    return out


def quantization_config(bits: int, group_size: int, lm_head: bool) -> dict[str, Any]:
    """The ``quantization_config`` block ``ninfer-rt quantize`` writes into config.json."""
    return {
        "quant_method": QUANT_METHOD,
        "bits": bits,
        "group_size": group_size,
        "sym": True,
        "lm_head": lm_head,
        "layout": LAYOUT_DOC,
    }
