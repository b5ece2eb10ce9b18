"""Batch-1 decode through the whole Engine (scheduler, KV ledger, runner, sampling, output streams), as
`ninfer-rt generate` and the server run it: the host time the engine adds per step on top of the
executor's graphed step (tools/bench_decode.py times that alone on a random model of the same shape).

A prompt of random token ids (--context tokens) is prefilled, then --max-tokens are decoded greedily
(ignore_eos); the figure is the engine's own decode tok/s for the request. --profile-host prints where the
host's time goes over the decode steps (cProfile, top functions; the wait for the GPU shows up under
synchronize). Appends one JSON line to bench/results/engine.jsonl.

    python tools/make_shaped_model.py --shape qwen3-8b --out /tmp/qwen3-8b
    python tools/bench_engine.py --model /tmp/qwen3-8b --context 256,114812 --kv-dtype int8 --profile-host
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams


def decode_request(engine: Engine, context: int, max_tokens: int, profiler: cProfile.Profile | None) -> float:
    """Decode tok/s of one request with a `context`-token prompt; the profiler (if any) covers every step
    after the first token, i.e. the decode steps."""
    vocab = engine.runner.model.config.vocab_size
    prompt = np.random.default_rng(context).integers(0, vocab, context).tolist()
    request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    final = None
    while final is None:
        for output in engine.step():
            if output.request_id == request_id and profiler is not None and output.token_ids:
                profiler.enable()  # idempotent: the first token is out, decode steps follow
            if output.request_id == request_id and output.finished:
                final = output
    if profiler is not None:
        profiler.disable()
    return final.stats.decode_tok_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", default="256", help="comma list of prompt lengths")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-dtype", default="bf16")
    parser.add_argument("--profile-host", action="store_true")
    parser.add_argument("--no-overlap", action="store_true", help="read each step's samples before the next step")
    args = parser.parse_args()

    contexts = [int(c) for c in args.context.split(",")]
    engine = Engine.load(args.model, EngineConfig(
        device=args.device, kv_dtype=args.kv_dtype, max_concurrency=1, max_context=max(contexts) + args.max_tokens + 64,
        overlap=not args.no_overlap))
    decode_request(engine, 16, 8, None)  # warm-up: first launches, the prefill path
    info = run_info(open_device(0)) if args.device == "cuda" else {"gpu": "none"}
    rows = []
    for context in contexts:
        profiler = cProfile.Profile() if args.profile_host else None
        tok_s = decode_request(engine, context, args.max_tokens, profiler)
        rows.append(info | {"model": args.model, "context": context, "kv_dtype": args.kv_dtype, "overlap": not args.no_overlap,
                            "decode_tok_s": tok_s, "ms_per_token": 1e3 / tok_s})
        if profiler is not None:
            print(f"host profile of the decode steps at context {context}:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    print_table(rows, ["context", "kv_dtype", "overlap", "decode_tok_s", "ms_per_token"])
    print(f"appended to {append_results('engine', rows)}")


if __name__ == "__main__":
    main()
