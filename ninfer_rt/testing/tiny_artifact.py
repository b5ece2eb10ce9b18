"""A qwen3_6_27b `.ninfer` artifact at a tiny shape, converted from a tiny hybrid checkpoint as NInfer's
`qwen3.6-27b-artifact.md` converts the published one, and the same quantized weights as a safetensors checkpoint.

`write_tiny_artifact` follows the document's source mapping (sections 10-12): q_proj's per-head
[query | output gate] halves separated, then the fused parents formed, each object quantized in its
inventory format; the draft head gathers output-head rows of a fixed id table; the Vision objects (which
the runtime does not bind) are random at tiny widths. `write_dequantized_checkpoint` states the same
formats per role in the Hugging Face layout, so a model loaded from it must compute what the artifact's
does: quantization is per row and group, so quantizing a fused parent equals quantizing its row blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from ninfer_rt.artifact import qwen3_6_27b as inv
from ninfer_rt.artifact.layouts import float32_to_bf16_float32
from ninfer_rt.artifact.writer import Entry, ResourceEntry, TensorEntry, dequantized, write_artifact
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.hybrid_weights import split_query_gate

SINGLE_FILE = "model.safetensors"
VISION_HIDDEN, VISION_INTERMEDIATE, VISION_PATCH, VISION_POSITIONS = 32, 64, 96, 16


def _source(model_dir: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    return ModelConfig.from_dir(model_dir), load_file(str(model_dir / SINGLE_FILE))


def _query_gate(cfg: ModelConfig, q_proj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    query, gate = split_query_gate(q_proj, cfg.num_attention_heads, cfg.head_dim)
    return np.asarray(query), np.asarray(gate)


def _full_attention_values(cfg: ModelConfig, src: dict[str, np.ndarray], p: str) -> dict[str, np.ndarray]:
    query, gate = _query_gate(cfg, src[p + "self_attn.q_proj.weight"])
    return {
        "attention/query_key": np.concatenate([query, src[p + "self_attn.k_proj.weight"]]),
        "attention/gate_value": np.concatenate([gate, src[p + "self_attn.v_proj.weight"]]),
        "attention/query_norm": src[p + "self_attn.q_norm.weight"],
        "attention/key_norm": src[p + "self_attn.k_norm.weight"],
        "attention/output": src[p + "self_attn.o_proj.weight"],
    }


def _gdn_values(cfg: ModelConfig, src: dict[str, np.ndarray], p: str) -> dict[str, np.ndarray]:
    assert cfg.linear_attention is not None
    qkv = src[p + "linear_attn.in_proj_qkv.weight"]
    qk_rows = 2 * cfg.linear_attention.key_dim
    return {
        "gdn/a_log": float32_to_bf16_float32(src[p + "linear_attn.A_log"]),  # BF16 source expanded to FP32
        "gdn/dt_bias": float32_to_bf16_float32(src[p + "linear_attn.dt_bias"]),
        "gdn/convolution": src[p + "linear_attn.conv1d.weight"][:, 0, :].T,
        "gdn/a_projection": src[p + "linear_attn.in_proj_a.weight"],
        "gdn/b_projection": src[p + "linear_attn.in_proj_b.weight"],
        "gdn/query_key": qkv[:qk_rows],
        "gdn/value_z": np.concatenate([qkv[qk_rows:], src[p + "linear_attn.in_proj_z.weight"]]),
        "gdn/norm": src[p + "linear_attn.norm.weight"],
        "gdn/output": src[p + "linear_attn.out_proj.weight"],
    }


def _layer_values(cfg: ModelConfig, src: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{layer}."
    mixer = _full_attention_values if inv.is_full_attention(layer) else _gdn_values
    return {
        "input_norm": src[p + "input_layernorm.weight"],
        **mixer(cfg, src, p),
        "post_attention_norm": src[p + "post_attention_layernorm.weight"],
        "mlp/gate_up": np.concatenate([src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]]),
        "mlp/down": src[p + "mlp.down_proj.weight"],
    }


def _mtp_values(cfg: ModelConfig, src: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    m = "mtp.layers.0."
    query, gate = _query_gate(cfg, src[m + "self_attn.q_proj.weight"])
    fused = [query, src[m + "self_attn.k_proj.weight"], gate, src[m + "self_attn.v_proj.weight"]]
    return {
        "mtp/input_projection": src["mtp.fc.weight"],
        "mtp/embedding_norm": src["mtp.pre_fc_norm_embedding.weight"],
        "mtp/hidden_norm": src["mtp.pre_fc_norm_hidden.weight"],
        "mtp/layer/input_norm": src[m + "input_layernorm.weight"],
        "mtp/layer/attention/query_key_gate_value": np.concatenate(fused),
        "mtp/layer/attention/query_norm": src[m + "self_attn.q_norm.weight"],
        "mtp/layer/attention/key_norm": src[m + "self_attn.k_norm.weight"],
        "mtp/layer/attention/output": src[m + "self_attn.o_proj.weight"],
        "mtp/layer/post_attention_norm": src[m + "post_attention_layernorm.weight"],
        "mtp/layer/mlp/gate_up": np.concatenate([src[m + "mlp.gate_proj.weight"], src[m + "mlp.up_proj.weight"]]),
        "mtp/layer/mlp/down": src[m + "mlp.down_proj.weight"],
        "mtp/final_norm": src["mtp.norm.weight"],
    }


def vision_shape(name: str, text_hidden: int) -> tuple[int, ...]:
    h, i = VISION_HIDDEN, VISION_INTERMEDIATE
    suffix = name.split("/", 3)[-1] if name.startswith("vision/layers/") else name
    shapes = {
        "vision/patch_embedding": (h, VISION_PATCH), "vision/patch_embedding_bias": (h,),
        "vision/position_embedding": (VISION_POSITIONS, h),
        "attention/qkv": (3 * h, h), "attention/qkv_bias": (3 * h,), "attention/output": (h, h),
        "attention/output_bias": (h,), "mlp/fc1": (i, h), "mlp/fc1_bias": (i,), "mlp/fc2": (h, i),
        "mlp/fc2_bias": (h,), "norm1/weight": (h,), "norm1/bias": (h,), "norm2/weight": (h,), "norm2/bias": (h,),
        "vision/merger/fc1": (4 * h, 4 * h), "vision/merger/fc1_bias": (4 * h,),
        "vision/merger/fc2": (text_hidden, 4 * h), "vision/merger/fc2_bias": (text_hidden,),
        "vision/merger/norm/weight": (h,), "vision/merger/norm/bias": (h,),
    }
    return shapes[suffix]


def draft_token_ids(tokens: int, rows: int, seed: int = 0) -> np.ndarray:
    """A fixed table of `rows` distinct token ids below `tokens`, in no particular order."""
    return np.random.default_rng(seed).permutation(tokens)[:rows].astype(np.int32)


def frontend_resources(model_dir: Path) -> dict[str, bytes]:
    files = {name: (model_dir / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")}
    jinja = model_dir / "chat_template.jinja"
    template = jinja.read_text() if jinja.exists() else json.loads(files["tokenizer_config.json"]).get("chat_template", "")
    files["chat_template.jinja"] = template.encode()
    files["preprocessor_config.json"] = files["video_preprocessor_config.json"] = b"{}"
    return {name: files[name] for name in inv.FRONTEND_RESOURCES}


def artifact_values(model_dir: Path, draft_rows: int, tokens: int) -> dict[str, np.ndarray]:
    """Every tensor object's logical values (before encoding), name -> values, in writer order."""
    cfg, src = _source(model_dir)
    values: dict[str, np.ndarray] = {inv.EMBEDDING: src["model.embed_tokens.weight"]}
    for layer in range(cfg.num_hidden_layers):
        values.update({inv.layer_prefix(layer) + k: v for k, v in _layer_values(cfg, src, layer).items()})
    ids = draft_token_ids(tokens, draft_rows)
    values.update({
        inv.FINAL_NORM: src["model.norm.weight"], inv.OUTPUT_HEAD: src["lm_head.weight"],
        inv.DRAFT_HEAD: src["lm_head.weight"][ids], inv.DRAFT_HEAD_TOKEN_IDS: ids,
    })
    values.update(_mtp_values(cfg, src))
    rng = np.random.default_rng(1)
    for name in inv.inventory(cfg.num_hidden_layers):
        if name.startswith("vision/"):
            values[name] = (0.02 * rng.standard_normal(vision_shape(name, cfg.hidden_size))).astype(np.float32)
    return values


def write_tiny_artifact(model_dir: Path, path: Path, draft_rows: int, tokens: int, model_id: str = inv.MODEL_IDS[0]) -> list[TensorEntry]:
    """Writes the artifact of `model_dir` (a single-file causal-LM checkpoint with MTP); returns its tensors."""
    cfg = ModelConfig.from_dir(model_dir)
    formats = inv.inventory(cfg.num_hidden_layers)
    tensors = [TensorEntry(name, np.ascontiguousarray(v), formats[name]) for name, v in artifact_values(model_dir, draft_rows, tokens).items()]
    resources: list[Entry] = [ResourceEntry(inv.FRONTEND_PREFIX + n, d) for n, d in frontend_resources(model_dir).items()]
    write_artifact(path, model_id, [*resources, *tensors])
    return tensors


def _hf_formats(cfg: ModelConfig, name: str) -> str:
    """The inventory format of a Hugging Face tensor (q_proj and in_proj_qkv hold two, handled apart)."""
    if name.startswith("mtp.") and name.endswith("proj.weight") or name == "mtp.fc.weight":
        return "W8G32_F16S"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "Q6G64_F16S"
    if name.endswith(("k_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return "Q4G64_F16S"
    if name.endswith(("v_proj.weight", "o_proj.weight", "down_proj.weight", "in_proj_z.weight", "out_proj.weight")):
        return "Q5G64_F16S"
    return "FP32" if name.endswith(("A_log", "dt_bias")) else "BF16"


def _hf_dequantized(cfg: ModelConfig, name: str, tensor: np.ndarray) -> np.ndarray:
    if name.endswith("self_attn.q_proj.weight"):
        query, gate = _query_gate(cfg, tensor)
        fmts = ("W8G32_F16S",) * 2 if name.startswith("mtp.") else ("Q4G64_F16S", "Q5G64_F16S")
        halves = (dequantized(fmts[0], query), dequantized(fmts[1], gate))
        per_head = [h.reshape(cfg.num_attention_heads, 1, cfg.head_dim, -1) for h in halves]
        return np.concatenate(per_head, axis=1).reshape(tensor.shape)
    if name.endswith("linear_attn.in_proj_qkv.weight"):
        assert cfg.linear_attention is not None
        rows = 2 * cfg.linear_attention.key_dim
        return np.concatenate([dequantized("Q4G64_F16S", tensor[:rows]), dequantized("Q5G64_F16S", tensor[rows:])])
    fmt = _hf_formats(cfg, name)
    if fmt == "FP32":
        return float32_to_bf16_float32(tensor)
    return dequantized(fmt, tensor)


def write_dequantized_checkpoint(model_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose weights are the values the artifact of `model_dir` decodes to."""
    shutil.copytree(model_dir, out_dir)
    cfg, src = _source(model_dir)
    tensors = {name: np.ascontiguousarray(_hf_dequantized(cfg, name, t), np.float32) for name, t in src.items()}
    save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
    return out_dir
