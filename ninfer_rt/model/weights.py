"""Safetensors checkpoints (single file or sharded) as memory-mapped numpy arrays, checked against the config.

Tensors are named as a causal LM stores them (``model.layers.N...``, ``lm_head.weight``, ``mtp...``) whatever
the checkpoint's layout: a vision-language checkpoint's text weights (``model.language_model.*``) are renamed,
its vision tower (``model.visual.*``) is left unread, since only the tensors a model uses are ever mapped.
The files themselves are read by ``safetensors_file``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.hybrid_config import FULL_ATTENTION, LINEAR_ATTENTION
from ninfer_rt.model.hybrid_weights import (
    GatedAttentionWeights,
    LinearAttentionWeights,
    gated_attention_tensors,
    linear_attention_tensors,
)
from ninfer_rt.quantize.format import Linear, QuantFormatError
from ninfer_rt.quantize.scheme import convert_quantized, quantized_layout, scheme_from_dir
from ninfer_rt.model.safetensors_file import SafetensorsFile, Shape, WeightsError

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"

# Where each architecture stores its text model's ``model.*`` tensors, when not under ``model.``
TEXT_MODEL_PREFIX = {"Qwen3_5ForConditionalGeneration": "model.language_model."}
UNUSED_PREFIXES = ("model.visual.",)  # a vision-language checkpoint's vision tower


class CheckpointMismatchError(WeightsError):
    """Tensors missing, unexpected or mis-shaped for the config (one line naming each tensor)."""


def stored_name(cfg: ModelConfig, name: str) -> str:
    """The name ``cfg``'s checkpoints store the tensor ``name`` under."""
    prefix = TEXT_MODEL_PREFIX.get(cfg.architecture)
    return prefix + name.removeprefix("model.") if prefix and name.startswith("model.") else name


def _model_name(cfg: ModelConfig, stored: str) -> str:
    prefix = TEXT_MODEL_PREFIX.get(cfg.architecture)
    return "model." + stored.removeprefix(prefix) if prefix and stored.startswith(prefix) else stored


def expected_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor name and shape of the Hugging Face layout for ``cfg`` (linear weights are [out, in])."""
    expected: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        expected.update(_decoder_layer_tensors(cfg, f"model.layers.{i}.", cfg.layer_type(i)))
    expected["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if cfg.mtp_layers:
        expected["mtp.fc.weight"] = (cfg.hidden_size, 2 * cfg.hidden_size)
        expected["mtp.pre_fc_norm_embedding.weight"] = (cfg.hidden_size,)
        expected["mtp.pre_fc_norm_hidden.weight"] = (cfg.hidden_size,)
        expected.update(_decoder_layer_tensors(cfg, "mtp.layers.0.", FULL_ATTENTION))
        expected["mtp.norm.weight"] = (cfg.hidden_size,)
    return expected


def _decoder_layer_tensors(cfg: ModelConfig, prefix: str, layer_type: str) -> dict[str, Shape]:
    dense = _dense_layer_tensors(cfg, prefix)
    if not cfg.is_hybrid:
        return dense
    mixer = linear_attention_tensors if layer_type == LINEAR_ATTENTION else gated_attention_tensors
    return {**mixer(cfg, prefix), **{name: shape for name, shape in dense.items() if ".self_attn." not in name}}


def _dense_layer_tensors(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    tensors: dict[str, Shape] = {
        "input_layernorm.weight": (cfg.hidden_size,),
        "self_attn.q_proj.weight": (q_dim, cfg.hidden_size),
        "self_attn.k_proj.weight": (kv_dim, cfg.hidden_size),
        "self_attn.v_proj.weight": (kv_dim, cfg.hidden_size),
        "self_attn.o_proj.weight": (cfg.hidden_size, q_dim),
        "post_attention_layernorm.weight": (cfg.hidden_size,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
        "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
        "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size),
    }
    if cfg.qk_norm:
        tensors["self_attn.q_norm.weight"] = (cfg.head_dim,)
        tensors["self_attn.k_norm.weight"] = (cfg.head_dim,)
    return {prefix + name: shape for name, shape in tensors.items()}


def _is_ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors real checkpoints carry that the model does not use; transformers skips them too."""
    if name.endswith("rotary_emb.inv_freq") or name.startswith(UNUSED_PREFIXES):
        return True
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # some tied checkpoints store the tied copy anyway
    return name.startswith("mtp.") and not cfg.mtp_layers


class Checkpoint(Mapping[str, Linear]):
    """Name -> array as stored (bf16 stays ml_dtypes.bfloat16, memory-mapped), plus the model config.
    A quantized linear weight is a QuantizedWeight under its plain name (``...q_proj.weight``)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, Linear], files: Sequence[SafetensorsFile] = ()) -> None:
        self.config = config
        self._tensors = tensors
        self._files = tuple(files)

    def release_pages(self) -> None:
        """Drops the mapped pages read so far from the resident set (SafetensorsFile.release_pages)."""
        for f in self._files:
            f.release_pages()

    def __getitem__(self, name: str) -> Linear:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def load_checkpoint(model_dir: str | Path, config: ModelConfig | None = None) -> Checkpoint:
    """Maps every safetensors file of ``model_dir`` and checks names and shapes against the config; only
    the expected tensors are read. Keys are the causal-LM names (module docstring) in every layout.

    Raises :class:`CheckpointMismatchError` listing all missing, unexpected and mis-shaped tensors together,
    by the names the checkpoint stores them under.
    """
    model_dir = Path(model_dir)
    cfg = config or ModelConfig.from_dir(model_dir)
    files = _open_files(model_dir)
    located = _locate_tensors(model_dir, files)
    found = {name: f.shape(name) for name, f in located.items()}
    as_stored = {stored_name(cfg, name): shape for name, shape in expected_tensors(cfg).items()}
    try:
        scheme = scheme_from_dir(model_dir)
        expected, quantized = quantized_layout(scheme, as_stored, found) if scheme else (as_stored, [])
        problems = _layout_problems(cfg, expected, found)
        if problems:
            raise CheckpointMismatchError(f"{model_dir}: checkpoint does not match config.json: " + "; ".join(problems))
        tensors = {name: located[name].tensor(name) for name in expected}
        # Quantized linears become QuantizedWeight (imports converted to the project's layout here).
        converted = convert_quantized(scheme, tensors, quantized) if scheme else tensors
        return Checkpoint(cfg, {_model_name(cfg, name): tensor for name, tensor in converted.items()}, files)
    except QuantFormatError as err:
        raise WeightsError(f"{model_dir}: {err}") from None


def _open_files(model_dir: Path) -> list[SafetensorsFile]:
    file_names = _checkpoint_file_names(model_dir)
    progress = tqdm(file_names, desc="mapping weights", unit="file", disable=not sys.stderr.isatty())
    files: list[SafetensorsFile] = []
    unreadable: list[str] = []
    for name in progress:
        try:
            files.append(SafetensorsFile(model_dir / name))
        except WeightsError as exc:
            unreadable.append(str(exc))
    if unreadable:
        raise WeightsError("; ".join(unreadable))
    return files


def _checkpoint_file_names(model_dir: Path) -> list[str]:
    index_path = model_dir / SHARD_INDEX
    if index_path.exists():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise WeightsError(f"{index_path}: not a safetensors index ({exc})") from None
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (model_dir / name).exists()]
        if missing:
            raise WeightsError(f"{index_path}: shard files missing: {', '.join(missing)}")
        return names
    if (model_dir / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    raise WeightsError(f"{model_dir}: neither {SINGLE_FILE} nor {SHARD_INDEX} found")


def _locate_tensors(model_dir: Path, files: list[SafetensorsFile]) -> dict[str, SafetensorsFile]:
    located: dict[str, SafetensorsFile] = {}
    duplicated: list[str] = []
    for f in files:
        for name in f.names():
            if name in located:
                duplicated.append(f"{name} (in {located[name].path.name} and {f.path.name})")
            located[name] = f
    if duplicated:
        raise WeightsError(f"{model_dir}: tensors stored twice: " + ", ".join(duplicated))
    return located


def _layout_problems(cfg: ModelConfig, expected: dict[str, Shape], found: dict[str, Shape]) -> list[str]:
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected and not _is_ignorable(name, cfg)]
    misshaped = [
        f"{name} is {list(found[name])}, expected {list(shape)}"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: " + ", ".join(missing))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: " + ", ".join(unexpected))
    if misshaped:
        problems.append(f"{len(misshaped)} wrong shape: " + ", ".join(misshaped))
    return problems


@dataclass(frozen=True)
class _NormsAndMLP:
    """What every decoder layer has around its token mixer."""

    input_norm: np.ndarray
    post_norm: np.ndarray
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


@dataclass(frozen=True)
class LayerWeights(_NormsAndMLP):
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: np.ndarray | None  # None for architectures without q/k norm (llama)
    k_norm: np.ndarray | None

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, prefix: str) -> LayerWeights:
        return cls(
            q_proj=ckpt[prefix + "self_attn.q_proj.weight"],
            k_proj=ckpt[prefix + "self_attn.k_proj.weight"],
            v_proj=ckpt[prefix + "self_attn.v_proj.weight"],
            o_proj=ckpt[prefix + "self_attn.o_proj.weight"],
            q_norm=ckpt.get(prefix + "self_attn.q_norm.weight"),
            k_norm=ckpt.get(prefix + "self_attn.k_norm.weight"),
            **_norms_and_mlp(ckpt, prefix),
        )


@dataclass(frozen=True)
class HybridLayerWeights(_NormsAndMLP):
    """A Qwen3.5 decoder layer: its token mixer by layer type, then the MLP. The norms are zero-centred."""

    mixer: LinearAttentionWeights | GatedAttentionWeights

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, prefix: str, layer_type: str) -> HybridLayerWeights:
        mixer = LinearAttentionWeights if layer_type == LINEAR_ATTENTION else GatedAttentionWeights
        return cls(mixer=mixer.from_checkpoint(ckpt, prefix, ckpt.config), **_norms_and_mlp(ckpt, prefix))


def _norms_and_mlp(ckpt: Checkpoint, prefix: str) -> dict[str, Linear]:
    return {
        "input_norm": ckpt[prefix + "input_layernorm.weight"],
        "post_norm": ckpt[prefix + "post_attention_layernorm.weight"],
        "gate_proj": ckpt[prefix + "mlp.gate_proj.weight"],
        "up_proj": ckpt[prefix + "mlp.up_proj.weight"],
        "down_proj": ckpt[prefix + "mlp.down_proj.weight"],
    }


def _layers(ckpt: Checkpoint) -> list[LayerWeights] | list[HybridLayerWeights]:
    cfg = ckpt.config
    prefixes = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)]
    if cfg.is_hybrid:
        return [HybridLayerWeights.from_checkpoint(ckpt, p, cfg.layer_type(i)) for i, p in enumerate(prefixes)]
    return [LayerWeights.from_checkpoint(ckpt, p) for p in prefixes]


def _layer(ckpt: Checkpoint, prefix: str, layer_type: str) -> LayerWeights | HybridLayerWeights:
    if ckpt.config.is_hybrid:
        return HybridLayerWeights.from_checkpoint(ckpt, prefix, layer_type)
    return LayerWeights.from_checkpoint(ckpt, prefix)


@dataclass(frozen=True)
class MTPWeights:
    fc: Linear  # [hidden, 2*hidden]; input is cat(norm_embedding(embed), norm_hidden(h))
    norm_embedding: np.ndarray
    norm_hidden: np.ndarray
    layer: LayerWeights | HybridLayerWeights  # the hybrids' MTP layer is a gated-attention layer
    norm: np.ndarray

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> MTPWeights:
        return cls(
            fc=ckpt["mtp.fc.weight"],
            norm_embedding=ckpt["mtp.pre_fc_norm_embedding.weight"],
            norm_hidden=ckpt["mtp.pre_fc_norm_hidden.weight"],
            layer=_layer(ckpt, "mtp.layers.0.", FULL_ATTENTION),
            norm=ckpt["mtp.norm.weight"],
        )


@dataclass(frozen=True)
class DraftHeadWeights:
    """A reduced-vocabulary output head stored apart from lm_head (a `.ninfer` artifact's, quantized on its
    own): row i scores token token_ids[i]."""

    token_ids: np.ndarray  # distinct full-vocabulary ids
    rows: np.ndarray  # [len(token_ids), hidden]

    def rows_for(self, ids: np.ndarray) -> np.ndarray | None:
        """The stored rows of `ids`, in that order, or None when some id has no stored row."""
        order = np.argsort(self.token_ids, kind="stable")
        at = np.minimum(np.searchsorted(self.token_ids[order], ids), len(order) - 1)
        found = order[at]
        return self.rows[found] if np.array_equal(self.token_ids[found], ids) else None


@dataclass(frozen=True)
class ModelWeights:
    """Structured view of a checkpoint; arrays are the checkpoint's own (bf16, memory-mapped)."""

    config: ModelConfig
    embed: np.ndarray
    layers: list[LayerWeights] | list[HybridLayerWeights]  # HybridLayerWeights for the hybrids
    norm: np.ndarray
    lm_head: Linear  # the embedding array itself when tie_word_embeddings
    mtp: MTPWeights | None
    draft_head: DraftHeadWeights | None = None  # what `--lm-head-draft` scores, when the model ships one

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> ModelWeights:
        cfg = ckpt.config
        embed = ckpt["model.embed_tokens.weight"]
        return cls(
            config=cfg,
            embed=embed,
            layers=_layers(ckpt),
            norm=ckpt["model.norm.weight"],
            lm_head=embed if cfg.tie_word_embeddings else ckpt["lm_head.weight"],
            mtp=MTPWeights.from_checkpoint(ckpt) if cfg.mtp_layers else None,
        )


def load_model_weights(model_dir: str | Path) -> ModelWeights:
    return ModelWeights.from_checkpoint(load_checkpoint(model_dir))
