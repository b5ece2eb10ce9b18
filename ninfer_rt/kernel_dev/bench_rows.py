"""The benchmarks of the row-wise families (rmsnorm, activation, embedding, sampling), of the dense and
groupwise-int GEMVs, of the groupwise-int prefill GEMM and of the load-time octet rearrangement, on a model's
shapes (cases.py)."""

from __future__ import annotations

import numpy as np

from ninfer_rt.cuda import gemm_quant_ops, linear_ops, ops, quant_layout_ops, quant_ops, sampling_ops
from ninfer_rt.cuda.benchmark import BenchSession, Measurement, cold_copies
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.engine.sampling import pack_device_params
from ninfer_rt.kernel_dev.cases import BF16, DECODE_ROWS, EPS, F32, I32, PREFILL_TOKENS, Shape, gemv_shapes, row_cases

QUANT_BITS = (4, 8)
QUANT_GROUP = 128


# -- elementwise and row families -------------------------------------------------------------------------


def bench_rmsnorm(s: BenchSession, shape: Shape) -> list[Measurement]:
    h = shape["hidden_size"]
    results = []
    for case, rows in row_cases():
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
    for case, rows in row_cases():
        gate_ups, out = s.cold(rows * 2 * inter * BF16, "gate_up"), s.filled(rows * inter * BF16, "out")
        seconds = s.time(lambda i: ops.silu_mul(s.lib, s.stream, gate_ups[i % len(gate_ups)], out, rows, inter), len(gate_ups))
        results.append(Measurement("silu_mul_bf16", case, seconds, 3 * rows * inter * BF16))
        s.release()
    return results


def bench_embedding(s: BenchSession, shape: Shape) -> list[Measurement]:
    vocab, h = shape["vocab_size"], shape["hidden_size"]
    table = s.filled(vocab * h * BF16, "embed")  # rows drawn at random from a table far larger than L2
    results = []
    for case, rows in row_cases():
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


def bench_gemm_quant(s: BenchSession, shape: Shape, wgmma: bool = False) -> list[Measurement]:
    """The fused prefill GEMM over each projection (gate_up as the plain product of its 2N rows), at the agent
    turn's 531 new tokens and a prefill chunk (tools/bench_quant.py --gemm sets it beside dequantize + cuBLASLt):
    gemm_quant.cu's mma.sync kernel, or with `wgmma` gemm_quant_sm90.cu's (sm_90a)."""
    results = []
    for bits in QUANT_BITS:
        for label, (n, k, epilogue) in gemv_shapes(shape).items():
            w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
            epilogue = Epilogue.STORE_F32 if epilogue is Epilogue.STORE_F32 else Epilogue.STORE
            code_bytes, scale_bytes = w_rows * k * bits // 8, w_rows * (k // QUANT_GROUP) * BF16
            copies = cold_copies(s.device, code_bytes + scale_bytes)
            weights = [
                QuantizedDeviceWeight(q, sc, w_rows, k, bits, QUANT_GROUP)
                for q, sc in zip(s.cold(code_bytes, "qweight", copies), s.cold(scale_bytes, "scales", copies))
            ]
            for rows in (531, PREFILL_TOKENS):
                x, y = s.filled(rows * k * BF16, "x"), s.filled(rows * w_rows * epilogue.out_bytes, "y")
                seconds = s.time(
                    lambda i: gemm_quant_ops.gemm(s.lib, s.stream, x, weights[i % copies], y, rows, epilogue, wgmma=wgmma), copies
                )
                moved = code_bytes + scale_bytes + rows * k * BF16 + rows * w_rows * epilogue.out_bytes
                tokens = gemm_quant_ops.token_tile(rows)
                spec = gemm_quant_ops.sm90_spec(bits, QUANT_GROUP) if wgmma else gemm_quant_ops.gemm_spec(bits, QUANT_GROUP, tokens)
                results.append(Measurement(spec.name, f"int{bits} {label} {w_rows}x{k} rows={rows}", seconds, moved, 2 * rows * w_rows * k))
            s.release()
    return results


def bench_quant_layout(s: BenchSession, shape: Shape) -> list[Measurement]:
    """Each projection's codes rearranged from the checkpoint's rows into the GPU layout (a load-time pass:
    codes read once, written once)."""
    results = []
    for bits in QUANT_BITS:
        for label, (n, k, epilogue) in gemv_shapes(shape).items():
            w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
            row_bytes, octet_bytes = w_rows * k * bits // 8, quant_layout_ops.octet_code_bytes(bits, w_rows, k)
            sources, out = s.cold(row_bytes, "row_codes"), s.filled(octet_bytes, "octets")
            seconds = s.time(
                lambda i: quant_layout_ops.octets_from_rows(s.lib, s.stream, sources[i % len(sources)], out, bits, w_rows, k),
                len(sources),
            )
            spec = quant_layout_ops.octets_from_rows_spec(bits)
            results.append(Measurement(spec.name, f"int{bits} {label} {w_rows}x{k}", seconds, row_bytes + octet_bytes))
            s.release()
    return results
