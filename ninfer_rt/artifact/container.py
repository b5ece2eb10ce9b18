"""Reading a `.ninfer` v1 file: the 16-byte prefix, the closed JSON object directory, and the payload spans.

The file is memory-mapped; every object's payload is a read-only view into the map, so opening an artifact
of many gigabytes reads only its directory. Every check of NInfer's `artifact-container.md` v1 is made at
open: exact magic, the JSON range inside the file, the closed root/tensor/resource member sets and their
types, unique names, registered format/layout/encoding identities, each tensor's exact encoded size, and
ordered, aligned, non-overlapping payloads inside the file. A failure raises ArtifactError with one line.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ninfer_rt.artifact.layouts import (
    CONTIGUOUS,
    RAW_BYTES,
    RESOURCE_ALIGNMENT,
    TENSOR_ALIGNMENT,
    ArtifactError,
    align_up,
    bf16_words_to_float32,
    check_format_layout,
    dequantize_row_split,
    direct_words,
    encoded_bytes,
)

MAGIC = b"NINFER\x00\x01"
PREFIX_BYTES = 16
PAYLOAD_ALIGNMENT = 4096
TENSOR_MEMBERS = {"name", "kind", "shape", "format", "layout", "offset", "bytes"}
RESOURCE_MEMBERS = {"name", "kind", "encoding", "offset", "bytes"}
ROOT_MEMBERS = {"model_id", "objects"}
RESOURCE_ENCODINGS = (RAW_BYTES,)


@dataclass(frozen=True)
class ArtifactObject:
    """One directory entry. Tensors have shape/format/layout; resources have encoding (and shape None)."""

    name: str
    kind: str
    offset: int
    bytes: int
    shape: tuple[int, ...] | None = None
    format: str | None = None
    layout: str | None = None
    encoding: str | None = None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ArtifactError(message)


def read_directory(data: mmap.mmap | bytes) -> tuple[dict[str, Any], int]:
    """The decoded JSON value and payload_offset, after the prefix and JSON range checks."""
    require(len(data) >= PREFIX_BYTES, f"file is {len(data)} bytes, shorter than the 16-byte prefix")
    require(bytes(data[:8]) == MAGIC, f"bad magic {bytes(data[:8]).hex(' ')} (expected {MAGIC.hex(' ')})")
    json_bytes = int.from_bytes(data[8:16], "little")
    require(json_bytes > 0, "json_bytes is zero")
    metadata_end = PREFIX_BYTES + json_bytes
    payload_offset = align_up(metadata_end, PAYLOAD_ALIGNMENT)
    require(payload_offset <= len(data), f"file ends at {len(data)}, before the payload offset {payload_offset}")
    try:
        root = json.loads(bytes(data[PREFIX_BYTES:metadata_end]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"the directory is not UTF-8 JSON: {exc}") from None
    return root, payload_offset


def parse_object(entry: Any, index: int) -> ArtifactObject:
    """One directory object, with its closed member set and member types checked."""
    where = f"objects[{index}]"
    require(isinstance(entry, dict), f"{where} is not a JSON object")
    kind = entry.get("kind")
    members = {"tensor": TENSOR_MEMBERS, "resource": RESOURCE_MEMBERS}.get(kind)
    require(members is not None, f"{where}: kind {kind!r} is neither 'tensor' nor 'resource'")
    require(set(entry) == members, f"{where}: members {sorted(entry)} are not exactly {sorted(members)}")
    name = entry["name"]
    require(isinstance(name, str) and name != "", f"{where}: name is not a nonempty string")
    where = f"object {name!r}"
    require(is_int(entry["offset"]) and entry["offset"] >= 0, f"{where}: offset is not a nonnegative integer")
    require(is_int(entry["bytes"]) and entry["bytes"] > 0, f"{where}: bytes is not a positive integer")
    if kind == "resource":
        encoding = entry["encoding"]
        require(encoding in RESOURCE_ENCODINGS, f"{where}: unknown resource encoding {encoding!r}")
        return ArtifactObject(name, kind, entry["offset"], entry["bytes"], encoding=encoding)
    shape = entry["shape"]
    require(
        isinstance(shape, list) and all(is_int(d) and d > 0 for d in shape),
        f"{where}: shape is not an array of positive integers",
    )
    for member in ("format", "layout"):
        require(isinstance(entry[member], str), f"{where}: {member} is not a string")
    try:
        check_format_layout(entry["format"], entry["layout"], tuple(shape))
    except ArtifactError as exc:
        raise ArtifactError(f"{where}: {exc}") from None
    size = encoded_bytes(entry["format"], entry["layout"], tuple(shape))
    require(size == entry["bytes"], f"{where}: bytes is {entry['bytes']}, its layout encodes {size}")
    return ArtifactObject(name, kind, entry["offset"], entry["bytes"], tuple(shape), entry["format"], entry["layout"])


def parse_objects(root: Any, payload_bytes: int) -> tuple[str, list[ArtifactObject]]:
    """model_id and the objects, with unique names and ordered, aligned, in-file payload spans."""
    require(isinstance(root, dict), "the directory is not a JSON object")
    require(set(root) == ROOT_MEMBERS, f"directory members {sorted(root)} are not exactly {sorted(ROOT_MEMBERS)}")
    model_id, entries = root["model_id"], root["objects"]
    require(isinstance(model_id, str) and model_id != "", "model_id is not a nonempty string")
    require(isinstance(entries, list) and entries != [], "objects is not a nonempty array")
    objects = [parse_object(entry, index) for index, entry in enumerate(entries)]
    names = [obj.name for obj in objects]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    require(not duplicates, f"object names repeat: {duplicates}")
    cursor = 0
    for obj in objects:
        alignment = TENSOR_ALIGNMENT if obj.kind == "tensor" else RESOURCE_ALIGNMENT
        end = obj.offset + obj.bytes
        require(obj.offset >= cursor, f"object {obj.name!r} at {obj.offset} overlaps or precedes the one before it (ends {cursor})")
        require(obj.offset % alignment == 0, f"object {obj.name!r} offset {obj.offset} is not {alignment}-byte aligned")
        require(end <= payload_bytes, f"object {obj.name!r} ends at {end}, past the {payload_bytes} payload bytes")
        cursor = end
    return model_id, objects


class Artifact:
    """An open `.ninfer` v1 file: model_id, its objects by name, and read-only payload views into the map."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            size = handle.seek(0, 2)
            require(size > 0, "the file is empty")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            root, self.payload_offset = read_directory(self._map)
            self.model_id, objects = parse_objects(root, size - self.payload_offset)
        except ArtifactError:
            self._map.close()
            raise
        self.objects = {obj.name: obj for obj in objects}

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._map.close()

    def object(self, name: str) -> ArtifactObject:
        if name not in self.objects:
            raise KeyError(f"no object {name!r} in {self.path}")
        return self.objects[name]

    def payload(self, name: str) -> memoryview:
        """The object's stored bytes, a view into the memory map (valid until close)."""
        obj = self.object(name)
        start = self.payload_offset + obj.offset
        return memoryview(self._map)[start : start + obj.bytes]

    def resource(self, name: str) -> bytes:
        require(self.object(name).kind == "resource", f"object {name!r} is a tensor, not a resource")
        return bytes(self.payload(name))

    def tensor_values(self, name: str, dtype: DTypeLike = np.float32) -> np.ndarray:
        """The logical values: float32 (grouped formats dequantized through bfloat16, BF16 widened; a grouped
        tensor straight into `dtype` when asked, e.g. bfloat16), int32 for I32."""
        obj = self.object(name)
        require(obj.kind == "tensor", f"object {name!r} is a resource, not a tensor")
        assert obj.shape is not None and obj.format is not None
        payload = self.payload(name)
        if obj.layout != CONTIGUOUS:
            return dequantize_row_split(obj.format, obj.shape, payload, dtype)
        words = direct_words(obj.format, obj.shape, payload)
        if obj.format == "BF16":
            return bf16_words_to_float32(words)
        return words.astype(words.dtype.newbyteorder("="))
