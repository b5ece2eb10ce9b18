"""AttentionBackend: the CUDA executor's attention op and all of its device state.

A step's attention per layer is rope_kv, then decode attention for sequences of 1..decode_max_queries new
rows and prefill attention for longer ones (cuda/attention_ops.py). `plan` runs once per step: it takes
the published step and the KV cache's pages; the launches of each head geometry (kernel variant, split
counts, whether int8 pages are widened first) are decided at the geometry's first layer of the step and
reused by the others. `forward` launches one layer.

The device state lives on the instance, allocated outside any capture and kept for the executor's life (a
queued kernel or a captured graph may still read it):
- per head geometry: the roped q scratch [max_tokens, Hq D] and the decode workspace (one wave of splits of
  any batch), made at the geometry's first step;
- per head_dim: the split-prefill workspace, at the first prefill step that splits;
- per kv geometry: the widening buffers (int8 KV on sm_90a), made by `reserve` (the engine reserves them
  before sizing the KV cache) or at the first step that widens;
- resident blocks per SM of each kernel, asked of the driver once.
A decode step's launches depend only on its query lengths and the device, never on context lengths, so it
can be captured and replayed; inside `capturing()` any of the allocations above raises instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.cuda import attention_ops
from ninfer_rt.cuda.attention_buffers import (
    STEP_INPUT_NAMES,
    AttentionStep,
    DecodeWorkspace,
    OutputGate,
    PagedKV,
    PrefillWorkspace,
    RopeArgs,
    StepInputs,
    WidenedKV,
)
from ninfer_rt.cuda.attention_plan import (
    BF16_BYTES,
    PAGE_SIZE,
    DecodePlan,
    Heads,
    KVVariant,
    decode_lens,
    decode_max_queries,
    decode_plan,
    decode_scratch_splits,
    decode_spec,
    decode_workspace_bytes,
    has_prefill,
)
from ninfer_rt.cuda.attention_prefill_plan import (
    PrefillPlan,
    prefill_kernel,
    prefill_num_splits,
    prefill_tiles,
    prefill_widening_applies,
    prefill_widens,
    prefill_workspace_rows,
    prefill_workspace_bytes,
    widening_capacity,
    widening_pages,
)
from ninfer_rt.cuda.kernels import KernelLibrary, KernelSpec
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.model.executor import AttentionParams
from ninfer_rt.exec.layer_backend import CaptureGuard, PublishedStep
from ninfer_rt.kv.cache import KVCache, KVDtype

_VARIANTS = {KVDtype.BF16: KVVariant.BF16, KVDtype.INT8: KVVariant.INT8}


def kv_variant(dtype: KVDtype) -> KVVariant:
    """The kernels' variant for a KV cache of `dtype` (they read bf16 and int8 pages)."""
    if dtype not in _VARIANTS:
        raise ValueError(f"the CUDA attention kernels read bf16 or int8 KV, not {dtype.value}")
    return _VARIANTS[dtype]


@dataclass(frozen=True)
class _Scratch:
    q: DeviceBuffer
    decode: DecodeWorkspace


@dataclass(frozen=True)
class _LayerPlan:
    decode: DecodePlan | None
    prefill: PrefillPlan | None


def qkv_stride(params: AttentionParams) -> int:
    """Values per fused qkv row: q, k, v heads, then (gated attention) a gate per q head."""
    shape = params.shape
    return shape.q_size + 2 * shape.kv_size + (shape.q_size if params.output_gate else 0)


def rope_args(params: AttentionParams) -> RopeArgs:
    """The table, the q/k norm gains (f32 when prepared zero-centred) and the rotated dims of a layer."""
    q_norm, k_norm = params.q_norm, params.k_norm
    return RopeArgs(
        params.rope.buffer,
        q_norm.buffer if q_norm is not None else None,
        k_norm.buffer if k_norm is not None else None,
        params.shape.norm_eps,
        rotary_dim=params.rotary_dim,
        norm_f32=q_norm is not None and q_norm.dtype == "f32",
    )


def _heads_key(heads: Heads) -> tuple[int, int, int]:
    return (heads.num_heads, heads.num_kv_heads, heads.head_dim)


class AttentionBackend(CaptureGuard):
    """The attention of one executor's steps on its compute stream (exec/layer_backend.LayerBackend)."""

    def __init__(
        self, library: KernelLibrary, streams: StreamSet, stream: Stream, *, max_tokens: int, max_seqs: int, max_pages_per_seq: int
    ) -> None:
        self.library = library
        self.streams = streams
        self.stream = stream
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self._scratch: dict[tuple[int, int, int], _Scratch] = {}
        self._prefill_workspaces: dict[int, PrefillWorkspace] = {}
        self._widened: dict[tuple[int, int], WidenedKV] = {}
        self._resident: dict[tuple[KernelSpec, int, int], int] = {}
        self._step: AttentionStep | None = None
        self._pages: tuple[PagedKV, ...] = ()
        self._pages_of: KVCache | None = None  # the cache _pages were made from
        self._variant = KVVariant.BF16
        self._plans: dict[tuple[int, int, int], _LayerPlan] = {}

    # -- reservation and capture ---------------------------------------------------------------------------

    def reserve(self, heads: Heads, kv_dtype: KVDtype) -> None:
        """The widening buffers, where long int8 prefill steps widen (attention_prefill_plan.prefill_widens)."""
        if prefill_widening_applies(self.library.target_arch, heads.head_dim, kv_variant(kv_dtype)):
            self.widened_kv(heads)

    def _allocate(self, nbytes: int, name: str) -> DeviceBuffer:
        if self._capturing:
            raise RuntimeError(f"attention: {name} would be allocated inside a captured step; run the step eagerly first")
        return DeviceBuffer(self.streams, nbytes, name)

    # -- per step ------------------------------------------------------------------------------------------

    def plan(self, step: PublishedStep) -> None:
        if step.kv is not self._pages_of:
            self._variant = kv_variant(step.kv.spec.dtype)
            self._pages = tuple(PagedKV(layer.k, layer.v, layer.k_scale, layer.v_scale) for layer in step.kv.layers)
            self._pages_of = step.kv
        inputs = StepInputs(**{name: step.inputs[name] for name in STEP_INPUT_NAMES})
        self._step = AttentionStep(
            inputs, step.query_lens, self.max_pages_per_seq, step.pages_read, step.pages_written, step.lane
        )
        self._plans = {}

    def forward(self, qkv: Buffer, out: Buffer, params: AttentionParams, kv_layer: int) -> None:
        """out [T, Hq D] = attention of the step's rows of `qkv` [T, qkv_stride(params)] over layer `kv_layer`'s
        pages, after writing the step's K/V there; RoPE turns params.rotary_dim dims of each head (all with
        0), and a gated layer's output is multiplied by sigmoid of the gate rows that follow v, by the kernel
        that stores it (no launch of its own)."""
        lib, stream, step, heads = self.library, self.stream, self._step, params.shape
        kv, plan, scratch = self._pages[kv_layer], self._layer_plan(heads), self._scratch_for(heads)
        attention_ops.rope_kv(lib, stream, step, heads, qkv, scratch.q, kv, rope_args(params), qkv_stride=qkv_stride(params))
        gate = OutputGate(qkv, heads.q_size + 2 * heads.kv_size, qkv_stride(params)) if params.output_gate else None
        if plan.decode is not None:
            attention_ops.decode_attention(lib, stream, step, heads, scratch.q, out, kv, plan.decode, scratch.decode, gate)
        if plan.prefill is not None:
            pages: PagedKV | WidenedKV = kv
            if plan.prefill.widened:
                pages = self.widened_kv(heads)
                attention_ops.widen_int8_kv(lib, stream, step, heads, kv, pages, plan.prefill.context)
            workspace = self._prefill_workspace(heads.head_dim) if plan.prefill.num_splits > 1 else None
            attention_ops.prefill_attention(lib, stream, step, heads, scratch.q, out, pages, plan.prefill, workspace, gate)

    # -- planning ------------------------------------------------------------------------------------------

    def _layer_plan(self, heads: Heads) -> _LayerPlan:
        key = _heads_key(heads)
        if key not in self._plans:
            query_lens = self._step.query_lens
            decode = None
            if decode_lens(heads, query_lens):
                resident = self._resident_blocks(decode_spec(heads.head_dim, self._variant))
                decode = decode_plan(heads, query_lens, self.library.device.sm_count, resident)
            prefill = self._prefill_plan(heads) if has_prefill(heads, query_lens) else None
            self._plans[key] = _LayerPlan(decode, prefill)
        return self._plans[key]

    def _prefill_plan(self, heads: Heads) -> PrefillPlan:
        """The step's prefill kernel and splits: the context is bounded by the block table's width (decode
        graphs never hold a prefill, so nothing here needs to be independent of the step)."""
        arch, d, query_lens = self.library.target_arch, heads.head_dim, self._step.query_lens
        context = self.max_pages_per_seq * PAGE_SIZE
        variant = self._variant
        if prefill_widens(arch, d, variant, max(query_lens)):
            if widening_pages(heads, query_lens, context) <= self.widened_kv(heads).capacity:
                variant = KVVariant.WIDENED
        kernel = prefill_kernel(arch, d, variant)
        tiles = prefill_tiles(heads, query_lens, kernel.tile_rows)
        sm_count = self.library.device.sm_count
        resident = self._resident.get((kernel.spec, kernel.smem, kernel.threads))
        if resident is None:
            resident = attention_ops.prefill_blocks_per_sm(self.library, kernel)
            self._resident[(kernel.spec, kernel.smem, kernel.threads)] = resident
        grid_blocks = tiles * heads.num_kv_heads * len(query_lens)
        capacity = prefill_workspace_rows(sm_count, d) // kernel.tile_rows
        splits = prefill_num_splits(grid_blocks, sm_count, resident, context, capacity)
        return PrefillPlan(kernel, tiles, splits, context)

    def _resident_blocks(self, spec: KernelSpec) -> int:
        key = (spec, 0, attention_ops.THREADS)
        if key not in self._resident:
            self._resident[key] = attention_ops.resident_blocks(self.library.kernel(spec))
        return self._resident[key]

    # -- buffers -------------------------------------------------------------------------------------------

    def _scratch_for(self, heads: Heads) -> _Scratch:
        key = _heads_key(heads)
        if key not in self._scratch:
            hq, hkv, d = key
            splits = decode_scratch_splits(self.library.device.sm_count, hkv, self.max_seqs)
            acc_bytes, ml_bytes = decode_workspace_bytes(splits, 1, decode_max_queries(hq, hkv), hq, d)
            self._scratch[key] = _Scratch(
                q=self._allocate(self.max_tokens * hq * d * BF16_BYTES, f"attention.q[{hq}x{d}]"),
                decode=DecodeWorkspace(
                    self._allocate(acc_bytes, f"attention.partial_acc[{hq}x{d}]"),
                    self._allocate(ml_bytes, f"attention.partial_ml[{hq}x{d}]"),
                ),
            )
        return self._scratch[key]

    def _prefill_workspace(self, head_dim: int) -> PrefillWorkspace:
        if head_dim not in self._prefill_workspaces:
            acc_bytes, ml_bytes = prefill_workspace_bytes(prefill_workspace_rows(self.library.device.sm_count, head_dim), head_dim)
            self._prefill_workspaces[head_dim] = PrefillWorkspace(
                self._allocate(acc_bytes, f"attention.prefill_partial_acc[d{head_dim}]"),
                self._allocate(ml_bytes, f"attention.prefill_partial_ml[d{head_dim}]"),
            )
        return self._prefill_workspaces[head_dim]

    def widened_kv(self, heads: Heads) -> WidenedKV:
        """The widening buffers of this kv geometry: PREFILL_WIDEN_SEQUENCES sequences of the widest block
        table (within PREFILL_WIDEN_BUDGET), tables for the most sequences a step has."""
        key = (heads.num_kv_heads, heads.head_dim)
        if key not in self._widened:
            if self._capturing:
                raise RuntimeError("attention: the widening buffers would be allocated inside a captured step")
            capacity = widening_capacity(*key, self.max_pages_per_seq)
            self._widened[key] = WidenedKV.allocate(self.streams, *key, capacity, 4 * self.max_seqs * self.max_pages_per_seq)
        return self._widened[key]
