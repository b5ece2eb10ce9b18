"""Decode GEMV bandwidth on model shapes, against the device's copy bandwidth measured in the same run.
Appends JSON lines to bench/results/kernels.jsonl.

The cases and their timing are ninfer_rt.kernel_dev.bench_rows.bench_gemv's (also `ninfer-rt kernels bench gemv`):
each measurement replays a CUDA graph of back-to-back launches (so Python launch overhead is not timed:
eager launches measured a ~35 us per-launch floor that was the host, not the kernel) and reports the
median over replays, per launch. Launches rotate over copies of the weight matrix, at least
ninfer_rt.cuda.benchmark.ROTATE_BYTES in all, so the 60 MB L2 never serves a matrix from the previous
launch. Weights and x are random bf16 (N(0, 0.02) tiled from one uploaded block), never zeros.

    python tools/bench_kernels.py --shape qwen3-8b --rows 1,2,4,8
"""

from __future__ import annotations

import argparse

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cuda.benchmark import BenchSession, copy_bandwidth
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.kernel_dev.bench_rows import bench_gemv
from ninfer_rt.model.shapes import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args()

    session = BenchSession.open(open_device(0), repeats=20)
    bandwidth = copy_bandwidth(session.streams)
    info = run_info(session.device)
    measured = bench_gemv(session, SHAPES[args.shape], tuple(int(r) for r in args.rows.split(",")))
    results = [
        info | {"shape": args.shape, **m.params, "us": m.seconds * 1e6, "GB_s": m.bytes / m.seconds / 1e9,
                "copy_bw_TBs": bandwidth / 1e12, "roofline_fraction": m.bytes / m.seconds / bandwidth}
        for m in measured
    ]
    print_table(results, ["op", "n", "k", "rows", "us", "GB_s", "roofline_fraction"])
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; appended to {append_results('kernels', results)}")
    session.close()


if __name__ == "__main__":
    main()
