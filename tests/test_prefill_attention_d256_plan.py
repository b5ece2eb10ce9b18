"""Prefill attention at head_dim 256 (the 27B's gated-attention layers: 24 q heads over 4 kv heads) on the CPU:
which kernel the plan picks per arch and page variant (sm_90a's wgmma kernel with 128-row tiles and its own
combine, the mma.sync one's 64-row tiles elsewhere and for unwidened int8 pages), the tiles and the split
workspace that follow the kernel's rows, and the launches a step makes (a recording library, no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ninfer_rt.cuda import attention_prefill_plan as prefill_plan
from ninfer_rt.cuda.attention_plan import KVVariant
from test_attention_compile import H200_SMS, RecordingLibrary, h200_occupancy, logical_step, run_attention_op  # noqa: F401 -- h200_occupancy: an autouse fixture


@pytest.mark.parametrize("arch", ["sm_80", "sm_120a"])
@pytest.mark.parametrize(("variant", "smem"), [(KVVariant.BF16, 101_376), (KVVariant.INT8, 100_864)])
def test_head_dim_256_prefill_is_the_mma_sync_kernel_off_hopper(arch: str, variant: KVVariant, smem: int) -> None:
    # 64-row tiles: Q, K, V [64][264] 16-bit (int8: Q and V f16, the raw pages [64][256] bytes, K's chunks
    # swizzled, and their scales); within the 101,376 bytes an sm_120 block may have (the seed's 27B with int8
    # KV on an RTX 5090). The wgmma kernels and the widening are sm_90a only
    kernel = prefill_plan.prefill_kernel(arch, 256, variant)
    assert (kernel.spec.name, kernel.threads, kernel.smem) == (f"prefill_attention_d256_{variant.value}", 128, smem)
    assert (kernel.tile_rows, kernel.combine.name) == (64, "prefill_attention_combine_d256")
    assert prefill_plan.prefill_smem_bytes(256, variant) == smem
    assert not prefill_plan.prefill_wgmma_applies(arch, 256, variant) and not prefill_plan.prefill_widens(arch, 256, variant, 4096)
    with pytest.raises(ValueError, match="no wgmma kernel"):
        prefill_plan.prefill_kernel(arch, 256, variant, wgmma=True)


@pytest.mark.parametrize("variant", [KVVariant.BF16, KVVariant.WIDENED])
def test_head_dim_256_prefill_on_sm_90a_is_the_wgmma_kernel_with_128_row_tiles(variant: KVVariant) -> None:
    # Q [128][256] 16-bit and two buffers of K and V [64][256]: 192 KiB + the 1 KiB of swizzle alignment (one block per SM)
    kernel = prefill_plan.prefill_kernel("sm_90a", 256, variant)
    assert (kernel.spec.name, kernel.threads, kernel.smem) == (f"prefill_attention_sm90_d256_{variant.value}", 256, 197_632)
    assert (kernel.tile_rows, kernel.combine.name) == (128, "prefill_attention_combine_d256_r128")
    assert prefill_plan.prefill_sm90_smem(256, variant) == 128 * 256 * 2 + 4 * 64 * 256 * 2 + 1024
    assert prefill_plan.prefill_kernel("sm_90a", 256, KVVariant.BF16, wgmma=False).spec.name == "prefill_attention_d256_bf16"


def test_int8_kv_at_head_dim_256_on_sm_90a_is_widened_for_long_chunks_else_the_mma_sync_kernel() -> None:
    int8 = KVVariant.INT8
    assert prefill_plan.prefill_widens("sm_90a", 256, int8, 256) and not prefill_plan.prefill_widens("sm_90a", 256, int8, 255)
    assert prefill_plan.prefill_kernel("sm_90a", 256, int8).spec.name == "prefill_attention_d256_int8"


def test_tiles_and_the_workspace_follow_the_kernels_tile_rows() -> None:
    # the gated-attention layers of Qwen3.6-27B: 24 q heads over 4 kv heads, GQA 6 -> 10 chunk rows of a 64-row
    # tile (60 used; the mma.sync kernel at head_dim 256), 21 of a 128-row tile (126 used)
    assert prefill_plan.mma_sync_tile_rows(256) == 64 and prefill_plan.mma_sync_tile_rows(128) == prefill_plan.mma_sync_tile_rows(64) == 128
    assert prefill_plan.prefill_tile_queries(24, 4, 64) == 10 and prefill_plan.prefill_tile_queries(24, 4, 128) == 21
    assert prefill_plan.prefill_grid_blocks(531, 2, 24, 4, 64) == 54 * 4 * 2
    assert prefill_plan.prefill_grid_blocks(531, 2, 24, 4, 128) == 26 * 4 * 2
    assert prefill_plan.prefill_workspace_bytes(7 * 64, 256) == (7 * 64 * 256 * 4, 7 * 64 * 2 * 4)
    # the workspace holds as many floats at head_dim 256 as at 128: half the rows, so half the 128-row blocks
    rows_256, rows_128 = prefill_plan.prefill_workspace_rows(H200_SMS, 256), prefill_plan.prefill_workspace_rows(H200_SMS, 128)
    assert rows_128 == H200_SMS * 16 * 128 and 2 * rows_256 == rows_128 == prefill_plan.prefill_workspace_rows(H200_SMS, 64)
    assert prefill_plan.prefill_workspace_bytes(rows_256, 256)[0] == prefill_plan.prefill_workspace_bytes(rows_128, 128)[0]
    with pytest.raises(ValueError, match="exceeds a 64-row tile"):
        prefill_plan.prefill_tile_queries(65, 1, 64)


@pytest.mark.parametrize(("context", "split"), [(300, False), (4000, True)])
def test_a_head_dim_256_prefill_step_off_hopper_launches_64_row_tiles_and_combines_them(context: int, split: bool) -> None:
    lib = RecordingLibrary(device=SimpleNamespace(sm_count=H200_SMS, arch="sm_80"))
    step = logical_step([300], [context], heads=(24, 4, 256))
    run_attention_op(lib, step)
    names = [launch.name for launch in lib.launches]
    assert names == ["rope_kv_d256_bf16", "prefill_attention_d256_bf16", *(["prefill_attention_combine_d256"] if split else [])]
    prefill = lib.launches[1]
    splits = prefill.grid[0] // 30  # 300 rows in tiles of 10 chunk rows
    assert prefill.grid == (30 * splits, 4, 1) and (splits > 1) == split
    assert (prefill.block, prefill.smem) == (128, 101_376) and lib.raised["prefill_attention_d256_bf16"] == 101_376
    if split:
        assert lib.launches[2].grid == (30 * 64 // 16, 4, 1)


def test_a_head_dim_256_prefill_step_on_sm_90a_launches_128_row_wgmma_tiles_and_their_combine() -> None:
    lib, step = RecordingLibrary(), logical_step([300], [4000], heads=(24, 4, 256))
    run_attention_op(lib, step)
    names = [launch.name for launch in lib.launches]
    assert names == ["rope_kv_d256_bf16", "prefill_attention_sm90_d256_bf16", "prefill_attention_combine_d256_r128"]
    prefill, combine = lib.launches[1:]
    splits = prefill.grid[0] // 15  # 300 rows in tiles of 21 chunk rows: 15 tiles
    assert prefill.grid == (15 * splits, 4, 1) and splits > 1
    assert (prefill.block, prefill.smem) == (256, 197_632) and lib.raised["prefill_attention_sm90_d256_bf16"] == 197_632
    assert combine.grid == (15 * 128 // 16, 4, 1)
    assert 15 * 4 * splits * 128 <= prefill_plan.prefill_workspace_rows(H200_SMS, 256)


SM120_SMEM_OPTIN = 99 * 1024  # the most dynamic shared memory a block of sm_86 / sm_89 / sm_120 may ask for


@pytest.mark.parametrize("variant", [KVVariant.BF16, KVVariant.INT8])
@pytest.mark.parametrize("head_dim", prefill_plan.PREFILL_HEAD_DIMS)
def test_every_mma_sync_prefill_kernel_fits_an_sm_120_block(head_dim: int, variant: KVVariant) -> None:
    assert prefill_plan.prefill_kernel("sm_120a", head_dim, variant).smem <= SM120_SMEM_OPTIN
