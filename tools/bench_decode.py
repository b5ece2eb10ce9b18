"""Batch-1 decode throughput of a random-weight model of a named shape, against the HBM roofline.

Builds the model directly on the GPU (weights tiled from one random device buffer: values do not change
the speed of a memory-bound step), fills a KV context of the requested length, then times graphed decode
steps end to end (publish, graph replay, greedy argmax, 4-byte read-back per step), once reading each token
back before the next step is enqueued and once with the engine's overlap (overlap_* columns). In the same run it
measures device copy bandwidth (cuMemcpyDtoDAsync of 2 GiB, bytes read + written) as the roofline.
Prints a table and appends one JSON line per measurement to bench/results/decode.jsonl.

    python tools/bench_decode.py --shape qwen3-8b --contexts 256,114812 --kv bf16,int8

A hybrid shape (qwen3.6-27b) is built by tools/bench_hybrid_model.py, its state slot zeroed before each
measurement, and its roofline bytes are tools/step_bytes.py's: the weights in their format, the K/V of the
full-attention layers and the linear layers' states read and written.

    python tools/bench_decode.py --shape qwen3.6-27b --contexts 256,7680 --kv int8 --weights int4
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from bench_hybrid_model import build_hybrid_model, hybrid_config
from random_weights import BENCH_SLOT, RandomModel, RandomWeights
from step_bytes import kv_bytes, state_bytes
from ninfer_rt.cuda.benchmark import copy_bandwidth
from ninfer_rt.cuda.driver import Device, open_device
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_graphs import GraphedForward
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import AttentionParams, StepBatch, WeightRole
from ninfer_rt.model.layers import PreparedLayer, PreparedModel
from ninfer_rt.model.mixers import PreparedAttention, attention_shape
from ninfer_rt.model.rope import rope_attention_scaling, rope_inv_freq
from ninfer_rt.model.shapes import SHAPES, is_hybrid_shape

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
PAGE_SIZE = 64


def shape_config(name: str, layers: int | None = None) -> ModelConfig:
    raw = dict(SHAPES[name], architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1_000_000.0,
               max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if layers is not None:
        raw["num_hidden_layers"] = layers
    return ModelConfig.from_dict(raw)


def build_random_model(executor: CudaExecutor, cfg: ModelConfig, seed: int = 0, weight_bits: int = 16) -> RandomModel:
    """Weights ~ N(0, 0.02) tiled from one random device buffer (tools/random_weights.py); norm gains 1.
    With weight_bits 4 or 8 the decoder layers' projections are group-128 quantized (random codes, scale
    1e-3; embedding and lm_head stay bf16, as `ninfer-rt quantize` leaves them by default)."""
    random = RandomWeights(executor, seed)
    counted = [0]

    def matrix(
        name: str, rows: int, cols: int, role: WeightRole = WeightRole.LINEAR, counts: bool = True
    ) -> DeviceTensor | QuantizedDeviceWeight:
        if weight_bits < 16 and name.startswith("layers."):
            weight = random.quantized(name, rows, cols, weight_bits, role)
            counted[0] += weight.qweight.nbytes + weight.scales.nbytes
            return weight
        tensor = random.dense(name, rows, cols, role)
        counted[0] += tensor.buffer.nbytes if counts else 0
        return tensor

    def ones(name: str, size: int) -> DeviceTensor:
        counted[0] += 2 * size
        return executor.prepare_weight(name, [np.ones(size, ml_dtypes.bfloat16)], WeightRole.NORM)

    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    rope = executor.prepare_rope(rope_inv_freq(cfg), rope_attention_scaling(cfg))
    layers = [
        PreparedLayer(
            input_norm=ones(f"layers.{n}.input_norm", h),
            mixer=PreparedAttention(
                qkv=matrix(f"layers.{n}.qkv", qkv_rows, h),
                params=AttentionParams(attention_shape(cfg), rope, ones(f"layers.{n}.q_norm", d), ones(f"layers.{n}.k_norm", d)),
                o_proj=matrix(f"layers.{n}.o_proj", h, cfg.num_attention_heads * d),
                kv_layer=n,
            ),
            post_norm=ones(f"layers.{n}.post_norm", h),
            gate_up=matrix(f"layers.{n}.gate_up", 2 * i, h, WeightRole.GATE_UP),
            down=matrix(f"layers.{n}.down", h, i),
        )
        for n in range(cfg.num_hidden_layers)
    ]
    embed = matrix("embed", cfg.vocab_size, h, WeightRole.EMBEDDING, counts=False)
    model = PreparedModel(cfg, embed, layers, ones("norm", h), matrix("lm_head", cfg.vocab_size, h), rope)
    random.close()
    return RandomModel(executor, model, counted[0] + 2 * h)


def decode_batch(context: int, token: int = 1, state_slot: int | None = None) -> StepBatch:
    """One sequence, one new token at position context-1 (its KV: pages 0..); a hybrid's state read from
    and written back to `state_slot`."""
    pages = -(-context // PAGE_SIZE)
    position = context - 1
    states = {} if state_slot is None else {
        "state_slots": np.array([state_slot], np.int32), "state_targets": np.array([[state_slot]], np.int32)
    }
    return StepBatch(
        token_ids=np.array([token], np.int32), positions=np.array([position], np.int32),
        query_start=np.array([0, 1], np.int32), context_lens=np.array([context], np.int32),
        block_tables=np.arange(pages, dtype=np.int32)[None, :],
        slot_mapping=np.array([position], np.int32), logit_rows=np.array([0], np.int32), **states,
    )


def bench_slot(graphed: GraphedForward) -> int | None:
    """The slot a graphed benchmark step runs over: the one-slot pool's, or None for a dense model."""
    return None if graphed.states is None else BENCH_SLOT


def time_decode(
    random: RandomModel, kv: KVCache, context: int, steps: int, profile_host: bool = False
) -> tuple[float, float, float, float]:
    """Seconds per decode step host to host (publish, replay, argmax, read back the token); the GPU's time
    per step when it never waits for the host (the difference is host time the GPU idles through); and
    the host's time per step spent publishing and launching the graph; and the seconds per step with the
    engine's overlap."""
    executor = random.executor
    graphed = GraphedForward(executor, random.model, kv, random.states)
    batch = decode_batch(context, state_slot=bench_slot(graphed))
    for _ in range(3):  # capture + warm-up
        executor.to_host(executor.argmax(graphed(batch).logits))
    started = time.perf_counter()
    enqueue = 0.0  # host time inside graphed(): publish + replay launch, which the idle GPU waits through
    for _ in range(steps):
        before = time.perf_counter()
        logits = graphed(batch).logits
        enqueue += time.perf_counter() - before
        executor.to_host(executor.argmax(logits))
    elapsed = (time.perf_counter() - started) / steps
    if profile_host:
        profile_host_steps(lambda: executor.to_host(executor.argmax(graphed(batch).logits)), steps)
    # Replays back to back without reading anything: the host enqueues far faster than a step runs, so the
    # GPU never waits and the events measure its time per step (plus a few-hundred-byte publish copy).
    begin = executor.compute.record(timing=True)
    for _ in range(steps):
        graphed(batch)
    gpu_seconds = begin.elapsed_ms(executor.compute.record(timing=True)) / 1e3 / steps
    overlapped = time_overlapped(executor, graphed, context, steps)
    graphed.destroy()
    return elapsed, gpu_seconds, enqueue / steps, overlapped


class OverlappedLoop:
    """Decode steps as the engine's overlap runs them (engine.py): step N+1 embeds step N's token from the
    device (Executor.feed) and its forward is enqueued before step N's token is read back; then step N+1's
    argmax is enqueued, fed, and its read-back started."""

    def __init__(self, executor: CudaExecutor, graphed: GraphedForward, context: int) -> None:
        self.executor, self.graphed = executor, graphed
        slot = bench_slot(graphed)
        self.fed = decode_batch(context, token=-1, state_slot=slot)
        ids = executor.argmax(graphed(decode_batch(context, state_slot=slot)).logits)
        executor.feed(ids)
        self.pending = executor.read_later(ids)

    def step(self) -> None:
        logits = self.graphed(self.fed).logits
        self.pending.result()
        ids = self.executor.argmax(logits)
        self.executor.feed(ids)
        self.pending = self.executor.read_later(ids)

    def finish(self) -> None:
        """Wait for the last step's token."""
        self.pending.result()


def time_overlapped(executor: CudaExecutor, graphed: GraphedForward, context: int, steps: int) -> float:
    """Seconds per token in the OverlappedLoop, after 3 warm-up steps: a step returns when the previous
    step's token has arrived, so `steps` steps span exactly `steps` token arrivals. The last step's own
    token is still in flight then, and is awaited outside the timed span (inside, it would count one
    step more than `steps`)."""
    loop = OverlappedLoop(executor, graphed, context)
    for _ in range(3):
        loop.step()
    started = time.perf_counter()
    for _ in range(steps):
        loop.step()
    elapsed = time.perf_counter() - started
    loop.finish()
    return elapsed / steps


def profile_host_steps(step: Callable[[], object], steps: int) -> None:
    """Where the host's time per step goes: the GPU idles through everything but the final wait."""
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [step() for _ in range(steps)])
    print(f"host profile over {steps} steps (times include the wait for the GPU in synchronize):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def make_kv(streams: StreamSet, cfg: ModelConfig, context: int, dtype: str, executor: CudaExecutor) -> KVCache:
    layers = len(cfg.full_attention_layers)  # a hybrid's linear layers keep no KV
    spec = KVSpec(layers, -(-context // PAGE_SIZE) + 1, cfg.num_key_value_heads, cfg.head_dim, KVDtype.parse(dtype), PAGE_SIZE)
    kv = KVCache(streams, spec)
    for layer in kv.layers:  # zeros: finite scores; the speed of the step does not depend on the values
        for buffer in (layer.k, layer.v, layer.k_scale, layer.v_scale):
            if buffer is not None:
                executor.compute.memset(buffer, 0)
    return kv


def run_info(device: Device | None) -> dict[str, object]:
    """Date, GPU ('cpu' without a device) and commit (NINFER_BENCH_COMMIT names it where the tree is an
    export, or a copy whose .git is not the tree's)."""
    commit = os.environ.get("NINFER_BENCH_COMMIT")
    if not commit:
        try:
            git = ["git", "rev-parse", "--short", "HEAD"]
            commit = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": device.name if device is not None else "cpu", "commit": commit}


def append_results(name: str, rows: list[dict[str, object]]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    with path.open("a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    return path


def print_table(rows: list[dict[str, object]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(_fmt(row[c]).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (quick runs)")
    parser.add_argument("--contexts", default="256,114812")
    parser.add_argument("--kv", default="bf16,int8")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--weights", default="bf16", help="comma list of bf16, int8, int4 (quantized projections)")
    parser.add_argument("--profile-host", action="store_true",
                        help="also profile the host side of the host-to-host steps (cProfile, top functions)")
    args = parser.parse_args()

    device = open_device(0)
    streams = StreamSet(device, verify=False)  # benchmarks measure the runtime, not the verifier
    hybrid = is_hybrid_shape(SHAPES[args.shape])
    cfg = hybrid_config(args.shape, args.layers) if hybrid else shape_config(args.shape, args.layers)
    build = build_hybrid_model if hybrid else build_random_model
    contexts = [int(c) for c in args.contexts.split(",")]
    executor = CudaExecutor(streams, max_tokens=8, max_seqs=1, max_pages_per_seq=-(-max(contexts) // PAGE_SIZE),
                            max_positions=max(contexts) + 1, max_logit_rows=8)
    bandwidth = copy_bandwidth(streams)
    info = run_info(device)
    rows = []
    for weights in args.weights.split(","):
        random = build(executor, cfg, weight_bits=WEIGHT_BITS[weights])
        rows += [info | {"weights": weights, "embedding_lm_head": "bf16"} | measure(random, args, context, dtype, bandwidth)
                 for dtype in args.kv.split(",") for context in contexts]
    print_table(rows, ["shape", "weights", "context", "kv_dtype", "tok_s", "ms_per_step", "graph_ms", "enqueue_ms", "bytes_per_step", "copy_bw_TBs", "roofline_fraction", "overlap_tok_s", "overlap_fraction"])
    print(f"appended to {append_results('decode', rows)}")


WEIGHT_BITS = {"bf16": 16, "int8": 8, "int4": 4}


def measure(random: RandomModel, args: argparse.Namespace, context: int, dtype: str, bandwidth: float) -> dict[str, object]:
    executor, cfg = random.executor, random.model.config
    kv = make_kv(executor.streams, cfg, context, dtype, executor)
    if random.states is not None:  # the empty prefix's state; the steps advance it from there
        random.states.zero(BENCH_SLOT, executor.compute)
    seconds, graph_seconds, enqueue_seconds, overlap_seconds = time_decode(random, kv, context, args.steps, args.profile_host)
    kv.free()
    step_kv, step_states = kv_bytes(cfg, context, dtype), state_bytes(cfg)
    step_bytes = random.weight_bytes_per_step + step_kv + step_states
    return {
        "shape": args.shape, "layers": cfg.num_hidden_layers, "context": context, "kv_dtype": dtype,
        "weight_bytes": random.weight_bytes_per_step, "kv_bytes": step_kv, "state_bytes": step_states,
        "tok_s": 1 / seconds, "ms_per_step": seconds * 1e3, "graph_ms": graph_seconds * 1e3,
        "enqueue_ms": enqueue_seconds * 1e3,
        "dependent_launch": executor.streams.dependent_launch, "bytes_per_step": step_bytes,
        "copy_bw_TBs": bandwidth / 1e12, "roofline_fraction": step_bytes / seconds / bandwidth,
        "overlap_tok_s": 1 / overlap_seconds, "overlap_fraction": step_bytes / overlap_seconds / bandwidth,
    }


if __name__ == "__main__":
    main()
