"""NInfer's `.ninfer` v1 artifacts: every tensor of a file written by NInfer's own tools reads back exactly as
NInfer's decoder reads it, and each malformation that artifact-container.md rules out is refused in one line."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ninfer_rt.artifact import Artifact, ArtifactError

# CI places a copy of shared/ beside the checkout.
FIXTURE_DIR = Path(__file__).absolute().parents[2] / "shared" / "fixtures" / "ninfer-artifact"
TINY = FIXTURE_DIR / "tiny.ninfer"
EXPECTED = FIXTURE_DIR / "tiny.expected.npz"

needs_fixture = pytest.mark.skipif(
    not TINY.is_file(), reason=f"the NInfer-written fixture {TINY} is absent (shared/ is not beside the checkout)"
)


def bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint32) if values.dtype == np.float32 else values


@needs_fixture
def test_every_tensor_of_the_ninfer_written_fixture_reads_back_bit_for_bit() -> None:
    expected = np.load(EXPECTED)
    with Artifact(TINY) as artifact:
        tensors = [obj.name for obj in artifact.objects.values() if obj.kind == "tensor"]
        assert sorted(name.replace("/", "__") for name in tensors) == sorted(expected.files)
        for name in tensors:
            values, want = artifact.tensor_values(name), expected[name.replace("/", "__")]
            assert values.dtype == want.dtype and values.shape == want.shape, name
            assert np.array_equal(bits(values), bits(want)), name


@needs_fixture
def test_the_fixture_directory_resource_and_formats() -> None:
    with Artifact(TINY) as artifact:
        assert artifact.model_id == "qwen3_6_27b"
        assert artifact.payload_offset == 4096
        assert json.loads(artifact.resource("frontend/meta")) == {"note": "a resource payload"}
        formats = {obj.format for obj in artifact.objects.values() if obj.kind == "tensor"}
        assert formats == {"Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S", "BF16", "FP32", "I32"}


def split(data: bytes) -> tuple[dict, bytes]:
    json_bytes = struct.unpack("<Q", data[8:16])[0]
    return json.loads(data[16 : 16 + json_bytes]), data[4096:]


def assemble(directory: dict, payload: bytes) -> bytes:
    text = json.dumps(directory).encode()
    head = b"NINFER\x00\x01" + struct.pack("<Q", len(text)) + text
    return head + bytes(-len(head) % 4096) + payload


def edited(tmp_path: Path, edit: Callable[[dict], Any]) -> Path:
    directory, payload = split(TINY.read_bytes())
    edit(directory)
    path = tmp_path / "edited.ninfer"
    path.write_bytes(assemble(directory, payload))
    return path


def set_member(index: int, member: str, value: Any) -> Callable[[dict], None]:
    return lambda directory: directory["objects"][index].__setitem__(member, value)


MALFORMED_DIRECTORIES = {
    "overlap": (set_member(1, "offset", 256), "overlaps"),
    "misaligned": (set_member(1, "offset", 6600), "not 256-byte aligned"),
    "past the end": (set_member(7, "offset", 10**9), "past the"),
    "unknown format": (set_member(0, "format", "Q3G64_F16S"), "unknown tensor format 'Q3G64_F16S'"),
    "unknown layout": (set_member(0, "layout", "row-split-k64-v1"), "unknown tensor layout"),
    "format in the wrong layout": (set_member(4, "layout", "row-split-k128-v1"), "cannot be stored in layout"),
    "unknown encoding": (set_member(7, "encoding", "gzip-v1"), "unknown resource encoding"),
    "wrong byte count": (set_member(0, "bytes", 6529), "its layout encodes 6528"),
    "boolean offset": (set_member(0, "offset", False), "offset is not a nonnegative integer"),
    "zero dimension": (set_member(5, "shape", [0]), "positive integers"),
    "extra member": (set_member(0, "source", "model.embed"), "are not exactly"),
    "duplicate name": (set_member(1, "name", "text/q4"), "names repeat"),
    "extra root member": (lambda d: d.__setitem__("schema", 1), "directory members"),
    "no objects": (lambda d: d.__setitem__("objects", []), "nonempty array"),
}


@needs_fixture
@pytest.mark.parametrize("case", sorted(MALFORMED_DIRECTORIES))
def test_a_malformed_directory_is_refused_in_one_line(tmp_path: Path, case: str) -> None:
    edit, message = MALFORMED_DIRECTORIES[case]
    with pytest.raises(ArtifactError, match=message) as raised:
        Artifact(edited(tmp_path, edit))
    assert "\n" not in str(raised.value)


@needs_fixture
def test_bad_magic_a_short_json_range_and_a_truncated_payload_are_refused(tmp_path: Path) -> None:
    data = TINY.read_bytes()
    cases = {
        "bad magic": (b"NINFER\x00\x02" + data[8:], "bad magic"),
        "json past the file": (data[:8] + struct.pack("<Q", 10**6) + data[16:], "before the payload offset"),
        "truncated": (data[:-1], "past the"),
        "not json": (data[:16] + b"\xff" + data[17:], "not UTF-8 JSON"),
    }
    for case, (corrupted, message) in cases.items():
        path = tmp_path / f"{case.replace(' ', '_')}.ninfer"
        path.write_bytes(corrupted)
        with pytest.raises(ArtifactError, match=message):
            Artifact(path)


def test_a_file_shorter_than_the_prefix_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.ninfer"
    path.write_bytes(b"NINFER")
    with pytest.raises(ArtifactError, match="shorter than the 16-byte prefix"):
        Artifact(path)


def test_row_split_sizes_follow_the_layout_formulas() -> None:
    from ninfer_rt.artifact.layouts import encoded_bytes

    assert encoded_bytes("Q5G64_F16S", "row-split-k128-v1", (2, 130)) == 528  # storage-layouts.md 3.6
    assert encoded_bytes("Q4G64_F16S", "row-split-k128-v1", (48, 200)) == 6528
    assert encoded_bytes("BF16", "contiguous-le-v1", ()) == 2
