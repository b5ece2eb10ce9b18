"""The attention families' benchmarks (rope_kv, decode and prefill attention, kv_widen) on a model's shapes:
one sequence per case over K/V pages rotated past the L2, pages in the shuffled order a prefix cache leaves."""

from __future__ import annotations

import numpy as np

from ninfer_rt.cuda import attention_ops, attention_plan, attention_prefill_plan
from ninfer_rt.cuda.attention_buffers import AttentionStep, DecodeWorkspace, PagedKV, PrefillWorkspace, RopeArgs, StepInputs, WidenedKV
from ninfer_rt.cuda.attention_plan import PAGE_SIZE, KVVariant
from ninfer_rt.cuda.attention_prefill_plan import PrefillPlan
from ninfer_rt.cuda.benchmark import BenchSession, Measurement, cold_copies
from ninfer_rt.kernel_dev.cases import BF16, EPS, F32, Shape, attention_shape, row_cases
from ninfer_rt.model.executor import AttentionShape

DECODE_CONTEXTS = (256, 8192, 114812)  # a fresh chat, a typical agent turn, the longest agent context
# (chunk, context): a fresh prompt, a chunk after a 28k prefix, an agent turn (531 new tokens after 114,281 cached)
PREFILL_CASES = ((4096, 4096), (4096, 32768), (531, 114812))
KV_KINDS = attention_plan.CACHE_VARIANTS


def kv_bytes(shape: AttentionShape, tokens: int, kv_dtype: KVVariant) -> int:
    """K and V bytes of `tokens` tokens (values, plus the f32 scales for int8)."""
    int8 = kv_dtype is KVVariant.INT8
    per_token = 2 * shape.num_kv_heads * (shape.head_dim * (1 if int8 else BF16) + (F32 if int8 else 0))
    return per_token * tokens


def _kv_layers(s: BenchSession, shape: AttentionShape, pages: int, kv_dtype: KVVariant) -> list[PagedKV]:
    """Rotating copies of one layer's pages: in the model each layer's KV is read once per step."""
    element = 1 if kv_dtype is KVVariant.INT8 else BF16
    slots = pages * PAGE_SIZE * shape.num_kv_heads
    copies = cold_copies(s.device, kv_bytes(shape, pages * PAGE_SIZE, kv_dtype))
    ks, vs = (s.cold(slots * shape.head_dim * element, name, copies) for name in ("k", "v"))
    if kv_dtype is KVVariant.BF16:
        return [PagedKV(k, v) for k, v in zip(ks, vs)]
    k_scales, v_scales = (s.cold(slots * F32, name, copies) for name in ("k_scale", "v_scale"))
    return [PagedKV(*parts) for parts in zip(ks, vs, k_scales, v_scales)]


def _step_inputs(s: BenchSession, query_lens: list[int], context: int, pages: int) -> StepInputs:
    """One sequence whose last `query_lens[0]` rows are new, pages in shuffled order (as a prefix cache leaves them)."""
    new = query_lens[0]
    positions = np.arange(context - new, context, dtype=np.int32)
    return StepInputs(
        positions=s.upload(positions, "positions"),
        query_start=s.upload(np.array([0, new], np.int32), "query_start"),
        context_lens=s.upload(np.array([context], np.int32), "context_lens"),
        block_tables=s.upload(np.random.default_rng(0).permutation(pages).astype(np.int32)[None, :], "block_tables"),
        slot_mapping=s.upload(positions, "slot_mapping"),
    )


def bench_rope_kv(s: BenchSession, shape: Shape) -> list[Measurement]:
    attn = attention_shape(shape)
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    results = []
    for kv_dtype in KV_KINDS:
        for case, tokens in row_cases():
            pages = -(-tokens // PAGE_SIZE)
            layers = _kv_layers(s, attn, pages, kv_dtype)
            inputs = _step_inputs(s, [tokens], tokens, pages)
            qkv, q_out = s.filled(tokens * (hq + 2 * hkv) * d * BF16, "qkv"), s.filled(tokens * hq * d * BF16, "q_out")
            rope, norms = s.filled(tokens * d * F32, "rope"), s.filled(d * BF16, "norm")
            step = AttentionStep(inputs, (tokens,), pages)

            def launch(i: int) -> None:
                attention_ops.rope_kv(
                    s.lib, s.stream, step, attn, qkv, q_out, layers[i % len(layers)], RopeArgs(rope, norms, norms, EPS),
                )

            seconds = s.time(launch, len(layers))
            moved = tokens * (hq + 2 * hkv) * d * BF16 + tokens * hq * d * BF16 + kv_bytes(attn, tokens, kv_dtype) + tokens * d * F32
            results.append(Measurement(attention_plan.rope_kv_spec(d, kv_dtype).name, f"{case} kv={kv_dtype.value}", seconds, moved))
            s.release()
    return results


def bench_decode_attention(
    s: BenchSession, shape: Shape, contexts: tuple[int, ...] = DECODE_CONTEXTS, kv_kinds: tuple[KVVariant, ...] = KV_KINDS
) -> list[Measurement]:
    """Batch 1, one new token; split count as the executor picks it (one wave of resident blocks)."""
    attn = attention_shape(shape)
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    results = []
    for kv_dtype in kv_kinds:
        for context in contexts:
            pages = -(-context // PAGE_SIZE)
            layers = _kv_layers(s, attn, pages, kv_dtype)
            inputs = _step_inputs(s, [1], context, pages)
            resident = attention_ops.resident_blocks(s.lib.kernel(attention_plan.decode_spec(d, kv_dtype)))
            splits = attention_plan.decode_num_splits(1, hkv, s.device.sm_count, resident, context)
            acc, ml = attention_plan.decode_workspace_bytes(splits, 1, attention_plan.decode_max_queries(hq, hkv), hq, d)
            step, decode = AttentionStep(inputs, (1,), pages), attention_plan.DecodePlan(splits, 1)
            workspace = DecodeWorkspace(s.filled(acc, "acc"), s.filled(ml, "ml"))
            q, out = s.filled(hq * d * BF16, "q"), s.filled(hq * d * BF16, "out")

            def launch(i: int) -> None:
                attention_ops.decode_attention(s.lib, s.stream, step, attn, q, out, layers[i % len(layers)], decode, workspace)

            seconds = s.time(launch, len(layers))
            flops = 4 * hq * d * context
            case = f"context={context} kv={kv_dtype.value} splits={splits}"
            params = {
                "context": context, "kv": kv_dtype.value, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
                "blocks_per_sm": resident, "num_splits": splits, "kv_copies": len(layers),
            }
            results.append(Measurement("decode_attention (split+combine)", case, seconds, kv_bytes(attn, context, kv_dtype), flops, params))
            s.release()
    return results


def bench_prefill_attention(
    s: BenchSession,
    shape: Shape,
    cases: tuple[tuple[int, int], ...] = PREFILL_CASES,
    kv_kinds: tuple[KVVariant, ...] = KV_KINDS,
    unsplit: bool = True,
) -> list[Measurement]:
    """One sequence of `chunk` new rows over `context` keys per case; the split count as the executor picks
    it, split cases also timed unsplit (`unsplit`). Where the arch has its own kernel (sm_90a: bf16 and int8
    KV) the portable mma.sync one is timed too, in the same run; int8 KV there also widened (the widening
    launch timed with the kernel)."""
    attn = attention_shape(shape)
    d = attn.head_dim
    arch = s.lib.target_arch
    results = []
    for kv_dtype in kv_kinds:
        own = attention_prefill_plan.prefill_kernel(arch, d, kv_dtype) != attention_prefill_plan.prefill_kernel(arch, d, kv_dtype, wgmma=False)
        for chunk, context in cases:
            prefill = _PrefillCase(s, attn, chunk, context, kv_dtype)
            for wgmma in (None, False) if own else (None,):
                results += prefill.measure(wgmma, unsplit, widen=False)
            if attention_prefill_plan.prefill_widens(arch, d, kv_dtype, attention_prefill_plan.PREFILL_WIDEN_MIN_QUERIES):
                results += prefill.measure(None, unsplit, widen=True)
            s.release()
    return results


class _PrefillCase:
    """One prefill case's device data (K/V copies rotated past L2, step inputs, q and out), timed per kernel."""

    def __init__(self, s: BenchSession, attn: AttentionShape, chunk: int, context: int, kv_dtype: KVVariant) -> None:
        self.s, self.attn, self.chunk, self.context, self.kv_dtype = s, attn, chunk, context, kv_dtype
        self.pages = -(-context // PAGE_SIZE)
        self.layers = _kv_layers(s, attn, self.pages, kv_dtype)
        self.inputs = _step_inputs(s, [chunk], context, self.pages)
        rows_bytes = chunk * attn.num_heads * attn.head_dim * BF16
        self.q, self.out = s.filled(rows_bytes, "q"), s.filled(rows_bytes, "out")

    def measure(self, wgmma: bool | None, unsplit: bool, widen: bool) -> list[Measurement]:
        """The kernel prefill_kernel picks with `wgmma` (or the widened one, after the widening, with `widen`),
        at the split count the executor would use (and, with `unsplit`, at one split too); the workspace and
        the widening buffers are made here, as graph capture must not allocate."""
        s, attn, d = self.s, self.attn, self.attn.head_dim
        kernel = attention_prefill_plan.prefill_kernel(s.lib.target_arch, d, KVVariant.WIDENED if widen else self.kv_dtype, wgmma)
        blocks = attention_prefill_plan.prefill_grid_blocks(self.chunk, 1, attn.num_heads, attn.num_kv_heads, kernel.tile_rows)
        resident = attention_ops.prefill_blocks_per_sm(s.lib, kernel)
        capacity = attention_prefill_plan.prefill_workspace_rows(s.device.sm_count, d) // kernel.tile_rows
        splits = attention_prefill_plan.prefill_num_splits(blocks, s.device.sm_count, resident, self.context, capacity)
        step = AttentionStep(self.inputs, (self.chunk,), self.pages)
        widened = _widening_buffers(s, attn, self.pages, self.inputs) if widen else None
        results = []
        for num_splits in (splits, 1) if splits > 1 and unsplit else (splits,):
            acc, ml = attention_prefill_plan.prefill_workspace_bytes(blocks * num_splits * kernel.tile_rows, d)
            workspace = PrefillWorkspace(s.filled(acc, "partial_acc"), s.filled(ml, "partial_ml")) if num_splits > 1 else None
            prefill = PrefillPlan(kernel, blocks // attn.num_kv_heads, num_splits, self.context)

            def launch(i: int, prefill: PrefillPlan = prefill, workspace: PrefillWorkspace | None = workspace) -> None:
                kv = self.layers[i % len(self.layers)]
                if widened is not None:
                    attention_ops.widen_int8_kv(s.lib, s.stream, step, attn, kv, widened, self.context)
                pages = widened if widened is not None else kv
                attention_ops.prefill_attention(s.lib, s.stream, step, attn, self.q, self.out, pages, prefill, workspace)

            seconds = s.time(launch, len(self.layers))
            chunk, context = self.chunk, self.context
            attended = chunk * (context - chunk) + chunk * (chunk + 1) // 2  # causal: row i sees the prefix and i + 1 rows
            moved = 2 * chunk * attn.num_heads * d * BF16 + kv_bytes(attn, context, self.kv_dtype)
            params = {
                "kernel": ("widen_int8_kv + " if widen else "") + kernel.spec.name, "chunk": chunk, "context": context,
                "kv": self.kv_dtype.value, "q_heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": d,
                "blocks_per_sm": resident, "num_splits": num_splits, "kv_copies": len(self.layers),
            }
            name = params["kernel"] + (" (split+combine)" if num_splits > 1 else "")
            case = f"chunk={chunk} context={context} kv={self.kv_dtype.value} splits={num_splits}"
            results.append(Measurement(name, case, seconds, moved, 4 * attn.num_heads * d * attended, params))
        return results


def _widening_buffers(s: BenchSession, attn: AttentionShape, pages: int, inputs: StepInputs) -> WidenedKV:
    """Widening buffers for one sequence of `pages` pages, released with the case's other buffers."""
    values = pages * attention_prefill_plan.widened_page_bytes(attn.num_kv_heads, attn.head_dim) // 2
    return WidenedKV(s.filled(values, "widened_k"), s.filled(values, "widened_v"), s.filled(inputs.block_tables.nbytes, "widened_tables"), pages)


def bench_kv_widen(s: BenchSession, shape: Shape, contexts: tuple[int, ...] = (8192, 114812)) -> list[Measurement]:
    """One prefill sequence's int8 pages widened to f16 (kv_widen.cu): int8 and scales read, f16 written."""
    attn = attention_shape(shape)
    hkv, d = attn.num_kv_heads, attn.head_dim
    results = []
    for context in contexts:
        pages = -(-context // PAGE_SIZE)
        layers = _kv_layers(s, attn, pages, KVVariant.INT8)
        inputs = _step_inputs(s, [attention_prefill_plan.PREFILL_WIDEN_MIN_QUERIES], context, pages)
        step = AttentionStep(inputs, (attention_prefill_plan.PREFILL_WIDEN_MIN_QUERIES,), pages)
        widened = _widening_buffers(s, attn, pages, inputs)

        def launch(i: int) -> None:
            attention_ops.widen_int8_kv(s.lib, s.stream, step, attn, layers[i % len(layers)], widened, context)

        seconds = s.time(launch, len(layers))
        moved = kv_bytes(attn, pages * PAGE_SIZE, KVVariant.INT8) + pages * attention_prefill_plan.widened_page_bytes(hkv, d)
        results.append(Measurement(attention_prefill_plan.WIDEN_INT8_KV.name, f"context={context}", seconds, moved))
        s.release()
    return results
