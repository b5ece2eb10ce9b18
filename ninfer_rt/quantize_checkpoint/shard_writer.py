"""Safetensors shards written as a stream: the header from a plan of names, dtypes and shapes, then each
tensor's bytes as they are produced, so that no shard is ever held in memory.

``safetensors.numpy.save_file`` takes a whole dict of arrays and copies each into bytes before writing; a
2 GiB shard of a 27B checkpoint would then cost 4 GiB. Here a tensor may even arrive in row chunks
(``StreamedTensor`` parts), each written and dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ninfer_rt.model.safetensors_file import SAFETENSORS_DTYPES, Shape

DTYPE_NAMES = {dtype: name for name, dtype in reversed(SAFETENSORS_DTYPES.items())}
HEADER_ALIGNMENT = 8  # the data section starts 8-byte aligned, as safetensors writes it


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: np.dtype
    shape: Shape

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def plan_shards(tensors: Iterable[PlannedTensor], shard_bytes: int) -> list[list[PlannedTensor]]:
    """Consecutive tensors in shards of at least ``shard_bytes`` (the last may be smaller)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if size >= shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return [shard for shard in shards if shard]


def write_shard(path: Path, planned: list[PlannedTensor], parts: Iterator[np.ndarray]) -> None:
    """Writes ``planned`` to ``path``, taking their bytes from ``parts`` in order: each tensor is one array,
    or several row chunks that add up to it."""
    header, offset = {}, 0
    for tensor in planned:
        header[tensor.name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
    with path.open("wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for tensor in planned:
            _write_tensor(f, tensor, parts)


def _write_tensor(f, tensor: PlannedTensor, parts: Iterator[np.ndarray]) -> None:  # noqa: ANN001 -- a binary file
    written = 0
    while written < tensor.nbytes:
        part = next(parts)
        if part.dtype != tensor.dtype or part.shape[1:] != tensor.shape[1:]:
            raise AssertionError(f"{tensor.name}: got {part.dtype} {list(part.shape)}, planned {tensor.dtype} {list(tensor.shape)}")
        f.write(np.ascontiguousarray(part).reshape(-1).view(np.uint8).data)
        written += part.nbytes
    if written != tensor.nbytes:
        raise AssertionError(f"{tensor.name}: wrote {written} bytes, planned {tensor.nbytes}")
