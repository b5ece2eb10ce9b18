"""`ninfer-rt inspect`: the object listing, --tensor/--npy writing float32 values, and one-line refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from click.testing import CliRunner
from test_ninfer_artifact import EXPECTED, TINY, needs_fixture

from ninfer_rt.cli import main


@needs_fixture
def test_inspect_lists_every_object() -> None:
    result = CliRunner().invoke(main, ["inspect", str(TINY)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "model_id qwen3_6_27b"
    assert "text/q4  tensor  [48, 200]  Q4G64_F16S  row-split-k128-v1  6528" in lines
    assert "frontend/meta  resource  -  -  raw-bytes-v1  30" in lines
    assert len(lines) == 9


@needs_fixture
def test_inspect_writes_a_tensor_as_float32(tmp_path: Path) -> None:
    out = tmp_path / "q6.npy"
    result = CliRunner().invoke(main, ["inspect", str(TINY), "--tensor", "text/q6", "--npy", str(out)])
    assert result.exit_code == 0, result.output
    values = np.load(out)
    assert values.dtype == np.float32
    assert np.array_equal(values.view(np.uint32), np.load(EXPECTED)["text__q6"].view(np.uint32))


@needs_fixture
def test_inspect_refuses_an_unknown_tensor_without_writing(tmp_path: Path) -> None:
    out = tmp_path / "none.npy"
    result = CliRunner().invoke(main, ["inspect", str(TINY), "--tensor", "text/none", "--npy", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["Error: --tensor text/none: no tensor of that name in " + str(TINY)]
    assert not out.exists()


def test_inspect_refuses_a_file_that_is_not_an_artifact_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.ninfer"
    path.write_bytes(b"GGUF" + bytes(5000))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "bad magic" in result.output


def test_inspect_refuses_a_missing_file_and_a_lone_tensor_flag(tmp_path: Path) -> None:
    missing = CliRunner().invoke(main, ["inspect", str(tmp_path / "absent.ninfer")])
    lone = CliRunner().invoke(main, ["inspect", str(tmp_path / "absent.ninfer"), "--tensor", "text/q4"])
    assert (missing.exit_code, lone.exit_code) == (2, 2)
    assert "no such file" in missing.output and "--tensor and --npy go together" in lone.output


@needs_fixture
def test_inspect_refuses_an_unwritable_npy_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "absent-dir" / "q6.npy"
    result = CliRunner().invoke(main, ["inspect", str(TINY), "--tensor", "text/q6", "--npy", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"Error: --npy {out}: No such file or directory"]
    assert not list(tmp_path.rglob("*.npy*"))
