"""What the attention launches take (attention_ops.py): the step's int32 device tables and each sequence's
new rows, a layer's K/V pages, RoPE's table and norms, the output gate, the split partials' workspaces and
the widened pages of int8 KV. Descriptions of device buffers only; the launches check their sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ninfer_rt.cuda.attention_plan import KVVariant
from ninfer_rt.cuda.attention_prefill_plan import widened_page_bytes
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.ops import StepRows, _require_bytes
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.ordering.verifier import Resource

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
class AttentionStep(StepRows):
    """A step as every attention launch of it sees it: the inputs, each sequence's new rows, the block
    table's width, the KV pages the step reads and writes (for the verifier) and its lanes."""

    inputs: StepInputs
    query_lens: tuple[int, ...]
    max_pages_per_seq: int
    pages_read: Sequence[Resource] = ()
    pages_written: Sequence[Resource] = ()
    lane: object = None

    def table_sizes(self) -> dict[str, tuple[Buffer, int]]:
        return self.inputs.table_sizes(self.num_seqs, self.max_pages_per_seq)


@dataclass(frozen=True)
class PagedKV:
    """One layer's K/V pages [num_pages, 64, Hkv, D]: bf16, or int8 with f32 scales [num_pages, 64, Hkv]."""

    k: Buffer
    v: Buffer
    k_scale: Buffer | None = None
    v_scale: Buffer | None = None

    def __post_init__(self) -> None:
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("int8 KV needs k_scale and v_scale buffers, bf16 KV none")

    @property
    def variant(self) -> KVVariant:
        return KVVariant.BF16 if self.k_scale is None else KVVariant.INT8

    @property
    def scale_args(self) -> tuple[Buffer | int, Buffer | int]:
        return (self.k_scale or 0, self.v_scale or 0)


@dataclass(frozen=True)
class RopeArgs:
    """What rope_kv applies besides the step: the cos/sin table (attention_plan.rope_table, rotary_dim / 2
    frequencies per row) and the optional per-head q/k RMSNorm gains (bf16, or f32 with `norm_f32`: the
    hybrid's zero-centred 1 + w) with their epsilon. rotary_dim 0 turns the whole head."""

    table: Buffer
    q_norm: Buffer | None = None
    k_norm: Buffer | None = None
    norm_eps: float = 1e-6
    rotary_dim: int = 0
    norm_f32: bool = False

    def turned(self, head_dim: int) -> int:
        return self.rotary_dim or head_dim

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("rope_kv: q_norm and k_norm come together (Qwen3) or not at all (Llama)")


@dataclass(frozen=True)
class OutputGate:
    """A gated attention's gates: bf16 rows `stride` values apart in `gates`, head h's D gates of a row at
    column + h * D (the fused qkv rows' gate columns, after v). The kernel that stores the output multiplies
    it by sigmoid(gate) before rounding it."""

    gates: Buffer
    column: int
    stride: int

    def check(self, op: str, rows: int, width: int) -> None:
        """The gates of `rows` rows of `width` outputs lie inside the buffer's rows; 4-byte aligned, as the
        kernels read them (pairs of gates; the decode combine 8 bytes at a time)."""
        if self.column < 0 or self.column + width > self.stride:
            raise ValueError(f"{op}: gate columns {self.column}..{self.column + width} overflow the gate rows ({self.stride})")
        if self.column % 4 or self.stride % 4:
            raise ValueError(f"{op}: gate column {self.column} and row stride {self.stride} are not multiples of 4 (8-byte loads)")
        _require_bytes(op, gates=(self.gates, rows * self.stride * 2))

    def args(self) -> tuple[int, int]:
        """The kernels' (gate, gate_stride) arguments: the first row's first gate."""
        return self.gates.ptr + 2 * self.column, self.stride


NO_GATE = (0, 0)  # the (gate, gate_stride) arguments of an ungated launch


@dataclass(frozen=True)
class DecodeWorkspace:
    """Flash-decoding partials: acc f32 [num_splits, B * max_queries, Hq, D], (max, sum) f32 [..., 2].
    Row slot b * max_queries + j holds query j of sequence b."""

    acc: Buffer
    ml: Buffer


@dataclass(frozen=True)
class PrefillWorkspace:
    """Split-prefill partials: acc f32 [blocks, R, D], (max, sum) f32 [blocks, R, 2], where a block is one
    (split, sequence, tile, kv head) of the prefill kernel's split grid and R its tile_rows."""

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

    @classmethod
    def allocate(cls, owner: StreamSet, n_kv_heads: int, head_dim: int, capacity: int, table_bytes: int) -> WidenedKV:
        values = capacity * widened_page_bytes(n_kv_heads, head_dim) // 2
        name = f"attention.widened[{n_kv_heads}x{head_dim}]"
        k, v = (DeviceBuffer(owner, values, f"{name}.{part}") for part in ("k", "v"))
        return cls(k, v, DeviceBuffer(owner, table_bytes, f"{name}.tables"), capacity)

    @property
    def resources(self) -> tuple[Resource, ...]:
        return tuple(buffer.resource for buffer in (self.k, self.v, self.tables))
