"""Decode GEMV bandwidth on model shapes, against the device's copy bandwidth measured in the same run.
Appends JSON lines to bench/results/kernels.jsonl.

Each measurement replays a CUDA graph of back-to-back launches (so Python launch overhead is not timed:
eager launches measured a ~35 us per-launch floor that was the host, not the kernel) and reports the
median over replays, per launch. Launches rotate over copies of the weight matrix, at least ROTATE_BYTES
in all, so the 60 MB L2 never serves a matrix from the previous launch. Weights and x are random bf16 (N(0,
0.02) tiled from one uploaded block), never zeros.

    python tools/bench_kernels.py --shape qwen3-8b --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import ml_dtypes
import numpy as np

from bench_decode import SHAPES, append_results, copy_bandwidth, print_table, run_info
from ninfer_rt.cuda import linear_ops
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.graphs import capture
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.memory import DeviceBuffer, StagingRing
from ninfer_rt.cuda.streams import Stream, StreamSet

ROTATE_BYTES = 512 << 20  # weight bytes one graph cycles through: several times the L2
MIN_LAUNCHES = 20  # launches per graph replay
REPEATS = 20  # timed replays (median)
SOURCE_BYTES = 32 << 20


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


class RandomFill:
    """Fills device buffers with random bf16 by copying one uploaded random block (fast for gigabytes)."""

    def __init__(self, streams: StreamSet, stream: Stream) -> None:
        self.stream = stream
        self.source = DeviceBuffer(streams, SOURCE_BYTES, "random_source")
        values = (np.random.default_rng(0).standard_normal(SOURCE_BYTES // 2) * 0.02).astype(ml_dtypes.bfloat16)
        ring = StagingRing(streams, 1, SOURCE_BYTES)
        ring.publish(stream, self.source, values.view(np.uint8), label="random source")
        ring.free()

    def __call__(self, buffer: DeviceBuffer) -> DeviceBuffer:
        for offset in range(0, buffer.nbytes, SOURCE_BYTES):
            self.stream.copy(buffer, self.source, min(SOURCE_BYTES, buffer.nbytes - offset), dst_offset=offset, label="fill")
        return buffer


def time_graph(stream: Stream, enqueue: Callable[[], None], launches: int) -> float:
    """Median seconds per launch over REPEATS replays of a graph of `enqueue` (which makes `launches`)."""
    enqueue()  # loads the kernel: nothing may load while capturing
    graph = capture(stream, enqueue)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPEATS):
        start = stream.record(timing=True)
        graph.replay()
        times.append(start.elapsed_ms(stream.record(timing=True)) / 1e3 / launches)
    graph.destroy()
    return statistics.median(times)


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
    fill = RandomFill(streams, stream)
    results = []
    for label, (n, k, epilogue) in gemv_shapes(args.shape).items():
        w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
        w_bytes = w_rows * k * 2
        weights = [fill(DeviceBuffer(streams, w_bytes, f"w{j}")) for j in range(-(-ROTATE_BYTES // w_bytes))]
        launches = max(MIN_LAUNCHES, len(weights))
        for rows in (int(r) for r in args.rows.split(",")):
            x = fill(DeviceBuffer(streams, rows * k * 2, "x"))
            y = DeviceBuffer(streams, rows * n * epilogue.out_bytes, "y")

            def enqueue() -> None:
                for j in range(launches):
                    linear_ops.gemv(lib, stream, x, weights[j % len(weights)], y, rows, n, k, epilogue)

            seconds = time_graph(stream, enqueue, launches)
            moved = w_bytes + rows * k * 2 + rows * n * epilogue.out_bytes
            results.append(info | {
                "shape": args.shape, "op": label, "n": n, "k": k, "rows": rows, "us": seconds * 1e6, "weight_copies": len(weights),
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
