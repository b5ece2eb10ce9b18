"""Each kernel family's benchmark on a model's shapes: the decode (and prefill) launches the model makes.

A bench function takes a `BenchSession` and a shape (ninfer_rt.model.shapes) and returns one `Measurement` per case
(median seconds per launch, the unique bytes a launch moves and its flops), timed by
`ninfer_rt.cuda.benchmark` (graph-replayed, inputs the model reads from HBM rotated past the L2).
`ninfer-rt kernels bench` and tools/bench_{kernels,attention}.py print them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from ninfer_rt.cuda import attention_ops, attention_plan, linear_ops, ops, quant_ops, sampling_ops
from ninfer_rt.cuda.attention_ops import AttentionStep, DecodeWorkspace, PagedKV, PrefillWorkspace, RopeArgs, StepInputs, WidenedKV
from ninfer_rt.cuda.attention_plan import PAGE_SIZE, KVVariant, PrefillPlan
from ninfer_rt.cuda.benchmark import BenchSession, Measurement, cold_copies
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.engine.sampling import pack_device_params
from ninfer_rt.kernel_benches_gdn import bench_gdn_conv, bench_gdn_delta_rule
from ninfer_rt.model.executor import AttentionShape

DECODE_ROWS = (1, 8)  # batch-1 decode and the widest speculative verify step
PREFILL_TOKENS = 4096  # one prefill chunk
DECODE_CONTEXTS = (256, 8192, 114812)  # a fresh chat, a typical agent turn, the longest agent context
# (chunk, context): a fresh prompt, a chunk after a 28k prefix, an agent turn (531 new tokens after 114,281 cached)
PREFILL_CASES = ((4096, 4096), (4096, 32768), (531, 114812))
KV_KINDS = attention_plan.CACHE_VARIANTS
QUANT_BITS = (4, 8)
QUANT_GROUP = 128
EPS = 1e-6
BF16, F32, I32 = 2, 4, 4

Shape = dict[str, int]
BenchFunction = Callable[[BenchSession, Shape], list[Measurement]]


def gemv_shapes(shape: Shape) -> dict[str, tuple[int, int, Epilogue]]:
    """label -> (n, k, epilogue) of a decoder layer's projections and the lm_head; n is the output width
    (SwiGLU reads 2n weight rows)."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return {
        "qkv": (q + 2 * kv, h, Epilogue.STORE),
        "o_proj": (h, q, Epilogue.STORE),
        "gate_up+swiglu": (i, h, Epilogue.SWIGLU),
        "down": (h, i, Epilogue.STORE),
        "lm_head(f32)": (shape["vocab_size"], h, Epilogue.STORE_F32),
    }


def attention_shape(shape: Shape) -> AttentionShape:
    return AttentionShape(shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"], EPS)


def _row_cases() -> list[tuple[str, int]]:
    return [*((f"rows={r}", r) for r in DECODE_ROWS), (f"rows={PREFILL_TOKENS}", PREFILL_TOKENS)]


# -- elementwise and row families -------------------------------------------------------------------------


def bench_rmsnorm(s: BenchSession, shape: Shape) -> list[Measurement]:
    h = shape["hidden_size"]
    results = []
    for case, rows in _row_cases():
        xs, w, out = s.cold(rows * h * BF16, "x"), s.filled(h * BF16, "w"), s.filled(rows * h * BF16, "out")
        seconds = s.time(lambda i: ops.rmsnorm(s.lib, s.stream, xs[i % len(xs)], w, out, rows, h, EPS), len(xs))
        results.append(Measurement("rmsnorm_bf16", case, seconds, 2 * rows * h * BF16 + h * BF16))
        residuals = s.cold(rows * h * BF16, "residual")
        seconds = s.time(
            lambda i: ops.rmsnorm(s.lib, s.stream, xs[i % len(xs)], w, out, rows, h, EPS, residuals[i % len(residuals)]),
            len(residuals),
        )
        results.append(Measurement("rmsnorm_residual_bf16", case, seconds, 4 * rows * h * BF16 + h * BF16))
        s.release()
    return results


def bench_activation(s: BenchSession, shape: Shape) -> list[Measurement]:
    inter = shape["intermediate_size"]
    results = []
    for case, rows in _row_cases():
        gate_ups, out = s.cold(rows * 2 * inter * BF16, "gate_up"), s.filled(rows * inter * BF16, "out")
        seconds = s.time(lambda i: ops.silu_mul(s.lib, s.stream, gate_ups[i % len(gate_ups)], out, rows, inter), len(gate_ups))
        results.append(Measurement("silu_mul_bf16", case, seconds, 3 * rows * inter * BF16))
        s.release()
    return results


def bench_embedding(s: BenchSession, shape: Shape) -> list[Measurement]:
    vocab, h = shape["vocab_size"], shape["hidden_size"]
    table = s.filled(vocab * h * BF16, "embed")  # rows drawn at random from a table far larger than L2
    results = []
    for case, rows in _row_cases():
        ids = s.upload(np.random.default_rng(0).integers(0, vocab, rows, dtype=np.int32), "ids")
        out = s.filled(rows * h * BF16, "out")
        seconds = s.time(lambda _: linear_ops.gather_rows(s.lib, s.stream, table, vocab, out, rows, h, ids))
        results.append(Measurement("gather_rows_bf16", case, seconds, 2 * rows * h * BF16 + rows * I32))
    s.release()
    return results


# (label, SamplingParams fields) of the sampling cases: the passes each makes are in sampling_ops.sample_launches
SAMPLING_CASES = (
    ("greedy", dict(temperature=0.0)),
    ("T=1", dict(temperature=1.0)),
    ("top_p=0.95", dict(temperature=0.7, top_p=0.95)),
    ("top_k=20 top_p=0.95", dict(temperature=0.6, top_k=20, top_p=0.95)),  # Qwen3's recommended thinking setting
)


def bench_sampling(s: BenchSession, shape: Shape) -> list[Measurement]:
    vocab = shape["vocab_size"]
    rng = np.random.default_rng(0)
    results = []
    for rows in DECODE_ROWS:
        # The logits were just written by the lm_head GEMV: hot in L2 in the model's step too. Model-like
        # values (N(0, 3)), not the random bf16 bits of `filled`, whose near-flat softmax is no real row.
        logits = s.upload((3 * rng.standard_normal((rows, vocab))).astype(np.float32), "logits")
        out = s.filled(rows * I32, "out")
        moved = rows * vocab * F32 + rows * I32
        scratch = s.filled(sampling_ops.argmax_scratch_bytes(rows), "argmax.scratch")
        s.stream.memset(scratch, 0)
        seconds = s.time(lambda _: sampling_ops.argmax(s.lib, s.stream, logits, out, rows, vocab, scratch))
        results.append(Measurement("argmax_f32", f"rows={rows} vocab={vocab}", seconds, moved))
        scratch = s.filled(sampling_ops.sample_scratch_bytes(rows), "sample.scratch")
        s.stream.memset(scratch, 0)
        for label, fields in SAMPLING_CASES:
            packed = pack_device_params([(SamplingParams(**fields), 0.5)] * rows, vocab)
            params = s.upload(packed, "params")
            flags = packed[:, sampling_ops.FLAGS_WORD]
            passes = len(sampling_ops.sample_launches(flags))
            seconds = s.time(lambda _: sampling_ops.sample(s.lib, s.stream, logits, out, rows, vocab, params, flags, scratch))
            case = f"{label} rows={rows} vocab={vocab} passes={passes}"
            results.append(Measurement("sample (all passes)", case, seconds, passes * moved, params={"passes": passes}))
        s.release()
    return results


# -- GEMV -----------------------------------------------------------------------------------------------------


def bench_gemv(s: BenchSession, shape: Shape, row_counts: tuple[int, ...] = DECODE_ROWS) -> list[Measurement]:
    results = []
    for label, (n, k, epilogue) in gemv_shapes(shape).items():
        w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
        weights = s.cold(w_rows * k * BF16, "w")
        for rows in row_counts:
            x, y = s.filled(rows * k * BF16, "x"), s.filled(rows * n * epilogue.out_bytes, "y")
            seconds = s.time(
                lambda i: linear_ops.gemv(s.lib, s.stream, x, weights[i % len(weights)], y, rows, n, k, epilogue), len(weights)
            )
            moved = w_rows * k * BF16 + rows * k * BF16 + rows * n * epilogue.out_bytes
            name, case = linear_ops.gemv_spec(epilogue, rows).name, f"{label} {n}x{k} rows={rows}"
            params = {"op": label, "n": n, "k": k, "rows": rows, "weight_copies": len(weights)}
            results.append(Measurement(name, case, seconds, moved, 2 * rows * w_rows * k, params))
        s.release()
    return results


def bench_gemv_quant(s: BenchSession, shape: Shape) -> list[Measurement]:
    results = []
    for bits in QUANT_BITS:
        for label, (n, k, epilogue) in gemv_shapes(shape).items():
            w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
            code_bytes, scale_bytes = w_rows * k * bits // 8, w_rows * (k // QUANT_GROUP) * BF16
            copies = cold_copies(s.device, code_bytes + scale_bytes)
            weights = [
                QuantizedDeviceWeight(q, sc, w_rows, k, bits, QUANT_GROUP)
                for q, sc in zip(s.cold(code_bytes, "qweight", copies), s.cold(scale_bytes, "scales", copies))
            ]
            for rows in DECODE_ROWS:
                x, y = s.filled(rows * k * BF16, "x"), s.filled(rows * n * epilogue.out_bytes, "y")
                seconds = s.time(lambda i: quant_ops.gemv(s.lib, s.stream, x, weights[i % len(weights)], y, rows, epilogue), len(weights))
                moved = code_bytes + scale_bytes + rows * k * BF16 + rows * n * epilogue.out_bytes
                case = f"int{bits} {label} {n}x{k} rows={rows}"
                spec = quant_ops.gemv_launch(weights[0], rows, epilogue, s.device.sm_count)[0]
                results.append(Measurement(spec.name, case, seconds, moved, 2 * rows * w_rows * k))
            s.release()
    return results


# -- attention ------------------------------------------------------------------------------------------------


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
        for case, tokens in _row_cases():
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
        own = attention_plan.prefill_kernel(arch, d, kv_dtype) != attention_plan.prefill_kernel(arch, d, kv_dtype, wgmma=False)
        for chunk, context in cases:
            prefill = _PrefillCase(s, attn, chunk, context, kv_dtype)
            for wgmma in (None, False) if own else (None,):
                results += prefill.measure(wgmma, unsplit, widen=False)
            if attention_plan.prefill_widens(arch, d, kv_dtype, attention_plan.PREFILL_WIDEN_MIN_QUERIES):
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
        kernel = attention_plan.prefill_kernel(s.lib.target_arch, d, KVVariant.WIDENED if widen else self.kv_dtype, wgmma)
        blocks = attention_plan.prefill_grid_blocks(self.chunk, 1, attn.num_heads, attn.num_kv_heads, d)
        resident = attention_ops.prefill_blocks_per_sm(s.lib, kernel)
        splits = attention_plan.prefill_num_splits(
            blocks, s.device.sm_count, resident, self.context, attention_plan.prefill_workspace_blocks(s.device.sm_count)
        )
        step = AttentionStep(self.inputs, (self.chunk,), self.pages)
        widened = _widening_buffers(s, attn, self.pages, self.inputs) if widen else None
        results = []
        for num_splits in (splits, 1) if splits > 1 and unsplit else (splits,):
            acc, ml = attention_plan.prefill_workspace_bytes(blocks * num_splits, d)
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
    values = pages * attention_plan.widened_page_bytes(attn.num_kv_heads, attn.head_dim) // 2
    return WidenedKV(s.filled(values, "widened_k"), s.filled(values, "widened_v"), s.filled(inputs.block_tables.nbytes, "widened_tables"), pages)


def bench_kv_widen(s: BenchSession, shape: Shape, contexts: tuple[int, ...] = (8192, 114812)) -> list[Measurement]:
    """One prefill sequence's int8 pages widened to f16 (kv_widen.cu): int8 and scales read, f16 written."""
    attn = attention_shape(shape)
    hkv, d = attn.num_kv_heads, attn.head_dim
    results = []
    for context in contexts:
        pages = -(-context // PAGE_SIZE)
        layers = _kv_layers(s, attn, pages, KVVariant.INT8)
        inputs = _step_inputs(s, [attention_plan.PREFILL_WIDEN_MIN_QUERIES], context, pages)
        step = AttentionStep(inputs, (attention_plan.PREFILL_WIDEN_MIN_QUERIES,), pages)
        widened = _widening_buffers(s, attn, pages, inputs)

        def launch(i: int) -> None:
            attention_ops.widen_int8_kv(s.lib, s.stream, step, attn, layers[i % len(layers)], widened, context)

        seconds = s.time(launch, len(layers))
        moved = kv_bytes(attn, pages * PAGE_SIZE, KVVariant.INT8) + pages * attention_plan.widened_page_bytes(hkv, d)
        results.append(Measurement(attention_plan.WIDEN_INT8_KV.name, f"context={context}", seconds, moved))
        s.release()
    return results


BENCHES: dict[str, BenchFunction] = {
    "rmsnorm": bench_rmsnorm,
    "activation": bench_activation,
    "embedding": bench_embedding,
    "sampling": bench_sampling,
    "gemv": bench_gemv,
    "gemv_quant": bench_gemv_quant,
    "rope_kv": bench_rope_kv,
    "decode_attention": bench_decode_attention,
    "prefill_attention": bench_prefill_attention,
    # time the sm_90a kernels and the mma.sync one in the same run
    "prefill_attention_sm90": bench_prefill_attention,  # bf16, and int8 widened
    "prefill_attention_sm90_int8": partial(bench_prefill_attention, kv_kinds=(KVVariant.INT8,)),
    "kv_widen": bench_kv_widen,
    "gdn_conv": bench_gdn_conv,
    "gdn_delta_rule": bench_gdn_delta_rule,
}
