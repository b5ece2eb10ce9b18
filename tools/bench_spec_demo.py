"""MTP speculation on a shipped model (the default, or --model NAME or DIR): greedy decode tok/s and
acceptance length for --draft-tokens k = 1..4 (with and without --lm-head-draft) against no speculation,
through the Engine exactly as `ninfer-rt generate` runs it. Several code prompts, 256 tokens each; the
first request of each engine is a warm-up. Prints a table and appends JSON lines to
bench/results/spec_demo.jsonl.

    python tools/bench_spec_demo.py --device cuda
    python tools/bench_spec_demo.py --device cpu --model tiny-qwen3-code --max-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cli.model_path import resolve_model
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\ndef list_files(path):",
    "def quicksort(items):",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
]

KV_PAGES = 256  # 16,384 tokens of 64-token pages: the prompts plus 256 new tokens each, many times over


def run(model: Path, device: str, draft_tokens: int, lm_head_draft: int | None, max_tokens: int) -> dict[str, object]:
    spec = "mtp" if draft_tokens else "none"
    # A fixed KV size: nine engines are built one after another, and 'auto' would let the first one's pages
    # (most of the GPU's free memory) starve the next before the collector frees them.
    engine = Engine.load(model, EngineConfig(
        device=device, spec=spec, draft_tokens=max(draft_tokens, 1), lm_head_draft=lm_head_draft, max_concurrency=1,
        kv_capacity=str(KV_PAGES)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    speeds, acceptance, tokens = [], [], []
    for index, prompt in enumerate([PROMPTS[0], *PROMPTS]):
        final = [out for out in engine.generate([prompt], params) if out.stats is not None][0]
        if index == 0:
            continue  # warm-up
        speeds.append(final.stats.decode_tok_s)
        tokens.append(final.stats.completion_tokens)
        if final.stats.acceptance is not None:
            acceptance.append(final.stats.acceptance.mean_acceptance_length)
    return {
        "model": model.name, "device": device, "draft_tokens": draft_tokens, "lm_head_draft": lm_head_draft,
        "decode_tok_s": statistics.median(speeds), "acceptance_length": statistics.mean(acceptance) if acceptance else 1.0,
        "completion_tokens": sum(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="a shipped model's name or a model directory (default: the shipped default)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--lm-head-draft", type=int, default=512, help="reduced draft vocabulary for the second pass")
    args = parser.parse_args()

    model = resolve_model(args.model)
    info = run_info(open_device(0) if args.device == "cuda" else None)
    rows = [info | run(model, args.device, 0, None, args.max_tokens)]
    for k in range(1, 5):
        for vocab in (None, args.lm_head_draft):
            rows.append(info | run(model, args.device, k, vocab, args.max_tokens))
    baseline = rows[0]["decode_tok_s"]
    for row in rows:
        row["speedup"] = row["decode_tok_s"] / baseline
    print_table(rows, ["draft_tokens", "lm_head_draft", "decode_tok_s", "acceptance_length", "speedup"])
    print(f"appended to {append_results('spec_demo', rows)}")


if __name__ == "__main__":
    main()
