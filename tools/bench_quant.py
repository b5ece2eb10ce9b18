"""Quantized decode GEMV (int4/int8, gemv_quant.cu) on model shapes against the device's copy bandwidth
measured in the same run. The roofline counts weight + scale bytes (what a decode step must read); the
"layer" rows sum one decoder layer's four projections, i.e. a batch-1 step's quantized weights (lm_head
stays bf16 by default; tools/bench_kernels.py measures it); for a hybrid shape the rows are its fused
projections (HYBRID_GEMVS) and the "step" row weighs each by how many a 27B step launches. Timing is ninfer_rt.cuda.benchmark's (graph
replays of back-to-back launches rotating over weight copies past L2). Appends JSON lines to
bench/results/quant.jsonl.

--gemm times the prefill GEMM instead, over the 27B's quantized matrices (GEMM_MATRICES) at --rows tokens
(default 531, the agent turn's new tokens, and 8192): the fused GEMM (NINFER_QUANT_GEMM=fused: on sm_90a the
wgmma kernel gemm_quant_sm90.cu, elsewhere gemm_quant.cu) and the portable mma.sync one (gemm_quant.cu, forced)
against dequantize + cuBLASLt (the default path) and against cuBLASLt alone on the same weight in bf16; the
"sum" rows add the matrices up. Appends JSON lines to bench/results/quant_gemm.jsonl.

--gdn-projection times the 27B Gated DeltaNet's input projection at decode widths as the executor runs a
quantized checkpoint's: one launch (the quantized [q | k | v | z] GEMV with the bf16 [b | a] rows as its dense
tail) against the three it replaced (the quantized GEMV, the bf16 GEMV, the concatenation); appends JSON lines
to bench/results/quant_gdn_projection.jsonl.

    python tools/bench_quant.py --shape qwen3-8b --bits 4,8 --rows 1,2,4,8
    python tools/bench_quant.py --shape qwen3.6-27b --bits 4,8 --rows 1,4   # the hybrid's GEMVs, a "step" row
    python tools/bench_quant.py --gemm --bits 4,8 --rows 531,8192
    python tools/bench_quant.py --gdn-projection --bits 4,8 --rows 1,2,4
"""

from __future__ import annotations

import argparse

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cuda import gemm_quant_ops, linear_ops, quant_ops
from ninfer_rt.cuda.benchmark import BenchSession, cold_copies, copy_bandwidth
from ninfer_rt.cuda.blas import Blas, GemmShape
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.linear_ops import Epilogue, RowLayout
from ninfer_rt.cuda.quant_ops import DenseTail, QuantizedDeviceWeight
from ninfer_rt.kernel_dev.cases import gemv_shapes
from ninfer_rt.model.shapes import SHAPES, is_hybrid_shape

LAYER_OPS = ("qkv", "o_proj", "gate_up+swiglu", "down")
TARGETS = {4: 0.75, 8: 0.80}  # issue 10: batch-1 decode, fraction of the copy roofline
HYBRID_TARGETS = {4: 0.80}  # issue 31: the int4 GEMV on its own at the 27B's shapes
# The 27B's quantized matrices (N, K) as issue 31 lists them: the Gated DeltaNet's [q | k | v] and z
# projections and its output (as the attention's o_proj), the attention's [q | gate] and k / v projections,
# the MLP's gate_up and down.
GEMM_MATRICES = {
    "gdn_qkv": (10240, 5120), "gdn_z": (6144, 5120), "out_proj": (5120, 6144), "attn_q_gate": (12288, 5120),
    "attn_kv": (1024, 5120), "gate_up": (34816, 5120), "down": (5120, 17408),
}
GEMM_PATHS = ("fused", "portable", "dequant", "bf16")  # fused: the default kernel; portable: mma.sync
GDN_PROJECTION = (2 * 16 * 128 + 2 * 48 * 128, 2 * 48, 5120)  # the 27B's [q | k | v | z] rows, [b | a] rows, inputs
# A hybrid's decode GEMVs as the executor launches them (hybrid_layers.py fuses each layer's projections), with how
# many a step of the 27B runs (48 Gated DeltaNet layers, 16 gated-attention layers; the lm_head apart): the "step"
# row sums them, the quantized GEMVs' share of a batch-1 step.
HYBRID_GEMVS = {
    "gdn_in_proj": (GDN_PROJECTION[0], 5120, Epilogue.STORE, 48), "gdn_out_proj": (5120, 6144, Epilogue.STORE, 48),
    "attn_qkv_gate": (12288 + 2 * 1024, 5120, Epilogue.STORE, 16), "attn_o_proj": (5120, 6144, Epilogue.STORE, 16),
    "gate_up+swiglu": (17408, 5120, Epilogue.SWIGLU, 64), "down": (5120, 17408, Epilogue.STORE, 64),
}


def bench_op(s: BenchSession, n: int, k: int, epilogue: Epilogue, bits: int, group: int, row_counts: list[int]) -> dict[int, tuple[int, float]]:
    """rows -> (weight + scale bytes, seconds per launch) of one projection."""
    w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
    code_bytes, scale_bytes = w_rows * k * bits // 8, w_rows * (k // group) * 2
    copies = cold_copies(s.device, code_bytes + scale_bytes)
    weights = [
        QuantizedDeviceWeight(q, sc, w_rows, k, bits, group)
        for q, sc in zip(s.cold(code_bytes, "qweight", copies), s.cold(scale_bytes, "scales", copies))
    ]
    timed = {}
    for rows in row_counts:
        x, y = s.filled(rows * k * 2, "x"), s.filled(rows * n * epilogue.out_bytes, "y")
        seconds = s.time(lambda i: quant_ops.gemv(s.lib, s.stream, x, weights[i % len(weights)], y, rows, epilogue), len(weights))
        timed[rows] = (code_bytes + scale_bytes, seconds)
    s.release()
    return timed


def bench_gemm(s: BenchSession, blas: Blas, n: int, k: int, bits: int, group: int, rows: int) -> dict[str, float]:
    """Seconds per GEMM of `rows` tokens by each of GEMM_PATHS, the quantized weight rotating over copies."""
    octet_rows = -(-n // 16) * 16  # the layout's rows: octets padded to an even count
    code_bytes, scale_bytes = octet_rows * k * bits // 8, octet_rows * (k // group) * 2
    copies = cold_copies(s.device, code_bytes + scale_bytes)
    weights = [
        QuantizedDeviceWeight(q, sc, n, k, bits, group)
        for q, sc in zip(s.cold(code_bytes, "qweight", copies), s.cold(scale_bytes, "scales", copies))
    ]
    x, y, scratch = s.filled(rows * k * 2, "x"), s.filled(rows * n * 2, "y"), s.filled(n * k * 2, "dequant_scratch")
    shape = GemmShape(rows, n, k)

    def dequant_then_gemm(i: int) -> None:
        quant_ops.dequantize(s.lib, s.stream, weights[i % copies], scratch)
        blas.gemm(s.stream, x, scratch, y, shape)

    timed = {
        "fused": s.time(lambda i: gemm_quant_ops.gemm(s.lib, s.stream, x, weights[i % copies], y, rows), copies),
        "portable": s.time(lambda i: gemm_quant_ops.gemm(s.lib, s.stream, x, weights[i % copies], y, rows, wgmma=False), copies),
        "dequant": s.time(dequant_then_gemm, copies),
        "bf16": s.time(lambda _: blas.gemm(s.stream, x, scratch, y, shape)),
    }
    s.release()
    return timed


def prefill_gemms(args: argparse.Namespace) -> None:
    row_counts = [int(r) for r in (args.rows or "531,8192").split(",")]
    session = BenchSession.open(open_device(0), launches=args.launches, repeats=args.repeats)
    blas = Blas(session.streams)
    info = run_info(session.device) | {"shape": "qwen3.6-27b", "group_size": args.group_size}
    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        for rows in row_counts:
            total = dict.fromkeys(GEMM_PATHS, 0.0)
            flops = 0
            for label, (n, k) in GEMM_MATRICES.items():
                timed = bench_gemm(session, blas, n, k, bits, args.group_size, rows)
                results.append(gemm_row(info, bits, label, n, k, rows, timed))
                total = {path: total[path] + timed[path] for path in GEMM_PATHS}
                flops += 2 * rows * n * k
            results.append(gemm_row(info, bits, "sum", 0, 0, rows, total, flops))
    print_table(results, ["bits", "op", "n", "k", "rows", "fused_us", "portable_us", "dequant_us", "bf16_us", "fused_TFLOPs", "speedup"])
    print(f"speedup = dequant_us / fused_us; appended to {append_results('quant_gemm', results)}")
    blas.close()
    session.close()


def gemm_row(info: dict[str, object], bits: int, op: str, n: int, k: int, rows: int, timed: dict[str, float],
             flops: int | None = None) -> dict[str, object]:
    flops = flops if flops is not None else 2 * rows * n * k
    return info | {"bits": bits, "op": op, "n": n, "k": k, "rows": rows, **{f"{p}_us": timed[p] * 1e6 for p in GEMM_PATHS},
                   "fused_TFLOPs": flops / timed["fused"] / 1e12, "speedup": timed["dequant"] / timed["fused"]}


def bench_gdn_projection(s: BenchSession, bits: int, group: int, rows: int) -> dict[str, float]:
    """Seconds per projection of `rows` rows: "fused" (one launch) and "separate" (GEMV, GEMV, two row gathers
    into the output's column ranges, as CudaExecutor.concat did), weights rotating over copies."""
    n, tail_rows, k = GDN_PROJECTION
    code_bytes, scale_bytes, tail_bytes = n * k * bits // 8, n * (k // group) * 2, tail_rows * k * 2
    copies = cold_copies(s.device, code_bytes + scale_bytes + tail_bytes)
    weights = [
        QuantizedDeviceWeight(q, sc, n, k, bits, group)
        for q, sc in zip(s.cold(code_bytes, "qweight", copies), s.cold(scale_bytes, "scales", copies))
    ]
    tails = s.cold(tail_bytes, "tail", copies)
    x, y = s.filled(rows * k * 2, "x"), s.filled(rows * (n + tail_rows) * 2, "y")
    y_quantized, y_tail = s.filled(rows * n * 2, "y_quantized"), s.filled(rows * tail_rows * 2, "y_tail")

    def fused(i: int) -> None:
        quant_ops.gemv(s.lib, s.stream, x, weights[i % copies], y, rows, tail=DenseTail(tails[i % copies], tail_rows))

    def separate(i: int) -> None:
        quant_ops.gemv(s.lib, s.stream, x, weights[i % copies], y_quantized, rows)
        linear_ops.gemv(s.lib, s.stream, x, tails[i % copies], y_tail, rows, tail_rows, k)
        for part, width, column in ((y_quantized, n, 0), (y_tail, tail_rows, n)):
            linear_ops.gather_rows(s.lib, s.stream, part, rows, y, rows, width, out_layout=RowLayout(n + tail_rows, column))

    timed = {"fused": s.time(fused, copies), "separate": s.time(separate, copies)}
    s.release()
    return timed


def gdn_projections(args: argparse.Namespace) -> None:
    session = BenchSession.open(open_device(0), repeats=20)
    info = run_info(session.device) | {"shape": "qwen3.6-27b", "group_size": args.group_size}
    n, tail_rows, k = GDN_PROJECTION
    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        for rows in (int(r) for r in (args.rows or "1,2,4").split(",")):
            timed = bench_gdn_projection(session, bits, args.group_size, rows)
            results.append(info | {"bits": bits, "n": n, "tail_rows": tail_rows, "k": k, "rows": rows,
                                   "fused_us": timed["fused"] * 1e6, "separate_us": timed["separate"] * 1e6})
    print_table(results, ["bits", "n", "tail_rows", "k", "rows", "fused_us", "separate_us"])
    print(f"appended to {append_results('quant_gdn_projection', results)}")
    session.close()


def decode_gemvs(args: argparse.Namespace) -> None:
    row_counts = [int(r) for r in (args.rows or "1,2,4,8").split(",")]
    session = BenchSession.open(open_device(0), repeats=20)
    bandwidth = copy_bandwidth(session.streams)
    info = run_info(session.device) | {"shape": args.shape, "group_size": args.group_size, "copy_bw_TBs": bandwidth / 1e12}

    def row(bits: int, op: str, n: int, k: int, rows: int, moved: int, seconds: float) -> dict[str, object]:
        return info | {"bits": bits, "op": op, "n": n, "k": k, "rows": rows, "us": seconds * 1e6, "weight_MB": moved / 1e6,
                       "GB_s": moved / seconds / 1e9, "roofline_fraction": moved / seconds / bandwidth}

    hybrid = is_hybrid_shape(SHAPES[args.shape])
    if hybrid:
        ops = HYBRID_GEMVS
    else:
        ops = {label: (*shape, 1) for label, shape in gemv_shapes(SHAPES[args.shape]).items() if label in LAYER_OPS}
    total_label = "step" if hybrid else "layer"
    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        total = {rows: (0, 0.0) for rows in row_counts}
        for label, (n, k, epilogue, count) in ops.items():
            for rows, (moved, seconds) in bench_op(session, n, k, epilogue, bits, args.group_size, row_counts).items():
                results.append(row(bits, label, n, k, rows, moved, seconds))
                total[rows] = (total[rows][0] + count * moved, total[rows][1] + count * seconds)
        results += [row(bits, total_label, 0, 0, rows, moved, seconds) for rows, (moved, seconds) in total.items()]
    print_table(results, ["bits", "op", "n", "k", "rows", "us", "weight_MB", "GB_s", "roofline_fraction"])
    targets = HYBRID_TARGETS if hybrid else TARGETS
    for r in results:
        if r["op"] == total_label and r["rows"] == 1 and r["bits"] in targets:
            verdict = "PASS" if r["roofline_fraction"] >= targets[r["bits"]] else "MISS"
            print(f"int{r['bits']} batch-1 {total_label}: {r['roofline_fraction']:.3f} of copy bandwidth (target {targets[r['bits']]}) {verdict}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; appended to {append_results('quant', results)}")
    session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--rows", default=None, help="decode: 1,2,4,8; --gemm: 531,8192")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--gemm", action="store_true", help="the prefill GEMM over the 27B's matrices")
    parser.add_argument("--gdn-projection", action="store_true", help="the 27B GDN input projection, fused or not")
    parser.add_argument("--launches", type=int, default=4, help="--gemm: launches per timed graph")
    parser.add_argument("--repeats", type=int, default=5, help="--gemm: timed graph replays (the median is kept)")
    args = parser.parse_args()
    if args.gemm:
        prefill_gemms(args)
        return
    if args.gdn_projection:
        gdn_projections(args)
        return
    decode_gemvs(args)


if __name__ == "__main__":
    main()
