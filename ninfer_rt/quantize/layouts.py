"""The GPU layout of groupwise weights (LAYOUT_OCTETS), and the operations that read either layout.

On the GPU the codes and scales are rearranged once, at load time (device_layout() defines it): rows in
octets of 8, each row's inputs in 16-byte chunks of 8-input runs ordered so that the decode GEMV's tensor-core
fragments come straight out of a load (kernels_src/gemv_quant.cu documents it). The CUDA executor rearranges
the codes on the device (kernels_src/quant_layout.cu, byte for byte this definition) and the scales here
(octet_scales); concat_rows() returns the whole layout on the host, for what the kernel does not take (parts
of different widths) and for tests; dequantize() reads either layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer_rt.quantize.format import (
    BF16,
    LANES,
    LAYOUT_OCTETS,
    LAYOUT_ROWS,
    OCTET_ROWS,
    RUN_INPUTS,
    Linear,
    QuantFormatError,
    QuantizedWeight,
    ScaleFormat,
    column_inputs,
    pack,
    signed,
    unpack,
)

# int4 run i (0..7) -> nibble of its word: (word >> 4s) & 0x000F000F is then the pair (i_2s, i_2s+1).
INT4_RUN_NIBBLE = np.array([0, 4, 1, 5, 2, 6, 3, 7])
_NIBBLE_INPUT = np.argsort(INT4_RUN_NIBBLE)  # nibble n of a run's word holds input _NIBBLE_INPUT[n]
_INT4_LOW_NIBBLES, _INT4_HIGH_NIBBLES = _NIBBLE_INPUT[0::2], _NIBBLE_INPUT[1::2]
# int8 run: byte b of the run's 8 bytes holds input INT8_RUN_ORDER[b]; a word's halves are then (i0, i1).
INT8_RUN_ORDER = np.array([0, 2, 1, 3, 4, 6, 5, 7])


def dequantize(weight: QuantizedWeight, dtype: type = np.float32) -> np.ndarray:
    """W [out, in] in ``dtype``, exact for float32 and wider: q times a bf16 or fp16 scale is exact in
    float32 (at most 8 + 11 significant bits), and fp16-scale values are then rounded once to bf16, as
    their format defines (ScaleFormat)."""
    weight = rows_layout(weight)
    out, in_features = weight.shape
    wide = np.float64 if np.dtype(dtype).itemsize > 4 else np.float32
    q = signed(unpack(weight.qweight, weight.bits), weight.bits).astype(wide)
    values = q * np.repeat(weight.scales.astype(wide), weight.group_size, axis=1)
    if weight.scale_format is ScaleFormat.FP16:
        values = values.astype(np.float32).astype(BF16)
    return values.astype(dtype).reshape(out, in_features)


def dense(part: Linear, dtype: type) -> np.ndarray:
    """A checkpoint array or a quantized weight as a dense array of ``dtype``."""
    return dequantize(part, dtype) if isinstance(part, QuantizedWeight) else np.asarray(part, dtype=dtype)


def dense_rows(part: Linear, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a checkpoint array (in its dtype) or of a quantized weight (dequantized, float32: exact)."""
    if not isinstance(part, QuantizedWeight):
        return np.asarray(part)[ids]
    weight = rows_layout(part)
    return dequantize(QuantizedWeight(weight.bits, weight.group_size, weight.qweight[ids], weight.scales[ids]))


def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stack quantized weights along the output dimension (fused qkv / gate_up) into one weight in the GPU
    layout (device_layout: what the CUDA executor uploads). Parts of different widths are widened to the
    widest exactly (an int4 code re-centred as int8)."""
    return device_layout(stack_rows(parts))


def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """concat_rows in the checkpoint layout (LAYOUT_ROWS)."""
    parts = [rows_layout(p) for p in parts]
    check_fusable(parts)
    bits = max(p.bits for p in parts)
    qweights = [p.qweight if p.bits == bits else _widen(p.qweight, p.bits, bits) for p in parts]
    return QuantizedWeight(
        bits, parts[0].group_size, np.concatenate(qweights, axis=0), np.concatenate([p.scales for p in parts], axis=0)
    )


def check_fusable(parts: Sequence[QuantizedWeight]) -> None:
    """Weights stacked into one must share their group size and scale format (their widths may differ)."""
    group_sizes = {p.group_size for p in parts}
    if len(group_sizes) != 1:
        raise QuantFormatError(f"cannot fuse weights with different group sizes {sorted(group_sizes)}")
    scale_formats = {p.scale_format.value for p in parts}
    if len(scale_formats) != 1:
        raise QuantFormatError(f"cannot fuse weights with different scale formats {sorted(scale_formats)}")


def split_rows(weight: QuantizedWeight, *sizes: int) -> list[QuantizedWeight]:
    """The row blocks of a fused weight, in order (stack_rows' inverse); the sizes must cover every row.
    Blocks are views of the codes and scales: a group never spans rows."""
    weight = rows_layout(weight)
    if sum(sizes) != weight.shape[0]:
        raise QuantFormatError(f"a fused weight of {weight.shape[0]} rows does not split into {list(sizes)}")
    bounds = np.cumsum(sizes)[:-1]
    return [
        QuantizedWeight(weight.bits, weight.group_size, qweight, scales)
        for qweight, scales in zip(np.split(weight.qweight, bounds), np.split(weight.scales, bounds))
    ]




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
    octets = padded_octets(out)
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
    return QuantizedWeight(bits, weight.group_size, qweight, octet_scales(weight.scales), LAYOUT_OCTETS, out)


def padded_octets(rows: int) -> int:
    """Octets of a weight of `rows` rows in the GPU layout: an even number (a GEMV tile is two octets)."""
    octets = -(-rows // OCTET_ROWS)
    return octets + octets % 2


def octet_scales(scales: np.ndarray) -> np.ndarray:
    """Scales [rows, groups] in the GPU layout [octets, groups, 8], the padding rows' scales 0."""
    rows, groups = scales.shape
    octets = padded_octets(rows)
    padded = np.zeros((octets * OCTET_ROWS, groups), scales.dtype)
    padded[:rows] = scales
    return np.ascontiguousarray(padded.reshape(octets, OCTET_ROWS, groups).transpose(0, 2, 1))


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
