"""Quantized decode GEMV (int4/int8, gemv_quant.cu) on model shapes against the device's copy bandwidth
measured in the same run. The roofline counts weight + scale bytes (what a decode step must read); the
"layer" rows sum one decoder layer's four projections, i.e. a batch-1 step's quantized weights (lm_head
stays bf16 by default; tools/bench_kernels.py measures it). Timing is ninfer_rt.cuda.benchmark's (graph
replays of back-to-back launches rotating over weight copies past L2). Appends JSON lines to
bench/results/quant.jsonl.

    python tools/bench_quant.py --shape qwen3-8b --bits 4,8 --rows 1,2,4,8
"""

from __future__ import annotations

import argparse

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cuda import quant_ops
from ninfer_rt.cuda.benchmark import BenchSession, cold_copies, copy_bandwidth
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.kernel_dev.cases import gemv_shapes
from ninfer_rt.model.shapes import SHAPES

LAYER_OPS = ("qkv", "o_proj", "gate_up+swiglu", "down")
TARGETS = {4: 0.75, 8: 0.80}  # issue 10: batch-1 decode, fraction of the copy roofline


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]

    session = BenchSession.open(open_device(0), repeats=20)
    bandwidth = copy_bandwidth(session.streams)
    info = run_info(session.device) | {"shape": args.shape, "group_size": args.group_size, "copy_bw_TBs": bandwidth / 1e12}

    def row(bits: int, op: str, n: int, k: int, rows: int, moved: int, seconds: float) -> dict[str, object]:
        return info | {"bits": bits, "op": op, "n": n, "k": k, "rows": rows, "us": seconds * 1e6, "weight_MB": moved / 1e6,
                       "GB_s": moved / seconds / 1e9, "roofline_fraction": moved / seconds / bandwidth}

    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        layer = {rows: (0, 0.0) for rows in row_counts}
        for label, (n, k, epilogue) in gemv_shapes(SHAPES[args.shape]).items():
            if label not in LAYER_OPS:
                continue
            for rows, (moved, seconds) in bench_op(session, n, k, epilogue, bits, args.group_size, row_counts).items():
                results.append(row(bits, label, n, k, rows, moved, seconds))
                layer[rows] = (layer[rows][0] + moved, layer[rows][1] + seconds)
        results += [row(bits, "layer", 0, 0, rows, moved, seconds) for rows, (moved, seconds) in layer.items()]
    print_table(results, ["bits", "op", "n", "k", "rows", "us", "weight_MB", "GB_s", "roofline_fraction"])
    for r in results:
        if r["op"] == "layer" and r["rows"] == 1:
            verdict = "PASS" if r["roofline_fraction"] >= TARGETS[r["bits"]] else "MISS"
            print(f"int{r['bits']} batch-1 layer: {r['roofline_fraction']:.3f} of copy bandwidth (target {TARGETS[r['bits']]}) {verdict}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; appended to {append_results('quant', results)}")
    session.close()


if __name__ == "__main__":
    main()
