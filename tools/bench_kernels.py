"""Decode GEMV bandwidth on model shapes (and the cuBLASLt GEMM for comparison), against the device's
copy bandwidth measured in the same run. Appends JSON lines to bench/results/kernels.jsonl.

    python tools/bench_kernels.py --shape qwen3-8b --rows 1,2,4,8
"""

from __future__ import annotations

import argparse

from bench_decode import SHAPES, append_results, copy_bandwidth, print_table, run_info
from ninfer_rt.cuda import linear_ops
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet

REPEATS = 50


def gemv_shapes(name: str) -> dict[str, tuple[int, int, Epilogue]]:
    """label -> (n, k, epilogue); n is the output width (SwiGLU reads 2n weight rows)."""
    s = SHAPES[name]
    h, i, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    return {
        "qkv": (q + 2 * kv, h, Epilogue.STORE),
        "o_proj": (h, q, Epilogue.STORE),
        "gate_up+swiglu": (i, h, Epilogue.SWIGLU),
        "down": (h, i, Epilogue.STORE),
        "lm_head(f32)": (s["vocab_size"], h, Epilogue.STORE_F32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)
    stream = streams.create("bench")
    lib = KernelLibrary(device)
    bandwidth = copy_bandwidth(streams)
    info = run_info(device)
    results = []
    for label, (n, k, epilogue) in gemv_shapes(args.shape).items():
        w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
        # Several weight copies, used round-robin, so a matrix never sits in the 50 MB L2 between launches.
        weights = [DeviceBuffer(streams, w_rows * k * 2, f"w{j}") for j in range(4)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = DeviceBuffer(streams, rows * k * 2, "x")
            y = DeviceBuffer(streams, rows * n * epilogue.out_bytes, "y")
            for buf in (x, *weights):
                stream.memset(buf, 0)

            def launch(j: int) -> None:
                linear_ops.gemv(lib, stream, x, weights[j % len(weights)], y, rows, n, k, epilogue)

            launch(0)
            start = stream.record(timing=True)
            for j in range(REPEATS):
                launch(j)
            seconds = start.elapsed_ms(stream.record(timing=True)) / 1000 / REPEATS
            moved = w_rows * k * 2 + rows * k * 2 + rows * n * epilogue.out_bytes
            results.append(info | {
                "shape": args.shape, "op": label, "n": n, "k": k, "rows": rows, "us": seconds * 1e6,
                "GB_s": moved / seconds / 1e9, "copy_bw_TBs": bandwidth / 1e12, "roofline_fraction": moved / seconds / bandwidth,
            })
            x.free()
            y.free()
        for w in weights:
            w.free()
    print_table(results, ["op", "n", "k", "rows", "us", "GB_s", "roofline_fraction"])
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; appended to {append_results('kernels', results)}")


if __name__ == "__main__":
    main()
