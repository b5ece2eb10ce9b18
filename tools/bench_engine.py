"""Batch-1 decode, MTP rounds and the agent turn through the whole Engine (scheduler, KV ledger, state
ledger, runner, sampling, output streams), as `ninfer-rt generate` and the server run them: the host time
the engine adds per step on top of the executor's graphed step (tools/bench_decode.py times that alone on
a random model of the same shape), for dense models and the Qwen3.5 hybrids alike.

Decode: a prompt of random token ids (--context tokens) is prefilled, then --max-tokens are decoded greedily
(ignore_eos); the figure is the engine's own decode tok/s for the request. With --draft-tokens K (MTP
speculation; the checkpoint needs an MTP layer) a row also gives the mean tokens a round emits and the time
of one draft + verify round; random weights accept almost nothing, so a round emits about one token and
its time is what a round costs against a plain step (the row with --draft-tokens 0).

Agent turn (--agent-turn CACHED,NEW): a request with a CACHED-token prompt, then the next turn's request,
the same prompt plus NEW tokens: its time to first token, and how many prompt tokens the prefix cache (and
on a hybrid, the state snapshot at the end of the first prompt) let it skip.

--profile-host prints where the host's time goes over the decode steps (cProfile, top functions; the wait
for the GPU shows up under synchronize). --profile-turn prints where the agent turn's time to first token
goes on the GPU, kernel by kernel (a CUPTI trace of the second request; torch's profiler, on the GPU machine
only), and how much of it the GPU sat idle. Appends JSON lines to bench/results/engine.jsonl (the turn's
kernels to turn_profile.jsonl) unless --no-append.

    python tools/make_shaped_model.py --shape qwen3.6-27b --bits 4 --out /tmp/qwen3.6-27b
    python tools/bench_engine.py --model /tmp/qwen3.6-27b --context 256,7680 --kv-dtype int8 --draft-tokens 0,3 \
        --lm-head-draft 32768 --agent-turn 114281,531
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from dataclasses import dataclass

import numpy as np

from bench_decode import append_results, print_table, run_info
from profile_decode import kernel_totals, profiled
from ninfer_rt.cuda.attention_plan import PAGE_SIZE
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestStats
from ninfer_rt.engine.request import SamplingParams


def run_request(engine: Engine, prompt: list[int], max_tokens: int, profiler: cProfile.Profile | None = None) -> RequestStats:
    """The finished request's stats; the profiler (if any) covers every step after the first token, i.e.
    the decode steps."""
    request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while True:
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if profiler is not None and output.token_ids:
                profiler.enable()  # idempotent: the first token is out, decode steps follow
            if output.finished:
                if profiler is not None:
                    profiler.disable()
                assert output.stats is not None, "a finished output carries its request's stats"
                return output.stats


def random_prompt(engine: Engine, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, engine.runner.model.config.vocab_size, length).tolist()


def decode_row(engine: Engine, context: int, max_tokens: int, profiler: cProfile.Profile | None) -> dict[str, object]:
    stats = run_request(engine, random_prompt(engine, context, seed=context), max_tokens, profiler)
    row: dict[str, object] = {"context": context, "decode_tok_s": stats.decode_tok_s, "ms_per_token": 1e3 / stats.decode_tok_s}
    if stats.acceptance is not None:
        per_round = stats.acceptance.mean_acceptance_length
        row |= {"tokens_per_round": per_round, "ms_per_round": 1e3 * per_round / stats.decode_tok_s}
    return row


def agent_turn_row(engine: Engine, cached: int, new: int, kernels: list[dict[str, object]] | None = None) -> dict[str, object]:
    """The second turn of a conversation: its prompt is the first turn's plus `new` tokens. With `kernels`
    (a list to fill), the turn runs under a CUPTI trace and its kernels' rows go there."""
    first = random_prompt(engine, cached, seed=cached)
    run_request(engine, first, max_tokens=1)
    second = first + random_prompt(engine, new, seed=new)
    outcome: list[RequestStats] = []
    began = time.perf_counter()
    if kernels is None:
        outcome.append(run_request(engine, second, max_tokens=1))
    else:
        ops = profiled(lambda: outcome.append(run_request(engine, second, max_tokens=1)), engine.runner.executor.compute.synchronize)
        busy_ms, rows = kernel_totals(ops)
        kernels += [{"busy_ms_total": busy_ms} | row for row in rows]
    stats = outcome[0]
    return {"context": cached + new, "agent_turn_new": new, "ttft_ms": 1e3 * stats.ttft_s,
            "cached_tokens": stats.cached_tokens, "turn_ms": 1e3 * (time.perf_counter() - began), "traced": kernels is not None}


def print_turn_profile(kernels: list[dict[str, object]], turn: dict[str, object], top: int = 30) -> None:
    busy = float(kernels[0]["busy_ms_total"]) if kernels else 0.0
    print(f"agent turn: time to first token {turn['ttft_ms']:.1f} ms (under the trace); the GPU busy {busy:.1f} ms of it, "
          f"{len(kernels)} kernels and copies by name, the heaviest {min(top, len(kernels))}:")
    print_table(kernels[:top], ["kernel", "launches", "busy_ms", "duration_ms"])


@dataclass(frozen=True)
class Plan:
    contexts: list[int]
    max_tokens: int
    agent_turns: list[tuple[int, int]]

    @property
    def max_context(self) -> int:
        longest = max([*self.contexts, *(cached + new for cached, new in self.agent_turns)])
        return longest + self.max_tokens + 64


def bench_config(
    args: argparse.Namespace, plan: Plan, draft_tokens: int, turn_profiles: list[dict[str, object]]
) -> list[dict[str, object]]:
    spec = {"spec": "mtp", "draft_tokens": draft_tokens, "lm_head_draft": args.lm_head_draft} if draft_tokens else {}
    engine = Engine.load(args.model, EngineConfig(
        device=args.device, kv_dtype=args.kv_dtype, max_concurrency=1, max_context=plan.max_context,
        kv_capacity=args.kv_capacity, overlap=not args.no_overlap, **spec))
    run_request(engine, random_prompt(engine, 16, seed=16), 8)  # warm-up: first launches, the prefill path
    setting = {"model": args.model, "kv_dtype": args.kv_dtype, "overlap": not args.no_overlap, "draft_tokens": draft_tokens,
               "lm_head_draft": args.lm_head_draft if draft_tokens else None}
    rows = []
    for context in plan.contexts:
        profiler = cProfile.Profile() if args.profile_host else None
        rows.append(setting | decode_row(engine, context, plan.max_tokens, profiler))
        if profiler is not None:
            print(f"host profile of the decode steps at context {context}, {draft_tokens} draft tokens:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    for cached, new in plan.agent_turns:
        kernels: list[dict[str, object]] | None = [] if args.profile_turn else None
        rows.append(setting | agent_turn_row(engine, cached, new, kernels))
        if kernels is not None:
            print_turn_profile(kernels, rows[-1])
            turn_profiles.extend(setting | {"context": cached + new, "agent_turn_new": new} | k for k in kernels)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", default="256", help="comma list of prompt lengths ('' for none)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-dtype", default="bf16")
    parser.add_argument("--kv-capacity", default=None,
                        help="KV pages, or auto (default: auto for one draft setting; with several, each engine's "
                             "context twice over in pages, since the engines of one process all stay on the device)")
    parser.add_argument("--draft-tokens", default="0", help="comma list of MTP draft lengths, 0 for plain decoding")
    parser.add_argument("--lm-head-draft", type=int, default=None, help="draft over this many lm_head rows")
    parser.add_argument("--agent-turn", default="", help="CACHED,NEW: time a turn that extends a cached prompt")
    parser.add_argument("--profile-host", action="store_true")
    parser.add_argument("--profile-turn", action="store_true", help="trace the agent turn's kernels (CUPTI, through torch)")
    parser.add_argument("--no-overlap", action="store_true", help="read each step's samples before the next step")
    parser.add_argument("--no-append", action="store_true", help="print the table only")
    args = parser.parse_args()

    cached_new = [int(n) for n in args.agent_turn.split(",")] if args.agent_turn else []
    if len(cached_new) not in (0, 2):
        parser.error(f"--agent-turn takes CACHED,NEW (two token counts), got {args.agent_turn!r}")
    plan = Plan([int(c) for c in args.context.split(",") if c], args.max_tokens, [tuple(cached_new)] if cached_new else [])
    draft_settings = [int(d) for d in args.draft_tokens.split(",")]
    if args.kv_capacity is None:
        args.kv_capacity = "auto" if len(draft_settings) == 1 else str(2 * -(-plan.max_context // PAGE_SIZE))
    info = run_info(open_device(0) if args.device == "cuda" else None)
    if args.profile_turn and (args.device != "cuda" or not plan.agent_turns):
        parser.error("--profile-turn traces the GPU's kernels: it needs --device cuda and --agent-turn")
    turn_profiles: list[dict[str, object]] = []
    rows = [info | row for k in draft_settings for row in bench_config(args, plan, k, turn_profiles)]
    columns = ["context", "kv_dtype", "overlap", "draft_tokens", "decode_tok_s", "ms_per_token", "tokens_per_round",
               "ms_per_round", "agent_turn_new", "ttft_ms", "cached_tokens"]
    print_table([{c: row.get(c, "") for c in columns} for row in rows], columns)
    if not args.no_append:
        print(f"appended to {append_results('engine', rows)}")
        if turn_profiles:
            print(f"appended to {append_results('turn_profile', [info | row for row in turn_profiles])}")


if __name__ == "__main__":
    main()
