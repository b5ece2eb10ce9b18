"""Launch wrappers for the Gated DeltaNet families (kernels_src/gdn_conv.cu, gdn_delta_rule.cu, gdn_chunked_split.cu).

A layer's linear attention is four launches over the step's rows: the causal conv + SiLU (which also writes
the target slots' conv windows), the recurrent delta rule for sequences of at most RECURRENT_MAX_ROWS rows
and the chunked one for longer sequences (each kernel takes the whole step's tables and skips the other
kind's sequences; or, given a workspace, the chunked form split into three passes), then the gated output norm. The math of each kernel is documented at the top of its
.cu file.

State slots are kv/states.py's; this package sits below kv/, so the caller hands each layer's slice of the
pool as a `StateLayer` and the step's slot spans (StateSlotPool.resource) as the resources to declare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ninfer_rt.cuda import gdn_split_plan
from ninfer_rt.cuda.gdn_split_plan import CHUNK, RECURRENT_MAX_ROWS
from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec, kernel_with_smem
from ninfer_rt.cuda.memory import Buffer
from ninfer_rt.cuda.ops import StepRows, _require_bytes, _require_positive
from ninfer_rt.cuda.streams import require_stream
from ninfer_rt.ordering.verifier import Resource

# The kernels' constants, mirrored from kernels_src/gdn_*.cu and checked against them (test_linear_attn_constants).
CONV_KERNEL = 4  # the conv kernel instantiated (gdn_conv_silu_k4)
CONV_THREADS = 128  # kConvThreads
CONV_ROWS_PER_SPLIT = 64  # rows of one sequence per conv block; at least CONV_KERNEL - 1
RECURRENT_THREADS = 128
RECURRENT_COLUMNS = 16  # kRecurrentColumns: value columns per recurrent block
VALUE_DIM_MULTIPLE = 32  # the value head dims every kernel's column groups divide
CHUNK_THREADS = 256
KEY_DIMS = (64, 128)  # key head dims instantiated
CHUNK_COLUMN_GROUPS = (32, 16)  # value columns per chunked block, widest first
SPLIT_THREADS = 256  # kSplitThreads
SPLIT_OUTPUT_COLUMNS = 32  # kOutputColumns: the columns a whole-head pass covers at a time
# value columns per block of the split form's sequential pass: at the 27B shape 192 blocks of 89 KiB, one wave
# of two per H200 SM (16 columns would make 384 blocks, two waves); gdn_split_carry_d*_c16 is for the benchmark
SPLIT_CARRY_COLUMNS = 32
SPLIT_PASSES = ("gdn_split_terms", "gdn_split_carry", "gdn_split_out")  # launch labels, in order
GATED_NORM_THREADS = 128
_F32, _BF16, _I32 = 4, 2, 4

_DELTA_RULE_SIGNATURE = (Arg.PTR,) * 3 + (Arg.I32, Arg.I32) + (Arg.PTR,) * 3 + (Arg.I64, Arg.I32, Arg.PTR, Arg.PTR) + (
    Arg.I32, Arg.PTR, Arg.I32, Arg.I32, Arg.I32)
CONV_SILU = KernelSpec(
    "gdn_conv", "gdn_conv_silu_k4",
    (Arg.PTR, Arg.PTR, Arg.I32, Arg.PTR, Arg.PTR, Arg.I64, Arg.I32, Arg.PTR, Arg.PTR, Arg.I32, Arg.PTR, Arg.I32, Arg.I32),
)
GATED_NORM = KernelSpec("gdn_delta_rule", "gdn_gated_norm", (Arg.PTR,) * 3 + (Arg.I32, Arg.I32, Arg.PTR, Arg.I32, Arg.I32, Arg.F32))


def recurrent_spec(key_dim: int) -> KernelSpec:
    return KernelSpec("gdn_delta_rule", f"gdn_recurrent_d{key_dim}", _DELTA_RULE_SIGNATURE)


def chunked_spec(key_dim: int, columns: int) -> KernelSpec:
    return KernelSpec("gdn_delta_rule", f"gdn_chunked_d{key_dim}_c{columns}", _DELTA_RULE_SIGNATURE)


def chunked_smem_bytes(key_dim: int, columns: int) -> int:
    """gdn_delta_rule.cu's ChunkSmem<DK, CV>::kFloats, in bytes: k and q [64][dk+1] (q's region at least
    A and T, 2 x 64 x 64), P [64][65], S [dk][cv], v [64][cv], three [64] vectors."""
    row_stride = key_dim + 1
    q_region = max(CHUNK * row_stride, 2 * CHUNK * CHUNK)
    floats = CHUNK * row_stride + q_region + CHUNK * (CHUNK + 1) + key_dim * columns + CHUNK * columns + 3 * CHUNK
    return _F32 * floats


_SPLIT_SIGNATURE = _DELTA_RULE_SIGNATURE + (Arg.PTR,) * 6  # + the workspace: norms, w, u, cum, h, kt


def split_specs(key_dim: int, carry_columns: int) -> tuple[KernelSpec, KernelSpec, KernelSpec]:
    """The split chunked form's passes: chunk terms, state carry (`carry_columns` per block), outputs."""
    return (
        KernelSpec("gdn_chunked_split", f"gdn_split_terms_d{key_dim}", _SPLIT_SIGNATURE),
        KernelSpec("gdn_chunked_split", f"gdn_split_carry_d{key_dim}_c{carry_columns}", _SPLIT_SIGNATURE),
        KernelSpec("gdn_chunked_split", f"gdn_split_out_d{key_dim}", _SPLIT_SIGNATURE),
    )


def split_smem_bytes(key_dim: int, carry_columns: int) -> tuple[int, int, int]:
    """gdn_chunked_split.cu's TermsSmem, CarrySmem and OutputSmem kFloats, in bytes, in split_specs' order."""
    wide = SPLIT_OUTPUT_COLUMNS + 4  # operand_stride
    # plane_stride; in words: a bf16 row is half a word an element, a pair of bf16 planes a word
    key_plane, row_plane, value_plane = key_dim + 8, CHUNK + 8, SPLIT_OUTPUT_COLUMNS + 8
    terms = CHUNK * key_plane // 2 + 2 * CHUNK * CHUNK + CHUNK * row_plane + CHUNK * value_plane // 2 + 4 * CHUNK
    carry = (carry_columns + CHUNK) * key_plane + (key_dim + carry_columns) * row_plane + CHUNK
    out = CHUNK * key_plane + CHUNK * row_plane + 2 * SPLIT_OUTPUT_COLUMNS * key_plane + CHUNK * wide + 3 * CHUNK
    return _F32 * terms, _F32 * carry, _F32 * out


def chunk_columns(key_dim: int, value_dim: int, smem_limit: int) -> int:
    """The widest column group that divides the value dim and whose shared memory fits the device
    (32 on sm_80/sm_90; 16 on sm_120's 99 KiB at dk 128)."""
    for columns in CHUNK_COLUMN_GROUPS:
        if value_dim % columns == 0 and chunked_smem_bytes(key_dim, columns) <= smem_limit:
            return columns
    raise ValueError(f"gdn_chunked: no column group of {CHUNK_COLUMN_GROUPS} fits value_dim {value_dim} in {smem_limit} bytes")


@dataclass(frozen=True)
class GdnHeads:
    """Gated DeltaNet geometry, as the kernels see it (model/executor.py's LinearAttentionShape)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    norm_eps: float

    def __post_init__(self) -> None:
        if self.key_dim not in KEY_DIMS:
            raise ValueError(f"gated delta rule: key head dim {self.key_dim} not instantiated (supported: {KEY_DIMS})")
        if self.value_dim % VALUE_DIM_MULTIPLE:
            raise ValueError(f"gated delta rule: value head dim {self.value_dim} is not a multiple of {VALUE_DIM_MULTIPLE}")
        if self.value_heads % self.key_heads:
            raise ValueError(f"{self.value_heads} value heads are not a multiple of {self.key_heads} key heads")

    @property
    def key_size(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_size(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_size + self.value_size

    @property
    def projection_stride(self) -> int:
        """Values per row of the fused projection [q | k | v | z | b | a]."""
        return self.conv_channels + self.value_size + 2 * self.value_heads

    @property
    def gate_column(self) -> int:
        """Where b starts (a follows its value_heads columns)."""
        return self.conv_channels + self.value_size


@dataclass(frozen=True)
class StateLayer:
    """One linear-attention layer's part of the state-slot pool (kv/states.py): slot s's conv window at
    `buffer + layer_offset + s * slot_bytes`, its recurrent state `conv_bytes` further on."""

    buffer: Buffer
    layer_offset: int
    slot_bytes: int
    conv_bytes: int

    @property
    def ptr(self) -> int:
        return self.buffer.ptr + self.layer_offset


@dataclass(frozen=True)
class GdnStep(StepRows):
    """A step as every linear-attention launch sees it: query_start [B+1], state_slots [B] and
    state_targets [B, num_targets] on the device; each sequence's rows; the slot spans read (sources) and
    written (targets) for the verifier; the lanes."""

    query_start: Buffer
    state_slots: Buffer
    state_targets: Buffer
    query_lens: tuple[int, ...]
    num_targets: int
    slots_read: Sequence[Resource] = ()
    slots_written: Sequence[Resource] = ()
    lane: object = None

    @property
    def recurrent(self) -> bool:
        return any(0 < n <= RECURRENT_MAX_ROWS for n in self.query_lens)

    @property
    def chunked(self) -> bool:
        return any(n > RECURRENT_MAX_ROWS for n in self.query_lens)

    def table_sizes(self) -> dict[str, tuple[Buffer, int]]:
        return {
            "query_start": (self.query_start, (self.num_seqs + 1) * _I32),
            "state_slots": (self.state_slots, self.num_seqs * _I32),
            "state_targets": (self.state_targets, self.num_seqs * self.num_targets * _I32),
        }

    @property
    def tables(self) -> tuple[Resource, ...]:
        return (self.query_start.resource, self.state_slots.resource, self.state_targets.resource)


def _state_args(states: StateLayer, step: GdnStep) -> tuple[object, ...]:
    return (states.ptr, states.slot_bytes, states.conv_bytes, step.state_slots, step.state_targets, step.num_targets)


def _check_step(op: str, step: GdnStep) -> None:
    _require_positive(op, num_seqs=step.num_seqs, num_targets=step.num_targets)
    if min(step.query_lens) < 1:
        raise ValueError(f"{op}: every sequence needs at least one row, got {list(step.query_lens)}")
    _require_bytes(op, **step.table_sizes())


def conv_silu(
    lib: KernelLibrary, stream: object, step: GdnStep, heads: GdnHeads, x: Buffer, weight: Buffer, out: Buffer, states: StateLayer
) -> None:
    """out [T, C] = silu(causal conv of the projection rows' [q | k | v] channels), each sequence continuing
    from its slot's window; the target slots' windows written (gdn_conv.cu)."""
    stream = require_stream(stream)
    _check_step("gdn_conv", step)
    channels, rows = heads.conv_channels, step.num_rows
    _require_bytes(
        "gdn_conv", x=(x, rows * heads.projection_stride * _BF16), weight=(weight, channels * CONV_KERNEL * _F32),
        out=(out, rows * channels * _BF16),
    )
    splits = math.ceil(max(step.query_lens) / CONV_ROWS_PER_SPLIT)
    lib.kernel(CONV_SILU).launch(
        stream, (math.ceil(channels / CONV_THREADS), splits, step.num_seqs), CONV_THREADS,
        out, x, heads.projection_stride, weight, *_state_args(states, step), step.query_start, channels, CONV_ROWS_PER_SPLIT,
        label="gdn_conv", reads=(x.resource, weight.resource, *step.tables, *step.slots_read),
        writes=(out.resource, *step.slots_written), lane=step.lane,
    )


@dataclass(frozen=True)
class DeltaRuleArgs:
    """The delta rule's inputs besides the step: the conv output [T, C], the projection rows (b, a), the
    gating parameters (f32 [Hv]) and the f32 output [T, Hv, dv]."""

    conv: Buffer
    x: Buffer
    a_log: Buffer
    dt_bias: Buffer
    out: Buffer


@dataclass(frozen=True)
class SplitWorkspace:
    """The split chunked form's arrays (gdn_split_plan.SplitWorkspace gives their sizes and contents)."""

    norms: Buffer
    w: Buffer
    u: Buffer
    cum: Buffer
    h: Buffer
    kt: Buffer

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return (self.norms, self.w, self.u, self.cum, self.h, self.kt)


def delta_rule(
    lib: KernelLibrary, stream: object, step: GdnStep, heads: GdnHeads, args: DeltaRuleArgs, states: StateLayer, columns: int,
    split: SplitWorkspace | None = None, split_passes: Sequence[str] = SPLIT_PASSES,
) -> None:
    """args.out = the gated delta rule over every sequence's rows from its slot's state, the targets' states
    stored: the recurrent kernel for sequences of <= RECURRENT_MAX_ROWS rows, for longer ones the chunked
    kernel (`columns` value columns per block, chunk_columns) or, given a workspace, its three split passes
    (`columns` per block of the sequential one; a benchmark may launch some of `split_passes` alone)."""
    stream = require_stream(stream)
    _check_step("gdn_delta_rule", step)
    rows, hv = step.num_rows, heads.value_heads
    _require_bytes(
        "gdn_delta_rule", conv=(args.conv, rows * heads.conv_channels * _BF16), x=(args.x, rows * heads.projection_stride * _BF16),
        a_log=(args.a_log, hv * _F32), dt_bias=(args.dt_bias, hv * _F32), out=(args.out, rows * heads.value_size * _F32),
    )
    if heads.value_dim % columns:
        raise ValueError(f"gdn_delta_rule: {columns} columns per block do not divide value_dim {heads.value_dim}")
    params = (
        args.out, args.conv, args.x, heads.projection_stride, heads.gate_column, args.a_log, args.dt_bias,
        *_state_args(states, step), step.query_start, heads.key_heads, hv, heads.value_dim,
    )
    reads = (args.conv.resource, args.x.resource, args.a_log.resource, args.dt_bias.resource, *step.tables, *step.slots_read)
    writes = (args.out.resource, *step.slots_written)
    if step.recurrent:
        lib.kernel(recurrent_spec(heads.key_dim)).launch(
            stream, (heads.value_dim // RECURRENT_COLUMNS, hv, step.num_seqs), RECURRENT_THREADS, *params,
            label="gdn_recurrent", reads=reads, writes=writes, lane=step.lane,
        )
    if step.chunked and split is not None:
        _split_passes(lib, stream, step, heads, args, params, split, columns, split_passes)
    elif step.chunked:
        smem = chunked_smem_bytes(heads.key_dim, columns)
        kernel_with_smem(lib, chunked_spec(heads.key_dim, columns), smem).launch(
            stream, (heads.value_dim // columns, hv, step.num_seqs), CHUNK_THREADS, *params,
            smem=smem, label="gdn_chunked", reads=reads, writes=writes, lane=step.lane,
        )


def _split_passes(
    lib: KernelLibrary, stream: object, step: GdnStep, heads: GdnHeads, args: DeltaRuleArgs, params: tuple[object, ...],
    ws: SplitWorkspace, columns: int, passes: Sequence[str],
) -> None:
    """gdn_chunked_split.cu's passes (those named in `passes`), each declaring the workspace arrays it reads
    and writes."""
    hv, chunks = heads.value_heads, gdn_split_plan.chunk_bases(step.query_lens, step.num_targets)[-1]
    needed = gdn_split_plan.SplitWorkspace(step.num_rows, chunks, heads.key_heads, hv, heads.key_dim, heads.value_dim)
    _require_bytes("gdn_split", **{name: (buf, size) for (name, size), buf in zip(needed.sizes().items(), ws.buffers)})
    per_chunk = (gdn_split_plan.max_chunks(step.query_lens, step.num_targets), hv, step.num_seqs)
    grids = (per_chunk, (heads.value_dim // columns, hv, step.num_seqs), per_chunk)
    norms, w, u, cum, h, kt = (b.resource for b in ws.buffers)
    accesses = (
        ((args.conv.resource, args.x.resource, args.a_log.resource, args.dt_bias.resource, *step.tables), (norms, w, u, cum, kt)),
        ((kt, w, u, cum, *step.tables, *step.slots_read), (u, h, *step.slots_written)),
        ((args.conv.resource, norms, u, cum, h, *step.tables), (args.out.resource,)),
    )
    specs, smems = split_specs(heads.key_dim, columns), split_smem_bytes(heads.key_dim, columns)
    for spec, smem, grid, (reads, writes), label in zip(specs, smems, grids, accesses, SPLIT_PASSES):
        if label not in passes:
            continue
        kernel_with_smem(lib, spec, smem).launch(
            stream, grid, SPLIT_THREADS, *params, *ws.buffers, smem=smem, label=label, reads=reads, writes=writes, lane=step.lane,
        )


def gated_norm(
    lib: KernelLibrary, stream: object, heads: GdnHeads, o: Buffer, x: Buffer, weight: Buffer, y: Buffer, rows: int,
    *, lane: object = None,
) -> None:
    """y [rows, Hv dv] bf16 = weight * rmsnorm(o) * silu(z) per value head, z the projection rows' z columns."""
    stream = require_stream(stream)
    _require_positive("gdn_gated_norm", rows=rows)
    _require_bytes(
        "gdn_gated_norm", o=(o, rows * heads.value_size * _F32), x=(x, rows * heads.projection_stride * _BF16),
        weight=(weight, heads.value_dim * _F32), y=(y, rows * heads.value_size * _BF16),
    )
    head_groups = -(-heads.value_heads // (GATED_NORM_THREADS // 32))  # a warp per (row, head)
    lib.kernel(GATED_NORM).launch(
        stream, (rows, head_groups), GATED_NORM_THREADS,
        y, o, x, heads.projection_stride, heads.conv_channels, weight, heads.value_heads, heads.value_dim, float(heads.norm_eps),
        label="gdn_gated_norm", reads=(o.resource, x.resource, weight.resource), writes=(y.resource,), lane=lane,
    )
