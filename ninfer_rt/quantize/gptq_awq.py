"""GPTQ and AWQ checkpoints' weights -> the project's groupwise format, converted when loaded.

GPTQ (4-bit, sym, no act-order) becomes int4 as is; AWQ GEMM 4-bit becomes int4 when every zero point is
8, otherwise exactly int8 (q - zero lies in [-15, 15], which int4 symmetric cannot hold; int8 keeps the
weights bit-exact at twice the bytes). Scales become bf16: an fp16 scale is rounded to 8 significant bits (a
relative change of at most 2^-9, far below int4's own step). The import is by name, so the Qwen3.5 hybrids'
linears (in_proj_qkv, in_proj_z, out_proj, the q | gate q_proj) load in both layouts, and in_proj_a/b, which
published GPTQ checkpoints keep in fp16/bf16, load as stored.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.quantize.format import BF16, QuantFormatError, QuantizedWeight, pack

# AutoAWQ's GEMM packing puts output column ORDER[i] of each 8 in nibble i; REVERSE undoes it.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


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
