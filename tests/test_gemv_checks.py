"""GEMV / GEMM argument checks: bad shapes are refused with a clear message before anything is enqueued."""

from __future__ import annotations

import pytest

from ninfer_rt.cuda import linear_ops
from ninfer_rt.cuda.blas import GemmShape
from ninfer_rt.cuda.linear_ops import Epilogue, gemv_spec
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet


@pytest.mark.parametrize(("rows", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_a_width_runs_the_smallest_bucket_that_holds_it(rows: int, bucket: int) -> None:
    assert gemv_spec(Epilogue.STORE, rows).name == f"gemv_bf16_b{bucket}"


@pytest.mark.parametrize("rows", [0, 9, 64])
def test_widths_outside_1_to_8_are_refused(rows: int) -> None:
    with pytest.raises(ValueError, match="rows must be in 1..8"):
        gemv_spec(Epilogue.SWIGLU, rows)


def test_k_not_a_multiple_of_8_is_refused_before_launch() -> None:
    streams = StreamSet()
    stream, buf = streams.create("compute"), DeviceBuffer(streams, 4096, "b")
    with pytest.raises(ValueError, match="multiple of 8"):
        linear_ops.gemv(None, stream, buf, buf, buf, 1, 4, 12)  # type: ignore[arg-type]
    assert stream.ring.seq == 0


def test_residual_epilogue_needs_a_residual_and_others_refuse_one() -> None:
    streams = StreamSet()
    stream, buf = streams.create("compute"), DeviceBuffer(streams, 4096, "b")
    with pytest.raises(ValueError, match="needs a residual"):
        linear_ops.gemv(None, stream, buf, buf, buf, 1, 8, 8, Epilogue.RESIDUAL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ignores it"):
        linear_ops.gemv(None, stream, buf, buf, buf, 1, 8, 8, Epilogue.STORE, residual=buf)  # type: ignore[arg-type]


def test_too_small_output_is_named() -> None:
    streams = StreamSet()
    stream = streams.create("compute")
    big, small = DeviceBuffer(streams, 4096, "big"), DeviceBuffer(streams, 8, "small")
    with pytest.raises(ValueError, match=r"y \(small\)"):
        linear_ops.gemv(None, stream, big, big, small, 2, 16, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize(("m", "n", "k"), [(4, 8, 12), (4, 12, 8), (0, 8, 8)])
def test_gemm_shapes_need_16_byte_rows_and_positive_sizes(m: int, n: int, k: int) -> None:
    with pytest.raises(ValueError):
        GemmShape(m, n, k)
