"""Decode attention bandwidth: flash-decoding (split + combine) at batch 1 over a paged KV cache.

Qwen3-8B attention shape (32 q heads, 8 kv heads, head_dim 128), one new token, contexts 256 / 8192 /
114812, bf16 and int8 KV. Each measurement replays a CUDA graph of `--reps` back-to-back launches of the
two kernels, so Python launch overhead is not timed; the median over `--repeats` replays (after warm-up)
is reported per launch. Launches rotate over copies of the KV cache (at least ROTATE_BYTES in all), so a
context that fits in the 60 MB L2 is still read from HBM. Bytes moved = KV bytes read (K and V values, plus
the f32 scales for int8); the fraction is of the H200's 4.28 TB/s. Prints a table and appends JSON lines
to bench/results/attention.jsonl.

    python tools/bench_attention.py [--contexts 256,8192,114812] [--kv bf16,int8]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cuda import attention_ops
from ninfer_rt.cuda.attention_ops import DecodeWorkspace, StepInputs
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.graphs import capture
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.memory import DeviceBuffer, StagingRing
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.exec.base import AttentionShape
from ninfer_rt.kv.cache import KVLayer

H200_BYTES_PER_S = 4.28e12
SHAPE = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, norm_eps=1e-6)
FILL_BYTE = 0x3C  # bf16 0x3C3C ~ 0.011, int8 60, f32 scale ~ 0.011: finite values, no NaN/denormal paths
ROTATE_BYTES = 256 << 20  # KV bytes the launches of one graph cycle through: several times the L2


def kv_bytes_read(context: int, kv_dtype: str) -> int:
    element = 1 if kv_dtype == "int8" else 2
    values = 2 * context * SHAPE.num_kv_heads * SHAPE.head_dim * element
    scales = 2 * context * SHAPE.num_kv_heads * 4 if kv_dtype == "int8" else 0
    return values + scales


def upload_int32(streams: StreamSet, stream: Stream, data: np.ndarray, name: str) -> DeviceBuffer:
    data = np.ascontiguousarray(data, np.int32)
    buffer = DeviceBuffer(streams, data.nbytes, name)
    ring = StagingRing(streams, 1, data.nbytes)
    ring.publish(stream, buffer, data, label=f"upload {name}")
    ring.free()
    return buffer


def filled(streams: StreamSet, stream: Stream, nbytes: int, name: str) -> DeviceBuffer:
    buffer = DeviceBuffer(streams, nbytes, name)
    stream.memset(buffer, FILL_BYTE)
    return buffer


def bench_one(lib: KernelLibrary, streams: StreamSet, stream: Stream, context: int, kv_dtype: str, reps: int, repeats: int) -> dict[str, object]:
    hq, hkv, d = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    pages = -(-context // attention_ops.PAGE_SIZE)
    element = 1 if kv_dtype == "int8" else 2
    page_elems = attention_ops.PAGE_SIZE * hkv * d
    copies = min(256, -(-ROTATE_BYTES // kv_bytes_read(context, kv_dtype)))
    caches = [_cache(streams, stream, pages, page_elems, element, kv_dtype) for _ in range(copies)]
    reps = max(reps, copies)
    inputs = StepInputs(
        positions=upload_int32(streams, stream, np.array([context - 1]), "positions"),
        query_start=upload_int32(streams, stream, np.array([0, 1]), "query_start"),
        context_lens=upload_int32(streams, stream, np.array([context]), "context_lens"),
        block_tables=upload_int32(streams, stream, np.random.default_rng(0).permutation(pages)[None, :], "block_tables"),
        slot_mapping=upload_int32(streams, stream, np.array([context - 1]), "slot_mapping"),
    )
    kernel = lib.kernel(attention_ops.decode_spec(d, kv_dtype))
    resident = attention_ops.decode_blocks_per_sm(kernel)
    num_splits = attention_ops.decode_num_splits(1, hkv, lib.device.sm_count, resident, context)
    acc_bytes, ml_bytes = attention_ops.decode_workspace_bytes(num_splits, 1, attention_ops.decode_max_queries(hq, hkv), hq, d)
    workspace = DecodeWorkspace(DeviceBuffer(streams, acc_bytes, "acc"), DeviceBuffer(streams, ml_bytes, "ml"))
    q, out = filled(streams, stream, hq * d * 2, "q"), DeviceBuffer(streams, hq * d * 2, "out")

    def enqueue() -> None:
        for i in range(reps):
            attention_ops.decode_attention(
                lib, stream, q, out, caches[i % copies], SHAPE, inputs, [1], pages, workspace, num_splits, kv_dtype=kv_dtype, pages_read=(),
            )

    enqueue()  # loads the kernels: nothing may load while capturing
    graph = capture(stream, enqueue)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start = stream.record(timing=True)
        graph.replay()
        times.append(start.elapsed_ms(stream.record(timing=True)) / reps)
    graph.destroy()
    for buffer in (*(b for cache in caches for b in cache.buffers()), q, out, workspace.acc, workspace.ml, *vars(inputs).values()):
        buffer.free()
    median_ms = statistics.median(times)
    nbytes = kv_bytes_read(context, kv_dtype)
    rate = nbytes / (median_ms / 1e3)
    return {
        "kernel": "decode_attention", "context": context, "kv": kv_dtype, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
        "blocks_per_sm": resident, "num_splits": num_splits, "kv_copies": copies, "us": median_ms * 1e3, "kv_bytes": nbytes, "GB/s": rate / 1e9, "of_peak": rate / H200_BYTES_PER_S,
    }


def _cache(streams: StreamSet, stream: Stream, pages: int, page_elems: int, element: int, kv_dtype: str) -> KVLayer:
    values = [filled(streams, stream, pages * page_elems * element, name) for name in ("k", "v")]
    scale_bytes = pages * attention_ops.PAGE_SIZE * SHAPE.num_kv_heads * 4
    scales = [filled(streams, stream, scale_bytes, name) for name in ("k_scale", "v_scale")] if kv_dtype == "int8" else [None, None]
    return KVLayer(*values, *scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,8192,114812")
    parser.add_argument("--kv", default="bf16,int8")
    parser.add_argument("--reps", type=int, default=20, help="launches per graph replay")
    parser.add_argument("--repeats", type=int, default=30, help="timed replays (median)")
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)  # benchmarks measure the kernels, not the verifier
    stream = streams.create("bench")
    lib = KernelLibrary(device)
    info = run_info(device)
    rows = [
        {**info, **bench_one(lib, streams, stream, int(context), kv_dtype, args.reps, args.repeats)}
        for kv_dtype in args.kv.split(",")
        for context in args.contexts.split(",")
    ]
    print(f"{device.name}, {device.sm_count} SMs, commit {info['commit']}")
    print_table(rows, ["kv", "context", "blocks_per_sm", "num_splits", "us", "kv_bytes", "GB/s", "of_peak"])
    print(f"appended to {append_results('attention', rows)}")


if __name__ == "__main__":
    main()
