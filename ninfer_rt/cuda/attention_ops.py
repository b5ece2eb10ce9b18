"""Launch wrappers for the attention families (kernels_src/{rope_kv,decode_attention,prefill_attention,
prefill_attention_sm90,prefill_attention_sm90_int8,kv_widen}.cu).

A step's attention is three launches over the same step inputs: `rope_kv` (q/k norm, RoPE, K/V into the
pages), then per sequence either flash-decoding (`decode_attention`, sequences with at most
`decode_max_queries` new rows: decode and speculative verify) or the tensor-core prefill kernel
(`prefill_attention`, longer chunks: mma.sync on every arch, warpgroup MMAs on sm_90a where they apply,
see prefill_kernel; on sm_90a a long chunk over int8 KV first widens the pages it reads to f16, dequantized
once per page instead of once per tile, see prefill_widens). Both attention kernels take the whole step's tables and skip the
other kind's sequences, so a mixed step needs no re-packing on the host.

KV pages are declared to the ordering verifier as ("kv", page) resources; the caller passes the page sets it
already computed from the host-side block tables and slot mapping (StepBatch.pages_read/pages_written), so
declaring costs nothing per launch. The math of each kernel is documented at the top of its .cu file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from cuda.bindings import driver as cu

from ninfer_rt.cuda.driver import check
from ninfer_rt.cuda.kernels import Arg, Kernel, KernelLibrary, KernelSpec
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.ops import _require_bytes, _require_positive
from ninfer_rt.cuda.streams import StreamSet, require_stream
from ninfer_rt.ordering.verifier import Resource

if TYPE_CHECKING:
    from ninfer_rt.exec.base import AttentionParams, AttentionShape
    from ninfer_rt.kv.cache import KVCache, KVLayer

PAGE_SIZE = 64  # kPageSize in attention_common.cuh
KV_KINDS = ("bf16", "int8")
ROPE_HEAD_DIMS = (64, 128, 256)
DECODE_HEAD_DIMS = (64, 128, 256)
PREFILL_HEAD_DIMS = (64, 128)
DECODE_ROWS_PER_BLOCK = 8  # kRowsPerBlock in decode_attention.cu: q rows (queries x GQA group) per block
DECODE_MAX_ROWS = 64  # rows per (sequence, kv head) the decode path takes: 8 row groups
DECODE_MAX_QUERIES = 8  # new rows per sequence up to which decode attention is used (spec verify width)
MAX_SPLITS = 256  # kMaxSplits in decode_attention.cu
MIN_PAGES_PER_SPLIT = 2  # below this a split's fixed cost outweighs the parallelism it adds
_THREADS = 128  # every attention kernel runs 4 warps
_MAX_BLOCKS_PER_SM = 2048 // _THREADS  # the hardware's resident-thread limit, for sizing scratch
_ROPE_HEADS_PER_BLOCK = 4  # kRopeWarps
PREFILL_TILE_ROWS = 128  # kFlashRows in prefill_attention.cu: M rows (chunk rows x GQA group) per block
PREFILL_MAX_SPLITS = 32  # key-range splits of one prefill tile, at most
PREFILL_MIN_PAGES_PER_SPLIT = 4  # below this a split's Q load and partial write outweigh its keys
PREFILL_COMBINE_ROWS = 16  # kCombineRows in prefill_attention.cu: M rows per combine block
PREFILL_WORKSPACE_BLOCKS_PER_SM = 16  # split blocks (tiles x kv heads x sequences x splits) the workspace holds
_SMEM_DEFAULT_LIMIT = 48 * 1024
_BF16 = 2
_F32 = 4

_ROPE_SIGNATURE = (Arg.PTR,) * 8 + (Arg.F32, Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32)
_DECODE_SIGNATURE = (Arg.PTR,) * 8 + (Arg.I32, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32, Arg.F32, Arg.I32)
_PREFILL_SIGNATURE = (Arg.PTR,) * 9 + (Arg.I32, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32, Arg.F32, Arg.I32)
_PREFILL_COMBINE_SIGNATURE = (Arg.PTR,) * 5 + (Arg.I32,) * 4
# sm_90a prefill kernels: bf16 KV, 2 warpgroups (prefill_attention_sm90.cu); int8 KV, a copying and 2
# multiplying warpgroups (prefill_attention_sm90_int8.cu) with PREFILL_SM90_INT8_STAGES page slots and
# PREFILL_SM90_INT8_LOOKAHEAD raw pages in flight (its kStages, kLookahead)
PREFILL_SM90_THREADS = {"bf16": 256, "int8": 384, "widened": 256}
PREFILL_SM90_INT8_STAGES = 4
PREFILL_SM90_INT8_LOOKAHEAD = 3
# Widened int8 KV (kv_widen.cu: f16 pages of the dequantized values, then prefill_attention_sm90.cu's f16
# kernel): the widening dequantizes each page once per step and layer, the int8 kernels apply its scales once
# per tile, and the f16 kernel is faster than the int8 one; the widening's own traffic and the f16 pages' twice
# the bytes cost about what 210 chunk rows gain (H200, 114,812 keys, qwen3-8b heads, widened against int8: 128
# rows 792 against 708 us, 256 rows 1369 against 1397, 531 rows 2639 against 3038; bench/logs/h200-2026-11-30-int8-kv-widening-b41b0ef.txt).
# Its buffers hold the pages of PREFILL_WIDEN_SEQUENCES prefill sequences of the longest context, at most
# PREFILL_WIDEN_BUDGET bytes; the engine reserves them before sizing the KV cache (Executor.reserve_attention).
PREFILL_WIDEN_MIN_QUERIES = 256
PREFILL_WIDEN_SEQUENCES = 2
PREFILL_WIDEN_BUDGET = 1 << 30
_WIDEN_SIGNATURE = (Arg.PTR,) * 3 + (Arg.I32,) + (Arg.PTR,) * 5 + (Arg.I32, Arg.PTR, Arg.PTR) + (Arg.I32,) * 3
WIDEN_INT8_KV = KernelSpec("kv_widen", "widen_int8_kv", _WIDEN_SIGNATURE)
WIDEN_THREADS = 256  # kWidenThreads
DECODE_COMBINE = KernelSpec("decode_attention", "decode_attention_combine", (Arg.PTR,) * 4 + (Arg.I32,) * 5)

STEP_INPUT_NAMES = ("positions", "query_start", "context_lens", "block_tables", "slot_mapping")


@dataclass(frozen=True)
class StepInputs:
    """The step's int32 device buffers (published per rule 3): positions and slot_mapping [T],
    query_start [B+1], context_lens [B], block_tables [B, max_pages_per_seq] (-1 where unused)."""

    positions: Buffer
    query_start: Buffer
    context_lens: Buffer
    block_tables: Buffer
    slot_mapping: Buffer

    def table_sizes(self, num_seqs: int, max_pages_per_seq: int) -> dict[str, tuple[Buffer, int]]:
        """The bytes the attention kernels read of the per-sequence tables, for _require_bytes."""
        return {
            "block_tables": (self.block_tables, num_seqs * max_pages_per_seq * 4),
            "context_lens": (self.context_lens, num_seqs * 4),
            "query_start": (self.query_start, (num_seqs + 1) * 4),
        }

    @property
    def tables(self) -> tuple[Resource, ...]:
        """The per-sequence tables as the attention kernels' declared reads."""
        return (self.block_tables.resource, self.context_lens.resource, self.query_start.resource)


@dataclass(frozen=True)
class DecodeWorkspace:
    """Flash-decoding partials: acc f32 [num_splits, B * max_queries, Hq, D], (max, sum) f32 [..., 2].
    Row slot b * max_queries + j holds query j of sequence b."""

    acc: Buffer
    ml: Buffer


@dataclass(frozen=True)
class WidenedKV:
    """int8 KV pages widened for a prefill step (kv_widen.cu): K, V f16 [capacity, 64, Hkv, D], and int32
    tables shaped like the step's block_tables, naming each prefill sequence's widened pages."""

    k: Buffer
    v: Buffer
    tables: Buffer
    capacity: int  # pages

    @property
    def resources(self) -> tuple[Resource, ...]:
        return tuple(buffer.resource for buffer in (self.k, self.v, self.tables))


def widened_page_bytes(n_kv_heads: int, head_dim: int) -> int:
    """One widened page: f16 K and V, all kv heads."""
    return 2 * PAGE_SIZE * n_kv_heads * head_dim * _BF16


@dataclass(frozen=True)
class PrefillWorkspace:
    """Split-prefill partials: acc f32 [blocks, R, D], (max, sum) f32 [blocks, R, 2], where a block is one
    (split, sequence, tile, kv head) of prefill_attention.cu's split grid and R = PREFILL_TILE_ROWS."""

    acc: Buffer
    ml: Buffer


# -- host-side math -------------------------------------------------------------------------------------


def rope_table(inv_freq: np.ndarray, attention_scaling: float, max_pos: int) -> np.ndarray:
    """cos/sin table f32 [max_pos, 2, D/2] as rope_kv.cu reads it: row p holds cos(p * inv_freq), then
    sin(p * inv_freq), both times `attention_scaling` (YaRN's mscale; 1.0 for plain RoPE). Angles in
    float64 so large positions keep full precision before the f32 rounding."""
    inv_freq = np.asarray(inv_freq, np.float64)
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.stack([np.cos(angles), np.sin(angles)], axis=1) * attention_scaling).astype(np.float32)


def decode_num_splits(
    num_seqs: int, n_kv_heads: int, sm_count: int, blocks_per_sm: int, max_context_len: int | None = None, row_groups: int = 1
) -> int:
    """KV splits per (sequence, kv head, row group) so the decode grid is one full wave: sm_count *
    blocks_per_sm resident blocks. A second, partial wave would double the time of a memory-bound kernel
    for a few blocks, so the count rounds down. With `max_context_len` no split gets fewer than
    MIN_PAGES_PER_SPLIT pages. Captured graphs call it without a context length, so the grid does not
    depend on it (the kernel divides each sequence's pages among the splits it is given; surplus splits
    exit at once)."""
    _require_positive(
        "decode_num_splits", num_seqs=num_seqs, n_kv_heads=n_kv_heads, sm_count=sm_count, blocks_per_sm=blocks_per_sm, row_groups=row_groups
    )
    splits = sm_count * blocks_per_sm // (num_seqs * n_kv_heads * row_groups)
    if max_context_len is not None:
        pages = math.ceil(max_context_len / PAGE_SIZE)
        splits = min(splits, max(1, pages // MIN_PAGES_PER_SPLIT))
    return max(1, min(splits, MAX_SPLITS))


def decode_blocks_per_sm(kernel: Kernel, dynamic_smem: int = 0, threads: int = _THREADS) -> int:
    """Blocks of an attention kernel resident per SM (its registers and shared memory decide, per arch)."""
    occupancy = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, threads, dynamic_smem)
    return int(check(occupancy, "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


def decode_max_queries(n_q_heads: int, n_kv_heads: int) -> int:
    """Longest per-sequence row count the decode kernel takes: DECODE_MAX_QUERIES, fewer when a GQA group
    is so wide that group * rows would exceed DECODE_MAX_ROWS."""
    group = _gqa_group(n_q_heads, n_kv_heads)
    return max(1, min(DECODE_MAX_QUERIES, DECODE_MAX_ROWS // group))


def decode_row_groups(rows: int) -> int:
    """Blocks per (split, kv head, sequence) for `rows` = queries * GQA group rows: one per 8 rows (each
    re-reads the split's K/V; verify steps only)."""
    if not 1 <= rows <= DECODE_MAX_ROWS:
        raise ValueError(f"decode attention holds 1..{DECODE_MAX_ROWS} rows per kv head, got {rows}")
    return math.ceil(rows / DECODE_ROWS_PER_BLOCK)


def decode_workspace_bytes(num_splits: int, num_seqs: int, max_queries: int, n_q_heads: int, head_dim: int) -> tuple[int, int]:
    """(acc bytes, ml bytes) of a DecodeWorkspace."""
    rows = num_splits * num_seqs * max_queries * n_q_heads
    return rows * head_dim * _F32, rows * 2 * _F32


def prefill_tile_queries(n_q_heads: int, n_kv_heads: int) -> int:
    """Chunk rows per prefill tile: R M rows hold all G q heads of a kv head for R // G rows."""
    group = _gqa_group(n_q_heads, n_kv_heads)
    if group > PREFILL_TILE_ROWS:
        raise ValueError(f"prefill_attention: a GQA group of {group} q heads exceeds the {PREFILL_TILE_ROWS}-row tile")
    return PREFILL_TILE_ROWS // group


def prefill_grid_blocks(longest: int, num_seqs: int, n_q_heads: int, n_kv_heads: int) -> int:
    """Blocks of one split of the prefill grid: tiles of the longest chunk x kv heads x sequences."""
    return math.ceil(longest / prefill_tile_queries(n_q_heads, n_kv_heads)) * n_kv_heads * num_seqs


def prefill_smem_bytes(head_dim: int, kv_dtype: str) -> int:
    """Dynamic shared memory of a prefill block (FlashSmem<D, int8>::kBytes in prefill_attention.cu): Q
    [128][D + 8] and V [64][D + 8] 16-bit tiles, K [64][D + 8] bf16 (bf16 KV) or, for int8 KV, the raw K and
    V pages [64][D + 16] bytes x 2 and 2 x 64 f32 scales."""
    if kv_dtype == "int8":
        return (PREFILL_TILE_ROWS + PAGE_SIZE) * (head_dim + 8) * _BF16 + 2 * PAGE_SIZE * (head_dim + 16) + 2 * PAGE_SIZE * _F32
    return (PREFILL_TILE_ROWS + 2 * PAGE_SIZE) * (head_dim + 8) * _BF16


@dataclass(frozen=True)
class PrefillKernel:
    spec: KernelSpec
    threads: int
    smem: int  # dynamic shared memory


def prefill_wgmma_applies(arch: str, head_dim: int) -> bool:
    return arch == "sm_90a" and head_dim == 128


def prefill_kernel(arch: str, head_dim: int, kv_dtype: str, wgmma: bool | None = None) -> PrefillKernel:
    """The prefill attention kernel for `arch`: on sm_90a at head_dim 128 the warpgroup-MMA one of the KV
    dtype (prefill_attention_sm90{,_int8}.cu; kv_dtype "widened": int8 KV after kv_widen.cu), else, or with
    `wgmma` False, the mma.sync one every arch runs."""
    applies = prefill_wgmma_applies(arch, head_dim)
    if (wgmma or kv_dtype == "widened") and not applies:
        raise ValueError(f"prefill_attention: the wgmma kernels need sm_90a and head_dim 128 ({arch}, {head_dim})")
    if applies and (wgmma is not False or kv_dtype == "widened"):
        return PrefillKernel(prefill_sm90_spec(kv_dtype), PREFILL_SM90_THREADS[kv_dtype], prefill_sm90_smem(kv_dtype))
    return PrefillKernel(prefill_spec(head_dim, kv_dtype), _THREADS, prefill_smem_bytes(head_dim, kv_dtype))


def prefill_widening_applies(arch: str, head_dim: int, kv_dtype: str) -> bool:
    """Whether a prefill step's KV can be widened here: int8 KV where the widened kernel (the sm_90a bf16
    kernel's f16 twin) exists."""
    return kv_dtype == "int8" and prefill_wgmma_applies(arch, head_dim)


def prefill_widens(arch: str, head_dim: int, kv_dtype: str, longest: int, wgmma: bool | None = None) -> bool:
    """Whether a prefill step over int8 KV widens its pages first (kv_widen.cu): where widening applies,
    when its longest chunk has PREFILL_WIDEN_MIN_QUERIES rows or more, unless `wgmma` is False."""
    applies = wgmma is not False and prefill_widening_applies(arch, head_dim, kv_dtype)
    return applies and longest >= PREFILL_WIDEN_MIN_QUERIES


def prefill_sm90_spec(kv_dtype: str) -> KernelSpec:
    family = "prefill_attention_sm90_int8" if kv_dtype == "int8" else "prefill_attention_sm90"
    return KernelSpec(family, f"prefill_attention_sm90_d128_{kv_dtype}", _PREFILL_SIGNATURE)


def prefill_sm90_smem(kv_dtype: str) -> int:
    """The sm_90a kernel's WgSmem / WsSmem::kBytes, plus 1 KiB to align it to the 128-byte swizzle's 1024-byte
    atoms. Q [128][128] 16-bit, then bf16 and widened: two buffers of the K and V page tiles [64][128]; int8:
    page slots of f16 K and V tiles and their scales, slots of raw pages [64][128] bytes and their scales, a
    full and an empty mbarrier (8 bytes) per page slot, a scratch word per multiplying thread."""
    q, tile, scales = PREFILL_TILE_ROWS * 128 * _BF16, PAGE_SIZE * 128 * _BF16, 2 * PAGE_SIZE * _F32
    if kv_dtype == "int8":
        slots = PREFILL_SM90_INT8_STAGES * (2 * tile + scales)
        raw = PREFILL_SM90_INT8_LOOKAHEAD * (2 * PAGE_SIZE * 128 + scales)
        barriers, scratch = 2 * PREFILL_SM90_INT8_STAGES * 8, 2 * 128 * _F32
        return q + slots + raw + barriers + scratch + 1024
    return q + 2 * 2 * tile + 1024


def prefill_blocks_per_sm(lib: KernelLibrary, head_dim: int, kv_dtype: str, wgmma: bool | None = None) -> int:
    """Blocks of the prefill kernel (prefill_kernel's choice) resident per SM (registers and shared memory
    decide, per arch)."""
    kernel = prefill_kernel(lib.target_arch, head_dim, kv_dtype, wgmma)
    _prefill_kernel(lib, kernel.spec, kernel.smem)  # the occupancy query needs the raised shared-memory limit
    return _occupancy(lib, kernel.spec, kernel.smem, kernel.threads)


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


def prefill_workspace_blocks(sm_count: int) -> int:
    """Split blocks a PrefillWorkspace holds (the executor's, sized once per device: 138 MB for 132 SMs at
    head_dim 128)."""
    return sm_count * PREFILL_WORKSPACE_BLOCKS_PER_SM


def prefill_workspace_bytes(blocks: int, head_dim: int) -> tuple[int, int]:
    """(acc bytes, ml bytes) of a PrefillWorkspace of `blocks` split blocks."""
    rows = blocks * PREFILL_TILE_ROWS
    return rows * head_dim * _F32, rows * 2 * _F32


def _gqa_group(n_q_heads: int, n_kv_heads: int) -> int:
    _require_positive("attention", n_q_heads=n_q_heads, n_kv_heads=n_kv_heads)
    if n_q_heads % n_kv_heads:
        raise ValueError(f"attention: {n_q_heads} q heads are not a multiple of {n_kv_heads} kv heads")
    return n_q_heads // n_kv_heads


def _check_kv(op: str, kv_dtype: str, cache: KVLayer) -> None:
    if kv_dtype not in KV_KINDS:
        raise ValueError(f"{op}: kv dtype must be one of {KV_KINDS}, got {kv_dtype!r}")
    if (kv_dtype == "int8") != (cache.k_scale is not None and cache.v_scale is not None):
        raise ValueError(f"{op}: int8 KV needs k_scale and v_scale buffers, bf16 KV none")


def _check_head_dim(op: str, head_dim: int, supported: tuple[int, ...]) -> None:
    if head_dim not in supported:
        raise ValueError(f"{op}: head_dim {head_dim} not instantiated (supported: {supported})")


def _scale_ptrs(cache: KVLayer) -> tuple[Buffer | int, Buffer | int]:
    return (cache.k_scale or 0, cache.v_scale or 0)


# -- kernels --------------------------------------------------------------------------------------------


def rope_kv_spec(head_dim: int, kv_dtype: str) -> KernelSpec:
    return KernelSpec("rope_kv", f"rope_kv_d{head_dim}_{kv_dtype}", _ROPE_SIGNATURE)


def decode_spec(head_dim: int, kv_dtype: str) -> KernelSpec:
    return KernelSpec("decode_attention", f"decode_attention_d{head_dim}_{kv_dtype}", _DECODE_SIGNATURE)


def prefill_spec(head_dim: int, kv_dtype: str) -> KernelSpec:
    return KernelSpec("prefill_attention", f"prefill_attention_d{head_dim}_{kv_dtype}", _PREFILL_SIGNATURE)


def prefill_combine_spec(head_dim: int) -> KernelSpec:
    return KernelSpec("prefill_attention", f"prefill_attention_combine_d{head_dim}", _PREFILL_COMBINE_SIGNATURE)


def _prefill_kernel(lib: KernelLibrary, spec: KernelSpec, smem: int) -> Kernel:
    """lib.kernel(spec), allowed `smem` bytes of dynamic shared memory (raised past 48 KiB once)."""
    kernel = lib.kernel(spec)
    if smem > _SMEM_DEFAULT_LIMIT and kernel.max_dynamic_smem < smem:
        kernel = lib.raise_dynamic_smem(spec, smem)
    return kernel


def rope_kv(
    lib: KernelLibrary,
    stream: object,
    qkv: Buffer,
    q_out: Buffer,
    cache: KVLayer,
    shape: AttentionShape,
    inputs: StepInputs,
    num_tokens: int,
    rope: Buffer,
    q_norm: Buffer | None,
    k_norm: Buffer | None,
    *,
    kv_dtype: str,
    pages_written: Sequence[Resource],
    lane: object = None,
) -> None:
    """q_out = rope(q_norm(q)); K/V pages at slot_mapping = rope(k_norm(k)), v (rope_kv.cu)."""
    stream = require_stream(stream)
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    _require_positive("rope_kv", num_tokens=num_tokens)
    _gqa_group(hq, hkv)
    _check_head_dim("rope_kv", d, ROPE_HEAD_DIMS)
    _check_kv("rope_kv", kv_dtype, cache)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_kv: q_norm and k_norm come together (Qwen3) or not at all (Llama)")
    _require_bytes(
        "rope_kv",
        qkv=(qkv, num_tokens * (hq + 2 * hkv) * d * _BF16),
        q_out=(q_out, num_tokens * hq * d * _BF16),
        positions=(inputs.positions, num_tokens * 4),
        slot_mapping=(inputs.slot_mapping, num_tokens * 4),
        rope=(rope, 2 * (d // 2) * _F32),
    )
    norms = tuple(n.resource for n in (q_norm, k_norm) if n is not None)
    grid = (math.ceil((hq + hkv) / _ROPE_HEADS_PER_BLOCK), num_tokens)
    lib.kernel(rope_kv_spec(d, kv_dtype)).launch(
        stream, grid, _THREADS,
        q_out, cache.k, cache.v, *_scale_ptrs(cache), qkv, q_norm or 0, k_norm or 0, float(shape.norm_eps), rope,
        inputs.positions, inputs.slot_mapping, hq, hkv,
        label="rope_kv",
        reads=(qkv.resource, rope.resource, inputs.positions.resource, inputs.slot_mapping.resource, *norms),
        writes=(q_out.resource, *pages_written),
        lane=lane,
    )


def decode_attention(
    lib: KernelLibrary,
    stream: object,
    q: Buffer,
    out: Buffer,
    cache: KVLayer,
    shape: AttentionShape,
    inputs: StepInputs,
    query_lens: Sequence[int],
    max_pages_per_seq: int,
    workspace: DecodeWorkspace,
    num_splits: int,
    *,
    kv_dtype: str,
    pages_read: Sequence[Resource],
    lane: object = None,
) -> None:
    """out rows of every sequence with 1..decode_max_queries new rows = paged causal attention
    (decode_attention.cu: split kernel, then combine). Other sequences' rows are left untouched."""
    stream = require_stream(stream)
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    group = _gqa_group(hq, hkv)
    _check_head_dim("decode_attention", d, DECODE_HEAD_DIMS)
    _check_kv("decode_attention", kv_dtype, cache)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    max_queries = decode_max_queries(hq, hkv)
    decode_lens = [n for n in query_lens if 1 <= n <= max_queries]
    if not decode_lens:
        raise ValueError(f"decode_attention: no sequence has 1..{max_queries} new rows ({list(query_lens)})")
    num_seqs, num_rows = len(query_lens), sum(query_lens)
    acc_bytes, ml_bytes = decode_workspace_bytes(num_splits, num_seqs, max_queries, hq, d)
    _require_bytes(
        "decode_attention",
        q=(q, num_rows * hq * d * _BF16),
        out=(out, num_rows * hq * d * _BF16),
        partial_acc=(workspace.acc, acc_bytes),
        partial_ml=(workspace.ml, ml_bytes),
        **inputs.table_sizes(num_seqs, max_pages_per_seq),
    )
    row_groups = decode_row_groups(max(decode_lens) * group)
    partials = (workspace.acc.resource, workspace.ml.resource)
    lib.kernel(decode_spec(d, kv_dtype)).launch(
        stream, (num_splits * row_groups, hkv, num_seqs), _THREADS,
        workspace.acc, workspace.ml, q, cache.k, cache.v, *_scale_ptrs(cache), inputs.block_tables,
        max_pages_per_seq, inputs.context_lens, inputs.query_start, max_queries, hq, hkv, shape.scale, row_groups,
        label="decode_attention", reads=(q.resource, *inputs.tables, *pages_read), writes=partials, lane=lane,
    )
    lib.kernel(DECODE_COMBINE).launch(
        stream, (num_seqs * max_queries, hq), _THREADS,
        out, workspace.acc, workspace.ml, inputs.query_start, num_splits, num_seqs, max_queries, hq, d,
        label="decode_attention_combine", reads=(*partials, inputs.query_start.resource), writes=(out.resource,), lane=lane,
    )


def prefill_attention(
    lib: KernelLibrary,
    stream: object,
    q: Buffer,
    out: Buffer,
    cache: KVLayer,
    shape: AttentionShape,
    inputs: StepInputs,
    query_lens: Sequence[int],
    max_pages_per_seq: int,
    *,
    kv_dtype: str,
    pages_read: Sequence[Resource],
    lane: object = None,
    num_splits: int | None = None,
    workspace: PrefillWorkspace | None = None,
    max_context_len: int | None = None,
    wgmma: bool | None = None,
    widen: bool | None = None,
) -> None:
    """out rows of every sequence with more than decode_max_queries new rows = causal attention of the
    chunk over the cached prefix and itself (prefill_attention.cu; prefill_kernel picks the kernel, `wgmma`
    False forces the mma.sync one). Other sequences' rows are untouched. int8 KV is widened first where
    prefill_widens says so and the step's pages fit the widening buffers (`widen` forces either way; forced
    and not fitting raises):
    K and V are then dequantized values rounded to f16 (kv_widen.cu), where the int8 kernels multiply the
    exact int8 values and apply the scales in f32.

    With `num_splits` None the split count is prefill_num_splits of the grid (tiles x kv heads x
    sequences), this device's SMs and the kernel's occupancy, the context bounded by `max_context_len`
    (else by the block table's width). More than one split writes partials to `workspace` (default: one
    per library and geometry, sized for prefill_workspace_blocks) and adds the combine launch. Prefill
    steps are never captured, so the launch sequence may depend on the chunk and context lengths."""
    stream = require_stream(stream)
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    tile_queries = prefill_tile_queries(hq, hkv)
    _check_head_dim("prefill_attention", d, PREFILL_HEAD_DIMS)
    _check_kv("prefill_attention", kv_dtype, cache)
    max_queries = decode_max_queries(hq, hkv)
    longest = max(query_lens, default=0)
    if longest <= max_queries:
        raise ValueError(f"prefill_attention: no sequence has more than {max_queries} new rows ({list(query_lens)})")
    num_seqs, num_rows = len(query_lens), sum(query_lens)
    _require_bytes(
        "prefill_attention",
        q=(q, num_rows * hq * d * _BF16),
        out=(out, num_rows * hq * d * _BF16),
        **inputs.table_sizes(num_seqs, max_pages_per_seq),
    )
    tiles = math.ceil(longest / tile_queries)
    context = max_context_len if max_context_len is not None else max_pages_per_seq * PAGE_SIZE
    forced = widen is not None
    if widen is None:
        widen = prefill_widens(lib.target_arch, d, kv_dtype, longest, wgmma)
    widened = None
    if widen and not prefill_widening_applies(lib.target_arch, d, kv_dtype):
        raise ValueError(
            f"prefill_attention: widening needs int8 KV on sm_90a at head_dim 128, not {kv_dtype} on {lib.target_arch} at {d}"
        )
    if widen:
        prefill_seqs = sum(1 for n in query_lens if n > max_queries)
        longest_pages = math.ceil(context / PAGE_SIZE)
        widened = widen_int8_kv(
            lib, stream, cache, shape, inputs, num_seqs, max_pages_per_seq, prefill_seqs * longest_pages, longest_pages,
            owner=q.owner, pages_read=pages_read, lane=lane,
        )
        if widened is None and forced:
            raise ValueError(
                f"prefill_attention: {prefill_seqs} prefill sequences of up to {context} tokens exceed the widening buffers"
            )
    chosen = prefill_kernel(lib.target_arch, d, "widened" if widened else kv_dtype, wgmma)
    spec, threads, smem = chosen.spec, chosen.threads, chosen.smem
    kernel = _prefill_kernel(lib, spec, smem)
    grid_blocks = tiles * hkv * num_seqs
    if num_splits is None:
        capacity = prefill_workspace_blocks(lib.device.sm_count)
        if workspace is not None:
            one_acc, one_ml = prefill_workspace_bytes(1, d)
            capacity = min(capacity, workspace.acc.nbytes // one_acc, workspace.ml.nbytes // one_ml)
        num_splits = prefill_num_splits(grid_blocks, lib.device.sm_count, _occupancy(lib, spec, smem, threads), context, capacity)
    if not 1 <= num_splits <= PREFILL_MAX_SPLITS:
        raise ValueError(f"prefill_attention: num_splits must be in [1, {PREFILL_MAX_SPLITS}], got {num_splits}")
    if widened:
        kv_args = (widened.k, widened.v, 0, 0, widened.tables)
        kv_reads: tuple[Resource, ...] = (inputs.context_lens.resource, inputs.query_start.resource, *widened.resources)
    else:
        kv_args = (cache.k, cache.v, *_scale_ptrs(cache), inputs.block_tables)
        kv_reads = (*inputs.tables, *pages_read)
    args = (q, *kv_args, max_pages_per_seq, inputs.context_lens, inputs.query_start, max_queries, hq, hkv, shape.scale,
            num_splits)
    reads = (q.resource, *kv_reads)
    if num_splits == 1:
        kernel.launch(
            stream, (tiles, hkv, num_seqs), threads, out, 0, 0, *args, smem=smem,
            label="prefill_attention", reads=reads, writes=(out.resource,), lane=lane,
        )
        return
    if workspace is None:
        workspace = _prefill_workspace_for(lib, q, d)
    acc_bytes, ml_bytes = prefill_workspace_bytes(grid_blocks * num_splits, d)
    _require_bytes("prefill_attention", partial_acc=(workspace.acc, acc_bytes), partial_ml=(workspace.ml, ml_bytes))
    partials = (workspace.acc.resource, workspace.ml.resource)
    kernel.launch(
        stream, (tiles * num_splits, hkv, num_seqs), threads, 0, workspace.acc, workspace.ml, *args, smem=smem,
        label="prefill_attention", reads=reads, writes=partials, lane=lane,
    )
    lib.kernel(prefill_combine_spec(d)).launch(
        stream, (tiles * PREFILL_TILE_ROWS // PREFILL_COMBINE_ROWS, hkv, num_seqs), _THREADS,
        out, workspace.acc, workspace.ml, inputs.context_lens, inputs.query_start, max_queries, hq, hkv, num_splits,
        label="prefill_attention_combine",
        reads=(*partials, inputs.context_lens.resource, inputs.query_start.resource), writes=(out.resource,), lane=lane,
    )


def widen_int8_kv(
    lib: KernelLibrary,
    stream: object,
    cache: KVLayer,
    shape: AttentionShape,
    inputs: StepInputs,
    num_seqs: int,
    max_pages_per_seq: int,
    pages_bound: int,
    longest_pages: int,
    *,
    owner: StreamSet,
    pages_read: Sequence[Resource],
    lane: object = None,
) -> WidenedKV | None:
    """Every prefill sequence's pages of `cache` (int8) widened (kv_widen.cu) into widened_kv's buffers for
    `owner` (the StreamSet of the prefill's q), or None, launching nothing, when `pages_bound` (at least the
    step's prefill pages: the prefill sequences times the longest prefill context's pages, `longest_pages`)
    exceeds their capacity."""
    hkv, d = shape.num_kv_heads, shape.head_dim
    widened = widened_kv(lib, owner, hkv, d, max_pages_per_seq, inputs.block_tables.nbytes)
    if pages_bound > widened.capacity:
        return None
    lib.kernel(WIDEN_INT8_KV).launch(
        stream, (longest_pages, num_seqs), WIDEN_THREADS, widened.k, widened.v, widened.tables, widened.capacity,
        cache.k, cache.v, *_scale_ptrs(cache), inputs.block_tables, max_pages_per_seq, inputs.context_lens,
        inputs.query_start, decode_max_queries(shape.num_heads, hkv), hkv, d,
        label="widen_int8_kv", reads=(*inputs.tables, *pages_read), writes=widened.resources, lane=lane,
    )
    return widened


# Widening pages per (library, geometry, pages per sequence, owner) and tables per (library, owner), allocated
# on first use. The tables grow to the widest step's block table (num_seqs rows), doubling: a buffer an enqueued
# kernel may still read is never freed, only replaced, and kept.
_widened_pages: dict[tuple[Any, ...], tuple[KernelLibrary, Any, tuple[DeviceBuffer, DeviceBuffer, int]]] = {}
_widened_tables: dict[tuple[Any, ...], tuple[KernelLibrary, Any, list[DeviceBuffer]]] = {}


def widened_kv(
    lib: KernelLibrary, owner: StreamSet, n_kv_heads: int, head_dim: int, max_pages_per_seq: int, table_bytes: int
) -> WidenedKV:
    """The widening buffers prefill_attention uses for `owner`'s buffers (its q's), this geometry and a block
    table of `table_bytes` (allocated here when missing or too small: call it at start-up, or before
    capturing a graph that widens). They hold PREFILL_WIDEN_SEQUENCES sequences of `max_pages_per_seq`
    pages, within PREFILL_WIDEN_BUDGET bytes."""
    key = (id(lib), n_kv_heads, head_dim, max_pages_per_seq, id(owner))
    if key not in _widened_pages:
        page_bytes = widened_page_bytes(n_kv_heads, head_dim)
        capacity = min(PREFILL_WIDEN_BUDGET // page_bytes, PREFILL_WIDEN_SEQUENCES * max_pages_per_seq)
        values = capacity * page_bytes // 2
        name = f"attention.widened[{n_kv_heads}x{head_dim}]"
        k, v = (DeviceBuffer(owner, values, f"{name}.{part}") for part in ("k", "v"))
        _widened_pages[key] = (lib, owner, (k, v, capacity))  # holding lib and owner keeps their ids from being reused
    tables = _widened_tables.setdefault((id(lib), id(owner)), (lib, owner, []))[2]
    if not tables or tables[-1].nbytes < table_bytes:
        size = max(table_bytes, 2 * tables[-1].nbytes if tables else 0)
        tables.append(DeviceBuffer(owner, size, "attention.widened.tables"))
    k, v, capacity = _widened_pages[key][2]
    return WidenedKV(k, v, tables[-1], capacity)


# Split-prefill workspaces per (library, head_dim, owner): allocated on the first split launch, reused after.
_prefill_workspaces: dict[tuple[Any, ...], tuple[KernelLibrary, Any, PrefillWorkspace]] = {}


def _prefill_workspace_for(lib: KernelLibrary, owner_buffer: Buffer, head_dim: int) -> PrefillWorkspace:
    owner = owner_buffer.owner
    key = (id(lib), head_dim, id(owner))
    if key not in _prefill_workspaces:
        acc_bytes, ml_bytes = prefill_workspace_bytes(prefill_workspace_blocks(lib.device.sm_count), head_dim)
        workspace = PrefillWorkspace(
            DeviceBuffer(owner, acc_bytes, f"attention.prefill_partial_acc[d{head_dim}]"),
            DeviceBuffer(owner, ml_bytes, f"attention.prefill_partial_ml[d{head_dim}]"),
        )
        _prefill_workspaces[key] = (lib, owner, workspace)  # holding lib and owner keeps their ids from being reused
    return _prefill_workspaces[key][2]


# -- the executor's attention op ------------------------------------------------------------------------


@dataclass
class _Scratch:
    q: DeviceBuffer
    workspace: DecodeWorkspace


# Scratch per (library, geometry, capacities): allocated by the first (eager) step of a shape and reused
# by every later one, so a captured graph's addresses stay valid. Sized for the largest batch up front.
_scratch: dict[tuple[Any, ...], tuple[KernelLibrary, _Scratch]] = {}


def _scratch_for(lib: KernelLibrary, owner_buffer: Buffer, shape: AttentionShape, max_rows: int, max_seqs: int) -> _Scratch:
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    key = (id(lib), hq, hkv, d, max_rows, max_seqs)
    if key not in _scratch:
        max_queries = decode_max_queries(hq, hkv)
        # splits * sequences never exceeds one wave of the most blocks an SM can hold (or max_seqs
        # sequences of one split each), whatever the batch size and kernel occupancy.
        wave = lib.device.sm_count * _MAX_BLOCKS_PER_SM // hkv
        acc_bytes, ml_bytes = decode_workspace_bytes(max(wave, max_seqs), 1, max_queries, hq, d)
        owner = owner_buffer.owner
        scratch = _Scratch(
            q=DeviceBuffer(owner, max_rows * hq * d * _BF16, f"attention.q[{hq}x{d}]"),
            workspace=DecodeWorkspace(
                DeviceBuffer(owner, acc_bytes, f"attention.partial_acc[{hq}x{d}]"),
                DeviceBuffer(owner, ml_bytes, f"attention.partial_ml[{hq}x{d}]"),
            ),
        )
        _scratch[key] = (lib, scratch)  # holding lib keeps id(lib) from being reused
    return _scratch[key][1]


_occupancies: dict[tuple[int, KernelSpec, int, int], tuple[KernelLibrary, int]] = {}


def _occupancy(lib: KernelLibrary, spec: KernelSpec, dynamic_smem: int = 0, threads: int = _THREADS) -> int:
    """decode_blocks_per_sm, asked of the driver once per (library, kernel, shared memory, threads)."""
    key = (id(lib), spec, dynamic_smem, threads)
    if key not in _occupancies:
        _occupancies[key] = (lib, decode_blocks_per_sm(lib.kernel(spec), dynamic_smem, threads))
    return _occupancies[key][1]


def attention(
    lib: KernelLibrary,
    stream: object,
    qkv: Buffer,
    out: Buffer,
    params: AttentionParams,
    kv: KVCache,
    kv_layer: int,
    *,
    inputs: StepInputs,
    query_lens: Sequence[int],
    max_pages_per_seq: int,
    pages_read: Sequence[Resource],
    pages_written: Sequence[Resource],
    lane: object = None,
    max_context_len: int | None = None,
) -> None:
    """The Executor's attention op on `qkv` [T, (Hq + 2 Hkv) D] -> out [T, Hq D]: rope_kv, then decode
    attention for short sequences and prefill attention for long ones. The launch sequence of a decode
    step depends only on `query_lens` and the device (never on context lengths), so it can be captured as a
    graph. Prefill steps (never captured) may pass `max_context_len` (the longest prefill sequence's
    context) to size prefill_attention's key splits; without it the block table's width bounds it."""
    shape = params.shape
    kv_dtype = kv.spec.dtype
    cache = kv.layers[kv_layer]
    num_rows = sum(query_lens)
    qkv_row_bytes = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * _BF16
    scratch = _scratch_for(lib, qkv, shape, qkv.nbytes // qkv_row_bytes, inputs.context_lens.nbytes // 4)
    rope_kv(
        lib, stream, qkv, scratch.q, cache, shape, inputs, num_rows, params.rope.buffer,
        params.q_norm.buffer if params.q_norm is not None else None,
        params.k_norm.buffer if params.k_norm is not None else None,
        kv_dtype=kv_dtype, pages_written=pages_written, lane=lane,
    )
    max_queries = decode_max_queries(shape.num_heads, shape.num_kv_heads)
    decode_lens = [n for n in query_lens if 1 <= n <= max_queries]
    if decode_lens:
        group = shape.num_heads // shape.num_kv_heads
        resident = _occupancy(lib, decode_spec(shape.head_dim, kv_dtype))
        row_groups = decode_row_groups(max(decode_lens) * group)
        num_splits = decode_num_splits(len(query_lens), shape.num_kv_heads, lib.device.sm_count, resident, row_groups=row_groups)
        decode_attention(
            lib, stream, scratch.q, out, cache, shape, inputs, query_lens, max_pages_per_seq, scratch.workspace,
            num_splits, kv_dtype=kv_dtype, pages_read=pages_read, lane=lane,
        )
    if any(n > max_queries for n in query_lens):
        prefill_attention(
            lib, stream, scratch.q, out, cache, shape, inputs, query_lens, max_pages_per_seq,
            kv_dtype=kv_dtype, pages_read=pages_read, lane=lane, max_context_len=max_context_len,
        )
