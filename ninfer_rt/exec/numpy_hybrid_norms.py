"""Norms and activations of the hybrid (Qwen3.5) model in numpy, in float32 or wider.

Both RMSNorms compute in float32 at least (float64 stays float64): the zero-centred one adds 1 to the
stored weight in that precision rather than folding 1 + w into a low-precision weight.
"""

from __future__ import annotations

import numpy as np

SOFTPLUS_THRESHOLD = 20.0  # above it softplus(x) is x to float32 rounding; torch's softplus cuts there too


def compute_dtype(x: np.ndarray) -> np.dtype:
    return np.result_type(x.dtype, np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x), accurate in relative terms for large negative x too; e^-x = inf there gives exactly 0."""
    with np.errstate(over="ignore"):
        denominator = np.exp(-x)
    denominator += 1.0
    return np.reciprocal(denominator, out=denominator)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), e^x kept finite."""
    return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD))))


def _rms_normalized(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(compute_dtype(x), copy=False)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def zero_centred_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x_n * (1 + w) over the last axis: the decoder, final, q/k and MTP norms of the hybrid model."""
    normed = _rms_normalized(x, eps)
    return normed * (1.0 + weight.astype(normed.dtype))


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Plain-weight RMSNorm over the last axis (a value head), times silu(gate): linear attention's output norm."""
    normed = _rms_normalized(x, eps)
    return weight.astype(normed.dtype) * normed * silu(gate.astype(normed.dtype, copy=False))
