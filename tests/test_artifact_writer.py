"""The project's `.ninfer` v1 writer: NInfer's own plane packing reproduced byte for byte, the canonical
encoder's codes and scales checked against a float64 statement of the profile, and files that read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.artifact import Artifact
from ninfer_rt.artifact.layouts import GROUPED_FORMATS, RowSplitGeometry, row_split_codes, row_split_scales
from ninfer_rt.artifact.writer import (
    ResourceEntry,
    TensorEntry,
    dequantized,
    pack_row_split,
    quantize_groups,
    write_artifact,
)

FIXTURE = Path(__file__).absolute().parents[2] / "shared" / "fixtures" / "ninfer-artifact" / "tiny.ninfer"
GROUPED = sorted(GROUPED_FORMATS)


@pytest.mark.skipif(not FIXTURE.exists(), reason="the NInfer-written fixture is not present")
@pytest.mark.parametrize("name", ["text/q4", "text/q5", "text/q6", "text/w8"])
def test_packing_the_fixtures_codes_and_scales_gives_ninfers_own_bytes(name: str) -> None:
    with Artifact(FIXTURE) as artifact:
        obj = artifact.object(name)
        geometry = RowSplitGeometry(GROUPED_FORMATS[obj.format], *obj.shape)
        payload = bytes(artifact.payload(name))  # a copy: the map closes with the artifact
    codes, scales = row_split_codes(geometry, memoryview(payload)), row_split_scales(geometry, memoryview(payload))
    assert pack_row_split(obj.format, codes, scales, obj.shape[1]) == payload


def _profile_oracle(fmt: str, row: np.ndarray) -> tuple[list[int], list[float]]:
    """MAXABS_F16_RECIP_RNE_V1 for one row, group by group, in float64 with explicit roundings."""
    grouped = GROUPED_FORMATS[fmt]
    qmax = 2 ** (grouped.code_bits - 1) - 1
    padded = np.zeros(-(-row.size // 128) * 128)
    padded[: row.size] = row
    codes, scales = [], []
    for group in padded.reshape(-1, grouped.group):
        amax = float(np.abs(group).max())
        scale16 = float(np.float16(np.float32(amax / qmax))) if amax else 0.0
        inverse = float(np.float32(1.0 / scale16)) if scale16 else 0.0
        codes += [int(min(max(np.rint(np.float32(x * inverse)), -qmax - 1), qmax)) for x in group]
        scales.append(scale16)
    return codes, scales


@pytest.mark.parametrize("fmt", GROUPED)
def test_codes_and_scales_follow_the_canonical_profile(fmt: str) -> None:
    values = np.random.default_rng(1).standard_normal((3, 200)).astype(np.float32)
    values[1, :64] = 0.0  # an all-zero group has scale 0 and codes 0
    codes, scales = quantize_groups(fmt, values)
    for r in range(values.shape[0]):
        expected_codes, expected_scales = _profile_oracle(fmt, values[r].astype(np.float64))
        assert codes[r].tolist() == expected_codes
        assert scales[r].astype(np.float64).tolist() == expected_scales


def test_a_written_file_reads_back_the_quantized_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tensors = [TensorEntry(f"t/{fmt}", rng.standard_normal((5, 130)).astype(np.float32), fmt) for fmt in GROUPED]
    tensors += [
        TensorEntry("t/bf", rng.standard_normal((3, 7)).astype(np.float32), "BF16"),
        TensorEntry("t/fp", rng.standard_normal(9).astype(np.float32), "FP32"),
        TensorEntry("t/ids", np.arange(11, dtype=np.int32)[::-1], "I32"),
    ]
    path = write_artifact(tmp_path / "x.ninfer", "qwen3_6_27b", [ResourceEntry("frontend/a", b"{}"), *tensors])
    with Artifact(path) as artifact:
        assert artifact.model_id == "qwen3_6_27b"
        assert artifact.resource("frontend/a") == b"{}"
        for entry in tensors:
            np.testing.assert_array_equal(artifact.tensor_values(entry.name), dequantized(entry.format, entry.values))
    assert [p.name for p in tmp_path.iterdir()] == ["x.ninfer"]
