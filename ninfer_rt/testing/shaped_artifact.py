"""A qwen3_6_27b `.ninfer` artifact of random weights at a hybrid model shape (the 27B's for the GPU's load
and decode figures, ~17 GB): every object in its inventory format, the grouped ones written as random
payload planes (any bit pattern is a valid code; the scales are drawn so a weight's spread is ~0.02), one
object in memory at a time. The frontend resources are the shaped checkpoints' filler tokenizer.

`object_shapes` states each object's shape from the model's widths (NInfer's `qwen3.6-27b-artifact.md`
inventory); the tiny converter (testing/tiny_artifact.py) writes the same shapes from a real checkpoint.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ninfer_rt.artifact import qwen3_6_27b as inv
from ninfer_rt.artifact.layouts import GROUPED_FORMATS, RowSplitGeometry
from ninfer_rt.artifact.writer import Entry, PackedEntry, ResourceEntry, TensorEntry, write_artifact
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.shapes import hybrid_text_config
from ninfer_rt.testing.shaped import HYBRID_MAX_POSITIONS, filler_tokenizer
from ninfer_rt.testing.tiny import write_tokenizer_files
from ninfer_rt.testing.tiny_artifact import draft_token_ids, frontend_resources, vision_shape

WEIGHT_SPREAD = 0.02  # the standard deviation the random codes times their scales come to


def shaped_config(shape: Mapping[str, int | float]) -> ModelConfig:
    """The hybrid ModelConfig of a SHAPES entry (the artifact carries no config: its shapes are the widths)."""
    return ModelConfig.from_dict(hybrid_text_config(shape) | {"max_position_embeddings": HYBRID_MAX_POSITIONS})


def object_shapes(cfg: ModelConfig, draft_rows: int) -> dict[str, tuple[int, ...]]:
    """Every tensor object's shape, name -> shape, in the inventory's order."""
    assert cfg.linear_attention is not None
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    linear = cfg.linear_attention
    common = {"input_norm": (hidden,), "post_attention_norm": (hidden,), "mlp/gate_up": (2 * inter, hidden), "mlp/down": (hidden, inter)}
    attention = {
        "attention/query_key": (q_dim + kv_dim, hidden), "attention/gate_value": (q_dim + kv_dim, hidden),
        "attention/query_norm": (cfg.head_dim,), "attention/key_norm": (cfg.head_dim,), "attention/output": (hidden, q_dim),
    }
    gdn = {
        "gdn/a_log": (linear.num_value_heads,), "gdn/dt_bias": (linear.num_value_heads,),
        "gdn/convolution": (linear.conv_kernel_size, linear.conv_channels),
        "gdn/a_projection": (linear.num_value_heads, hidden), "gdn/b_projection": (linear.num_value_heads, hidden),
        "gdn/query_key": (2 * linear.key_dim, hidden), "gdn/value_z": (2 * linear.value_dim, hidden),
        "gdn/norm": (linear.value_head_dim,), "gdn/output": (hidden, linear.value_dim),
    }
    mtp = {
        "mtp/input_projection": (hidden, 2 * hidden), "mtp/embedding_norm": (hidden,), "mtp/hidden_norm": (hidden,),
        "mtp/layer/input_norm": (hidden,), "mtp/layer/attention/query_key_gate_value": (2 * (q_dim + kv_dim), hidden),
        "mtp/layer/attention/query_norm": (cfg.head_dim,), "mtp/layer/attention/key_norm": (cfg.head_dim,),
        "mtp/layer/attention/output": (hidden, q_dim), "mtp/layer/post_attention_norm": (hidden,),
        "mtp/layer/mlp/gate_up": (2 * inter, hidden), "mtp/layer/mlp/down": (hidden, inter), "mtp/final_norm": (hidden,),
    }
    fixed = {
        inv.EMBEDDING: (vocab, hidden), inv.FINAL_NORM: (hidden,), inv.OUTPUT_HEAD: (vocab, hidden),
        inv.DRAFT_HEAD: (draft_rows, hidden), inv.DRAFT_HEAD_TOKEN_IDS: (draft_rows,), **mtp,
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for name in inv.inventory(cfg.num_hidden_layers):
        if name.startswith("text/layers/"):
            suffix = name.split("/", 3)[3]
            layer = int(name.split("/")[2])
            shapes[name] = {**common, **(attention if inv.is_full_attention(layer) else gdn)}[suffix]
        else:
            shapes[name] = fixed[name] if name in fixed else vision_shape(name, hidden)
    return shapes


def random_payload(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> bytes:
    """A `row-split-k128-v1` payload of random codes (base and high-bit planes of random bytes) and scales
    around the one that gives uniformly drawn codes a spread of WEIGHT_SPREAD."""
    grouped = GROUPED_FORMATS[fmt]
    geometry = RowSplitGeometry(grouped, rows, cols)
    payload = np.zeros(geometry.payload_bytes, np.uint8)
    base = geometry.groups * grouped.base_bytes_per_group
    high = geometry.groups * grouped.high_bytes_per_group
    payload[:base] = rng.integers(0, 256, base, np.uint8)  # 6x Generator.bytes' rate
    payload[geometry.high_offset : geometry.high_offset + high] = rng.integers(0, 256, high, np.uint8)
    code_spread = (1 << grouped.code_bits) / math.sqrt(12)
    scales = (WEIGHT_SPREAD / code_spread) * rng.uniform(0.5, 1.5, geometry.groups)
    payload[geometry.scale_offset :] = scales.astype("<f2").view(np.uint8)
    return payload.tobytes()


def _direct_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("gdn/a_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith(("gdn/dt_bias", "gdn/norm")):  # the gated norm's gain is plain, not 1 + w
        return np.ones(shape, np.float32)
    if name.endswith(("norm", "norm/weight")):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)  # zero-centred gains: 1 + w
    return (WEIGHT_SPREAD * rng.standard_normal(shape)).astype(np.float32)


def shaped_entries(cfg: ModelConfig, draft_rows: int, seed: int) -> list[TensorEntry | PackedEntry]:
    """The tensor objects, grouped ones as payloads made when written (each from its own seed)."""
    formats = inv.inventory(cfg.num_hidden_layers)
    entries: list[TensorEntry | PackedEntry] = []
    for index, (name, shape) in enumerate(object_shapes(cfg, draft_rows).items()):
        rng = np.random.default_rng([seed, index])
        fmt = formats[name]
        if fmt in GROUPED_FORMATS:
            rows, cols = shape
            entries.append(PackedEntry(name, (rows, cols), fmt, lambda f=fmt, r=rows, c=cols, g=rng: random_payload(f, r, c, g)))
        elif name == inv.DRAFT_HEAD_TOKEN_IDS:
            entries.append(TensorEntry(name, draft_token_ids(cfg.vocab_size, draft_rows, seed), fmt))
        else:
            entries.append(TensorEntry(name, _direct_values(name, shape, rng), fmt))
    return entries


def write_shaped_artifact(
    path: Path, shape: Mapping[str, int | float], draft_rows: int, seed: int = 0,
    progress: Callable[[str, int], None] | None = None,
) -> Path:
    """Writes the random-weight artifact of a hybrid SHAPES entry to `path` (a `.ninfer` file)."""
    cfg = shaped_config(shape)
    with tempfile.TemporaryDirectory() as frontend:
        write_tokenizer_files(Path(frontend), filler_tokenizer(cfg.vocab_size), HYBRID_MAX_POSITIONS)
        resources: list[Entry] = [ResourceEntry(inv.FRONTEND_PREFIX + n, d) for n, d in frontend_resources(Path(frontend)).items()]
    return write_artifact(path, inv.MODEL_IDS[0], [*resources, *shaped_entries(cfg, draft_rows, seed)], progress)
