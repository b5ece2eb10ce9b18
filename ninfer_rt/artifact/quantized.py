"""Grouped `.ninfer` tensors as the project's groupwise weights (QuantizedWeight), every value unchanged.

Q4G64 codes (4-bit two's complement, -8..7) are the int4 format's codes re-centred, u = q + 8, at group 64:
the base plane with each nibble's top bit flipped.
Q5G64 (-16..15), Q6G64 (-32..31) and W8G32 (-128..127) have no kernels of their own: their codes are widened
to int8, u = q + 128, at their own group size (64, or 32 for W8). The fp16 multipliers are kept as stored
(ScaleFormat.FP16), whose value bf16(q * scale) is what the reader decodes (layouts.dequantize_row_split).
The K padding to a multiple of 128 holds zero codes and whole groups; it is dropped, so a tensor binds only
when its logical K is a whole number of groups.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.artifact.container import ArtifactObject
from ninfer_rt.artifact.layouts import (
    GROUPED_FORMATS,
    ArtifactError,
    RowSplitGeometry,
    row_blocks,
    row_split_codes,
    row_split_scales,
)
from ninfer_rt.quantize.format import QuantizedWeight

BOUND_BITS = {"Q4G64_F16S": 4, "Q5G64_F16S": 8, "Q6G64_F16S": 8, "W8G32_F16S": 8}  # format -> int bits


def binds_quantized(obj: ArtifactObject) -> bool:
    """A grouped tensor whose logical K is whole groups (every artifact tensor of the 27B inventory)."""
    return obj.format in GROUPED_FORMATS and obj.shape is not None and obj.shape[1] % GROUPED_FORMATS[obj.format].group == 0


def quantized_weight(obj: ArtifactObject, payload: memoryview) -> QuantizedWeight:
    """The tensor's codes and multipliers as a QuantizedWeight in the checkpoint layout (LAYOUT_ROWS), copied
    out of the payload (the artifact may be closed afterwards)."""
    if not binds_quantized(obj):
        raise ArtifactError(f"{obj.name}: a {obj.format} tensor of shape {obj.shape} has no groupwise binding")
    assert obj.shape is not None and obj.format is not None
    fmt = GROUPED_FORMATS[obj.format]
    rows, cols = obj.shape
    geometry = RowSplitGeometry(fmt, rows, cols)
    bits = BOUND_BITS[obj.format]
    if bits == 4:
        # The base plane is already int4's packing (code 2i in the low nibble of byte i); flipping each
        # nibble's top bit re-centres two's complement q as u = q + 8. One pass, not an unpack and a repack.
        base = np.frombuffer(payload, np.uint8, geometry.groups * fmt.base_bytes_per_group).reshape(rows, -1)
        qweight = base[:, : cols // 2] ^ np.uint8(0x88)
    else:
        qweight = np.empty((rows, cols), np.uint8)
        for start, stop in row_blocks(geometry):
            qweight[start:stop] = row_split_codes(geometry, payload, start, stop)[:, :cols].view(np.uint8) ^ np.uint8(0x80)  # q + 128
    scales = np.array(row_split_scales(geometry, payload)[:, : cols // fmt.group], np.float16)
    return QuantizedWeight(bits, fmt.group, qweight, scales)  # both branches made a new contiguous array
