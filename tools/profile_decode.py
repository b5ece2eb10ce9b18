"""Where a graphed batch-1 decode step's GPU time goes, kernel by kernel, from a CUPTI timeline.

Replays the decode graph of a random-weight model of a named shape (bench_decode's) under torch.profiler
(CUPTI activity records: one per kernel node of the replayed graph) and splits each step into the
kernels' *marginal* times: from the end of the previous kernel to the end of this one. With programmatic
dependent launch a kernel starts before its predecessor ends (its duration includes the wait), so
durations overlap, while marginal times add up to the step. Kernels are grouped by name and by their
place in the layer (a name used twice per layer, like the residual GEMV of o_proj and down, gets two
rows); the GEMVs' rows also show their weight bytes and the fraction of the copy bandwidth their marginal
time reaches. `--loop overlap` profiles the engine's overlapped loop instead (argmax, feed and read-back
between the replays, copies included). torch is used for the profiler only (a tool on the GPU machine, not
a runtime dependency).

    python tools/profile_decode.py --shape qwen3-8b --context 256 --kv bf16 --weights bf16
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench_decode import (
    PAGE_SIZE, WEIGHT_BITS, OverlappedLoop, append_results, bench_slot, build_random_model, decode_batch,
    make_kv, print_table, run_info, shape_config,
)
from bench_hybrid_model import build_hybrid_model, hybrid_config
from random_weights import BENCH_SLOT, QUANT_GROUP
from ninfer_rt.cuda.benchmark import copy_bandwidth
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_graphs import GraphedForward
from ninfer_rt.kernel_dev.cases import Shape, gemv_shapes
from ninfer_rt.model.shapes import SHAPES, is_hybrid_shape

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # what the device does, in CUPTI's trace categories
GEMV_ORDER = ("qkv", "o_proj", "gate_up", "down")  # the decoder layer's projections, in launch order


@dataclass(frozen=True)
class GpuOp:
    """A kernel or a copy, as CUPTI timed it."""

    name: str
    start_us: float
    end_us: float


def gpu_timeline(trace_path: Path) -> list[GpuOp]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    ops = [GpuOp(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_EVENTS]
    return sorted(ops, key=lambda op: op.start_us)


def split_steps(ops: list[GpuOp], steps: int) -> list[list[GpuOp]]:
    """Every step launches the same kernels and copies."""
    if len(ops) % steps:
        raise SystemExit(f"{len(ops)} GPU ops recorded over {steps} steps: the timeline is incomplete")
    per_step = len(ops) // steps
    return [ops[i:i + per_step] for i in range(0, len(ops), per_step)]


def projection_bytes(shape: Shape, weights: str) -> dict[str, int]:
    """Weight bytes per GEMV row label: the layer's projections at `weights` (codes and bf16 group scales
    when quantized), the lm_head in bf16 (as bench_decode builds them)."""
    bits = WEIGHT_BITS[weights]
    sizes = {}
    # gemv_shapes lists the layer's projections in launch order, then the lm_head
    for label, (n, k, epilogue) in zip((*GEMV_ORDER, "lm_head"), gemv_shapes(shape).values()):
        rows = 2 * n if epilogue is Epilogue.SWIGLU else n
        quantized = bits < 16 and label != "lm_head"
        sizes[label] = rows * k * (bits if quantized else 16) // 8 + (rows * (k // QUANT_GROUP) * 2 if quantized else 0)
    return sizes


def label_step(step: list[GpuOp], layers: int) -> list[str]:
    """A kernel's row: its name, plus its place among the layer's GEMVs (or among the layer's launches of
    the same name) where a name occurs more than once per layer."""
    counts: dict[str, int] = defaultdict(int)
    for kernel in step:
        counts[kernel.name] += 1
    gemvs_per_layer = sum(c for n, c in counts.items() if n.startswith("gemv")) // layers
    seen: dict[str, int] = defaultdict(int)
    gemv_seen = 0
    labels = []
    for kernel in step:
        per_layer = counts[kernel.name] // layers
        if kernel.name.startswith("gemv"):
            ordinal = gemv_seen
            gemv_seen += 1
            is_head = ordinal >= gemvs_per_layer * layers
            labels.append(f"{kernel.name} [{'lm_head' if is_head else GEMV_ORDER[ordinal % gemvs_per_layer]}]")
        elif per_layer > 1:
            labels.append(f"{kernel.name} #{seen[kernel.name] % per_layer}")
        else:
            labels.append(kernel.name)
        seen[kernel.name] += 1
    return labels


def summarize(
    steps: list[list[GpuOp]], shape: Shape, layers: int, weights: str, bandwidth: float, hybrid: bool = False
) -> list[dict[str, object]]:
    """Rows by kernel (and, for a dense model, by place in the layer). A hybrid's layers differ, so its rows
    are by kernel name alone, with no weight bytes."""
    marginal: dict[str, list[float]] = defaultdict(list)
    duration: dict[str, list[float]] = defaultdict(list)
    last_end = None
    for step in steps:
        if last_end is not None:  # the graph launch: replays do not overlap
            marginal["(between steps)"].append(step[0].start_us - last_end)
            duration["(between steps)"].append(0.0)
        previous_end = step[0].start_us
        for kernel, label in zip(step, [k.name for k in step] if hybrid else label_step(step, layers)):
            marginal[label].append(max(kernel.end_us, previous_end) - previous_end)
            duration[label].append(kernel.end_us - kernel.start_us)
            previous_end = max(previous_end, kernel.end_us)
        last_end = previous_end
    nbytes = {} if hybrid else projection_bytes(shape, weights)
    rows = []
    for label, times in marginal.items():
        per_step = len(times) / (len(steps) - 1 if label == "(between steps)" else len(steps))
        mean = sum(times) / len(times)
        op = label.rsplit("[", 1)[1].rstrip("]") if "[" in label else None
        row = {"kernel": label, "per_step": per_step, "marginal_us": mean, "duration_us": sum(duration[label]) / len(times),
               "ms_per_step": mean * per_step / 1e3, "weight_MB": nbytes[op] / 1e6 if op else 0.0,
               "roofline_fraction": nbytes[op] / (mean * 1e-6) / bandwidth if op else 0.0}
        rows.append(row)
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def kernel_totals(ops: list[GpuOp]) -> tuple[float, list[dict[str, object]]]:
    """A span's GPU ops (one request's turn, say) by name: launches, summed marginal time (from the end of
    the previous op to the end of this one, so overlapping ops count once and the rows add up to the time
    the GPU was busy) and summed duration; heaviest first. Returns (busy ms, rows)."""
    count: dict[str, int] = defaultdict(int)
    marginal: dict[str, float] = defaultdict(float)
    duration: dict[str, float] = defaultdict(float)
    previous_end = None
    for op in sorted(ops, key=lambda o: o.start_us):
        begin = op.start_us if previous_end is None else max(op.start_us, previous_end)
        count[op.name] += 1
        marginal[op.name] += max(0.0, op.end_us - begin)
        duration[op.name] += op.end_us - op.start_us
        previous_end = op.end_us if previous_end is None else max(previous_end, op.end_us)
    rows = [{"kernel": name, "launches": count[name], "busy_ms": marginal[name] / 1e3, "duration_ms": duration[name] / 1e3}
            for name in count]
    return sum(marginal.values()) / 1e3, sorted(rows, key=lambda r: -r["busy_ms"])


def profiled(work: Callable[[], object], synchronize: Callable[[], None]) -> list[GpuOp]:
    """The GPU ops `work` issued, from a CUPTI trace taken around it."""
    import torch  # the profiler only
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return gpu_timeline(trace)


def profile_steps(step: Callable[[], object], synchronize: Callable[[], None], steps: int) -> list[list[GpuOp]]:
    for _ in range(3):
        step()
    synchronize()

    def replays() -> None:
        for _ in range(steps):
            step()

    return split_steps(profiled(replays, synchronize), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--kv", choices=("bf16", "int8"), default="bf16")
    parser.add_argument("--weights", choices=sorted(WEIGHT_BITS), default="bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--loop", choices=("replay", "overlap"), default="replay",
                        help="graph replays back to back, or the engine's overlapped loop (argmax, feed, read-back)")
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)
    hybrid = is_hybrid_shape(SHAPES[args.shape])
    cfg = hybrid_config(args.shape) if hybrid else shape_config(args.shape)
    executor = CudaExecutor(streams, max_tokens=8, max_seqs=1, max_pages_per_seq=-(-args.context // PAGE_SIZE),
                            max_positions=args.context + 1, max_logit_rows=8)
    bandwidth = copy_bandwidth(streams)
    build = build_hybrid_model if hybrid else build_random_model
    random = build(executor, cfg, weight_bits=WEIGHT_BITS[args.weights])
    kv = make_kv(streams, cfg, args.context, args.kv, executor)
    if random.states is not None:
        random.states.zero(BENCH_SLOT, executor.compute)
    graphed = GraphedForward(executor, random.model, kv, random.states)
    batch = decode_batch(args.context, state_slot=bench_slot(graphed))
    step = OverlappedLoop(executor, graphed, args.context).step if args.loop == "overlap" else lambda: graphed(batch)
    steps = profile_steps(step, executor.compute.synchronize, args.steps)
    rows = summarize(steps, SHAPES[args.shape], cfg.num_hidden_layers, args.weights, bandwidth, hybrid)
    step_ms = sum(r["ms_per_step"] for r in rows)
    print(f"{len(steps)} steps profiled; {step_ms:.3f} ms per step (marginal times and the gaps between steps); "
          f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    print_table(rows, ["kernel", "per_step", "marginal_us", "duration_us", "ms_per_step", "weight_MB", "roofline_fraction"])
    info = run_info(device) | {"loop": args.loop, "shape": args.shape, "context": args.context, "kv_dtype": args.kv, "weights": args.weights,
                               "step_ms": step_ms, "copy_bw_TBs": bandwidth / 1e12}
    print(f"appended to {append_results('decode_profile', [info | r for r in rows])}")
    graphed.destroy()
    kv.free()


if __name__ == "__main__":
    main()
