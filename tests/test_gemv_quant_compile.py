"""gemv_quant.cu on the CPU: NVRTC compiles it for every target arch with every kernel quant_ops launches,
and quant_ops refuses malformed weights before anything reaches a stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_rt.cuda import quant_ops
from ninfer_rt.cuda.compiler import compile_family
from ninfer_rt.cuda.linear_ops import GEMV_BUCKETS
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import StreamSet

TARGET_ARCHS = ("sm_80", "sm_90a", "sm_120a")


def kernel_names() -> set[str]:
    gemvs = {quant_ops.gemv_spec(bits, rows).name for bits in (4, 8) for rows in GEMV_BUCKETS}
    return gemvs | {quant_ops.dequantize_spec(bits).name for bits in (4, 8)}


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_every_launched_kernel_compiles_for_each_target(arch: str, tmp_path: Path) -> None:
    compiled = compile_family("gemv_quant", arch, cache=tmp_path)
    for name in kernel_names():
        assert name.encode() in compiled.cubin, f"{name} missing from the {arch} cubin"


def weight(rows: int = 8, cols: int = 256, bits: int = 4, group_size: int = 128) -> QuantizedDeviceWeight:
    streams = StreamSet()  # logical buffers: the checks run before any launch
    qweight = DeviceBuffer(streams, rows * cols * bits // 8, "w.q")
    scales = DeviceBuffer(streams, rows * cols // group_size * 2, "w.q.scales")
    return QuantizedDeviceWeight(qweight, scales, rows, cols, bits, group_size)


@pytest.mark.parametrize(
    ("w", "message"),
    [
        (weight(group_size=96), "group size 96"),
        (weight(bits=8, group_size=16, cols=256), None),  # valid for int8 (one 16-value chunk per group)
        (weight(bits=4, group_size=16), "group size 16"),  # half an int4 chunk
        (weight(bits=3), "3-bit"),
    ],
)
def test_weights_the_kernels_cannot_read_are_refused(w: QuantizedDeviceWeight, message: str | None) -> None:
    if message is None:
        w.check("gemv_quant")
        return
    with pytest.raises(ValueError, match=message):
        w.check("gemv_quant")


def test_group_shift_is_log2_of_chunks_per_group() -> None:
    assert weight(bits=4, group_size=128).group_shift == 2  # 32 int4 values per chunk
    assert weight(bits=8, group_size=128).group_shift == 3  # 16 int8 values per chunk
    assert weight(bits=4, group_size=32).group_shift == 0


def test_more_than_8_rows_points_to_the_dequantize_path() -> None:
    with pytest.raises(ValueError, match="dequantize"):
        quant_ops.gemv_spec(4, 9)
