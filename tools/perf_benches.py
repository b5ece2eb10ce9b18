"""What docs/performance.md reports: each benchmark's results file, command, configuration and figures."""

from __future__ import annotations

from perf_data import Bench, Column as C

SHAPE, GPU, KV = C("shape", "shape"), C("GPU", "gpu"), C("KV", "kv_dtype")
WEIGHTS, CONTEXT = C("weights", "weights"), C("context", "context", "{:,}")

DECODE = Bench(
    "Batch-1 decode step (synthetic weights of the model's shape)",
    "decode.jsonl",
    "python tools/bench_decode.py --shape qwen3-8b --contexts 256,114812 --kv bf16,int8 --weights bf16,int8,int4",
    (GPU, SHAPE, WEIGHTS, KV, CONTEXT, C("dependent launch", "dependent_launch")),
    (
        C("tok/s, each token read back", "tok_s", "{:.1f}"),
        C("tok/s, engine loop (overlap)", "overlap_tok_s", "{:.1f}", optional=True),
        C("GPU ms a step (graph)", "graph_ms", "{:.3f}"),
        C("of roofline, read back", "roofline_fraction", "{:.3f}"),
        C("of roofline, overlap", "overlap_fraction", "{:.3f}", optional=True),
        C("copy TB/s", "copy_bw_TBs", "{:.2f}"),
    ),
    defaults={"weights": "bf16"},
)
ENGINE = Bench(
    "Decode through the whole engine (checkpoints from tools/make_shaped_model.py: /tmp/m8b and /tmp/q8 of "
    "the qwen3-8b shape, qwen3.6-27b-int4 the hybrid with int4 g128 weights; random weights accept no draft)",
    "engine.jsonl",
    "python tools/bench_engine.py --model DIR --context 256,114812 --kv-dtype int8 [--no-overlap] [--draft-tokens 0,3]",
    (GPU, C("checkpoint", "model"), C("draft tokens", "draft_tokens"), C("context", "context", "{:,}"), KV, C("overlap", "overlap")),
    (C("tok/s", "decode_tok_s", "{:.1f}"), C("ms a token", "ms_per_token", "{:.2f}")),
    defaults={"draft_tokens": 0},
)
TORCH = Bench(
    "torch on the same GPU, same shape (peers)",
    "decode_torch.jsonl",
    "python tools/bench_torch_decode.py --contexts 256 --weights bf16,int4,int8,int8-linear",
    (GPU, C("implementation", "impl"), SHAPE, WEIGHTS, KV, CONTEXT),
    (
        C("tok/s", "tok_s", "{:.1f}"),
        C("ms a step", "ms_per_step", "{:.2f}"),
        C("of roofline", "roofline_fraction", "{:.3f}"),
        C("torch", "torch", "{}", optional=True),
    ),
    defaults={"weights": "bf16"},
)
PREFILL = Bench(
    "Prefill and the agent turn (cached prefix + new tokens, time to first token)",
    "prefill.jsonl",
    "python tools/bench_prefill.py --tokens 8192; python tools/bench_prefill.py --cached 114281 --tokens 531 --chunk 531 --kv int8"
    " [--shape qwen3.6-27b --weights bf16,int4]",
    (GPU, SHAPE, WEIGHTS, C("cached", "cached", "{:,}"), C("new tokens", "tokens", "{:,}"), C("chunk", "chunk", "{:,}"), KV),
    (
        C("ms", "ms", "{:.1f}"),
        C("TFLOP/s", "TFLOPs", "{:.0f}"),
        C("GEMM TFLOP/s (same run)", "gemm_TFLOPs", "{:.0f}"),
        C("of GEMM rate", "gemm_fraction", "{:.3f}"),
    ),
    defaults={"weights": "bf16"},
)
DECODE_ATTENTION = Bench(
    "Decode attention alone",
    "attention.jsonl",
    "python tools/bench_attention.py --contexts 256,8192,114812 --kv bf16,int8",
    (GPU, C("kernel", "kernel"), C("context", "context", "{:,}"), C("KV", "kv")),
    (C("us", "us", "{:.1f}"), C("GB/s", "GB/s", "{:.0f}"), C("of copy bandwidth", "of_peak", "{:.3f}")),
)
PREFILL_ATTENTION = Bench(
    "Prefill attention alone (queries x keys)",
    "attention_prefill.jsonl",
    "python tools/bench_attention.py --prefill --kv bf16,int8 [--shape qwen3.6-27b]",
    (GPU, SHAPE, C("kernel", "kernel"), C("queries", "chunk", "{:,}"), C("keys", "context", "{:,}"), C("KV", "kv")),
    (C("us", "us", "{:.1f}"), C("TFLOP/s", "TFLOP/s", "{:.0f}")),
    retired=("prefill_attention_v1_d128_bf16", "prefill_attention_v1_d128_int8"),
    defaults={"shape": "qwen3-8b"},
)
QUANT_GEMV = Bench(
    "Quantized GEMV (tensor cores), one matrix or one layer",
    "quant.jsonl",
    "python tools/bench_quant.py --shape qwen3-8b --bits 4,8",
    (GPU, SHAPE, C("bits", "bits", "{}"), C("group", "group_size", "{}"), C("op", "op"), C("rows", "rows", "{}")),
    (C("us", "us", "{:.1f}"), C("GB/s", "GB_s", "{:.0f}"), C("of copy bandwidth", "roofline_fraction", "{:.3f}")),
    exclude_fields=("variant",),
)
BF16_GEMV = Bench(
    "bf16 GEMV",
    "kernels.jsonl",
    "python tools/bench_kernels.py --shape qwen3-8b",
    (GPU, SHAPE, C("op", "op"), C("rows", "rows", "{}")),
    (C("us", "us", "{:.1f}"), C("GB/s", "GB_s", "{:.0f}"), C("of copy bandwidth", "roofline_fraction", "{:.3f}")),
)
SPEC = Bench(
    "MTP speculative step against a plain step",
    "spec.jsonl",
    "python tools/bench_spec.py --contexts 256,114812",
    (GPU, SHAPE, CONTEXT, KV, C("drafts", "k", "{}"), C("lm-head draft", "lm_head_draft", "{}")),
    (
        C("plain ms", "ms_per_plain_step", "{:.2f}"),
        C("speculative ms", "ms_per_spec_step", "{:.2f}"),
        C("ratio", "ratio", "{:.2f}"),
    ),
    defaults={"lm_head_draft": "none"},
)
SPEC_DEMO = Bench(
    "MTP on the shipped models (greedy)",
    "spec_demo.jsonl",
    "python tools/bench_spec_demo.py [--model NAME|DIR] [--device cpu]",
    (GPU, C("model", "model"), C("device", "device"), C("drafts", "draft_tokens", "{}"), C("lm-head draft", "lm_head_draft", "{}")),
    (
        C("acceptance length", "acceptance_length", "{:.2f}"),
        C("tok/s", "decode_tok_s", "{:.0f}"),
        C("speed-up", "speedup", "{:.2f}"),
    ),
    defaults={"lm_head_draft": "none", "model": "tiny-qwen3-code"},
)
QUANT_QUALITY = Bench(
    "Quantization quality on the shipped model",
    "quant_quality.jsonl",
    "python tools/eval_quant.py",
    (C("model", "model"), C("weights", "variant")),
    (
        C("perplexity", "ppl", "{:.4f}"),
        C("increase", "ppl_increase", "{:+.4f}"),
        C("top-1 agreement", "top1_agreement", "{:.4f}"),
        C("tokens", "tokens", "{:,}"),
    ),
    defaults={"ppl_increase": 0.0, "top1_agreement": 1.0},
)
REPLAY = Bench(
    "Agent traffic replayed against a server (int8 KV, 2 lanes, verifier on)",
    "replay.jsonl",
    "tools/replay_gpu.sh replay $OUT qwen3-8b",
    (GPU, C("model", "model"), C("profile", "profile"), C("scale", "scale", "{}"), KV, C("lanes", "lanes", "{}")),
    (
        C("requests", "requests", "{}"),
        C("errors", "errors", "{}"),
        C("cached ratio", "cached_ratio", "{:.3f}"),
        C("TTFT p50 ms", "ttft_ms.p50", "{:.0f}"),
        C("TTFT p99 ms", "ttft_ms.p99", "{:.0f}"),
        C("inter-token p50 ms", "itl_ms.p50", "{:.2f}"),
        C("wall s", "wall_s", "{:.0f}"),
    ),
)
REPLAY_TINY = Bench(
    "Agent traffic replayed against a tiny random model (full scale, int8 KV, 2 lanes, verifier on)",
    "replay-agent-h200.json",
    "ninfer-rt replay agent.jsonl --url http://127.0.0.1:8000 --min-cached-ratio 0.9",
    (C("GPU", "gpu"),),
    (
        C("requests", "requests", "{}"),
        C("errors", "errors", "{}"),
        C("cached ratio after turn 1", "cached_ratio_after_first", "{:.3f}"),
        C("TTFT p50 s", "ttft_s.p50", "{:.3f}"),
        C("TTFT p99 s", "ttft_s.p99", "{:.3f}"),
        C("inter-token p50 s", "itl_s.p50", "{:.4f}"),
        C("wall s", "wall_s", "{:.0f}"),
    ),
    # The file predates the date and commit fields: the commit that recorded it and its time.
    provenance={"gpu": "NVIDIA H200", "date": "2026-11-30T00:49:46+00:00", "commit": "89cc649"},
)

GATED_DELTANET = Bench(
    "Gated DeltaNet delta rule at the 27B layer shape (16 key / 48 value heads of 128, 48 layer states), fla-core beside",
    "gdn.jsonl",
    "python tools/bench_gdn.py --recurrent 1,4 --chunked 531,8192",
    (GPU, C("kernel", "kernel"), C("T", "T", "{:,}"), C("states kept", "states_kept", "{}")),
    (C("us", "us", "{:.1f}"), C("GB/s", "GB/s", "{:.0f}"), C("of copy bandwidth", "of_copy_bw", "{:.3f}")),
)
QUANTIZE_MEMORY = Bench(
    "ninfer-rt quantize in bounded memory (27B layer shapes, fewer layers)",
    "quantize_memory.jsonl",
    "python tools/bench_quantize_memory.py",
    (C("layers", "layers", "{}"), C("bits", "bits", "{}"), C("group", "group_size", "{}")),
    (
        C("checkpoint bytes", "checkpoint_bytes", "{:,}"),
        C("largest tensor bytes", "largest_tensor_bytes", "{:,}"),
        C("peak RSS bytes", "peak_rss_bytes", "{:,}"),
        C("seconds", "seconds", "{:.0f}"),
        C("seconds at 64 layers", "seconds_at_64_layers", "{:.0f}"),
    ),
)

BENCHES = (
    DECODE, ENGINE, TORCH, PREFILL, DECODE_ATTENTION, PREFILL_ATTENTION, QUANT_GEMV, BF16_GEMV,
    SPEC, SPEC_DEMO, QUANT_QUALITY, REPLAY, REPLAY_TINY, GATED_DELTANET, QUANTIZE_MEMORY,
)
