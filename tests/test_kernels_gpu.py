"""Every kernel against its float64 reference on the GPU, on odd and large shapes (`pytest -m gpu`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gpu_session import POISON, GpuSession
from kernel_refs import rmsnorm_ref, rmsnorm_residual_ref, silu_mul_ref

from ninfer_rt.cuda import ops
from ninfer_rt.cuda.compiler import families
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.kernels import KernelLibrary

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
ROWS = (1, 7, 333)
HIDDEN = (64, 4096, 5120, 1000, 129)
INTER = (64, 1000, 129, 4096, 5120, 12288)
GUARD_BYTES = 256  # poisoned tail after each output: a write past the end would change it
# bf16 keeps 8 significant bits: each rounding is within 2^-8 relative. The fused residual path rounds
# twice (the stored sum, then the output), so allow 2^-6: any indexing or math bug is off by far more.
ELEMENT_RTOL = 2.0**-6
NORM_RTOL = 1e-2
EPS = 1e-6


@pytest.fixture(scope="module")
def gpu() -> Iterator[GpuSession]:
    session = GpuSession.open()
    yield session
    session.close()


@pytest.fixture
def session(gpu: GpuSession) -> Iterator[GpuSession]:
    yield gpu
    gpu.release()


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0, offset: float = 0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + offset).astype(BF16)


def assert_matches(name: str, got_bf16: np.ndarray, ref: np.ndarray) -> None:
    """Every element written (no NaN left from the poison) and within bf16 bounds of the reference."""
    got = got_bf16.astype(np.float64).reshape(ref.shape)
    assert np.isfinite(got).all(), f"{name}: {np.count_nonzero(~np.isfinite(got))} elements not written"
    relative = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert relative < NORM_RTOL, f"{name}: relative error {relative:.2e}"
    bound = ELEMENT_RTOL * np.abs(ref) + 1e-6
    worst = np.unravel_index(np.argmax(np.abs(got - ref) - bound), ref.shape)
    assert np.all(np.abs(got - ref) <= bound), f"{name}: at {worst} got {got[worst]}, expected {ref[worst]}"


def output_with_guard(session: GpuSession, stream, elements: int, name: str):
    return session.empty(stream, elements * BF16.itemsize + GUARD_BYTES, name)


def assert_guard_untouched(session: GpuSession, stream, buffer, elements: int) -> None:
    raw = session.download(stream, buffer, np.uint8, buffer.nbytes)
    assert np.all(raw[elements * BF16.itemsize :] == POISON), f"{buffer.name}: written past its end"


def gains(rng: np.random.Generator, hidden: int, dtype: str) -> np.ndarray:
    """Gains near 1: bf16, or f32 as the hybrid's zero-centred 1 + w (small w) is prepared."""
    if dtype == "f32":
        return (1.0 + 0.01 * rng.standard_normal(hidden)).astype(np.float32)
    return random_bf16(rng, (hidden,), scale=0.2, offset=1.0)


@pytest.mark.parametrize("gain", ["bf16", "f32"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm_matches_reference(session: GpuSession, rows: int, hidden: int, gain: str) -> None:
    rng = np.random.default_rng(rows * 10007 + hidden)
    x, w = random_bf16(rng, (rows, hidden), scale=3.0), gains(rng, hidden, gain)
    stream = session.stream(f"rmsnorm_{rows}x{hidden}")
    x_dev, w_dev = session.upload(stream, x, "x"), session.upload(stream, w, "w")
    out = output_with_guard(session, stream, x.size, "out")

    ops.rmsnorm(session.lib, stream, x_dev, w_dev, out, rows, hidden, EPS, gain_f32=gain == "f32")

    assert_matches("out", session.download(stream, out, BF16, x.size), rmsnorm_ref(x, w, EPS))
    assert_guard_untouched(session, stream, out, x.size)


@pytest.mark.parametrize("gain", ["bf16", "f32"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm_with_residual_matches_reference(session: GpuSession, rows: int, hidden: int, gain: str) -> None:
    rng = np.random.default_rng(rows * 10009 + hidden)
    x, residual = random_bf16(rng, (rows, hidden)), random_bf16(rng, (rows, hidden), scale=4.0)
    w = gains(rng, hidden, gain)
    stream = session.stream(f"rmsnorm_residual_{rows}x{hidden}")
    x_dev, w_dev = session.upload(stream, x, "x"), session.upload(stream, w, "w")
    residual_dev = session.upload(stream, residual, "residual")
    out = output_with_guard(session, stream, x.size, "out")

    ops.rmsnorm(session.lib, stream, x_dev, w_dev, out, rows, hidden, EPS, residual=residual_dev, gain_f32=gain == "f32")

    ref_out, ref_residual = rmsnorm_residual_ref(x, residual, w, EPS)
    assert_matches("out", session.download(stream, out, BF16, x.size), ref_out)
    assert_matches("residual", session.download(stream, residual_dev, BF16, x.size), ref_residual)
    assert_guard_untouched(session, stream, out, x.size)


@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_reference(session: GpuSession, rows: int, inter: int) -> None:
    rng = np.random.default_rng(rows * 10037 + inter)
    gate_up = random_bf16(rng, (rows, 2 * inter), scale=2.0)
    stream = session.stream(f"silu_mul_{rows}x{inter}")
    gate_up_dev = session.upload(stream, gate_up, "gate_up")
    out = output_with_guard(session, stream, rows * inter, "out")

    ops.silu_mul(session.lib, stream, gate_up_dev, out, rows, inter)

    assert_matches("out", session.download(stream, out, BF16, rows * inter), silu_mul_ref(gate_up))
    assert_guard_untouched(session, stream, out, rows * inter)


def test_a_cold_start_compiles_every_family_up_front_and_says_how_long_a_warm_start_is_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    device = open_device()
    KernelLibrary(device).preload(families())
    cold = capsys.readouterr().err
    KernelLibrary(device).preload(families())
    assert f"compiled {len(families())} kernel families" in cold and capsys.readouterr().err == ""
