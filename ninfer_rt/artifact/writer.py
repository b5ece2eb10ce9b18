"""Writing a `.ninfer` v1 file: the encoders of every registered format and layout, and the container framing.

Grouped formats are encoded with NInfer's `MAXABS_F16_RECIP_RNE_V1` profile (per row and group along K:
scale16 = f16(f32(amax / qmax)), codes = clamp(rne(f32(x * f32(1 / scale32))), qmin, qmax)) and laid out
`row-split-k128-v1` (K zero-padded to 128; base, high-bit and scale planes on 256-byte boundaries). The
file is the 16-byte prefix, the JSON directory, zero padding to 4096, then the payloads in object order
(tensors 256-aligned, resources byte-aligned), written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ninfer_rt.artifact.container import MAGIC, PAYLOAD_ALIGNMENT, PREFIX_BYTES
from ninfer_rt.artifact.layouts import (
    CONTIGUOUS,
    DIRECT_FORMATS,
    GROUPED_FORMATS,
    K_PAD_MULTIPLE,
    RAW_BYTES,
    RESOURCE_ALIGNMENT,
    ROW_SPLIT,
    TENSOR_ALIGNMENT,
    ArtifactError,
    RowSplitGeometry,
    align_up,
    float32_to_bf16_float32,
)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor to write: its logical float values (int32 for I32) and the format to encode them in."""

    name: str
    values: np.ndarray
    format: str


@dataclass(frozen=True)
class PackedEntry:
    """A grouped-format matrix given as its `row-split-k128-v1` payload (RowSplitGeometry's planes), made
    only when it is written: an artifact of many such entries is never whole in memory."""

    name: str
    shape: tuple[int, int]
    format: str
    payload: Callable[[], bytes]


@dataclass(frozen=True)
class ResourceEntry:
    name: str
    data: bytes


Entry = TensorEntry | PackedEntry | ResourceEntry


def quantize_groups(fmt: str, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [N, K_pad], binary16 scales [N, K_pad / group]) of a [N, K] matrix, by the canonical profile."""
    grouped = GROUPED_FORMATS[fmt]
    x = np.asarray(values, np.float32)
    if x.ndim != 2 or not np.isfinite(x).all():
        raise ArtifactError(f"{fmt} takes a finite [N, K] matrix, not shape {list(x.shape)}")
    rows, cols = x.shape
    padded = np.zeros((rows, align_up(cols, K_PAD_MULTIPLE)), np.float32)
    padded[:, :cols] = x
    groups = padded.reshape(rows, -1, grouped.group)
    qmax = np.float32((1 << (grouped.code_bits - 1)) - 1)
    amax = np.abs(groups).max(axis=2)
    scale16 = (amax / qmax).astype(np.float16)
    scale16[(scale16 == 0) & (amax > 0)] = np.uint16(1).view(np.float16)  # the 2^-24 underflow rescue
    if not np.isfinite(scale16).all():
        raise ArtifactError(f"{fmt}: a group's scale does not fit binary16")
    scale32 = scale16.astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(scale32 > 0, np.float32(1.0) / scale32, np.float32(0.0)).astype(np.float32)
    codes = np.clip(np.rint(groups * inverse[:, :, None]), -qmax - 1, qmax).astype(np.int8)
    return codes.reshape(rows, -1), scale16


def dequantized(fmt: str, values: np.ndarray) -> np.ndarray:
    """The values a reader decodes after `fmt` encodes `values` (grouped: bf16(scale * code); BF16: rounded)."""
    if fmt in DIRECT_FORMATS:
        return float32_to_bf16_float32(values) if fmt == "BF16" else np.asarray(values, DIRECT_FORMATS[fmt].dtype)
    codes, scales = quantize_groups(fmt, values)
    group = GROUPED_FORMATS[fmt].group
    wide = np.repeat(scales.astype(np.float32), group, axis=1) * codes.astype(np.float32)
    return float32_to_bf16_float32(wide)[:, : np.shape(values)[1]]


def encode_row_split(fmt: str, values: np.ndarray) -> bytes:
    """The `row-split-k128-v1` payload of a [N, K] matrix quantized by the canonical profile."""
    return pack_row_split(fmt, *quantize_groups(fmt, values), np.shape(values)[1])


def pack_row_split(fmt: str, codes: np.ndarray, scales: np.ndarray, cols: int) -> bytes:
    """Codes [N, K_pad] and scales [N, groups] as planes: base (nibble pairs or W8 bytes), high bits, scales."""
    grouped = GROUPED_FORMATS[fmt]
    geometry = RowSplitGeometry(grouped, codes.shape[0], cols)
    unsigned = codes.reshape(-1).view(np.uint8) & np.uint8((1 << grouped.code_bits) - 1)
    if grouped.code_bits == 8:
        base = unsigned
    else:
        low = unsigned & np.uint8(0x0F)
        base = low[0::2] | (low[1::2] << 4)
    payload = bytearray(geometry.payload_bytes)
    payload[: base.size] = base.tobytes()
    high_bits = grouped.code_bits - 4
    if grouped.code_bits != 8 and high_bits:
        # Lane-major stream: code t's high bit j is stream bit t * high_bits + j, bit (s mod 8) of byte s // 8.
        stream = ((unsigned[:, None] >> (4 + np.arange(high_bits, dtype=np.uint8))) & 1).astype(np.uint8)
        high = np.packbits(stream.reshape(-1), bitorder="little")
        payload[geometry.high_offset : geometry.high_offset + high.size] = high.tobytes()
    payload[geometry.scale_offset :] = scales.astype("<f2").tobytes()
    return bytes(payload)


@dataclass(frozen=True)
class _Planned:
    record: dict  # without offset and bytes
    nbytes: int
    alignment: int
    payload: Callable[[], bytes]


def _plan(entry: Entry) -> _Planned:
    """The entry's record, payload size and payload producer: the size is known before anything is encoded."""
    if isinstance(entry, ResourceEntry):
        record = {"name": entry.name, "kind": "resource", "encoding": RAW_BYTES}
        return _Planned(record, len(entry.data), RESOURCE_ALIGNMENT, lambda: entry.data)
    shape = tuple(entry.shape) if isinstance(entry, PackedEntry) else np.shape(entry.values)
    record = {"name": entry.name, "kind": "tensor", "shape": list(shape), "format": entry.format}
    if entry.format in GROUPED_FORMATS:
        size = RowSplitGeometry(GROUPED_FORMATS[entry.format], shape[0], shape[1]).payload_bytes
        payload = entry.payload if isinstance(entry, PackedEntry) else lambda: encode_row_split(entry.format, entry.values)
        return _Planned({**record, "layout": ROW_SPLIT}, size, TENSOR_ALIGNMENT, payload)
    if entry.format not in DIRECT_FORMATS:
        raise ArtifactError(f"unknown tensor format {entry.format!r}")
    if isinstance(entry, PackedEntry):
        raise ArtifactError(f"{entry.name}: a packed payload needs a grouped format, not {entry.format}")
    size = int(np.prod(shape, dtype=np.int64)) * DIRECT_FORMATS[entry.format].dtype.itemsize
    return _Planned({**record, "layout": CONTIGUOUS}, size, TENSOR_ALIGNMENT, lambda: _direct_payload(entry))


def _direct_payload(entry: TensorEntry) -> bytes:
    values = np.asarray(entry.values)
    if entry.format == "BF16":
        return values.astype(np.float32).astype(ml_dtypes.bfloat16).view("<u2").tobytes()
    return values.astype(DIRECT_FORMATS[entry.format].dtype).tobytes()


def write_artifact(
    path: Path | str, model_id: str, entries: Sequence[Entry], progress: Callable[[str, int], None] | None = None
) -> Path:
    """Writes the objects, in the given order, as one `.ninfer` v1 file, one payload in memory at a time;
    `progress(name, bytes)` after each. Nothing is left at `path` on failure."""
    path = Path(path)
    planned = [_plan(entry) for entry in entries]
    records, cursor = [], 0
    for plan in planned:
        cursor = align_up(cursor, plan.alignment)
        records.append({**plan.record, "offset": cursor, "bytes": plan.nbytes})
        cursor += plan.nbytes
    directory = json.dumps({"model_id": model_id, "objects": records}, separators=(",", ":")).encode()
    payload_offset = align_up(PREFIX_BYTES + len(directory), PAYLOAD_ALIGNMENT)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as out:
            out.write(MAGIC + len(directory).to_bytes(8, "little") + directory)
            for plan, record in zip(planned, records):
                payload = plan.payload()
                if len(payload) != plan.nbytes:
                    raise ArtifactError(f"{record['name']}: {len(payload)} payload bytes where {plan.nbytes} were planned")
                out.seek(payload_offset + record["offset"])
                out.write(payload)
                if progress is not None:
                    progress(record["name"], plan.nbytes)
            out.truncate(payload_offset + cursor)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
