"""Prefill: N new tokens (default 8192) after C cached ones (default 0) through a random-weight model of a
named shape (dense, or the qwen3.6-27b hybrid of tools/bench_hybrid_model.py with its state slot zeroed
before each run), in chunks of --chunk tokens (eager launches: the GEMMs, prefill attention and, in a
hybrid's linear layers, the conv and the chunked delta rule), timed from the first launch to the sampled
token on the host (time to first token for an agent turn: `--cached 114281 --tokens 531`).

FLOPs counted: the layer projections (2 x the elements of every layer matrix per token: attention, Gated
DeltaNet and MLP), causal attention in the full-attention layers (QK^T and PV: 4 x heads x head_dim per
(query, key) pair, keys = cached + earlier new tokens + itself), the chunked delta rule's products in the
linear layers (per chunk of n rows and value head: k k^T, w, q k^T 2 n^2 dk each, u and P v_new 2 n^2 dv
each, v_new = u - w S, the state update and q S 2 n dk dv each), lm_head for the last row only. The
roofline is the bf16 GEMM rate measured in the same run (cuBLASLt on the shape's own gate_up product at
8192 rows: 8192 x 24576 x 4096 for qwen3-8b, 8192 x 34816 x 5120 for qwen3.6-27b). --weights takes
bf16, int8 and int4 (every layer projection groupwise-int but a hybrid's in_proj_a/b; embedding and lm_head
bf16), each built in turn. Prints a table, appends JSON lines to bench/results/prefill.jsonl.

    python tools/bench_prefill.py --shape qwen3-8b --tokens 8192
    python tools/bench_prefill.py --shape qwen3-8b --cached 114281 --tokens 531 --kv int8
    python tools/bench_prefill.py --shape qwen3.6-27b --tokens 8192 --weights bf16,int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_decode import PAGE_SIZE, SHAPES, WEIGHT_BITS, append_results, build_random_model, make_kv, print_table, run_info, shape_config
from bench_hybrid_model import build_hybrid_model, hybrid_config
from random_weights import BENCH_SLOT, RandomModel
from ninfer_rt.cuda.blas import GemmShape
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import forward
from ninfer_rt.model.shapes import is_hybrid_shape
from ninfer_rt.model.weights import expected_tensors

GEMM_RATE_ROWS = 8192
DELTA_RULE_CHUNK = 64  # gdn_split_plan.CHUNK


def chunk_batch(start: int, size: int, total_pages: int, vocab: int, state_slot: int | None) -> StepBatch:
    """One sequence's prefill chunk; a hybrid's state read from and written back to `state_slot`."""
    positions = np.arange(start, start + size, dtype=np.int32)
    states = {} if state_slot is None else {
        "state_slots": np.array([state_slot], np.int32), "state_targets": np.array([[state_slot]], np.int32)
    }
    return StepBatch(
        token_ids=(positions * 7919 % vocab).astype(np.int32), positions=positions,
        query_start=np.array([0, size], np.int32), context_lens=np.array([start + size], np.int32),
        block_tables=np.arange(total_pages, dtype=np.int32)[None, :], slot_mapping=positions,
        logit_rows=np.array([size - 1], np.int32), **states,
    )


def matmul_flops(cfg: ModelConfig, tokens: int) -> float:
    """2 x the elements of every layer matrix per token, plus lm_head for one row."""
    layer_elements = sum(
        int(np.prod(shape)) for name, shape in expected_tensors(cfg).items() if name.startswith("model.layers.") and len(shape) == 2
    )
    return 2.0 * tokens * layer_elements + 2.0 * cfg.hidden_size * cfg.vocab_size


def attention_flops(cfg: ModelConfig, cached: int, tokens: int) -> float:
    """Causal attention of `tokens` new queries over `cached` + the new keys up to and including their own,
    in every full-attention layer."""
    pairs = tokens * cached + tokens * (tokens + 1) / 2
    return 4.0 * cfg.num_attention_heads * cfg.head_dim * pairs * len(cfg.full_attention_layers)


def delta_rule_flops(cfg: ModelConfig, tokens: int) -> float:
    """The chunked delta rule's products over `tokens` rows (chunks of 64 and the remainder) in every linear
    layer; 0 for a dense model."""
    linear = cfg.linear_attention
    if linear is None:
        return 0.0
    dk, dv = linear.key_head_dim, linear.value_head_dim
    full, rest = divmod(tokens, DELTA_RULE_CHUNK)
    per_head = sum(2.0 * n * n * (3 * dk + 2 * dv) + 6.0 * n * dk * dv for n in [DELTA_RULE_CHUNK] * full + [rest] * (rest > 0))
    return per_head * linear.num_value_heads * len(cfg.linear_attention_layers)


def gemm_shape(cfg: ModelConfig) -> GemmShape:
    return GemmShape(GEMM_RATE_ROWS, 2 * cfg.intermediate_size, cfg.hidden_size)


def gemm_rate(executor: CudaExecutor, shape: GemmShape, source: DeviceTensor, repeats: int = 20) -> float:
    """bf16 FLOP/s of cuBLASLt on `shape`; x and w filled from a bf16 weight (random values, as in a run)."""
    x = DeviceBuffer(executor.streams, shape.m * shape.k * 2, "gemm_rate.x")
    w = DeviceBuffer(executor.streams, shape.n * shape.k * 2, "gemm_rate.w")
    out = DeviceBuffer(executor.streams, shape.m * shape.n * 2, "gemm_rate.out")
    for buffer in (x, w):
        for offset in range(0, buffer.nbytes, source.buffer.nbytes):
            executor.compute.copy(buffer, source.buffer, min(source.buffer.nbytes, buffer.nbytes - offset), dst_offset=offset)
    stream = executor.compute
    executor.blas.gemm(stream, x, w, out, shape)  # warm-up: plan and workspace
    start = stream.record(timing=True)
    for _ in range(repeats):
        executor.blas.gemm(stream, x, w, out, shape)
    seconds = start.elapsed_ms(stream.record(timing=True)) / 1000 / repeats
    for buffer in (x, w, out):
        buffer.free()
    return 2.0 * shape.m * shape.n * shape.k / seconds


def time_prefill(random: RandomModel, args: argparse.Namespace, pages: int) -> float:
    """Median seconds of the prefill after a warm-up (kernels, cuBLASLt plans, activation pool, workspaces)."""
    executor, cfg = random.executor, random.model.config
    total = args.cached + args.tokens
    kv = make_kv(executor.streams, cfg, total, args.kv, executor)
    slot = None if random.states is None else BENCH_SLOT

    def prefill() -> float:
        if random.states is not None:  # the cached prefix's state stands in as zeros: its values cost nothing
            random.states.zero(BENCH_SLOT, executor.compute)
        started = time.perf_counter()
        for start in range(args.cached, total, args.chunk):
            size = min(args.chunk, total - start)
            out = forward(executor, random.model, chunk_batch(start, size, pages, cfg.vocab_size, slot), kv, random.states)
        executor.to_host(executor.argmax(out.logits))
        return time.perf_counter() - started

    prefill()
    seconds = statistics.median(prefill() for _ in range(args.repeats))
    kv.free()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=8192, help="new tokens")
    parser.add_argument("--cached", type=int, default=0, help="tokens already in the KV cache")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--kv", default="bf16")
    parser.add_argument("--weights", default="bf16", help="comma list of bf16, int8, int4 (quantized projections)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    weights = args.weights.split(",")
    if unknown := [w for w in weights if w not in WEIGHT_BITS]:
        parser.error(f"--weights: {', '.join(unknown)} not one of {', '.join(WEIGHT_BITS)}")

    device = open_device(0)
    streams = StreamSet(device, verify=False)
    hybrid = is_hybrid_shape(SHAPES[args.shape])
    cfg = hybrid_config(args.shape, args.layers) if hybrid else shape_config(args.shape, args.layers)
    build = build_hybrid_model if hybrid else build_random_model
    total = args.cached + args.tokens
    pages = -(-total // PAGE_SIZE)
    executor = CudaExecutor(streams, max_tokens=min(args.chunk, args.tokens), max_seqs=1, max_pages_per_seq=pages,
                            max_positions=total, max_logit_rows=8)
    delta_rule = delta_rule_flops(cfg, args.tokens)
    flops = matmul_flops(cfg, args.tokens) + attention_flops(cfg, args.cached, args.tokens) + delta_rule
    rows, rate = [], None
    for name in weights:
        random = build(executor, cfg, weight_bits=WEIGHT_BITS[name])
        rate = rate or gemm_rate(executor, gemm_shape(cfg), random.model.embed)
        seconds = time_prefill(random, args, pages)
        rows.append(run_info(device) | {
            "shape": args.shape, "layers": cfg.num_hidden_layers, "weights": name, "embedding_lm_head": "bf16",
            "cached": args.cached, "tokens": args.tokens, "chunk": args.chunk, "kv_dtype": args.kv, "ms": seconds * 1e3,
            "tok_s": args.tokens / seconds, "TFLOPs": flops / seconds / 1e12, "delta_rule_TFLOP": delta_rule / 1e12,
            "gemm_TFLOPs": rate / 1e12, "gemm_fraction": flops / seconds / rate,
        })
    print_table(rows, ["shape", "weights", "cached", "tokens", "chunk", "kv_dtype", "ms", "tok_s", "TFLOPs", "gemm_TFLOPs", "gemm_fraction"])
    print(f"appended to {append_results('prefill', rows)}")


if __name__ == "__main__":
    main()
