"""The groupwise integer weight format: QuantizedWeight, its checkpoint layout, and the code packing.

The layout (docs/ARCHITECTURE.md "Groupwise-int weights"; kernels_src/gemv_quant.cu reads it): a linear
weight W [out, in] is stored as
  ``<name>.qweight`` uint8 [out, in * bits / 8]: codes u = q + 2^(bits-1) (offset binary), row-major along
      the input. int4: byte j of a row holds input 2j in its low nibble and input 2j+1 in its high nibble.
  ``<name>.scales`` bf16 [out, in / group_size] (fp16 for artifact weights: ScaleFormat)
and W[o, i] = (u[o, i] - 2^(bits-1)) * scales[o, i // group_size]. Symmetric: no zero points. Offset binary
makes GPTQ's symmetric codes (zero point 8) the stored codes unchanged, and lets the GPU build floats
from codes with a single OR (see gemv_quant.cu). A scale may be negative: the grid then runs from
+2^(bits-1) steps down to -(2^(bits-1) - 1), which quantize() uses when a group's extreme is positive.

On the GPU the codes and scales are rearranged once, at load time, into LAYOUT_OCTETS (layouts.py), which
QuantizedWeight also holds.

The scales' number format (ScaleFormat) is part of the format: bf16 for the project's checkpoints, fp16 for
the group multipliers of NInfer's `.ninfer` artifacts, bound without conversion (an fp16 multiplier does not
fit bf16). It also fixes what a weight's value is: the exact product q * scale for bf16 scales (as above);
bf16(q * scale), the product rounded once to bfloat16, for fp16 scales, which is the value NInfer's decoder
defines for its formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
QUANT_METHOD = "ninfer-groupwise"
SUPPORTED_BITS = (4, 8)
MIN_GROUP_SIZE = 32  # one 16-byte int4 chunk of the GEMV; groups are whole chunks
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


class QuantFormatError(ValueError):
    """A quantized checkpoint (or quantization request) ninfer-rt cannot represent; one-line message."""


class ScaleFormat(Enum):
    """The number format of a weight's group scales (module docstring: it fixes the weight's values)."""

    BF16 = "bf16"  # W = q * scale, exact
    FP16 = "fp16"  # W = bf16(q * scale): NInfer's multipliers and its decoder's rounding

    @property
    def dtype(self) -> np.dtype:
        return BF16 if self is ScaleFormat.BF16 else np.dtype(np.float16)

    @classmethod
    def of(cls, dtype: np.dtype) -> ScaleFormat:
        for fmt in cls:
            if fmt.dtype == dtype:
                return fmt
        raise QuantFormatError(f"scales must be bf16 or float16, got {dtype}")


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
        if self.qweight.dtype != np.uint8:
            raise QuantFormatError(f"qweight must be uint8, got {self.qweight.dtype}")
        ScaleFormat.of(self.scales.dtype)
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
    def scale_format(self) -> ScaleFormat:
        """Given by the scales' dtype, so that it cannot disagree with them."""
        return ScaleFormat.of(self.scales.dtype)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


Linear = np.ndarray | QuantizedWeight


def check_group_size(group_size: int) -> None:
    if group_size < MIN_GROUP_SIZE or group_size & (group_size - 1):
        raise QuantFormatError(f"group size {group_size} is not supported (a power of two >= {MIN_GROUP_SIZE})")




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
