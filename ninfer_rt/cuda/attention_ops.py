"""Launch wrappers for the attention families (kernels_src/{rope_kv,decode_attention,prefill_attention,
prefill_attention_sm90,prefill_attention_sm90_int8,kv_widen}.cu).

A step's attention is three launches over the same step inputs: `rope_kv` (q/k norm, RoPE, K/V into the
pages), then per sequence either flash-decoding (`decode_attention`, sequences with at most
`decode_max_queries` new rows: decode and speculative verify) or the tensor-core prefill kernel
(`prefill_attention`, longer chunks), over the cache's pages or, for a long chunk over int8 KV on sm_90a,
the f16 pages `widen_int8_kv` made of them. Both attention kernels take the whole step's tables and skip the
other kind's sequences, so a mixed step needs no re-packing on the host.

Every wrapper launches what it is given: the kernel, split counts and buffers are decided by
attention_plan and attention_prefill_plan (exec/cuda_attention.py decides them once per step) and the
buffers are described by attention_buffers; a wrapper checks the buffers are large enough and declares the
accesses. KV pages are declared to the ordering verifier as ("kv", page) resources; the caller passes the
page sets it already computed from the host-side block tables and slot mapping, so declaring costs nothing
per launch. The math of each kernel is documented at the top of its .cu file.
"""

from __future__ import annotations

import math

from cuda.bindings import driver as cu

from ninfer_rt.cuda.attention_buffers import (
    NO_GATE,
    AttentionStep,
    DecodeWorkspace,
    OutputGate,
    PagedKV,
    PrefillWorkspace,
    RopeArgs,
    WidenedKV,
)
from ninfer_rt.cuda.attention_plan import (
    DECODE_COMBINE,
    DECODE_HEAD_DIMS,
    MAX_SPLITS,
    PAGE_SIZE,
    ROPE_HEAD_DIMS,
    SMEM_DEFAULT_LIMIT,
    THREADS,
    DecodePlan,
    Heads,
    KVVariant,
    check_rotary_dim,
    decode_lens,
    decode_max_queries,
    decode_spec,
    decode_workspace_bytes,
    gqa_group,
    has_prefill,
    rope_grid,
    rope_kv_spec,
)
from ninfer_rt.cuda.attention_prefill_plan import (
    PREFILL_COMBINE_ROWS,
    PREFILL_HEAD_DIMS,
    PREFILL_MAX_SPLITS,
    WIDEN_INT8_KV,
    WIDEN_THREADS,
    PrefillKernel,
    PrefillPlan,
    prefill_workspace_bytes,
    widening_pages,
)
from ninfer_rt.cuda.driver import check
from ninfer_rt.cuda.kernels import Kernel, KernelLibrary
from ninfer_rt.cuda.memory import Buffer
from ninfer_rt.cuda.ops import _require_bytes, _require_positive
from ninfer_rt.cuda.streams import require_stream
from ninfer_rt.ordering.verifier import Resource

_BF16, _F32 = 2, 4


# -- occupancy ------------------------------------------------------------------------------------------


def resident_blocks(kernel: Kernel, dynamic_smem: int = 0, threads: int = THREADS) -> int:
    """Blocks of an attention kernel resident per SM (its registers and shared memory decide, per arch)."""
    occupancy = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, threads, dynamic_smem)
    return int(check(occupancy, "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


def prefill_function(lib: KernelLibrary, kernel: PrefillKernel) -> Kernel:
    """The prefill kernel, allowed its dynamic shared memory (raised past 48 KiB once)."""
    function = lib.kernel(kernel.spec)
    if kernel.smem > SMEM_DEFAULT_LIMIT and function.max_dynamic_smem < kernel.smem:
        function = lib.raise_dynamic_smem(kernel.spec, kernel.smem)
    return function


def prefill_blocks_per_sm(lib: KernelLibrary, kernel: PrefillKernel) -> int:
    """Blocks of `kernel` resident per SM (the query needs the raised shared-memory limit)."""
    return resident_blocks(prefill_function(lib, kernel), kernel.smem, kernel.threads)


# -- launches -------------------------------------------------------------------------------------------


def rope_kv(
    lib: KernelLibrary,
    stream: object,
    step: AttentionStep,
    heads: Heads,
    qkv: Buffer,
    q_out: Buffer,
    kv: PagedKV,
    rope: RopeArgs,
    *,
    qkv_stride: int | None = None,
) -> None:
    """q_out = rope(q_norm(q)); K/V pages at slot_mapping = rope(k_norm(k)), v (rope_kv.cu), for the step's
    rows of `qkv` [T, qkv_stride] (default (Hq + 2 Hkv) D; the gated attention's rows carry gates after v)."""
    stream = require_stream(stream)
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
    num_tokens, inputs = step.num_rows, step.inputs
    stride = qkv_stride or (hq + 2 * hkv) * d
    _require_positive("rope_kv", num_tokens=num_tokens)
    gqa_group(hq, hkv)
    _check_head_dim("rope_kv", d, ROPE_HEAD_DIMS)
    check_rotary_dim(d, rope.turned(d))
    if stride < (hq + 2 * hkv) * d:
        raise ValueError(f"rope_kv: qkv rows of {stride} values cannot hold {hq} q and {hkv} k/v heads of {d}")
    _require_bytes(
        "rope_kv",
        qkv=(qkv, num_tokens * stride * _BF16),
        q_out=(q_out, num_tokens * hq * d * _BF16),
        positions=(inputs.positions, num_tokens * 4),
        slot_mapping=(inputs.slot_mapping, num_tokens * 4),
        rope=(rope.table, rope.turned(d) * _F32),
    )
    norms = tuple(n.resource for n in (rope.q_norm, rope.k_norm) if n is not None)
    lib.kernel(rope_kv_spec(d, kv.variant)).launch(
        stream, rope_grid(heads, num_tokens), THREADS,
        q_out, kv.k, kv.v, *kv.scale_args, qkv, rope.q_norm or 0, rope.k_norm or 0, float(rope.norm_eps), rope.table,
        inputs.positions, inputs.slot_mapping, hq, hkv, stride, rope.turned(d), int(rope.norm_f32),
        label="rope_kv",
        reads=(qkv.resource, rope.table.resource, inputs.positions.resource, inputs.slot_mapping.resource, *norms),
        writes=(q_out.resource, *step.pages_written),
        lane=step.lane,
    )


def decode_attention(
    lib: KernelLibrary,
    stream: object,
    step: AttentionStep,
    heads: Heads,
    q: Buffer,
    out: Buffer,
    kv: PagedKV,
    plan: DecodePlan,
    workspace: DecodeWorkspace,
    gate: OutputGate | None = None,
) -> None:
    """out rows of every sequence with 1..decode_max_queries new rows = paged causal attention
    (decode_attention.cu: split kernel, then combine), times sigmoid(gate) where a gate is given (applied by
    the combine as it stores). Other sequences' rows are left untouched."""
    stream = require_stream(stream)
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
    gqa_group(hq, hkv)
    _check_head_dim("decode_attention", d, DECODE_HEAD_DIMS)
    if not 1 <= plan.num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: num_splits must be in [1, {MAX_SPLITS}], got {plan.num_splits}")
    max_queries = decode_max_queries(hq, hkv)
    if not decode_lens(heads, step.query_lens):
        raise ValueError(f"decode_attention: no sequence has 1..{max_queries} new rows ({list(step.query_lens)})")
    num_seqs, num_rows, inputs = step.num_seqs, step.num_rows, step.inputs
    acc_bytes, ml_bytes = decode_workspace_bytes(plan.num_splits, num_seqs, max_queries, hq, d)
    _require_bytes(
        "decode_attention",
        q=(q, num_rows * hq * d * _BF16),
        out=(out, num_rows * hq * d * _BF16),
        partial_acc=(workspace.acc, acc_bytes),
        partial_ml=(workspace.ml, ml_bytes),
        **step.table_sizes(),
    )
    if gate is not None:
        gate.check("decode_attention", num_rows, hq * d)
    partials = (workspace.acc.resource, workspace.ml.resource)
    lib.kernel(decode_spec(d, kv.variant)).launch(
        stream, (plan.num_splits * plan.row_groups, hkv, num_seqs), THREADS,
        workspace.acc, workspace.ml, q, kv.k, kv.v, *kv.scale_args, inputs.block_tables,
        step.max_pages_per_seq, inputs.context_lens, inputs.query_start, max_queries, hq, hkv, heads.scale, plan.row_groups,
        label="decode_attention", reads=(q.resource, *inputs.tables, *step.pages_read), writes=partials, lane=step.lane,
    )
    lib.kernel(DECODE_COMBINE).launch(
        stream, (num_seqs * max_queries, hq), THREADS,
        out, workspace.acc, workspace.ml, inputs.query_start, plan.num_splits, num_seqs, max_queries, hq, d,
        *(gate.args() if gate is not None else NO_GATE),
        label="decode_attention_combine", reads=(*partials, inputs.query_start.resource, *_gate_reads(gate)),
        writes=(out.resource,), lane=step.lane,
    )


def widen_int8_kv(
    lib: KernelLibrary, stream: object, step: AttentionStep, heads: Heads, kv: PagedKV, widened: WidenedKV, context: int
) -> None:
    """Every prefill sequence's pages of the int8 `kv`, up to `context` tokens each, widened to f16 into
    `widened` (kv_widen.cu) in step order; `widened.tables` then names each sequence's widened pages."""
    stream = require_stream(stream)
    hkv, d = heads.num_kv_heads, heads.head_dim
    if kv.variant is not KVVariant.INT8:
        raise ValueError(f"widen_int8_kv: widening needs int8 KV, not {kv.variant.value}")
    pages = widening_pages(heads, step.query_lens, context)
    if pages > widened.capacity:
        raise ValueError(
            f"widen_int8_kv: the {pages} pages of prefill sequences of up to {context} tokens exceed the widening"
            f" buffers ({widened.capacity} pages)"
        )
    inputs = step.inputs
    _require_bytes("widen_int8_kv", widened_tables=(widened.tables, step.num_seqs * step.max_pages_per_seq * 4), **step.table_sizes())
    lib.kernel(WIDEN_INT8_KV).launch(
        stream, (math.ceil(context / PAGE_SIZE), step.num_seqs), WIDEN_THREADS, widened.k, widened.v, widened.tables, widened.capacity,
        kv.k, kv.v, *kv.scale_args, inputs.block_tables, step.max_pages_per_seq, inputs.context_lens,
        inputs.query_start, decode_max_queries(heads.num_heads, hkv), hkv, d,
        label="widen_int8_kv", reads=(*inputs.tables, *step.pages_read), writes=widened.resources, lane=step.lane,
    )


def prefill_attention(
    lib: KernelLibrary,
    stream: object,
    step: AttentionStep,
    heads: Heads,
    q: Buffer,
    out: Buffer,
    kv: PagedKV | WidenedKV,
    plan: PrefillPlan,
    workspace: PrefillWorkspace | None = None,
    gate: OutputGate | None = None,
) -> None:
    """out rows of every sequence with more than decode_max_queries new rows = causal attention of the
    chunk over the cached prefix and itself (prefill_attention.cu and its sm_90a twins: plan.kernel), over
    the cache's pages or the widened ones (widen_int8_kv, which rounds the dequantized values to f16 where
    the int8 kernels multiply the exact int8 values and apply the scales in f32), times sigmoid(gate) where a
    gate is given (applied by the launch that stores out). Other sequences' rows are untouched. More than one
    split writes partials to `workspace` and adds the combine launch."""
    stream = require_stream(stream)
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
    _check_prefill(step, heads, kv, plan, workspace)
    num_rows, inputs = step.num_rows, step.inputs
    _require_bytes("prefill_attention", q=(q, num_rows * hq * d * _BF16), out=(out, num_rows * hq * d * _BF16), **step.table_sizes())
    if gate is not None:
        gate.check("prefill_attention", num_rows, hq * d)
    gate_args = gate.args() if gate is not None else NO_GATE
    if isinstance(kv, WidenedKV):
        kv_args = (kv.k, kv.v, 0, 0, kv.tables)
        kv_reads: tuple[Resource, ...] = (inputs.context_lens.resource, inputs.query_start.resource, *kv.resources)
    else:
        kv_args = (kv.k, kv.v, *kv.scale_args, inputs.block_tables)
        kv_reads = (*inputs.tables, *step.pages_read)
    args = (q, *kv_args, step.max_pages_per_seq, inputs.context_lens, inputs.query_start, decode_max_queries(hq, hkv), hq, hkv,
            heads.scale, plan.num_splits)
    reads, function, kernel = (q.resource, *kv_reads), prefill_function(lib, plan.kernel), plan.kernel
    grid_rest = (hkv, step.num_seqs)
    if plan.num_splits == 1:
        function.launch(
            stream, (plan.tiles, *grid_rest), kernel.threads, out, 0, 0, *args, *gate_args, smem=kernel.smem,
            label="prefill_attention", reads=(*reads, *_gate_reads(gate)), writes=(out.resource,), lane=step.lane,
        )
        return
    partials = (workspace.acc.resource, workspace.ml.resource)
    function.launch(  # ungated partials: the combine applies the gate
        stream, (plan.tiles * plan.num_splits, *grid_rest), kernel.threads, 0, workspace.acc, workspace.ml, *args, *NO_GATE,
        smem=kernel.smem, label="prefill_attention", reads=reads, writes=partials, lane=step.lane,
    )
    lib.kernel(kernel.combine).launch(
        stream, (plan.tiles * kernel.tile_rows // PREFILL_COMBINE_ROWS, *grid_rest), THREADS,
        out, workspace.acc, workspace.ml, inputs.context_lens, inputs.query_start, decode_max_queries(hq, hkv), hq, hkv,
        plan.num_splits, *gate_args,
        label="prefill_attention_combine",
        reads=(*partials, inputs.context_lens.resource, inputs.query_start.resource, *_gate_reads(gate)), writes=(out.resource,),
        lane=step.lane,
    )


def _gate_reads(gate: OutputGate | None) -> tuple[Resource, ...]:
    return () if gate is None else (gate.gates.resource,)


def _check_prefill(
    step: AttentionStep, heads: Heads, kv: PagedKV | WidenedKV, plan: PrefillPlan, workspace: PrefillWorkspace | None
) -> None:
    gqa_group(heads.num_heads, heads.num_kv_heads)
    _check_head_dim("prefill_attention", heads.head_dim, PREFILL_HEAD_DIMS)
    if not has_prefill(heads, step.query_lens):
        max_queries = decode_max_queries(heads.num_heads, heads.num_kv_heads)
        raise ValueError(f"prefill_attention: no sequence has more than {max_queries} new rows ({list(step.query_lens)})")
    pages = KVVariant.WIDENED if isinstance(kv, WidenedKV) else kv.variant
    if plan.kernel.variant is not pages:
        raise ValueError(f"prefill_attention: a kernel for {plan.kernel.variant.value} pages given {pages.value} pages")
    if not 1 <= plan.num_splits <= PREFILL_MAX_SPLITS:
        raise ValueError(f"prefill_attention: num_splits must be in [1, {PREFILL_MAX_SPLITS}], got {plan.num_splits}")
    if plan.num_splits > 1:
        if workspace is None:
            raise ValueError(f"prefill_attention: {plan.num_splits} splits need a workspace")
        blocks = plan.tiles * heads.num_kv_heads * step.num_seqs * plan.num_splits
        acc_bytes, ml_bytes = prefill_workspace_bytes(blocks * plan.kernel.tile_rows, heads.head_dim)
        _require_bytes("prefill_attention", partial_acc=(workspace.acc, acc_bytes), partial_ml=(workspace.ml, ml_bytes))


def _check_head_dim(op: str, head_dim: int, supported: tuple[int, ...]) -> None:
    if head_dim not in supported:
        raise ValueError(f"{op}: head_dim {head_dim} not instantiated (supported: {supported})")
