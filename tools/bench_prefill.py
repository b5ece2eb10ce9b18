"""Prefill throughput: one sequence of N tokens (default 8192) through a random-weight model of a named
shape, in chunks of --chunk tokens (eager launches, cuBLASLt GEMMs, prefill attention).
Prints a table and appends JSON lines to bench/results/prefill.jsonl.

    python tools/bench_prefill.py --shape qwen3-8b --tokens 8192
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench_decode import PAGE_SIZE, SHAPES, append_results, build_random_model, make_kv, print_table, run_info, shape_config
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.base import StepBatch
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.layers import forward


def chunk_batch(start: int, size: int, total_pages: int, vocab: int) -> StepBatch:
    positions = np.arange(start, start + size, dtype=np.int32)
    return StepBatch(
        token_ids=(positions * 7919 % vocab).astype(np.int32), positions=positions,
        query_start=np.array([0, size], np.int32), context_lens=np.array([start + size], np.int32),
        block_tables=np.arange(total_pages, dtype=np.int32)[None, :], slot_mapping=positions,
        logit_rows=np.array([size - 1], np.int32),
    )


def matmul_flops(cfg: ModelConfig, tokens: int) -> float:
    """2 * params touched per token by the projections (attention's own FLOPs excluded)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d + cfg.num_attention_heads * d * h + 3 * h * i
    return 2.0 * tokens * per_layer * cfg.num_hidden_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--kv", default="bf16")
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)
    cfg = shape_config(args.shape, args.layers)
    pages = -(-args.tokens // PAGE_SIZE)
    executor = CudaExecutor(streams, max_tokens=args.chunk, max_seqs=1, max_pages_per_seq=pages,
                            max_positions=args.tokens, max_logit_rows=8)
    random = build_random_model(executor, cfg)
    kv = make_kv(streams, cfg, args.tokens, args.kv, executor)

    def prefill() -> None:
        for start in range(0, args.tokens, args.chunk):
            size = min(args.chunk, args.tokens - start)
            out = forward(executor, random.model, chunk_batch(start, size, pages, cfg.vocab_size), kv)
        executor.to_host(out.logits)

    prefill()  # warm-up: kernels, cuBLASLt plans, activation pool
    started = time.perf_counter()
    prefill()
    seconds = time.perf_counter() - started
    row = run_info(device) | {
        "shape": args.shape, "layers": cfg.num_hidden_layers, "tokens": args.tokens, "chunk": args.chunk,
        "kv_dtype": args.kv, "seconds": seconds, "tok_s": args.tokens / seconds,
        "matmul_TFLOPs": matmul_flops(cfg, args.tokens) / seconds / 1e12,
    }
    print_table([row], ["shape", "tokens", "chunk", "kv_dtype", "seconds", "tok_s", "matmul_TFLOPs"])
    print(f"appended to {append_results('prefill', [row])}")


if __name__ == "__main__":
    main()
