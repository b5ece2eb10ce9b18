"""Ordering rule 1: no default stream anywhere, and only ninfer_rt/cuda talks to the driver."""

from __future__ import annotations

from pathlib import Path

import pytest
from cuda.bindings import driver as cu
from import_scan import imported_modules

import ninfer_rt
from ninfer_rt.cuda import streams as streams_module
from ninfer_rt.cuda.driver import Device
from ninfer_rt.cuda.streams import DefaultStreamError, StreamSet, require_stream

PACKAGE = Path(ninfer_rt.__file__).parent
DRIVER_PACKAGE = PACKAGE / "cuda"
FORBIDDEN_OUTSIDE_CUDA = ("cuda", "nvmath")


@pytest.mark.parametrize(
    "stream",
    [None, 0, cu.CUstream(0), cu.CU_STREAM_LEGACY, cu.CU_STREAM_PER_THREAD, 1, 2],
    ids=["None", "0", "CUstream(0)", "CU_STREAM_LEGACY", "CU_STREAM_PER_THREAD", "1", "2"],
)
def test_require_stream_rejects_default_streams(stream: object) -> None:
    with pytest.raises(DefaultStreamError, match="default"):
        require_stream(stream)


def test_require_stream_passes_a_stream_set_stream() -> None:
    stream = StreamSet().create("compute")
    assert require_stream(stream) is stream


def fake_device() -> Device:
    return Device(0, None, "fake", (9, 0), 132, 1 << 30, 227 * 1024)


@pytest.mark.parametrize("handle", [0, 1, 2], ids=["null", "legacy", "per-thread"])
def test_stream_set_refuses_a_default_stream_handle_from_the_driver(monkeypatch: pytest.MonkeyPatch, handle: int) -> None:
    monkeypatch.setattr(streams_module.cu, "cuStreamCreate", lambda flags: (cu.CUresult.CUDA_SUCCESS, cu.CUstream(handle)))
    owner = StreamSet(fake_device())
    with pytest.raises(DefaultStreamError, match="default-stream handle"):
        owner.create("compute")
    assert owner.streams == []


def test_stream_set_creates_only_non_blocking_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    requested: list[object] = []

    def create(flags: object) -> tuple:
        requested.append(flags)
        return cu.CUresult.CUDA_SUCCESS, cu.CUstream(0x5000)

    monkeypatch.setattr(streams_module.cu, "cuStreamCreate", create)
    StreamSet(fake_device()).create("compute")
    assert requested == [cu.CUstream_flags.CU_STREAM_NON_BLOCKING]


def is_forbidden(module: str) -> bool:
    return module.split(".")[0] in FORBIDDEN_OUTSIDE_CUDA


def test_only_ninfer_rt_cuda_imports_cuda_or_nvmath() -> None:
    offenders = {
        f"{path.relative_to(PACKAGE.parent)}: {module}"
        for path in PACKAGE.rglob("*.py")
        if DRIVER_PACKAGE not in path.parents
        for module in imported_modules(path)
        if is_forbidden(module)
    }
    assert not offenders, f"only ninfer_rt/cuda may import the CUDA bindings: {sorted(offenders)}"


def test_import_scan_sees_every_import_form(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import cuda.bindings.driver as cu\nfrom nvmath import bindings\ndef f():\n    from cuda import pathfinder\n")
    assert {name for name in imported_modules(module) if is_forbidden(name)} == {"cuda.bindings.driver", "nvmath", "cuda"}
