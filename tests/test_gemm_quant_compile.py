"""gemm_quant.cu and gemm_quant_sm90.cu on the CPU: NVRTC compiles every kernel the wrapper launches for each
target arch (the wgmma kernels for sm_90a, within its registers and shared memory), the host's mirror of the
kernels' constants (gemm_quant_ops) matches the sources, the weight copies leave before the wait for the previous
kernel, and the wrapper picks the kernel and its launch shape, declares its accesses and refuses what the kernels
cannot compute before anything reaches a stream (a recording library, no GPU)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kernel_source import constexpr_int
from ninfer_rt.cuda import gemm_quant_ops as plan
from ninfer_rt.cuda.compiler import compile_family, compile_log, family_ptx
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.quant_ops import F16S_FORMATS, QuantizedDeviceWeight
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.quantize.format import ScaleFormat
from test_attention_compile import RecordingLibrary
from test_pdl_contract import entry_bodies

TARGET_ARCHS = ("sm_80", "sm_90a", "sm_120a")
SM120_SMEM_OPTIN = 99 * 1024  # the most dynamic shared memory a block of sm_86 / sm_89 / sm_120 may ask for
SM90_SMEM_OPTIN = 227 * 1024  # an H100 / H200 block's
GROUPS = (32, 64, 128, 256)


def variants() -> list[tuple[int, int, ScaleFormat]]:
    bf16 = [(bits, group, ScaleFormat.BF16) for bits in (4, 8) for group in GROUPS]
    return bf16 + [(bits, group, ScaleFormat.FP16) for bits, group in F16S_FORMATS]


def kernel_names() -> set[str]:
    return {plan.gemm_spec(bits, group, tokens, scales).name for bits, group, scales in variants() for tokens in plan.TOKEN_TILES}


def test_kernel_names() -> None:
    assert kernel_names() == {
        f"gemm_{v}_t{t}" for t in (32, 64)
        for v in ("int4", "int8", "int4_g32", "int4_g64", "int8_g32", "int4_g64_f16s", "int8_f16s", "int8_g32_f16s")
    }
    assert plan.gemm_spec(8, 128, 64).name == plan.gemm_spec(8, 64, 64).name == "gemm_int8_t64"  # a scale per column
    assert [plan.token_tile(rows) for rows in (1, 9, 32, 33, 531, 8192)] == [32, 32, 32, 64, 64, 64]


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_every_launched_kernel_compiles_for_each_target(arch: str, tmp_path: Path) -> None:
    compiled = compile_family("gemm_quant", arch, cache=tmp_path)
    for name in kernel_names():
        assert name.encode() in compiled.cubin, f"{name} missing from the {arch} cubin"


def test_the_hosts_constants_are_the_kernels() -> None:
    source = "gemm_quant.cu"
    assert constexpr_int(source, "kGemmWarps") == plan.WARPS
    assert constexpr_int(source, "kWarpPairs") == plan.WARP_PAIRS
    assert constexpr_int(source, "kRasterTiles") == plan.RASTER_TILES
    assert constexpr_int(source, "kChains") == plan.CHAINS
    assert (constexpr_int(source, "kStagesInt4"), constexpr_int(source, "kStagesInt8")) == (plan.STAGES_INT4, plan.STAGES_INT8)


def test_every_variant_fits_the_shared_memory_of_every_target() -> None:
    sizes = {(bits, group, tokens): plan.smem_bytes(bits, group, tokens) for bits, group, _ in variants() for tokens in plan.TOKEN_TILES}
    assert max(sizes.values()) <= SM120_SMEM_OPTIN, sizes
    # int4 g128 at 64 tokens: 2 stages of 32 octets' weights (16 KiB), 64 tokens' x (16 KiB), scales (512 B)
    assert sizes[(4, 128, 64)] == 2 * (16384 + 16384 + 512)


def test_weight_copies_leave_before_the_wait_and_masks_come_from_registers() -> None:
    masks = ("983055", "8323199", "8388736")  # 0x000F000F, 0x007F007F, 0x00800080 as PTX immediates
    bodies = entry_bodies(family_ptx("gemm_quant", "sm_90a"))
    for name in kernel_names():
        body = bodies[name]
        assert body.index("cp.async.cg.shared.global") < body.index("griddepcontrol.wait") < body.index("mma.sync"), name
        assert "ld.volatile.global.u32" in body and not any(mask in body for mask in masks), name


def test_the_wgmma_kernels_are_the_mma_sync_kernels_variants() -> None:
    assert {plan.sm90_spec(bits, group, scales).name for bits, group, scales in variants()} == {
        f"gemm_{v}_sm90" for v in ("int4", "int8", "int4_g32", "int4_g64", "int8_g32", "int4_g64_f16s", "int8_f16s", "int8_g32_f16s")
    }


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_the_wgmma_kernels_compile_for_sm_90a_only(arch: str, tmp_path: Path) -> None:
    cubin = compile_family("gemm_quant_sm90", arch, cache=tmp_path).cubin
    for bits, group, scales in variants():
        assert (plan.sm90_spec(bits, group, scales).name.encode() in cubin) == (arch == "sm_90a")


def test_the_wgmma_kernels_constants_and_shared_memory() -> None:
    source = "gemm_quant_sm90.cu"
    assert constexpr_int(source, "kGroupThreads") * 2 == constexpr_int(source, "kBlockThreads") == plan.SM90_THREADS
    assert constexpr_int(source, "kTokens") == plan.SM90_TOKENS and constexpr_int(source, "kStages") == plan.SM90_STAGES
    assert constexpr_int(source, "kTileOctets") == plan.TILE_OCTETS and constexpr_int(source, "kRasterTiles") == plan.RASTER_TILES
    # a stage: x, 128 tokens by KC inputs (int4 32 KiB, int8 16 KiB); weights 16 KiB; scales 512 B a segment; 1 KiB rounding
    assert [plan.sm90_stage_bytes(bits, 128) for bits in (4, 8)] == [49 * 1024, 33 * 1024]
    assert plan.sm90_stage_bytes(4, 32) == 50 * 1024  # 4 segments: 2 KiB of scales
    sizes = [plan.sm90_smem_bytes(bits, group) for bits, group, _ in variants()]
    assert plan.sm90_smem_bytes(4, 128) == 4 * 49 * 1024 + 1024 and max(sizes) <= SM90_SMEM_OPTIN


def test_the_wgmma_kernels_copy_weights_before_the_wait_and_x_after_it() -> None:
    bodies = entry_bodies(family_ptx("gemm_quant_sm90", "sm_90a"))
    for bits, group, scales in variants():
        body = bodies[plan.sm90_spec(bits, group, scales).name]
        weights, wait = body.index("cp.async.cg.shared.global"), body.index("griddepcontrol.wait")
        assert weights < wait < body.index("cp.async.ca.shared.global") < body.index("wgmma.mma_async")


def test_the_wgmma_kernels_keep_their_accumulators_in_registers_without_serializing() -> None:
    # ptxas: no spills, and no C7515 ("wgmma.mma_async instructions are serialized ..."), which any other instruction
    # writing the accumulators while a wgmma is in flight brings
    log = compile_log("gemm_quant_sm90", "sm_90a")
    assert "C7515" not in log and "serialized" not in log, log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == len({plan.sm90_spec(*v).name for v in variants()}) and all(spill == ("0", "0") for spill in spills), log


# -- the wrapper -------------------------------------------------------------------------------------------


def weight(streams: StreamSet, rows: int = 300, cols: int = 512, bits: int = 4, group: int = 128,
           scale_format: ScaleFormat = ScaleFormat.BF16) -> QuantizedDeviceWeight:
    w = QuantizedDeviceWeight(DeviceBuffer(streams, 1, "w"), DeviceBuffer(streams, 1, "w.scales"), rows, cols, bits, group, scale_format)
    w.qweight, w.scales = DeviceBuffer(streams, w.code_bytes, "w"), DeviceBuffer(streams, w.scale_bytes, "w.scales")
    return w


@pytest.mark.parametrize(("rows", "epilogue", "tokens"), [(9, Epilogue.STORE, 32), (531, Epilogue.STORE_F32, 64), (70, Epilogue.RESIDUAL, 64)])
def test_gemm_launches_a_block_per_tile_and_declares_its_accesses(rows: int, epilogue: Epilogue, tokens: int) -> None:
    streams, lib = StreamSet(verify=False), RecordingLibrary(device=SimpleNamespace(sm_count=132, arch="sm_80"))  # mma.sync
    w = weight(streams, group=32)  # 300 rows: 38 octets, two row tiles
    x, y = DeviceBuffer(streams, rows * 512 * 2, "x"), DeviceBuffer(streams, rows * 300 * epilogue.out_bytes, "y")
    residual = y if epilogue is Epilogue.RESIDUAL else None
    plan.gemm(lib, streams.create("compute"), x, w, y, rows, epilogue, residual)
    [launch] = lib.launches
    assert launch.name == f"gemm_int4_g32_t{tokens}" and launch.block == plan.THREADS
    assert launch.grid == 2 * -(-rows // tokens) and launch.smem == plan.smem_bytes(4, 32, tokens)
    code = {Epilogue.STORE: 0, Epilogue.RESIDUAL: 1, Epilogue.STORE_F32: 3}[epilogue]
    assert launch.args[5:] == (rows, 300, 512, 5, code, 300)  # y's rows 300 apart: packed
    assert set(launch.reads) == {x.resource, w.qweight.resource, w.scales.resource} | ({y.resource} if residual else set())
    assert launch.writes == (y.resource,)


@pytest.mark.parametrize(("change", "message"), [
    (dict(epilogue=Epilogue.SWIGLU), "SWIGLU epilogue"),
    (dict(group=16), "group size 16"),
    (dict(cols=192, group=64), "cols % 128"),  # not a whole int4 column
    (dict(scale_format=ScaleFormat.FP16), r"not \(4, 128\)"),
    (dict(rows=0), "rows"),
    (dict(y_bytes=100), "y"),
    (dict(out_stride=299), "299 apart"),  # narrower than the weight's 300 rows
    (dict(out_stride=400, y_bytes=40 * 300 * 2), "y"),  # packed bf16 rows fit; 400 apart need (39 * 400 + 300) * 2 bytes
])
def test_gemm_refuses_what_the_kernel_cannot_compute_before_launching(change: dict, message: str) -> None:
    streams, lib = StreamSet(verify=False), RecordingLibrary()
    stream = streams.create("compute")
    cols = change.get("cols", 512)
    w = weight(streams, cols=cols, group=change.get("group", 128), scale_format=change.get("scale_format", ScaleFormat.BF16))
    rows = change.get("rows", 40)
    x, y = DeviceBuffer(streams, 40 * cols * 2, "x"), DeviceBuffer(streams, change.get("y_bytes", 40 * 300 * 4), "y")
    with pytest.raises(ValueError, match=message):
        plan.gemm(lib, stream, x, w, y, rows, change.get("epilogue", Epilogue.STORE), out_stride=change.get("out_stride"))
    assert not lib.launches and stream.ring.seq == 0


@pytest.mark.parametrize(("rows", "arch", "group", "scales", "kernel"), [
    (65, "sm_90a", 128, ScaleFormat.BF16, "gemm_int4_sm90"),
    (64, "sm_90a", 128, ScaleFormat.BF16, "gemm_int4_t64"),  # below SM90_MIN_ROWS
    (531, "sm_90a", 64, ScaleFormat.FP16, "gemm_int4_g64_f16s_sm90"),  # NInfer's Q4G64: a scale per half column
    (531, "sm_80", 128, ScaleFormat.BF16, "gemm_int4_t64"),
    (531, "sm_120a", 128, ScaleFormat.BF16, "gemm_int4_t64"),
])
def test_gemm_runs_the_wgmma_kernel_on_sm_90a_from_65_rows(rows: int, arch: str, group: int, scales: ScaleFormat, kernel: str) -> None:
    streams, lib = StreamSet(verify=False), RecordingLibrary(device=SimpleNamespace(sm_count=132, arch=arch))
    w = weight(streams, group=group, scale_format=scales)  # 300 rows: 38 octets, two row tiles
    x, y = DeviceBuffer(streams, rows * 512 * 2, "x"), DeviceBuffer(streams, rows * 300 * 2, "y")
    plan.gemm(lib, streams.create("compute"), x, w, y, rows)
    [launch] = lib.launches
    assert launch.name == kernel
    if kernel.endswith("_sm90"):
        assert (launch.block, launch.smem, launch.grid) == (256, plan.sm90_smem_bytes(4, group), 2 * -(-rows // 128))
        assert lib.raised[kernel] == plan.sm90_smem_bytes(4, group)


def test_gemm_forced_onto_the_wgmma_kernel_or_off_it() -> None:
    streams, lib = StreamSet(verify=False), RecordingLibrary()
    stream = streams.create("compute")
    x, y = DeviceBuffer(streams, 531 * 512 * 2, "x"), DeviceBuffer(streams, 531 * 300 * 2, "y")
    plan.gemm(lib, stream, x, weight(streams), y, 9, wgmma=True)
    plan.gemm(lib, stream, x, weight(streams), y, 531, wgmma=False)
    assert [launch.name for launch in lib.launches] == ["gemm_int4_sm90", "gemm_int4_t64"]
    off_hopper = RecordingLibrary(device=SimpleNamespace(sm_count=132, arch="sm_120a"))
    with pytest.raises(ValueError, match="the wgmma kernels need sm_90a"):
        plan.gemm(off_hopper, stream, x, weight(streams), y, 531, wgmma=True)
    assert not off_hopper.launches
