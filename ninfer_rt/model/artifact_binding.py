"""A qwen3_6_27b `.ninfer` artifact bound to the hybrid model definition, its grouped formats kept quantized.

The artifact carries no config.json: the widths come from its tensors' shapes (hidden from the embedding,
heads from the query rows over the query-norm width, GDN heads from `a_log` and the gated-norm width, whose
key and value heads share one width) and the rest from the facts NInfer's inventory fixes (RoPE theta,
rotary fraction, norm epsilon, native context, one MTP layer). Fused parents are split by rows into the
projections ModelWeights holds; the GDN `[q | k | v]` GEMM input is re-fused from `query_key` and the
value half of `value_z`. Grouped tensors bind as QuantizedWeight (artifact/quantized.py: Q4G64 as int4,
the others widened to int8, fp16 multipliers kept), except the token embedding and the draft head, which
are read by row and decode to bfloat16 on the host; `quantized=False` decodes every tensor so (every
grouped format reconstructs through bf16 exactly), the FP32 `A_log` / `dt_bias` staying FP32. Splitting and
re-fusing move codes and scales only; a fused parent of two formats is widened to the wider. The frontend resources are materialised, byte for byte, in a
cache directory named by their digest, so the Tokenizer and chat template read them as a model directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ninfer_rt.artifact import Artifact, ArtifactError
from ninfer_rt.artifact import qwen3_6_27b as inv
from ninfer_rt.artifact.quantized import binds_quantized, quantized_weight
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.hybrid_config import FULL_ATTENTION
from ninfer_rt.model.hybrid_weights import GatedAttentionWeights, LinearAttentionWeights
from ninfer_rt.model.weights import DraftHeadWeights, HybridLayerWeights, ModelWeights, MTPWeights
from ninfer_rt.quantize.format import Linear, QuantizedWeight
from ninfer_rt.quantize.layouts import dense, split_rows, stack_rows

ARTIFACT_SUFFIX = ".ninfer"


@dataclass(frozen=True)
class ArtifactModel:
    weights: ModelWeights
    frontend_dir: Path  # tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json, ...


def is_artifact_path(path: str | Path) -> bool:
    return Path(path).suffix == ARTIFACT_SUFFIX and Path(path).is_file()


def load_artifact_model(path: str | Path, cache_root: Path | None = None, *, quantized: bool = True) -> ArtifactModel:
    """Opens, checks and binds the artifact (grouped tensors kept quantized unless `quantized` is False);
    raises ArtifactError (one line naming the file) when it is not a complete qwen3_6_27b artifact."""
    try:
        with Artifact(path) as artifact:
            _check_inventory(artifact)
            frontend_dir = materialise_frontend(artifact, cache_root or _cache_root())
            config = artifact_config(artifact, json.loads(artifact.resource(_frontend("generation_config.json"))))
            return ArtifactModel(
                weights=artifact_weights(artifact, config, quantized),
                frontend_dir=frontend_dir,
            )
    except (ArtifactError, ValueError, KeyError) as exc:
        raise ArtifactError(f"{path}: {exc}") from None


def artifact_frontend(path: str | Path, cache_root: Path | None = None) -> Path:
    """The checked artifact's frontend directory, reading only its directory and resources (no tensors)."""
    try:
        with Artifact(path) as artifact:
            _check_inventory(artifact)
            return materialise_frontend(artifact, cache_root or _cache_root())
    except (ArtifactError, KeyError) as exc:
        raise ArtifactError(f"{path}: {exc}") from None


def draft_frequencies(model: ArtifactModel) -> np.ndarray:
    """Counts that make the draft vocabulary (spec_vocab.DraftVocab) the draft head's token-id table."""
    assert model.weights.draft_head is not None
    ids = model.weights.draft_head.token_ids
    counts = np.zeros(model.weights.config.vocab_size, np.int64)
    counts[ids] = np.arange(len(ids), 0, -1)  # row order is the table's rank order
    return counts


def _frontend(name: str) -> str:
    return inv.FRONTEND_PREFIX + name


def _check_inventory(artifact: Artifact) -> None:
    if artifact.model_id not in inv.MODEL_IDS:
        raise ArtifactError(f"model_id {artifact.model_id!r} is not one ninfer-rt binds ({', '.join(inv.MODEL_IDS)})")
    names = set(artifact.objects)
    expected = inv.inventory(inv.text_layer_count(names))
    resources = {_frontend(name) for name in inv.FRONTEND_RESOURCES}
    missing = [name for name in [*resources, *expected] if name not in names]
    unexpected = sorted(names - resources - set(expected))
    if missing or unexpected:
        raise ArtifactError(f"not the qwen3_6_27b inventory: missing {missing[:4]}, unexpected {unexpected[:4]}")
    misformatted = [name for name, fmt in expected.items() if artifact.objects[name].format != fmt]
    if misformatted:
        raise ArtifactError(f"objects not in their inventory format: {misformatted[:4]}")


def _shape(artifact: Artifact, name: str) -> tuple[int, ...]:
    shape = artifact.object(name).shape
    assert shape is not None
    return shape


def artifact_config(artifact: Artifact, generation_config: dict[str, Any]) -> ModelConfig:
    """The hybrid's config from the tensor shapes and the inventory's fixed facts (module docstring)."""
    layers = inv.text_layer_count(set(artifact.objects))
    full = next(layer for layer in range(layers) if inv.is_full_attention(layer))
    gdn = next(layer for layer in range(layers) if not inv.is_full_attention(layer))
    vocab, hidden = _shape(artifact, inv.EMBEDDING)
    head_dim = _shape(artifact, inv.layer_prefix(full) + "attention/query_norm")[0]
    q_and_k = _shape(artifact, inv.layer_prefix(full) + "attention/query_key")[0]
    q_dim = _shape(artifact, inv.layer_prefix(full) + "attention/output")[1]
    linear_head_dim = _shape(artifact, inv.layer_prefix(gdn) + "gdn/norm")[0]
    key_dim = _shape(artifact, inv.layer_prefix(gdn) + "gdn/query_key")[0] // 2
    raw = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _shape(artifact, inv.layer_prefix(full) + "mlp/down")[1],
        "num_hidden_layers": layers,
        "num_attention_heads": q_dim // head_dim,
        "num_key_value_heads": (q_and_k - q_dim) // head_dim,
        "head_dim": head_dim,
        "layer_types": ["full_attention" if inv.is_full_attention(i) else "linear_attention" for i in range(layers)],
        "linear_num_key_heads": key_dim // linear_head_dim,
        "linear_num_value_heads": _shape(artifact, inv.layer_prefix(gdn) + "gdn/a_log")[0],
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_conv_kernel_dim": _shape(artifact, inv.layer_prefix(gdn) + "gdn/convolution")[0],
        "rms_norm_eps": inv.RMS_NORM_EPS,
        "max_position_embeddings": inv.NATIVE_CONTEXT,
        "rope_parameters": {"rope_type": "default", "rope_theta": inv.ROPE_THETA,
                            "partial_rotary_factor": inv.PARTIAL_ROTARY_FACTOR},
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "bos_token_id": generation_config.get("bos_token_id"),
        "eos_token_id": generation_config.get("eos_token_id"),
        "dtype": "bfloat16",
    }
    return ModelConfig.from_dict(raw)


BIND_THREADS = 8  # numpy releases the GIL in the binding's passes: 2.4x on 2 cores, the 27B's ~11 G Q5 codes


class _Values:
    """The tensors as bound: grouped ones quantized (when asked and bindable), the rest decoded. The quantized
    ones the model takes are bound ahead on a thread pool, in inventory order (every one is kept anyway)."""

    def __init__(self, artifact: Artifact, quantized: bool) -> None:
        self._artifact = artifact
        self._quantized = quantized
        self._pool = ThreadPoolExecutor(min(BIND_THREADS, os.cpu_count() or 1), thread_name_prefix="ninfer-bind")
        ahead = [name for name in artifact.objects if self._binds(name) and _taken_quantized(name)]
        self._bound = {name: self._pool.submit(self._bind, name) for name in ahead}

    def _binds(self, name: str) -> bool:
        return self._quantized and binds_quantized(self._artifact.object(name))

    def _bind(self, name: str) -> QuantizedWeight:
        return quantized_weight(self._artifact.object(name), self._artifact.payload(name))

    def __call__(self, name: str) -> Linear:
        future = self._bound.pop(name, None)
        if future is not None:
            return future.result()
        return self._bind(name) if self._binds(name) else self.decoded(name)

    def close(self) -> None:
        for future in self._bound.values():
            future.cancel()
        self._pool.shutdown(wait=True)

    def decoded(self, name: str) -> np.ndarray:
        """bfloat16 (exact for every format but FP32), FP32 kept as float32."""
        if self._artifact.objects[name].format == "FP32":
            return self._artifact.tensor_values(name)
        # bf16 as decoded, block by block: a 248k-row embedding never exists in float32
        return self._artifact.tensor_values(name, ml_dtypes.bfloat16).astype(ml_dtypes.bfloat16, copy=False)


def _rows(matrix: Linear, *sizes: int) -> list[Linear]:
    """The fused parent's row blocks, in physical order; the sizes must cover every row."""
    if isinstance(matrix, QuantizedWeight):
        return split_rows(matrix, *sizes)
    if sum(sizes) != matrix.shape[0]:
        raise ArtifactError(f"a fused parent of {matrix.shape[0]} rows does not split into {list(sizes)}")
    return np.split(matrix, np.cumsum(sizes)[:-1])


def _fused(*parts: Linear) -> Linear:
    """Row blocks of (possibly) different formats as one matrix: quantized when every block is."""
    if all(isinstance(part, QuantizedWeight) for part in parts):
        return stack_rows(parts)  # type: ignore[arg-type]
    return np.concatenate([dense(part, ml_dtypes.bfloat16) for part in parts])


def _gated_attention(values: _Values, prefix: str, cfg: ModelConfig, fused: tuple[str, ...]) -> GatedAttentionWeights:
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    if len(fused) == 1:  # MTP: one [query, key, output gate, value] parent
        q, k, gate, v = _rows(values(prefix + fused[0]), q_dim, kv_dim, q_dim, kv_dim)
    else:
        q, k = _rows(values(prefix + fused[0]), q_dim, kv_dim)
        gate, v = _rows(values(prefix + fused[1]), q_dim, kv_dim)
    return GatedAttentionWeights(
        q_proj=q, gate_proj=gate, k_proj=k, v_proj=v, o_proj=values(prefix + "output"),
        q_norm=values.decoded(prefix + "query_norm"), k_norm=values.decoded(prefix + "key_norm"),
    )


def _linear_attention(values: _Values, prefix: str, cfg: ModelConfig) -> LinearAttentionWeights:
    assert cfg.linear_attention is not None
    value_dim = cfg.linear_attention.num_value_heads * cfg.linear_attention.value_head_dim
    value, z = _rows(values(prefix + "value_z"), value_dim, value_dim)
    return LinearAttentionWeights(
        in_proj_qkv=_fused(values(prefix + "query_key"), value),
        in_proj_z=z,
        in_proj_b=values(prefix + "b_projection"),
        in_proj_a=values(prefix + "a_projection"),
        conv_weight=np.ascontiguousarray(values.decoded(prefix + "convolution").T),
        A_log=values.decoded(prefix + "a_log"),
        dt_bias=values.decoded(prefix + "dt_bias"),
        norm=values.decoded(prefix + "norm"),
        out_proj=values(prefix + "output"),
    )


def _layer(values: _Values, prefix: str, cfg: ModelConfig, mixer: GatedAttentionWeights | LinearAttentionWeights) -> HybridLayerWeights:
    gate, up = _rows(values(prefix + "mlp/gate_up"), cfg.intermediate_size, cfg.intermediate_size)
    return HybridLayerWeights(
        input_norm=values.decoded(prefix + "input_norm"), post_norm=values.decoded(prefix + "post_attention_norm"),
        gate_proj=gate, up_proj=up, down_proj=values(prefix + "mlp/down"), mixer=mixer,
    )


def _taken_quantized(name: str) -> bool:
    """The objects the model takes quantized, worth binding ahead: layers, MTP and the output head (the
    embedding and the draft head are decoded; Vision objects are not bound)."""
    return name.startswith(("text/layers/", "mtp/")) or name == inv.OUTPUT_HEAD


def artifact_weights(artifact: Artifact, cfg: ModelConfig, quantized: bool = True) -> ModelWeights:
    values = _Values(artifact, quantized)
    try:
        return _bound_weights(artifact, cfg, values)
    finally:
        values.close()


def _bound_weights(artifact: Artifact, cfg: ModelConfig, values: _Values) -> ModelWeights:
    layers = []
    for layer in range(cfg.num_hidden_layers):
        prefix = inv.layer_prefix(layer)
        if cfg.layer_type(layer) == FULL_ATTENTION:
            mixer = _gated_attention(values, prefix + "attention/", cfg, ("query_key", "gate_value"))
        else:
            mixer = _linear_attention(values, prefix + "gdn/", cfg)
        layers.append(_layer(values, prefix, cfg, mixer))
    mtp_layer = _layer(values, "mtp/layer/", cfg, _gated_attention(values, "mtp/layer/attention/", cfg, ("query_key_gate_value",)))
    mtp = MTPWeights(
        fc=values("mtp/input_projection"), norm_embedding=values.decoded("mtp/embedding_norm"),
        norm_hidden=values.decoded("mtp/hidden_norm"), layer=mtp_layer, norm=values.decoded("mtp/final_norm"),
    )
    token_ids = np.array(artifact.tensor_values(inv.DRAFT_HEAD_TOKEN_IDS), np.int64)
    draft_head = DraftHeadWeights(token_ids, values.decoded(inv.DRAFT_HEAD))  # rows picked per draft vocabulary
    return ModelWeights(
        config=cfg, embed=values.decoded(inv.EMBEDDING), layers=layers, norm=values.decoded(inv.FINAL_NORM),
        lm_head=values(inv.OUTPUT_HEAD), mtp=mtp, draft_head=draft_head,
    )


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ninfer-rt" / "frontend"


def materialise_frontend(artifact: Artifact, cache_root: Path) -> Path:
    """The six frontend resources as files of one directory, named by their digest; written once, atomically."""
    files = {name: artifact.resource(_frontend(name)) for name in inv.FRONTEND_RESOURCES}
    digest = hashlib.sha256(b"".join(hashlib.sha256(data).digest() for data in files.values())).hexdigest()[:32]
    target = cache_root / digest
    if target.is_dir():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_root, prefix=".staging-"))
    for name, data in files.items():
        (staging / name).write_bytes(data)
    try:
        staging.rename(target)
    except OSError:  # another process materialised the same resources first
        for name in files:
            (staging / name).unlink()
        staging.rmdir()
    return target
