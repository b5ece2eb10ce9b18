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
for the GPU shows up under synchronize). --trace runs each timed request (the decode rows' and the agent
turn's second request) under a CUPTI trace (torch's profiler, on the GPU machine only) and prints how long the
GPU was busy of the request's wall time, kernel by kernel: the idle rest is what the host costs (an MTP
round's reads of drafts and verdicts included); the traced rows' figures carry the trace's overhead. Appends
JSON lines to bench/results/engine.jsonl (the traces' kernels to engine_trace.jsonl) unless --no-append.

    python tools/make_shaped_model.py --shape qwen3.6-27b --bits 4 --out /tmp/qwen3.6-27b
    python tools/bench_engine.py --model /tmp/qwen3.6-27b --context 256,7680 --kv-dtype int8 --draft-tokens 0,3 \
        --lm-head-draft 32768 --agent-turn 114281,531
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from dataclasses import dataclass, field

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


@dataclass
class Trace:
    """A CUPTI trace of one request (--trace): how long the GPU was busy of its wall time, kernel by kernel."""

    what: str
    wall_ms: float = 0.0
    busy_ms: float = 0.0
    kernels: list[dict[str, object]] = field(default_factory=list)

    def run(self, engine: Engine, prompt: list[int], max_tokens: int) -> RequestStats:
        outcome: list[RequestStats] = []
        began = time.perf_counter()
        ops = profiled(lambda: outcome.append(run_request(engine, prompt, max_tokens)), engine.runner.executor.compute.synchronize)
        self.wall_ms = 1e3 * (time.perf_counter() - began)
        self.busy_ms, self.kernels = kernel_totals(ops)
        return outcome[0]

    def print(self, top: int = 30) -> None:
        print(f"{self.what}: {self.wall_ms:.1f} ms wall under the trace, the GPU busy {self.busy_ms:.1f} ms of it "
              f"({1 - self.busy_ms / self.wall_ms:.1%} idle); {len(self.kernels)} kernels and copies by name, the heaviest "
              f"{min(top, len(self.kernels))}:")
        print_table(self.kernels[:top], ["kernel", "launches", "busy_ms", "duration_ms"])

    def rows(self, setting: dict[str, object]) -> list[dict[str, object]]:
        whole = {"traced": self.what, "wall_ms": self.wall_ms, "busy_ms_total": self.busy_ms}
        return [setting | whole | kernel for kernel in self.kernels]


def decode_row(
    engine: Engine, context: int, max_tokens: int, profiler: cProfile.Profile | None, trace: Trace | None = None
) -> dict[str, object]:
    prompt = random_prompt(engine, context, seed=context)
    stats = trace.run(engine, prompt, max_tokens) if trace else run_request(engine, prompt, max_tokens, profiler)
    row: dict[str, object] = {"context": context, "decode_tok_s": stats.decode_tok_s, "ms_per_token": 1e3 / stats.decode_tok_s}
    if stats.acceptance is not None:
        per_round = stats.acceptance.mean_acceptance_length
        row |= {"tokens_per_round": per_round, "ms_per_round": 1e3 * per_round / stats.decode_tok_s}
    return row | ({"traced": True} if trace else {})


def agent_turn_row(engine: Engine, cached: int, new: int, trace: Trace | None = None) -> dict[str, object]:
    """The second turn of a conversation: its prompt is the first turn's plus `new` tokens (under `trace` if given)."""
    first = random_prompt(engine, cached, seed=cached)
    run_request(engine, first, max_tokens=1)
    second = first + random_prompt(engine, new, seed=new)
    began = time.perf_counter()
    stats = trace.run(engine, second, max_tokens=1) if trace else run_request(engine, second, max_tokens=1)
    return {"context": cached + new, "agent_turn_new": new, "ttft_ms": 1e3 * stats.ttft_s,
            "cached_tokens": stats.cached_tokens, "turn_ms": 1e3 * (time.perf_counter() - began)} | ({"traced": True} if trace else {})


@dataclass(frozen=True)
class Plan:
    contexts: list[int]
    max_tokens: int
    agent_turns: list[tuple[int, int]]

    @property
    def max_context(self) -> int:
        longest = max([*self.contexts, *(cached + new for cached, new in self.agent_turns)])
        return longest + self.max_tokens + 64


def bench_config(args: argparse.Namespace, plan: Plan, draft_tokens: int, traces: list[dict[str, object]]) -> list[dict[str, object]]:
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
        trace = Trace(f"decode at context {context}, {draft_tokens} draft tokens ({plan.max_tokens} tokens)") if args.trace else None
        rows.append(setting | decode_row(engine, context, plan.max_tokens, profiler, trace))
        if profiler is not None:
            print(f"host profile of the decode steps at context {context}, {draft_tokens} draft tokens:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        if trace is not None:
            trace.print()
            traces.extend(trace.rows(setting | {"context": context}))
    for cached, new in plan.agent_turns:
        trace = Trace(f"agent turn ({cached:,} cached + {new} new tokens), {draft_tokens} draft tokens") if args.trace else None
        rows.append(setting | agent_turn_row(engine, cached, new, trace))
        if trace is not None:
            trace.print()
            traces.extend(trace.rows(setting | {"context": cached + new, "agent_turn_new": new}))
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
    parser.add_argument("--trace", action="store_true", help="trace each request's kernels (CUPTI, through torch): GPU busy and idle time")
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
    if args.trace and args.device != "cuda":
        parser.error("--trace records the GPU's kernels: it needs --device cuda")
    if args.trace and args.profile_host:
        parser.error("--trace and --profile-host each time the request their own way: pick one")
    info = run_info(open_device(0) if args.device == "cuda" else None)
    traces: list[dict[str, object]] = []
    rows = [info | row for k in draft_settings for row in bench_config(args, plan, k, traces)]
    columns = ["context", "kv_dtype", "overlap", "draft_tokens", "decode_tok_s", "ms_per_token", "tokens_per_round",
               "ms_per_round", "agent_turn_new", "ttft_ms", "cached_tokens"]
    print_table([{c: row.get(c, "") for c in columns} for row in rows], columns)
    if not args.no_append:
        print(f"appended to {append_results('engine', rows)}")
        if traces:
            print(f"appended to {append_results('engine_trace', [info | row for row in traces])}")


if __name__ == "__main__":
    main()
