"""Seconds per MTP speculative step against a plain graphed decode step, batch 1, on a random-weight model
of a named shape with a random MTP module of the same shape (one decoder layer, fc, norms).

plain: bench_decode.time_decode (publish, graph replay, device argmax, 4-byte read-back).
spec: one step as SpecRunner runs it for a greedy request whose k drafts are all accepted: the verify
forward over 1 + k rows (graph), its argmax ids to the host, the MTP catch-up over the same rows and the
k - 1 draft steps (graphs, exec/cuda_graphs.py), each followed by its argmax read; drafting scores the whole
lm_head or, with --lm-head-draft N, N rows of it. Scheduling and batch building on the host are not timed
in either. A step that emits a + 1 tokens pays off when ratio = spec / plain < a + 1.
Prints a table and appends one JSON line per measurement to bench/results/spec.jsonl.

    python tools/bench_spec.py --shape qwen3-8b --contexts 256,114812 --kv int8,bf16 --draft-tokens 3
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from bench_decode import PAGE_SIZE, RandomModel, append_results, build_random_model, make_kv, print_table, run_info, shape_config, time_decode
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_graphs import GraphedForward, GraphedMTPSteps
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.model.executor import StepBatch, WeightRole
from ninfer_rt.model.layers import PreparedModel
from ninfer_rt.model.mtp import PreparedMTP
from ninfer_rt.model.shapes import SHAPES


@dataclass
class SpecModel:
    random: RandomModel  # the main model (weight_bytes_per_step also counts the MTP layer; unused here)
    mtp: PreparedMTP
    draft_heads: dict[int | None, DeviceTensor]  # None: the shared lm_head; N: its first N rows


def build_spec_model(executor: CudaExecutor, shape: str, layers: int | None, draft_vocab: int | None) -> SpecModel:
    """The shape's model with one more random layer, which becomes the MTP module's decoder layer."""
    cfg = shape_config(shape, layers)
    extended = build_random_model(executor, shape_config(shape, cfg.num_hidden_layers + 1))
    full = extended.model
    model = PreparedModel(cfg, full.embed, full.layers[:-1], full.norm, full.lm_head, full.rope)
    h = cfg.hidden_size

    def ones(name: str) -> DeviceTensor:
        return executor.prepare_weight(name, [np.ones(h, ml_dtypes.bfloat16)], WeightRole.NORM)

    mtp = PreparedMTP(
        fc=rows_of(executor, full.lm_head, "mtp.fc", h, 2 * h),
        norm_embedding=ones("mtp.norm_embedding"), norm_hidden=ones("mtp.norm_hidden"),
        layer=full.layers[-1], norm=ones("mtp.norm"),
    )
    heads: dict[int | None, DeviceTensor] = {None: full.lm_head}
    if draft_vocab:
        heads[draft_vocab] = rows_of(executor, full.lm_head, "mtp.lm_head_draft", draft_vocab, h)
    executor.compute.synchronize()
    return SpecModel(replace(extended, model=model), mtp, heads)


def rows_of(executor: CudaExecutor, source: DeviceTensor, name: str, rows: int, cols: int) -> DeviceTensor:
    """A new [rows, cols] weight holding the first bytes of `source` (random values are all a timing needs)."""
    tensor = executor.empty_weight(name, rows, cols, role=WeightRole.LINEAR)
    if tensor.buffer.nbytes > source.buffer.nbytes:
        raise ValueError(f"{name}: {tensor.buffer.nbytes} bytes wanted from a {source.buffer.nbytes}-byte source")
    executor.compute.copy(tensor.buffer, source.buffer, tensor.buffer.nbytes, label=f"fill {name}")
    return tensor


@dataclass(frozen=True)
class SpecBatches:
    verify: StepBatch  # x[N-1] and k drafts at positions context-1 .. context-1+k
    catch_up: StepBatch  # the same rows, the logits of the last (all drafts accepted)
    drafts: list[StepBatch]  # k - 1 single rows, past the accepted ones


def spec_batches(context: int, k: int) -> SpecBatches:
    verify = rows_batch(context - 1, k + 1, list(range(k + 1)))
    catch_up = rows_batch(context - 1, k + 1, [k])
    # N' = context + k + 1 tokens after the step; draft j is written at position N' - 2 + j.
    drafts = [rows_batch(context + k - 1 + j, 1, [0]) for j in range(1, k)]
    return SpecBatches(verify, catch_up, drafts)


def rows_batch(start: int, rows: int, logit_rows: list[int]) -> StepBatch:
    """One sequence whose KV fills pages 0.. in order; `rows` new tokens from position `start`."""
    positions = np.arange(start, start + rows, dtype=np.int32)
    return StepBatch(
        token_ids=np.ones(rows, np.int32), positions=positions,
        query_start=np.array([0, rows], np.int32), context_lens=np.array([start + rows], np.int32),
        block_tables=np.arange(-(-(start + rows) // PAGE_SIZE), dtype=np.int32)[None, :],
        slot_mapping=positions, logit_rows=np.array(logit_rows, np.int32),
    )


def time_spec(spec: SpecModel, kv: KVCache, context: int, k: int, steps: int) -> dict[int | None, float]:
    """Seconds per speculative step host to host, per draft head."""
    executor = spec.random.executor
    verify = GraphedForward(executor, spec.random.model, kv)
    mtp_steps = GraphedMTPSteps(executor, spec.random.model, spec.mtp, kv)
    batches = spec_batches(context, k)

    def step(head: DeviceTensor) -> None:
        out = verify(batches.verify)
        executor.to_host(executor.argmax(out.logits))
        executor.to_host(mtp_steps.catch_up(batches.catch_up, out.hidden, head).ids)
        for draft in batches.drafts:
            executor.to_host(mtp_steps.draft(draft, head).ids)

    seconds = {}
    for vocab, head in spec.draft_heads.items():
        for _ in range(3):  # captures + warm-up
            step(head)
        started = time.perf_counter()
        for _ in range(steps):
            step(head)
        seconds[vocab] = (time.perf_counter() - started) / steps
    verify.destroy()
    mtp_steps.destroy()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (quick runs)")
    parser.add_argument("--contexts", default="256,114812")
    parser.add_argument("--kv", default="int8,bf16")
    parser.add_argument("--draft-tokens", type=int, default=3, help="k: drafts verified per step")
    parser.add_argument("--lm-head-draft", type=int, default=32768, help="also time drafting over this many lm_head rows (0: only the full head)")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)  # benchmarks measure the runtime, not the verifier
    contexts = [int(c) for c in args.contexts.split(",")]
    k = args.draft_tokens
    longest = max(contexts) + 2 * k  # the last draft row's position is context + 2k - 2
    executor = CudaExecutor(streams, max_tokens=8, max_seqs=1, max_pages_per_seq=-(-longest // PAGE_SIZE) + 1,
                            max_positions=longest + 1, max_logit_rows=8)
    spec = build_spec_model(executor, args.shape, args.layers, args.lm_head_draft or None)
    cfg = spec.random.model.config
    info = run_info(device)
    rows = []
    for dtype in args.kv.split(","):
        for context in contexts:
            kv = make_kv(streams, shape_config(args.shape, cfg.num_hidden_layers + 1), context + 2 * k, dtype, executor)
            plain = time_decode(spec.random, kv, context, args.steps)[0]
            for vocab, seconds in time_spec(spec, kv, context, k, args.steps).items():
                rows.append(info | {
                    "shape": args.shape, "layers": cfg.num_hidden_layers, "context": context, "kv_dtype": dtype,
                    "k": k, "lm_head_draft": vocab, "ms_per_plain_step": plain * 1e3, "ms_per_spec_step": seconds * 1e3,
                    "ratio": seconds / plain,
                })
            kv.free()
    print_table(rows, ["shape", "context", "kv_dtype", "k", "lm_head_draft", "ms_per_plain_step", "ms_per_spec_step", "ratio"])
    print(f"appended to {append_results('spec', rows)}")


if __name__ == "__main__":
    main()
