"""Peak memory and time of `ninfer-rt quantize` (int4, group 128) on a Qwen3.5/3.6-27B-shaped random checkpoint.

A bf16 27B checkpoint is 54 GB; this writes one with the 27B layer shapes (hidden 5120, intermediate 17408,
vocab 248320, 24/4 heads of 256, Gated DeltaNet 16 key / 48 value heads of 128, conv 4, untied lm_head) but
--layers decoder layers (default 4: three linear-attention and one full-attention layer), quantizes it in a
child process, and reports the child's peak RSS (VmHWM) next to the checkpoint's size and its largest tensor,
and the time extrapolated to 64 layers by quantized parameters. Prints a table and appends a JSON line to
bench/results/quantize_memory.jsonl. The checkpoints are deleted afterwards unless --keep.

    python tools/bench_quantize_memory.py --work /tmp/qbench [--layers 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.weights import expected_tensors
from ninfer_rt.quantize_checkpoint.writer import quantized_names
from ninfer_rt.testing.shaped import write_random_weights
from ninfer_rt.testing.tiny import write_json

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "quantize_memory.jsonl"
FULL_LAYERS = 64
SHAPE_27B = {
    "hidden_size": 5120, "intermediate_size": 17408, "vocab_size": 248320, "num_attention_heads": 24,
    "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}
CHILD = """
import json, sys, time
from pathlib import Path
from ninfer_rt.quantize_checkpoint.writer import quantize_checkpoint
start = time.perf_counter()
quantize_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]), 4, 128)
seconds = time.perf_counter() - start
status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
print(json.dumps({"seconds": seconds, "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024}))
"""


def hybrid_config(layers: int, shape: dict[str, int]) -> dict[str, object]:
    """A qwen3_5_text config.json of ``shape`` with ``layers`` layers, every 4th full attention, no MTP."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 262144, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        **shape,
    }


def write_checkpoint(out: Path, layers: int, shape: dict[str, int]) -> ModelConfig:
    out.mkdir(parents=True, exist_ok=True)
    config = hybrid_config(layers, shape)
    cfg = ModelConfig.from_dict(config)
    write_random_weights(out, cfg, seed=0)
    write_json(out / "config.json", config)
    return cfg


def quantize_in_child(model_dir: Path, out_dir: Path) -> dict[str, float]:
    """{"seconds", "peak_rss_bytes"} of quantize_checkpoint run alone in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(out_dir)], check=True,
                          capture_output=True, text=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def tensor_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes of the bf16 checkpoint, its largest tensor, and the parameters that get quantized."""
    shapes = expected_tensors(cfg)
    elements = {name: int(np.prod(shape)) for name, shape in shapes.items()}
    return {
        "checkpoint_bytes": 2 * sum(elements.values()),
        "largest_tensor_bytes": 2 * max(elements.values()),
        "quantized_params": sum(elements[name] for name in quantized_names(shapes, False)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="Scratch directory (needs ~12 GB at 4 layers).")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    model_dir, out_dir = args.work / "bf16", args.work / "int4"
    start = time.perf_counter()
    cfg = write_checkpoint(model_dir, args.layers, SHAPE_27B)
    write_seconds = time.perf_counter() - start
    try:
        measured = quantize_in_child(model_dir, out_dir)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    sizes = tensor_sizes(cfg)
    full = tensor_sizes(ModelConfig.from_dict(hybrid_config(FULL_LAYERS, SHAPE_27B)))
    row = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip(),
        "layers": args.layers, "bits": 4, "group_size": 128, **sizes, **measured,
        "write_seconds": round(write_seconds, 1),
        "seconds_at_64_layers": round(measured["seconds"] * full["quantized_params"] / sizes["quantized_params"], 1),
        "checkpoint_bytes_at_64_layers": full["checkpoint_bytes"],
    }
    gib = 1 << 30
    print(f"{'layers':>6} {'checkpoint':>11} {'largest tensor':>15} {'peak RSS':>9} {'time':>7} {'time @64 layers':>16}")
    print(f"{args.layers:>6} {row['checkpoint_bytes'] / gib:>9.1f} G {row['largest_tensor_bytes'] / gib:>13.2f} G "
          f"{row['peak_rss_bytes'] / gib:>7.2f} G {row['seconds']:>6.0f}s {row['seconds_at_64_layers']:>15.0f}s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
