"""`ninfer-rt kernels compile`: compiles every family, caches, reports errors with clear exit codes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ninfer_rt.cli import main
from ninfer_rt.cuda import compiler
from ninfer_rt.cuda.compiler import families


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("NINFER_CACHE_DIR", str(directory))
    return directory


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def table_rows(output: str) -> list[list[str]]:
    """The data rows of the compile table: family, arch, cubin bytes, seconds, status."""
    return [line.split() for line in output.strip().splitlines()[1:]]


def test_help_lists_the_kernels_group() -> None:
    result = run("--help")
    assert result.exit_code == 0 and "kernels" in result.output


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_compile_twice_second_run_is_all_cached_and_fast(arch: str) -> None:
    expected = families()
    first = run("kernels", "compile", "--arch", arch)
    assert first.exit_code == 0, first.output
    assert [row[0] for row in table_rows(first.output)] == expected
    assert {row[4] for row in table_rows(first.output)} == {"compiled"}

    second = run("kernels", "compile", "--arch", arch)
    assert second.exit_code == 0, second.output
    rows = table_rows(second.output)
    assert [row[0] for row in rows] == expected
    assert all(row[1] == arch and int(row[2]) > 0 and row[4] == "cached" for row in rows)
    assert sum(float(row[3]) for row in rows) < 1.0


def test_compile_only_the_named_families() -> None:
    result = run("kernels", "compile", "--arch", "sm_80", "rmsnorm")
    assert result.exit_code == 0, result.output
    assert [row[0] for row in table_rows(result.output)] == ["rmsnorm"]


def test_unknown_family_is_one_line_and_exit_2() -> None:
    result = run("kernels", "compile", "--arch", "sm_90a", "nonexistent")
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "'nonexistent'" in result.output


def test_unknown_arch_is_one_line_and_exit_2() -> None:
    result = run("kernels", "compile", "--arch", "sm_12")
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "'sm_12'" in result.output


def test_native_arch_without_a_gpu_is_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "device_count", lambda: 0)
    result = run("kernels", "compile", "--arch", "native")
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_compile_error_exits_non_zero_with_the_nvrtc_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = tmp_path / "kernels_src"
    shutil.copytree(compiler.kernels_dir(), kernels)
    (kernels / "broken.cu").write_text('// broken on line 2\nextern "C" __global__ void k() { int x = ; }\n')
    monkeypatch.setenv("NINFER_KERNELS_DIR", str(kernels))
    result = run("kernels", "compile", "--arch", "sm_90a", "broken")
    assert result.exit_code == 1
    assert "broken.cu(2): error" in result.output


def test_compile_out_writes_each_cubin_as_the_cuda_tools_read_it(tmp_path: Path) -> None:
    out = tmp_path / "cubins"
    result = run("kernels", "compile", "--arch", "sm_90a", "rmsnorm", "embedding", "--out", str(out))
    assert result.exit_code == 0, result.output
    for family in ("rmsnorm", "embedding"):
        cubin = (out / f"{family}-sm_90a.cubin").read_bytes()
        assert cubin.startswith(b"\x7fELF")  # no cache header: cuobjdump -sass reads it
        assert cubin == compiler.compile_family(family, "sm_90a").cubin
    assert sorted(p.name for p in out.iterdir()) == ["embedding-sm_90a.cubin", "rmsnorm-sm_90a.cubin"]


def test_compile_out_onto_a_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    result = run("kernels", "compile", "--arch", "sm_90a", "rmsnorm", "--out", str(taken))
    assert result.exit_code == 2
    assert "'--out'" in result.output and "is a file" in result.output
    assert taken.read_text() == "not a directory"


def test_compile_out_that_cannot_be_created_is_one_line_and_exit_2(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    result = run("kernels", "compile", "--arch", "sm_90a", "rmsnorm", "--out", str(taken / "cubins"))
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and result.output.startswith(f"Error: --out {taken / 'cubins'}:")
