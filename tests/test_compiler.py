"""NVRTC compilation of kernels_src/ and the on-disk cubin cache (no GPU needed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ninfer_rt.cuda import compiler
from ninfer_rt.cuda.compiler import ArchError, KernelCompileError, UnknownFamilyError, compile_family, families

TARGET_ARCHS = ("sm_120a", "sm_90a", "sm_80")
ELF_MAGIC = b"\x7fELF"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("NINFER_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of kernels_src/ that a test may edit."""
    directory = tmp_path / "kernels_src"
    shutil.copytree(compiler.kernels_dir(), directory)
    monkeypatch.setenv("NINFER_KERNELS_DIR", str(directory))
    return directory


def test_families_are_the_cu_files_of_kernels_src() -> None:
    assert families() == sorted(path.stem for path in compiler.kernels_dir().glob("*.cu"))
    assert {"rmsnorm", "activation"} <= set(families())


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("family", families())
def test_every_family_compiles_to_a_cubin_for_each_target_arch(family: str, arch: str) -> None:
    result = compile_family(family, arch)
    assert (result.family, result.arch, result.cached) == (family, arch, False)
    assert result.cubin.startswith(ELF_MAGIC)


def test_every_family_source_opens_with_a_comment() -> None:
    for family in families():
        assert (compiler.kernels_dir() / f"{family}.cu").read_text().startswith("//"), family


def test_second_compile_is_loaded_from_the_cache() -> None:
    first = compile_family("rmsnorm", "sm_90a")
    second = compile_family("rmsnorm", "sm_90a")
    assert second.cached and second.cubin == first.cubin


def test_cache_is_keyed_by_arch() -> None:
    compile_family("rmsnorm", "sm_90a")
    assert not compile_family("rmsnorm", "sm_80").cached


def test_cache_is_keyed_by_defines() -> None:
    compile_family("rmsnorm", "sm_90a")
    assert not compile_family("rmsnorm", "sm_90a", defines={"NINFER_VARIANT": 2}).cached
    assert compile_family("rmsnorm", "sm_90a", defines={"NINFER_VARIANT": 2}).cached


def test_editing_a_local_header_invalidates_the_cache(kernels: Path) -> None:
    compile_family("rmsnorm", "sm_90a")
    header = kernels / "common.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    assert not compile_family("rmsnorm", "sm_90a").cached


def test_editing_the_source_invalidates_the_cache(kernels: Path) -> None:
    compile_family("activation", "sm_90a")
    source = kernels / "activation.cu"
    source.write_text(source.read_text() + "\n// edited\n")
    assert not compile_family("activation", "sm_90a").cached


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


@pytest.mark.parametrize(
    "corrupt",
    [_flip_last_byte, lambda data: data[: len(data) // 2], lambda data: b"", lambda data: b"garbage" + data[7:]],
    ids=["flipped-byte", "truncated", "empty", "bad-header"],
)
def test_corrupt_cache_entry_is_recompiled_and_repaired(cache: Path, corrupt) -> None:
    original = compile_family("rmsnorm", "sm_90a")
    (entry,) = cache.glob("rmsnorm-sm_90a-*.cubin")
    entry.write_bytes(corrupt(entry.read_bytes()))
    recompiled = compile_family("rmsnorm", "sm_90a")
    assert not recompiled.cached and recompiled.cubin == original.cubin
    assert compile_family("rmsnorm", "sm_90a").cached


def test_cache_directory_holds_only_the_entry_after_a_compile(cache: Path) -> None:
    compile_family("activation", "sm_80")
    (entry,) = cache.iterdir()  # the temporary file was renamed into place, not left behind
    assert entry.name.startswith("activation-sm_80-") and entry.suffix == ".cubin"


def test_broken_source_raises_compile_error_naming_file_and_line(kernels: Path) -> None:
    (kernels / "broken.cu").write_text('// a kernel with a type error on line 3\nextern "C" __global__ void k(int* p) {\n    p[0] = undeclared_name;\n}\n')
    with pytest.raises(KernelCompileError) as info:
        compile_family("broken", "sm_90a")
    assert "broken.cu(3)" in str(info.value)
    assert "undeclared_name" in info.value.log


def test_error_in_a_local_header_names_the_header(kernels: Path) -> None:
    (kernels / "bad.cuh").write_text("int broken = ;\n")
    (kernels / "uses_bad.cu").write_text('// includes a broken header\n#include "bad.cuh"\n')
    with pytest.raises(KernelCompileError, match=r"bad\.cuh\(1\)"):
        compile_family("uses_bad", "sm_90a")


def test_source_may_request_nvrtc_options(kernels: Path) -> None:
    (kernels / "opts.cu").write_text(
        '// nvrtc-options: -DNINFER_FROM_SOURCE=3\nstatic_assert(NINFER_FROM_SOURCE == 3, "option not applied");\n'
        'extern "C" __global__ void k() {}\n'
    )
    assert compile_family("opts", "sm_90a").cubin.startswith(ELF_MAGIC)


def test_unknown_family_is_rejected() -> None:
    with pytest.raises(UnknownFamilyError, match="'no_such_family'"):
        compile_family("no_such_family", "sm_90a")


@pytest.mark.parametrize("arch", ["sm_91", "sm_80a", "sm_90f", "sm_9", "compute_90", "90", "sm_90x", ""])
def test_unknown_arch_is_rejected(arch: str) -> None:
    with pytest.raises(ArchError, match="unknown arch"):
        compile_family("rmsnorm", arch)


def test_native_arch_without_a_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "device_count", lambda: 0)
    with pytest.raises(ArchError, match="needs a CUDA GPU"):
        compile_family("rmsnorm", "native")


def test_cuda_headers_are_found() -> None:
    (include,) = compiler.cuda_include_dirs()
    assert (Path(include) / "cuda_bf16.h").is_file()


def test_cuda_headers_are_found_without_cuda_pathfinder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "_pathfinder_include_dir", lambda: None)
    (include,) = compiler.cuda_include_dirs()
    assert (Path(include) / "cuda_bf16.h").is_file()
