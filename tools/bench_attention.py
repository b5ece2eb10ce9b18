"""Decode attention bandwidth: flash-decoding (split + combine) at batch 1 over a paged KV cache.

Qwen3-8B attention shape (32 q heads, 8 kv heads, head_dim 128), one new token, contexts 256 / 8192 /
114812, bf16 and int8 KV; the cases and their timing are ninfer_rt.kernel_dev.bench_attention.bench_decode_attention's
(also `ninfer-rt kernels bench decode_attention`). Each measurement replays a CUDA graph of at least `--reps`
back-to-back launches of the two kernels, so Python launch overhead is not timed; the median over `--repeats`
replays (after warm-up) is reported per launch. Launches rotate over copies of the KV cache (at least
ninfer_rt.cuda.benchmark.ROTATE_BYTES in all), so a context that fits in the 60 MB L2 is still read from HBM.
Bytes moved = KV bytes read (K and V values, plus the f32 scales for int8); the fraction is of the H200's
4.28 TB/s. Prints a table and appends JSON lines to bench/results/attention.jsonl.

    python tools/bench_attention.py [--contexts 256,8192,114812] [--kv bf16,int8]

--prefill times prefill attention instead (ninfer_rt.kernel_dev.bench_attention.bench_prefill_attention, the split count as
the executor picks it): the agent turn (531 new rows over 114,812 keys) and an 8192-token causal chunk, in
TFLOP/s counting 4 * attended pairs * head_dim * q heads:

    python tools/bench_attention.py --prefill [--cases 531x114812,8192x8192] [--kv int8,bf16]

--shape takes another model's attention heads (qwen3.6-27b: its gated-attention layers, 24 q heads over 4 kv
heads of 256); the rows name the shape.
"""

from __future__ import annotations

import argparse

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cuda.attention_plan import KVVariant
from ninfer_rt.cuda.benchmark import BenchSession
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.kernel_dev.bench_attention import bench_decode_attention, bench_prefill_attention
from ninfer_rt.model.shapes import SHAPES

H200_BYTES_PER_S = 4.28e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,8192,114812")
    parser.add_argument("--kv", default="bf16,int8")
    parser.add_argument("--reps", type=int, default=20, help="launches per graph replay")
    parser.add_argument("--repeats", type=int, default=30, help="timed replays (median)")
    parser.add_argument("--prefill", action="store_true", help="prefill attention (see the module doc) instead of decode")
    parser.add_argument("--cases", default="531x114812,8192x8192", help="--prefill: CHUNKxCONTEXT,...")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="the model whose attention heads are timed")
    args = parser.parse_args()

    kinds = tuple(KVVariant(kv) for kv in args.kv.split(","))
    session = BenchSession.open(open_device(0), args.reps, args.repeats)
    info = run_info(session.device) | {"shape": args.shape}
    if args.prefill:
        cases = tuple(tuple(int(n) for n in case.split("x")) for case in args.cases.split(","))
        measured = bench_prefill_attention(session, SHAPES[args.shape], cases, kinds, unsplit=False)
        rows = [
            {**info, **m.params, "us": m.seconds * 1e6, "TFLOP/s": m.flops / m.seconds / 1e12, "GB/s": m.bytes / m.seconds / 1e9}
            for m in measured
        ]
        print(f"{session.device.name}, {session.device.sm_count} SMs, commit {info['commit']}")
        print_table(rows, ["kernel", "kv", "chunk", "context", "blocks_per_sm", "num_splits", "us", "TFLOP/s", "GB/s"])
        print(f"appended to {append_results('attention_prefill', rows)}")
        session.close()
        return
    contexts = tuple(int(c) for c in args.contexts.split(","))
    measured = bench_decode_attention(session, SHAPES[args.shape], contexts, kinds)
    rows = [
        {**info, "kernel": "decode_attention", **m.params, "us": m.seconds * 1e6, "kv_bytes": m.bytes,
         "GB/s": m.bytes / m.seconds / 1e9, "of_peak": m.bytes / m.seconds / H200_BYTES_PER_S}
        for m in measured
    ]
    print(f"{session.device.name}, {session.device.sm_count} SMs, commit {info['commit']}")
    print_table(rows, ["kv", "context", "blocks_per_sm", "num_splits", "us", "kv_bytes", "GB/s", "of_peak"])
    print(f"appended to {append_results('attention', rows)}")
    session.close()


if __name__ == "__main__":
    main()
