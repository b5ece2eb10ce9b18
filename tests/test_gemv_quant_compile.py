"""gemv_quant.cu on the CPU: NVRTC compiles it for every target arch with every kernel quant_ops launches,
the weight loads leave before the wait for the previous kernel, and quant_ops refuses malformed weights
before anything reaches a stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_rt.cuda import quant_ops
from ninfer_rt.cuda.compiler import compile_family, family_ptx
from ninfer_rt.cuda.linear_ops import GEMV_BUCKETS, Epilogue
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.quantize.format import ScaleFormat
from test_pdl_contract import entry_bodies

TARGET_ARCHS = ("sm_80", "sm_90a", "sm_120a")


def kernel_names() -> set[str]:
    gemvs = {
        quant_ops.gemv_spec(bits, rows, group, warps).name
        for bits in (4, 8) for rows in GEMV_BUCKETS for group in (32, 64, 128, 256) for warps in quant_ops.WARPS
    }
    f16s = {
        quant_ops.gemv_spec(bits, rows, group, warps, ScaleFormat.FP16).name
        for bits, group in quant_ops.F16S_FORMATS for rows in GEMV_BUCKETS for warps in quant_ops.WARPS
    }
    return gemvs | f16s | {quant_ops.dequantize_spec(bits, scales).name for bits in (4, 8) for scales in ScaleFormat}


def test_the_artifact_formats_have_fp16_scale_kernels() -> None:
    # Q4G64 -> int4 g64; Q5G64 / Q6G64 -> int8 g64 (a whole int8 column per scale); W8G32 -> int8 g32.
    names = {quant_ops.gemv_spec(bits, 3, group, 8, ScaleFormat.FP16).name for bits, group in quant_ops.F16S_FORMATS}
    assert names == {"gemv_int4_g64_f16s", "gemv_int8_b4_f16s", "gemv_int8_g32_f16s"}
    assert quant_ops.gemv_spec(8, 1, 64, 16, ScaleFormat.FP16).name == "gemv_int8_b1_f16s_w16"
    assert quant_ops.dequantize_spec(4, ScaleFormat.FP16).name == "dequantize_int4_f16s_bf16"
    assert quant_ops.dequantize_spec(4).name == "dequantize_int4_bf16"


def test_grids_of_at_most_two_tiles_per_sm_get_16_warps_per_block() -> None:
    # H200 (132 SMs), qwen3-8b: o_proj and down have 256 tiles, qkv 384, gate_up 1,536.
    assert [quant_ops.gemv_warps(tiles, 132) for tiles in (256, 264, 265, 384, 1536)] == [16, 16, 8, 8, 8]
    assert quant_ops.gemv_spec(8, 1, 128, 16).name == "gemv_int8_b1_w16"
    assert quant_ops.gemv_spec(4, 3, 32, 16).name == "gemv_int4_g32_w16"
    with pytest.raises(ValueError, match="12 warps per block"):
        quant_ops.gemv_spec(8, 1, 128, 12)


def test_small_groups_have_their_own_kernels() -> None:
    assert {quant_ops.gemv_spec(bits, 3, group).name for bits in (4, 8) for group in (32, 64)} == {
        "gemv_int4_g32", "gemv_int4_g64", "gemv_int8_g32", "gemv_int8_b4"
    }


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_every_launched_kernel_compiles_for_each_target(arch: str, tmp_path: Path) -> None:
    compiled = compile_family("gemv_quant", arch, cache=tmp_path)
    for name in kernel_names():
        assert name.encode() in compiled.cubin, f"{name} missing from the {arch} cubin"


def weight(
    rows: int = 16, cols: int = 256, bits: int = 4, group_size: int = 128, padded_rows: int | None = None,
    scale_format: ScaleFormat = ScaleFormat.BF16,
) -> QuantizedDeviceWeight:
    streams = StreamSet()  # logical buffers: the checks run before any launch
    stored = padded_rows or rows
    qweight = DeviceBuffer(streams, stored * cols * bits // 8, "w.q")
    scales = DeviceBuffer(streams, max(stored * cols // max(group_size, 1) * 2, 16), "w.q.scales")
    return QuantizedDeviceWeight(qweight, scales, rows, cols, bits, group_size, scale_format)


@pytest.mark.parametrize(
    ("w", "message"),
    [
        (weight(group_size=96), "group size 96"),
        (weight(bits=8, group_size=32, cols=64), None),  # one int8 column, two groups
        (weight(bits=8, group_size=16), "group size 16"),  # a run of 32 inputs shares one scale
        (weight(bits=4, group_size=64, cols=192), "cols % 128"),  # not a whole int4 column
        (weight(bits=3), "3-bit"),
        (weight(rows=20, padded_rows=32), None),  # 3 octets, padded to 4
        (weight(rows=20, padded_rows=24), "qweight"),  # the padding octet is missing
        (weight(bits=4, group_size=64, scale_format=ScaleFormat.FP16), None),  # Q4G64
        (weight(bits=8, group_size=32, scale_format=ScaleFormat.FP16), None),  # W8G32
        (weight(bits=4, group_size=128, scale_format=ScaleFormat.FP16), r"not \(4, 128\)"),  # no such kernel
    ],
)
def test_weights_the_kernels_cannot_read_are_refused(w: QuantizedDeviceWeight, message: str | None) -> None:
    if message is None:
        w.check("gemv_quant")
        return
    with pytest.raises(ValueError, match=message):
        w.check("gemv_quant")


def test_octets_pad_to_whole_tiles() -> None:
    assert weight(rows=16).octets == 2 and weight(rows=17).octets == 4 and weight(rows=8).octets == 2
    assert weight(rows=16, bits=8).code_bytes == 16 * 256
    assert weight(group_size=128).group_log2 == 7 and weight(group_size=32).group_log2 == 5


def test_more_than_8_rows_points_to_the_dequantize_path() -> None:
    with pytest.raises(ValueError, match="dequantize"):
        quant_ops.gemv_spec(4, 9)


def test_swiglu_needs_whole_octets_of_outputs() -> None:
    streams = StreamSet()
    stream, buf = streams.create("compute"), DeviceBuffer(streams, 1 << 16, "b")
    w = weight(rows=2 * 12, padded_rows=32)  # N = 12: up rows would start mid-octet
    with pytest.raises(ValueError, match="N % 8 == 0"):
        quant_ops.gemv(None, stream, buf, w, buf, 1, Epilogue.SWIGLU)  # type: ignore[arg-type]
    assert stream.ring.seq == 0


def test_gemv_issues_weight_loads_before_waiting_for_the_previous_kernel() -> None:
    bodies = entry_bodies(family_ptx("gemv_quant", "sm_90a"))
    for name in ("gemv_int4_b1", "gemv_int8_b8", "gemv_int4_g32", "gemv_int4_g64_f16s", "gemv_int8_b1_f16s"):
        body = bodies[name]
        assert body.index("ld.global.nc.L1::no_allocate") < body.index("griddepcontrol.wait"), name
        assert body.index("griddepcontrol.wait") < body.index("mma.sync"), name


def test_dequantization_masks_come_from_registers_not_immediates() -> None:
    # An immediate mask is re-materialized by ptxas before every LOP3 (a sixth of the int4 GEMV's hot-loop
    # instructions on sm_90a); the kernels read the masks once from dequant_mask_table instead.
    masks = {"0x000F000F": "983055", "0x007F007F": "8323199", "0x00800080": "8388736"}
    bodies = entry_bodies(family_ptx("gemv_quant", "sm_90a"))
    for name in ("gemv_int4_b1", "gemv_int8_b8", "gemv_int4_g32", "dequantize_int8_bf16", "gemv_int8_g32_f16s",
                 "dequantize_int4_f16s_bf16"):
        body = bodies[name]
        assert "ld.volatile.global.u32" in body, name
        for hex_value, decimal in masks.items():
            assert decimal not in body, f"{name} has the mask {hex_value} as an immediate"
