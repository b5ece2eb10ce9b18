"""Quantized decode GEMV (int4/int8, gemv_quant.cu) on model shapes against the device's copy bandwidth
measured in the same run. The roofline counts weight + scale bytes (what a decode step must read); the
"layer" rows sum one decoder layer's four projections, i.e. a whole batch-1 step's quantized weights.
Appends JSON lines to bench/results/quant.jsonl.

    python tools/bench_quant.py --shape qwen3-8b --bits 4,8 --rows 1,2,4,8
"""

from __future__ import annotations

import argparse

from bench_decode import SHAPES, append_results, copy_bandwidth, print_table, run_info
from ninfer_rt.cuda import quant_ops
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.kernel_benches import gemv_shapes

REPEATS = 50
L2_DEFEAT_BYTES = 256 << 20  # weight copies used round-robin add up to this: no launch finds its matrix in L2
LAYER_OPS = ("qkv", "o_proj", "gate_up+swiglu", "down")
FILL = 0x3C  # codes 3/12 and bf16 0x3C3C (~0.011) scales/activations: finite, no denormals


def weight_copies(streams: StreamSet, stream: Stream, rows: int, cols: int, bits: int, group: int) -> list[QuantizedDeviceWeight]:
    one = rows * cols * bits // 8 + rows * cols // group * 2
    copies = []
    for j in range(max(2, -(-L2_DEFEAT_BYTES // one))):
        q = DeviceBuffer(streams, rows * cols * bits // 8, f"q{j}")
        s = DeviceBuffer(streams, rows * cols // group * 2, f"s{j}")
        stream.memset(q, FILL)
        stream.memset(s, FILL)
        copies.append(QuantizedDeviceWeight(q, s, rows, cols, bits, group))
    return copies


def time_gemv(lib: KernelLibrary, streams: StreamSet, stream: Stream, w: list[QuantizedDeviceWeight], rows: int, epilogue: Epilogue) -> float:
    """Seconds per launch, averaged over REPEATS back-to-back launches."""
    n = w[0].rows // 2 if epilogue is Epilogue.SWIGLU else w[0].rows
    x = DeviceBuffer(streams, rows * w[0].cols * 2, "x")
    y = DeviceBuffer(streams, rows * n * epilogue.out_bytes, "y")
    stream.memset(x, FILL)

    def launch(j: int) -> None:
        quant_ops.gemv(lib, stream, x, w[j % len(w)], y, rows, epilogue)

    launch(0)
    start = stream.record(timing=True)
    for j in range(REPEATS):
        launch(j + 1)
    seconds = start.elapsed_ms(stream.record(timing=True)) / 1000 / REPEATS
    x.free()
    y.free()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)
    stream = streams.create("bench")
    lib = KernelLibrary(device)
    bandwidth = copy_bandwidth(streams)
    info = run_info(device) | {"shape": args.shape, "group_size": args.group_size, "copy_bw_TBs": bandwidth / 1e12}
    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        layer: dict[int, tuple[int, float]] = {}  # rows -> (bytes, seconds) summed over LAYER_OPS
        for label, (n, k, epilogue) in gemv_shapes(SHAPES[args.shape]).items():
            if label not in LAYER_OPS:
                continue  # lm_head stays bf16 by default: bench_kernels.py measures it
            w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
            copies = weight_copies(streams, stream, w_rows, k, bits, args.group_size)
            for rows in (int(r) for r in args.rows.split(",")):
                seconds = time_gemv(lib, streams, stream, copies, rows, epilogue)
                moved = copies[0].nbytes
                total = layer.get(rows, (0, 0.0))
                layer[rows] = (total[0] + moved, total[1] + seconds)
                results.append(info | {"bits": bits, "op": label, "n": n, "k": k, "rows": rows, "us": seconds * 1e6,
                                       "weight_MB": moved / 1e6, "GB_s": moved / seconds / 1e9,
                                       "roofline_fraction": moved / seconds / bandwidth})
            for w in copies:
                w.qweight.free()
                w.scales.free()
        for rows, (moved, seconds) in layer.items():
            results.append(info | {"bits": bits, "op": "layer", "n": 0, "k": 0, "rows": rows, "us": seconds * 1e6,
                                   "weight_MB": moved / 1e6, "GB_s": moved / seconds / 1e9,
                                   "roofline_fraction": moved / seconds / bandwidth})
    print_table(results, ["bits", "op", "n", "k", "rows", "us", "weight_MB", "GB_s", "roofline_fraction"])
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; targets at rows=1 (layer): int4 >= 0.75, int8 >= 0.80; "
          f"appended to {append_results('quant', results)}")


if __name__ == "__main__":
    main()
