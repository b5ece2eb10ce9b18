"""Prefill attention geometry: which prefill kernel applies (the mma.sync one every arch runs, or on sm_90a
the warpgroup-MMA ones, over bf16, int8 or widened int8 pages), its shared memory, tiles, key-range splits
and workspace, and whether and into how many pages a step's int8 KV is widened first.

Pure functions of shapes, arch and occupancy, as attention_plan.py's (which holds the geometry every
attention kernel shares, RoPE's and decode's). The constants mirror the `constexpr`s of
kernels_src/{prefill_common.cuh,prefill_attention,prefill_attention_sm90,prefill_attention_sm90_int8,kv_widen}.cu
(a test parses the sources and checks them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ninfer_rt.cuda.attention_plan import (
    BF16_BYTES,
    F32_BYTES,
    PAGE_SIZE,
    THREADS,
    Heads,
    KVVariant,
    cache_variant,
    decode_max_queries,
    gqa_group,
)
from ninfer_rt.cuda.kernels import Arg, KernelSpec
from ninfer_rt.cuda.ops import _require_positive

PREFILL_HEAD_DIMS = (64, 128, 256)
PREFILL_TILE_ROWS = 128  # kFlashRows: M rows (chunk rows x GQA group) per block
PREFILL_TILE_ROWS_D256 = 64  # kFlashRowsD256: the mma.sync kernel's at head_dim 256 (one m16 tile per warp)
# head dims of the sm_90a wgmma kernels: bf16 and widened KV (prefill_attention_sm90.cu), int8 KV
# (prefill_attention_sm90_int8.cu); their tiles are PREFILL_TILE_ROWS at every head dim
PREFILL_SM90_HEAD_DIMS = (128, 256)
PREFILL_SM90_INT8_HEAD_DIMS = (128,)
PREFILL_MAX_SPLITS = 32  # key-range splits of one prefill tile, at most
PREFILL_MIN_PAGES_PER_SPLIT = 4  # below this a split's Q load and partial write outweigh its keys
PREFILL_COMBINE_ROWS = 16  # kCombineRows: M rows per combine block
# the workspace holds this many split blocks (tiles x kv heads x sequences x splits) of 128 rows at head_dim
# <= 128; at 256, as many floats: half the rows
PREFILL_WORKSPACE_BLOCKS_PER_SM = 16
# sm_90a prefill kernels: bf16 KV, 2 warpgroups (prefill_attention_sm90.cu's kBlockThreads); int8 KV, a copying
# and 2 multiplying warpgroups (prefill_attention_sm90_int8.cu's) with PREFILL_SM90_INT8_STAGES page slots and
# PREFILL_SM90_INT8_LOOKAHEAD raw pages in flight (its kStages, kLookahead)
PREFILL_SM90_BF16_THREADS = 256
PREFILL_SM90_INT8_THREADS = 384
PREFILL_SM90_INT8_STAGES = 4
PREFILL_SM90_INT8_LOOKAHEAD = 3
# Widened int8 KV (kv_widen.cu: f16 pages of the dequantized values, then prefill_attention_sm90.cu's f16
# kernel): the widening dequantizes each page once per step and layer, the int8 kernels apply its scales once
# per tile, and the f16 kernel is faster than the int8 one; the widening's own traffic and the f16 pages' twice
# the bytes cost about what 210 chunk rows gain (H200, 114,812 keys, qwen3-8b heads, widened against int8: 128
# rows 792 against 708 us, 256 rows 1369 against 1397, 531 rows 2639 against 3038; bench/logs/h200-2026-11-30-int8-kv-widening-b41b0ef.txt).
# Its buffers hold the pages of PREFILL_WIDEN_SEQUENCES prefill sequences of the longest context, at most
# PREFILL_WIDEN_BUDGET bytes; the engine reserves them before sizing the KV cache (Executor.reserve_step_buffers).
PREFILL_WIDEN_MIN_QUERIES = 256
PREFILL_WIDEN_SEQUENCES = 2
PREFILL_WIDEN_BUDGET = 1 << 30
WIDEN_THREADS = 256  # kWidenThreads

_GATE = (Arg.PTR, Arg.I32)  # the output gate's (gate, gate_stride): attention_buffers.OutputGate
_PREFILL_SIGNATURE = (Arg.PTR,) * 9 + (Arg.I32, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32, Arg.F32, Arg.I32) + _GATE
_PREFILL_COMBINE_SIGNATURE = (Arg.PTR,) * 5 + (Arg.I32,) * 4 + _GATE
_WIDEN_SIGNATURE = (Arg.PTR,) * 3 + (Arg.I32,) + (Arg.PTR,) * 5 + (Arg.I32, Arg.PTR, Arg.PTR) + (Arg.I32,) * 3
WIDEN_INT8_KV = KernelSpec("kv_widen", "widen_int8_kv", _WIDEN_SIGNATURE)


# -- kernels --------------------------------------------------------------------------------------------


def prefill_spec(head_dim: int, variant: KVVariant) -> KernelSpec:
    return KernelSpec("prefill_attention", f"prefill_attention_d{head_dim}_{cache_variant(variant).value}", _PREFILL_SIGNATURE)


def prefill_combine_spec(head_dim: int, tile_rows: int) -> KernelSpec:
    """The combine of `tile_rows`-row partials: the mma.sync kernel's rows (prefill_attention_combine_d{D}), or
    the sm_90a kernel's 128 at head_dim 256 (prefill_attention_combine_d256_r128)."""
    suffix = "" if tile_rows == mma_sync_tile_rows(head_dim) else f"_r{tile_rows}"
    return KernelSpec("prefill_attention", f"prefill_attention_combine_d{head_dim}{suffix}", _PREFILL_COMBINE_SIGNATURE)


def prefill_sm90_spec(head_dim: int, variant: KVVariant) -> KernelSpec:
    family = "prefill_attention_sm90_int8" if variant is KVVariant.INT8 else "prefill_attention_sm90"
    return KernelSpec(family, f"prefill_attention_sm90_d{head_dim}_{variant.value}", _PREFILL_SIGNATURE)


# -- prefill --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillKernel:
    spec: KernelSpec
    variant: KVVariant  # the pages it reads
    threads: int
    smem: int  # dynamic shared memory
    tile_rows: int  # M rows (chunk rows x GQA group) per block
    combine: KernelSpec  # what merges its split partials


@dataclass(frozen=True)
class PrefillPlan:
    """A prefill launch's shape: its kernel, tiles (kernel.tile_rows M rows) per (kv head, sequence) of the
    longest chunk, key-range splits per tile, and the context bound the splits (and a widening) cover."""

    kernel: PrefillKernel
    tiles: int
    num_splits: int
    context: int

    @property
    def widened(self) -> bool:
        return self.kernel.variant is KVVariant.WIDENED


def mma_sync_tile_rows(head_dim: int) -> int:
    """M rows per block of the mma.sync kernel (kTileRows<D> of prefill_attention.cu): 64 at head_dim 256, where
    a warp holds one m16 tile of 256 f32 dims; 128 below (and in the sm_90a kernels at every head dim)."""
    return PREFILL_TILE_ROWS_D256 if head_dim == 256 else PREFILL_TILE_ROWS


def prefill_tile_queries(n_q_heads: int, n_kv_heads: int, tile_rows: int) -> int:
    """Chunk rows per prefill tile: R M rows hold all G q heads of a kv head for R // G rows."""
    group = gqa_group(n_q_heads, n_kv_heads)
    if group > tile_rows:
        raise ValueError(f"prefill_attention: a GQA group of {group} q heads exceeds a {tile_rows}-row tile")
    return tile_rows // group


def prefill_tiles(heads: Heads, query_lens: Sequence[int], tile_rows: int) -> int:
    return math.ceil(max(query_lens) / prefill_tile_queries(heads.num_heads, heads.num_kv_heads, tile_rows))


def prefill_grid_blocks(longest: int, num_seqs: int, n_q_heads: int, n_kv_heads: int, tile_rows: int) -> int:
    """Blocks of one split of the prefill grid: tiles of the longest chunk x kv heads x sequences."""
    return math.ceil(longest / prefill_tile_queries(n_q_heads, n_kv_heads, tile_rows)) * n_kv_heads * num_seqs


def prefill_smem_bytes(head_dim: int, variant: KVVariant) -> int:
    """Dynamic shared memory of a prefill block (FlashSmem<D, int8>::kBytes in prefill_attention.cu): Q
    [R][D + 8] (R = mma_sync_tile_rows) and V [64][D + 8] 16-bit tiles, K [64][D + 8] bf16 (bf16 KV) or, for
    int8 KV, the raw K and V pages [64][D + 16] bytes x 2 (unpadded at head_dim 256, where K's chunks are
    swizzled instead) and 2 x 64 f32 scales. At most 99 KiB: what an sm_86 / sm_89 / sm_120 block may have."""
    rows = mma_sync_tile_rows(head_dim)
    if variant is KVVariant.INT8:
        raw_row = head_dim if head_dim == 256 else head_dim + 16  # FlashSmem::kRawStride
        return (rows + PAGE_SIZE) * (head_dim + 8) * BF16_BYTES + 2 * PAGE_SIZE * raw_row + 2 * PAGE_SIZE * F32_BYTES
    return (rows + 2 * PAGE_SIZE) * (head_dim + 8) * BF16_BYTES


def prefill_sm90_smem(head_dim: int, variant: KVVariant) -> int:
    """The sm_90a kernel's WgSmem<D> / WsSmem::kBytes, plus 1 KiB to align it to the 128-byte swizzle's 1024-byte
    atoms. Q [128][D] 16-bit, then bf16 and widened: two buffers of the K and V page tiles [64][D]; int8 (D =
    128): page slots of f16 K and V tiles and their scales, slots of raw pages [64][128] bytes and their
    scales, a full and an empty mbarrier (8 bytes) per page slot, a scratch word per multiplying thread."""
    q, tile, scales = PREFILL_TILE_ROWS * head_dim * BF16_BYTES, PAGE_SIZE * head_dim * BF16_BYTES, 2 * PAGE_SIZE * F32_BYTES
    if variant is KVVariant.INT8:
        slots = PREFILL_SM90_INT8_STAGES * (2 * tile + scales)
        raw = PREFILL_SM90_INT8_LOOKAHEAD * (2 * PAGE_SIZE * head_dim + scales)
        barriers, scratch = 2 * PREFILL_SM90_INT8_STAGES * 8, 2 * 128 * F32_BYTES
        return q + slots + raw + barriers + scratch + 1024
    return q + 2 * 2 * tile + 1024


def prefill_wgmma_applies(arch: str, head_dim: int, variant: KVVariant = KVVariant.BF16) -> bool:
    """Whether an sm_90a wgmma kernel reads `variant` pages at `head_dim` on `arch`."""
    dims = PREFILL_SM90_INT8_HEAD_DIMS if variant is KVVariant.INT8 else PREFILL_SM90_HEAD_DIMS
    return arch == "sm_90a" and head_dim in dims


def prefill_kernel(arch: str, head_dim: int, variant: KVVariant, wgmma: bool | None = None) -> PrefillKernel:
    """The prefill attention kernel for `arch`: on sm_90a the warpgroup-MMA one of the pages' variant where
    there is one (prefill_attention_sm90{,_int8}.cu: bf16 and WIDENED, int8 KV after kv_widen.cu, at head_dim
    128 and 256; int8 at 128), else, or with `wgmma` False, the mma.sync one every arch runs (sm_90a at head_dim
    64 too, and int8 pages at 256)."""
    applies = prefill_wgmma_applies(arch, head_dim, variant)
    widened = variant is KVVariant.WIDENED
    if (wgmma or widened) and not applies:
        raise ValueError(f"prefill_attention: no wgmma kernel for {variant.value} pages at head_dim {head_dim} on {arch} "
                         f"(sm_90a, head_dim {PREFILL_SM90_HEAD_DIMS}; int8 pages {PREFILL_SM90_INT8_HEAD_DIMS})")
    if applies and (wgmma is not False or widened):
        threads = PREFILL_SM90_INT8_THREADS if variant is KVVariant.INT8 else PREFILL_SM90_BF16_THREADS
        return PrefillKernel(prefill_sm90_spec(head_dim, variant), variant, threads, prefill_sm90_smem(head_dim, variant),
                             PREFILL_TILE_ROWS, prefill_combine_spec(head_dim, PREFILL_TILE_ROWS))
    rows = mma_sync_tile_rows(head_dim)
    return PrefillKernel(prefill_spec(head_dim, variant), variant, THREADS, prefill_smem_bytes(head_dim, variant), rows,
                         prefill_combine_spec(head_dim, rows))


def prefill_widening_applies(arch: str, head_dim: int, variant: KVVariant) -> bool:
    """Whether a prefill step's KV can be widened here: int8 KV where the widened kernel (the sm_90a bf16
    kernel's f16 twin) exists."""
    return variant is KVVariant.INT8 and prefill_wgmma_applies(arch, head_dim, KVVariant.WIDENED)


def prefill_widens(arch: str, head_dim: int, variant: KVVariant, longest: int, wgmma: bool | None = None) -> bool:
    """Whether a prefill step over int8 KV widens its pages first (kv_widen.cu): where widening applies,
    when its longest chunk has PREFILL_WIDEN_MIN_QUERIES rows or more, unless `wgmma` is False."""
    applies = wgmma is not False and prefill_widening_applies(arch, head_dim, variant)
    return applies and longest >= PREFILL_WIDEN_MIN_QUERIES


def prefill_num_splits(
    grid_blocks: int, sm_count: int, blocks_per_sm: int, max_context_len: int | None = None, max_blocks: int | None = None
) -> int:
    """Key-range splits per prefill tile. A grid of tiles alone (a chunk of a few hundred rows) fills a
    fraction of the SMs, each block walking the whole context; splitting multiplies the blocks. The count
    maximizes the last wave's fill (blocks / (waves * resident slots)), each extra split costing 0.5% (its
    partials and their merge); with `max_context_len` a split keeps PREFILL_MIN_PAGES_PER_SPLIT pages, and
    grid_blocks * splits stays within `max_blocks` (the workspace). Large grids get 1 (no workspace)."""
    _require_positive("prefill_num_splits", grid_blocks=grid_blocks, sm_count=sm_count, blocks_per_sm=blocks_per_sm)
    limit = PREFILL_MAX_SPLITS
    if max_context_len is not None:
        limit = min(limit, max(1, math.ceil(max_context_len / PAGE_SIZE) // PREFILL_MIN_PAGES_PER_SPLIT))
    if max_blocks is not None:
        limit = min(limit, max(1, max_blocks // grid_blocks))
    slots = sm_count * blocks_per_sm
    best, best_score = 1, -1.0
    for splits in range(1, limit + 1):
        waves = splits * grid_blocks / slots
        score = waves / math.ceil(waves) - 0.005 * (splits - 1)
        if score > best_score + 1e-9:
            best, best_score = splits, score
    return best


def prefill_workspace_rows(sm_count: int, head_dim: int) -> int:
    """Partial rows a PrefillWorkspace holds (the executor's, sized once per device and head dim: 138 MB for
    132 SMs at head_dim 128 and 256): PREFILL_WORKSPACE_BLOCKS_PER_SM blocks of 128 rows per SM, half the rows
    at head_dim 256. A kernel's split blocks fit in rows // its tile_rows."""
    return sm_count * PREFILL_WORKSPACE_BLOCKS_PER_SM * PREFILL_TILE_ROWS * PREFILL_TILE_ROWS // max(PREFILL_TILE_ROWS, head_dim)


def prefill_workspace_bytes(rows: int, head_dim: int) -> tuple[int, int]:
    """(acc bytes, ml bytes) of `rows` partial rows: split blocks x their tile_rows."""
    return rows * head_dim * F32_BYTES, rows * 2 * F32_BYTES


# -- widening -------------------------------------------------------------------------------------------


def widened_page_bytes(n_kv_heads: int, head_dim: int) -> int:
    """One widened page: f16 K and V, all kv heads."""
    return 2 * PAGE_SIZE * n_kv_heads * head_dim * BF16_BYTES


def widening_capacity(n_kv_heads: int, head_dim: int, max_pages_per_seq: int) -> int:
    """Pages the widening buffers hold: PREFILL_WIDEN_SEQUENCES sequences of `max_pages_per_seq` pages, within
    PREFILL_WIDEN_BUDGET bytes."""
    return min(PREFILL_WIDEN_BUDGET // widened_page_bytes(n_kv_heads, head_dim), PREFILL_WIDEN_SEQUENCES * max_pages_per_seq)


def widening_pages(heads: Heads, query_lens: Sequence[int], context: int) -> int:
    """Pages a widening of the step writes at most: its prefill sequences times the pages of `context`."""
    max_queries = decode_max_queries(heads.num_heads, heads.num_kv_heads)
    return sum(1 for n in query_lens if n > max_queries) * math.ceil(context / PAGE_SIZE)
