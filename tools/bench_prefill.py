"""Prefill: N new tokens (default 8192) after C cached ones (default 0) through a random-weight model of a
named shape, in chunks of --chunk tokens (eager launches, cuBLASLt GEMMs, prefill attention), timed from
the first launch to the sampled token on the host (time to first token for an agent turn:
`--cached 114281 --tokens 531`).

FLOPs counted: the projections (2 x params per token) and causal attention (QK^T and PV: 4 x heads x
head_dim per (query, key) pair, keys = cached + earlier new tokens + itself); lm_head for the last row
only. The roofline is the bf16 GEMM rate measured in the same run (cuBLASLt, 8192 x 24576 x 4096, the
gate_up projection of qwen3-8b at 8192 tokens). Prints a table, appends JSON lines to
bench/results/prefill.jsonl.

    python tools/bench_prefill.py --shape qwen3-8b --tokens 8192
    python tools/bench_prefill.py --shape qwen3-8b --cached 114281 --tokens 531 --kv int8
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_decode import PAGE_SIZE, SHAPES, append_results, build_random_model, make_kv, print_table, run_info, shape_config
from ninfer_rt.cuda.blas import GemmShape
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import forward

GEMM_RATE_SHAPE = GemmShape(8192, 24576, 4096)


def chunk_batch(start: int, size: int, total_pages: int, vocab: int) -> StepBatch:
    positions = np.arange(start, start + size, dtype=np.int32)
    return StepBatch(
        token_ids=(positions * 7919 % vocab).astype(np.int32), positions=positions,
        query_start=np.array([0, size], np.int32), context_lens=np.array([start + size], np.int32),
        block_tables=np.arange(total_pages, dtype=np.int32)[None, :], slot_mapping=positions,
        logit_rows=np.array([size - 1], np.int32),
    )


def matmul_flops(cfg: ModelConfig, tokens: int) -> float:
    """2 * params touched per token by the projections, plus lm_head for one row."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d + cfg.num_attention_heads * d * h + 3 * h * i
    return 2.0 * tokens * per_layer * cfg.num_hidden_layers + 2.0 * h * cfg.vocab_size


def attention_flops(cfg: ModelConfig, cached: int, tokens: int) -> float:
    """Causal attention of `tokens` new queries over `cached` + the new keys up to and including their own."""
    pairs = tokens * cached + tokens * (tokens + 1) / 2
    return 4.0 * cfg.num_attention_heads * cfg.head_dim * pairs * cfg.num_hidden_layers


def gemm_rate(executor: CudaExecutor, weight: DeviceTensor, repeats: int = 20) -> float:
    """bf16 FLOP/s of cuBLASLt on GEMM_RATE_SHAPE; x filled from a weight (random values, as in a run)."""
    shape = GEMM_RATE_SHAPE
    x = DeviceBuffer(executor.streams, shape.m * shape.k * 2, "gemm_rate.x")
    w = DeviceBuffer(executor.streams, shape.n * shape.k * 2, "gemm_rate.w")
    out = DeviceBuffer(executor.streams, shape.m * shape.n * 2, "gemm_rate.out")
    for buffer in (x, w):
        for offset in range(0, buffer.nbytes, weight.buffer.nbytes):
            executor.compute.copy(buffer, weight.buffer, min(weight.buffer.nbytes, buffer.nbytes - offset), dst_offset=offset)
    stream = executor.compute
    executor.blas.gemm(stream, x, w, out, shape)  # warm-up: plan and workspace
    start = stream.record(timing=True)
    for _ in range(repeats):
        executor.blas.gemm(stream, x, w, out, shape)
    seconds = start.elapsed_ms(stream.record(timing=True)) / 1000 / repeats
    for buffer in (x, w, out):
        buffer.free()
    return 2.0 * shape.m * shape.n * shape.k / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=8192, help="new tokens")
    parser.add_argument("--cached", type=int, default=0, help="tokens already in the KV cache")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--kv", default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)
    cfg = shape_config(args.shape, args.layers)
    total = args.cached + args.tokens
    pages = -(-total // PAGE_SIZE)
    executor = CudaExecutor(streams, max_tokens=min(args.chunk, args.tokens), max_seqs=1, max_pages_per_seq=pages,
                            max_positions=total, max_logit_rows=8)
    random = build_random_model(executor, cfg)
    kv = make_kv(streams, cfg, total, args.kv, executor)

    def prefill() -> float:
        started = time.perf_counter()
        for start in range(args.cached, total, args.chunk):
            size = min(args.chunk, total - start)
            out = forward(executor, random.model, chunk_batch(start, size, pages, cfg.vocab_size), kv)
        executor.to_host(executor.argmax(out.logits))
        return time.perf_counter() - started

    prefill()  # warm-up: kernels, cuBLASLt plans, activation pool
    seconds = statistics.median(prefill() for _ in range(args.repeats))
    rate = gemm_rate(executor, random.model.layers[0].gate_up)
    flops = matmul_flops(cfg, args.tokens) + attention_flops(cfg, args.cached, args.tokens)
    row = run_info(device) | {
        "shape": args.shape, "layers": cfg.num_hidden_layers, "cached": args.cached, "tokens": args.tokens,
        "chunk": args.chunk, "kv_dtype": args.kv, "ms": seconds * 1e3, "tok_s": args.tokens / seconds,
        "TFLOPs": flops / seconds / 1e12, "gemm_TFLOPs": rate / 1e12, "gemm_fraction": flops / seconds / rate,
    }
    print_table([row], ["shape", "cached", "tokens", "chunk", "kv_dtype", "ms", "tok_s", "TFLOPs", "gemm_TFLOPs", "gemm_fraction"])
    print(f"appended to {append_results('prefill', [row])}")


if __name__ == "__main__":
    main()
