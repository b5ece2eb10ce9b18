"""FP8 block-scaled checkpoints (``quant_method: fp8``, ``weight_block_size: [128, 128]``), dequantized at load.

Each FP8 linear ``X.weight`` is F8_E4M3 [out, in] with ``X.weight_scale_inv`` float32 (or bf16)
[ceil(out / b0), ceil(in / b1)]: W = weight * weight_scale_inv over each b0 x b1 block (the name notwithstanding,
the stored value multiplies; the last blocks may be partial). ninfer-rt has no FP8 GEMM, so the weights become
bf16 when loaded (e4m3's 4 significant bits times the scale, rounded to bf16's 8); modules the checkpoint keeps
unquantized (embeddings, norms, lm_head, in_proj_a/b) load as stored.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ninfer_rt.quantize.format import BF16, QuantFormatError, Shape

SCALE_SUFFIX = "weight_scale_inv"
FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def scale_shape(shape: Shape, block: tuple[int, int]) -> Shape:
    return tuple(math.ceil(size / step) for size, step in zip(shape, block))


def from_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """bf16 [out, in] = weight * scale_inv per block, one block row of weights in float32 at a time."""
    if weight.dtype != FP8_E4M3:
        raise QuantFormatError(f"weight is {weight.dtype}, expected float8_e4m3fn")
    rows, cols = block
    out = np.empty(weight.shape, BF16)
    for block_row, start in enumerate(range(0, weight.shape[0], rows)):
        scales = np.repeat(np.asarray(scale_inv[block_row], np.float32), cols)[: weight.shape[1]]
        out[start : start + rows] = (weight[start : start + rows].astype(np.float32) * scales).astype(BF16)
    return out
