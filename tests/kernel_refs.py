"""float64 numpy references for the kernel families (kernels_src/*.cu), used by the GPU tests.

They compute the exact math of each kernel's header comment, without bf16 rounding of intermediates,
so a kernel is judged against the true result within bf16 bounds.
"""

from __future__ import annotations

import numpy as np


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return w.astype(np.float64) * (x * inv_rms)


def rmsnorm_residual_ref(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(out, residual_out): residual_out = x + residual, out = rmsnorm(residual_out)."""
    summed = x.astype(np.float64) + residual.astype(np.float64)
    return rmsnorm_ref(summed, w, eps), summed


def silu_mul_ref(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [rows, 2 * inter] -> silu(gate) * up, [rows, inter]."""
    gate_up = gate_up.astype(np.float64)
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    return gate / (1.0 + np.exp(-gate)) * up
