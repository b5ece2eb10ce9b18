"""One ``.safetensors`` file, memory-mapped: tensors are zero-copy numpy views, read only when touched.

The header is parsed here rather than through ``safe_open(framework="numpy")`` because numpy has no
bfloat16 and ``safe_open`` copies every tensor; ``np.memmap`` + ml_dtypes gives bf16 views with no copy.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

Shape = tuple[int, ...]

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
}

# A header bigger than this is a corrupt length prefix, not a real header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class WeightsError(ValueError):
    """The checkpoint's files are unreadable or do not match the config; lists every problem at once."""


@dataclass(frozen=True)
class _TensorLocation:
    dtype: np.dtype
    shape: Shape
    begin: int  # absolute byte offsets in the file
    end: int


class SafetensorsFile:
    """One memory-mapped ``.safetensors`` file; tensors are zero-copy views of the mapping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._locations = _read_header(path)
        self._map: mmap.mmap | None = None
        self._mapping: np.ndarray | None = None
        if path.stat().st_size:
            with path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._mapping = np.frombuffer(self._map, dtype=np.uint8)

    def names(self) -> list[str]:
        return list(self._locations)

    def shape(self, name: str) -> Shape:
        return self._locations[name].shape

    def tensor(self, name: str) -> np.ndarray:
        loc = self._locations[name]
        if loc.begin == loc.end:
            return np.zeros(loc.shape, dtype=loc.dtype)
        return self._mapping[loc.begin : loc.end].view(loc.dtype).reshape(loc.shape)

    def release_pages(self) -> None:
        """Drops the file's pages read so far from this process's resident set; they stay in the page cache
        and are read again if touched. A pass over a checkpoint larger than memory then stays bounded."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)


def _read_header(path: Path) -> dict[str, _TensorLocation]:
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightsError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise WeightsError(f"{path}: truncated or corrupt safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{path}: corrupt safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    locations = {name: _tensor_location(path, name, entry, data_start) for name, entry in header.items()}
    data_end = max((loc.end for loc in locations.values()), default=data_start)
    if data_end > file_size:
        raise WeightsError(
            f"{path}: truncated safetensors file ({file_size} bytes, its header needs {data_end} bytes)"
        )
    return locations


def _tensor_location(path: Path, name: str, entry: dict, data_start: int) -> _TensorLocation:
    dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise WeightsError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
    shape = tuple(int(d) for d in entry["shape"])
    begin, end = (int(o) for o in entry["data_offsets"])
    if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise WeightsError(f"{path}: tensor {name} has {end - begin} bytes for shape {list(shape)} {dtype}")
    return _TensorLocation(dtype=dtype, shape=shape, begin=data_start + begin, end=data_start + end)
