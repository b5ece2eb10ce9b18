"""Safetensors checkpoints (single file or sharded) as memory-mapped numpy arrays, checked against the config.

The safetensors header is parsed here rather than through ``safe_open(framework="numpy")`` because numpy
has no bfloat16 and ``safe_open`` copies every tensor; ``np.memmap`` + ml_dtypes gives bf16 views with no copy.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.quantize.format import Linear, QuantFormatError
from ninfer_rt.quantize.scheme import convert_quantized, quantized_layout, scheme_from_dir

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
}

# A header bigger than this is a corrupt length prefix, not a real header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class WeightsError(ValueError):
    """The checkpoint's files are unreadable or do not match the config; lists every problem at once."""


Shape = tuple[int, ...]


def expected_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor name and shape of the Hugging Face layout for ``cfg`` (linear weights are [out, in])."""
    expected: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        expected.update(_decoder_layer_tensors(cfg, f"model.layers.{i}."))
    expected["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if cfg.mtp_layers:
        expected["mtp.fc.weight"] = (cfg.hidden_size, 2 * cfg.hidden_size)
        expected["mtp.pre_fc_norm_embedding.weight"] = (cfg.hidden_size,)
        expected["mtp.pre_fc_norm_hidden.weight"] = (cfg.hidden_size,)
        expected.update(_decoder_layer_tensors(cfg, "mtp.layers.0."))
        expected["mtp.norm.weight"] = (cfg.hidden_size,)
    return expected


def _decoder_layer_tensors(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
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
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # some tied checkpoints store the tied copy anyway
    return name.startswith("mtp.") and not cfg.mtp_layers


@dataclass(frozen=True)
class _TensorLocation:
    dtype: np.dtype
    shape: Shape
    begin: int  # absolute byte offsets in the file
    end: int


class SafetensorsFile:
    """One memory-mapped ``.safetensors`` file; tensors are zero-copy views of the mapping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._locations = _read_header(path)
        self._mapping = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else None

    def names(self) -> list[str]:
        return list(self._locations)

    def shape(self, name: str) -> Shape:
        return self._locations[name].shape

    def tensor(self, name: str) -> np.ndarray:
        loc = self._locations[name]
        if loc.begin == loc.end:
            return np.zeros(loc.shape, dtype=loc.dtype)
        # np.asarray drops the np.memmap subclass (whose arithmetic results stay memmaps); still no copy
        return np.asarray(self._mapping[loc.begin : loc.end]).view(loc.dtype).reshape(loc.shape)


def _read_header(path: Path) -> dict[str, _TensorLocation]:
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightsError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise WeightsError(f"{path}: truncated or corrupt safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{path}: corrupt safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    locations = {name: _tensor_location(path, name, entry, data_start) for name, entry in header.items()}
    data_end = max((loc.end for loc in locations.values()), default=data_start)
    if data_end > file_size:
        raise WeightsError(
            f"{path}: truncated safetensors file ({file_size} bytes, its header needs {data_end} bytes)"
        )
    return locations


def _tensor_location(path: Path, name: str, entry: dict, data_start: int) -> _TensorLocation:
    dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise WeightsError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
    shape = tuple(int(d) for d in entry["shape"])
    begin, end = (int(o) for o in entry["data_offsets"])
    if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise WeightsError(f"{path}: tensor {name} has {end - begin} bytes for shape {list(shape)} {dtype}")
    return _TensorLocation(dtype=dtype, shape=shape, begin=data_start + begin, end=data_start + end)


class Checkpoint(Mapping[str, Linear]):
    """Name -> array as stored (bf16 stays ml_dtypes.bfloat16, memory-mapped), plus the model config.
    A quantized linear weight is a QuantizedWeight under its plain name (``...q_proj.weight``)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, Linear]) -> None:
        self.config = config
        self._tensors = tensors

    def __getitem__(self, name: str) -> Linear:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def load_checkpoint(model_dir: str | Path, config: ModelConfig | None = None) -> Checkpoint:
    """Maps every safetensors file of ``model_dir`` and checks names and shapes against the config.

    Raises :class:`WeightsError` listing all missing, unexpected and mis-shaped tensors together.
    """
    model_dir = Path(model_dir)
    cfg = config or ModelConfig.from_dir(model_dir)
    files = _open_files(model_dir)
    located = _locate_tensors(model_dir, files)
    found = {name: f.shape(name) for name, f in located.items()}
    try:
        scheme = scheme_from_dir(model_dir)
        expected, quantized = quantized_layout(scheme, expected_tensors(cfg), found) if scheme else (expected_tensors(cfg), [])
        problems = _layout_problems(cfg, expected, found)
        if problems:
            raise WeightsError(f"{model_dir}: checkpoint does not match config.json: " + "; ".join(problems))
        tensors = {name: located[name].tensor(name) for name in expected}
        # Quantized linears become QuantizedWeight (imports converted to the project's layout here).
        return Checkpoint(cfg, convert_quantized(scheme, tensors, quantized) if scheme else tensors)
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
class LayerWeights:
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: np.ndarray | None  # None for architectures without q/k norm (llama)
    k_norm: np.ndarray | None
    input_norm: np.ndarray
    post_norm: np.ndarray
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, prefix: str) -> LayerWeights:
        return cls(
            q_proj=ckpt[prefix + "self_attn.q_proj.weight"],
            k_proj=ckpt[prefix + "self_attn.k_proj.weight"],
            v_proj=ckpt[prefix + "self_attn.v_proj.weight"],
            o_proj=ckpt[prefix + "self_attn.o_proj.weight"],
            q_norm=ckpt.get(prefix + "self_attn.q_norm.weight"),
            k_norm=ckpt.get(prefix + "self_attn.k_norm.weight"),
            input_norm=ckpt[prefix + "input_layernorm.weight"],
            post_norm=ckpt[prefix + "post_attention_layernorm.weight"],
            gate_proj=ckpt[prefix + "mlp.gate_proj.weight"],
            up_proj=ckpt[prefix + "mlp.up_proj.weight"],
            down_proj=ckpt[prefix + "mlp.down_proj.weight"],
        )


@dataclass(frozen=True)
class MTPWeights:
    fc: Linear  # [hidden, 2*hidden]; input is cat(norm_embedding(embed), norm_hidden(h))
    norm_embedding: np.ndarray
    norm_hidden: np.ndarray
    layer: LayerWeights
    norm: np.ndarray

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> MTPWeights:
        return cls(
            fc=ckpt["mtp.fc.weight"],
            norm_embedding=ckpt["mtp.pre_fc_norm_embedding.weight"],
            norm_hidden=ckpt["mtp.pre_fc_norm_hidden.weight"],
            layer=LayerWeights.from_checkpoint(ckpt, "mtp.layers.0."),
            norm=ckpt["mtp.norm.weight"],
        )


@dataclass(frozen=True)
class ModelWeights:
    """Structured view of a checkpoint; arrays are the checkpoint's own (bf16, memory-mapped)."""

    config: ModelConfig
    embed: np.ndarray
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: Linear  # the embedding array itself when tie_word_embeddings
    mtp: MTPWeights | None

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> ModelWeights:
        cfg = ckpt.config
        embed = ckpt["model.embed_tokens.weight"]
        return cls(
            config=cfg,
            embed=embed,
            layers=[LayerWeights.from_checkpoint(ckpt, f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)],
            norm=ckpt["model.norm.weight"],
            lm_head=embed if cfg.tie_word_embeddings else ckpt["lm_head.weight"],
            mtp=MTPWeights.from_checkpoint(ckpt) if cfg.mtp_layers else None,
        )


def load_model_weights(model_dir: str | Path) -> ModelWeights:
    return ModelWeights.from_checkpoint(load_checkpoint(model_dir))
