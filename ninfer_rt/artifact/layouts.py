"""The registered numeric formats and storage layouts of `.ninfer` v1 tensors: encoded sizes and decoding.

Direct formats (BF16, FP32, I32) are stored `contiguous-le-v1`, C order, little-endian words. Grouped formats
(Q4/Q5/Q6 at group 64, W8 at group 32, one binary16 multiplier per group) are stored `row-split-k128-v1`:
K padded to a multiple of 128, then a base-code plane (nibble pairs, or one byte per W8 code), an optional
high-bit plane (Q5/Q6), and the scale plane, each plane starting on a 256-byte boundary. The registries are
closed: a name that is not listed here is refused, never parsed into components.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

CONTIGUOUS = "contiguous-le-v1"
ROW_SPLIT = "row-split-k128-v1"
RAW_BYTES = "raw-bytes-v1"
TENSOR_ALIGNMENT = 256
RESOURCE_ALIGNMENT = 1
MAX_DIRECT_RANK = 16
K_PAD_MULTIPLE = 128
PLANE_ALIGNMENT = 256


class ArtifactError(ValueError):
    """A `.ninfer` file that breaks the v1 specification; the message is one line."""


@dataclass(frozen=True)
class DirectFormat:
    name: str
    dtype: np.dtype  # the little-endian word as numpy stores it


@dataclass(frozen=True)
class GroupedFormat:
    name: str
    code_bits: int
    group: int
    base_bytes_per_group: int
    high_bytes_per_group: int


DIRECT_FORMATS = {
    f.name: f
    for f in (
        DirectFormat("BF16", np.dtype("<u2")),
        DirectFormat("FP32", np.dtype("<f4")),
        DirectFormat("I32", np.dtype("<i4")),
    )
}
GROUPED_FORMATS = {
    f.name: f
    for f in (
        GroupedFormat("Q4G64_F16S", 4, 64, 32, 0),
        GroupedFormat("Q5G64_F16S", 5, 64, 32, 8),
        GroupedFormat("Q6G64_F16S", 6, 64, 32, 16),
        GroupedFormat("W8G32_F16S", 8, 32, 32, 0),
    )
}
LAYOUT_FORMATS = {CONTIGUOUS: DIRECT_FORMATS, ROW_SPLIT: GROUPED_FORMATS}


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class RowSplitGeometry:
    """Where each plane of a row-split-k128-v1 tensor lies inside its payload (storage-layouts.md 3.6)."""

    fmt: GroupedFormat
    rows: int
    cols: int

    @property
    def groups_per_row(self) -> int:
        return align_up(self.cols, K_PAD_MULTIPLE) // self.fmt.group

    @property
    def groups(self) -> int:
        return self.rows * self.groups_per_row

    @property
    def high_offset(self) -> int:
        return align_up(self.groups * self.fmt.base_bytes_per_group, PLANE_ALIGNMENT)

    @property
    def scale_offset(self) -> int:
        return self.high_offset + align_up(self.groups * self.fmt.high_bytes_per_group, PLANE_ALIGNMENT)

    @property
    def payload_bytes(self) -> int:
        return self.scale_offset + self.groups * 2


def check_format_layout(fmt: str, layout: str, shape: tuple[int, ...]) -> None:
    """Refuses an unregistered layout or format, a format the layout does not take, or an illegal rank."""
    if layout not in LAYOUT_FORMATS:
        raise ArtifactError(f"unknown tensor layout {layout!r}")
    if fmt not in DIRECT_FORMATS and fmt not in GROUPED_FORMATS:
        raise ArtifactError(f"unknown tensor format {fmt!r}")
    if fmt not in LAYOUT_FORMATS[layout]:
        raise ArtifactError(f"format {fmt} cannot be stored in layout {layout}")
    if layout == ROW_SPLIT and len(shape) != 2:
        raise ArtifactError(f"layout {layout} takes a rank-2 [N, K] shape, not {list(shape)}")
    if layout == CONTIGUOUS and len(shape) > MAX_DIRECT_RANK:
        raise ArtifactError(f"layout {layout} takes rank 0..{MAX_DIRECT_RANK}, not {len(shape)}")


def encoded_bytes(fmt: str, layout: str, shape: tuple[int, ...]) -> int:
    """The exact payload length the layout gives this (format, shape); check_format_layout must pass first."""
    if layout == ROW_SPLIT:
        return RowSplitGeometry(GROUPED_FORMATS[fmt], shape[0], shape[1]).payload_bytes
    return int(np.prod(shape, dtype=object)) * DIRECT_FORMATS[fmt].dtype.itemsize


def direct_words(fmt: str, shape: tuple[int, ...], payload: memoryview) -> np.ndarray:
    """The stored words, read-only and backed by the payload (no copy): uint16 bit patterns for BF16."""
    return np.frombuffer(payload, dtype=DIRECT_FORMATS[fmt].dtype).reshape(shape)


def bf16_words_to_float32(words: np.ndarray) -> np.ndarray:
    """BF16 expands to binary32 exactly: the word becomes the high half, the low half is zero."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_float32(values: np.ndarray) -> np.ndarray:
    """Rounds binary32 to the nearest bfloat16, ties to even, and returns it widened back to float32."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


_BYTES = np.arange(256, dtype="<u2")
_NIBBLE_PAIRS = (_BYTES & 0x0F) | ((_BYTES >> 4) << 8)  # little-endian pairs: a byte's two nibbles as two bytes


ROW_BLOCK_CODES = 1 << 25  # codes decoded at a time: bounds a large tensor's temporaries (~0.5 GB for f32 values)


def row_blocks(geometry: RowSplitGeometry) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of about ROW_BLOCK_CODES codes each."""
    step = max(1, ROW_BLOCK_CODES // (geometry.groups_per_row * geometry.fmt.group))
    for start in range(0, geometry.rows, step):
        yield start, min(start + step, geometry.rows)


def row_split_codes(geometry: RowSplitGeometry, payload: memoryview, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The signed codes of rows [start, stop) as int8 [rows, K_pad], rebuilt from the base plane and, for
    Q5/Q6, the high-bit plane (a row's codes are whole bytes of either plane: K_pad is a multiple of 128)."""
    fmt = geometry.fmt
    stop = geometry.rows if stop is None else stop
    padded_cols = geometry.groups_per_row * fmt.group
    base_row = geometry.groups_per_row * fmt.base_bytes_per_group
    base = np.frombuffer(payload, np.uint8, (stop - start) * base_row, start * base_row)
    if fmt.code_bits == 8:
        return base.view(np.int8).reshape(stop - start, padded_cols)
    unsigned = _NIBBLE_PAIRS[base].view(np.uint8)  # byte i -> codes 2i (low nibble), 2i + 1 (high nibble)
    high_bits = fmt.code_bits - 4
    if high_bits:
        high_row = geometry.groups_per_row * fmt.high_bytes_per_group
        high = np.frombuffer(payload, np.uint8, (stop - start) * high_row, geometry.high_offset + start * high_row)
        # The high-bit stream is lane-major: code t's high bit j is stream bit t * high_bits + j, bit (s mod 8)
        # of byte s // 8.
        stream = np.unpackbits(high, bitorder="little")
        np.left_shift(stream, np.uint8(4), out=stream)
        for j in range(high_bits):
            np.bitwise_or(unsigned, stream[j::high_bits] << np.uint8(j), out=unsigned)
    sign = np.uint8(1 << (fmt.code_bits - 1))
    unsigned ^= sign  # two's complement of code_bits bits, sign-extended in 8: (u ^ s) - s, wrapping
    unsigned -= sign
    return unsigned.view(np.int8).reshape(stop - start, padded_cols)


def row_split_scales(geometry: RowSplitGeometry, payload: memoryview) -> np.ndarray:
    """The binary16 multipliers [N, groups_per_row]."""
    scales = np.frombuffer(payload, np.dtype("<f2"), geometry.groups, geometry.scale_offset)
    return scales.reshape(geometry.rows, geometry.groups_per_row)


def dequantize_row_split(fmt: str, shape: tuple[int, ...], payload: memoryview, dtype: DTypeLike = np.float32) -> np.ndarray:
    """w = binary32(scale * code) for the logical columns, rounded to bfloat16 and returned as `dtype`
    (float32, or bfloat16 itself), a block of rows at a time."""
    geometry = RowSplitGeometry(GROUPED_FORMATS[fmt], shape[0], shape[1])
    scales = row_split_scales(geometry, payload)
    out = np.empty((geometry.rows, geometry.cols), dtype)
    for start, stop in row_blocks(geometry):
        codes = row_split_codes(geometry, payload, start, stop).astype(np.float32)
        codes *= np.repeat(scales[start:stop].astype(np.float32), geometry.fmt.group, axis=1)  # exact in f32
        out[start:stop] = codes[:, : geometry.cols].astype(ml_dtypes.bfloat16)
    return out
