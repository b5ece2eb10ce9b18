"""Random-weight checkpoints of a real model's shape (qwen3-8b: 16 GB), written in seconds, for GPU replays.

The layout is make_tiny_model's (config.json, sharded bf16 safetensors with an index, tokenizer files with
the ChatML template), with three differences that matter at this size and for an agent replay:

- No weight is drawn one by one. Every matrix is a window of one cyclic sequence of N(0, 0.02) bf16 values,
  starting at a random place; the sequence's length is a prime, so no two rows of a matrix are equal (not
  even in the 1.2 GB embedding, which wraps around it). Files are written straight from that buffer.
  Norm gains are 1.0, so activations stay O(1..10) in bf16 through 36 layers.
- The tokenizer is the tiny model's trained byte-level BPE (every replay word stays one token) followed by
  "filler" tokens `<t{id}>` up to vocab_size. Fillers are added tokens, matched before BPE, and prefix-free
  (each ends with '>'), so any sequence of them decodes to text that encodes back to the same ids.
- lm_head rows of the BPE part (specials and markup included) are zero: their logit is 0 while the top 20
  fillers' are over three standard deviations above it, so under the checkpoint's own sampling
  (generation_config: top-k 20, which `serve` applies when a request sets none) the model emits fillers
  only. Every reply then comes back in the next turn's prompt as the ids it was generated as, and the prefix
  cache hits across turns as it would with a real model. It also never emits EOS or markup, so replies run
  to max_tokens and the chat structure is the trace's. (Without top-k, about 0.3% of sampled tokens are
  BPE ones; a lone byte of a multi-byte character, for one, decodes to U+FFFD and does not round-trip.)

A hybrid shape (qwen3.6-27b) is written as a `qwen3_5_text` checkpoint; its zero-centred norm gains are
0 (a gain of 1). With `bits`, every weight `ninfer-rt quantize` would quantize is written directly in the
groupwise format (quantize/format.py: uniform random codes, one scale per bits that gives the bf16 weights'
standard deviation), never as a bf16 copy: the bf16 27B checkpoint is ~54 GB, the int4 one ~17 GB.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np
from tokenizers import AddedToken, Tokenizer

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.shapes import HYBRID_MAX_POSITIONS, hybrid_text_config, is_hybrid_shape
from ninfer_rt.model.weights import SHARD_INDEX, Shape, expected_tensors
from ninfer_rt.quantize.format import check_group_size
from ninfer_rt.quantize.scheme import quantization_config
from ninfer_rt.quantize_checkpoint.writer import quantized_names
from ninfer_rt.testing.tiny import (
    ENDOFTEXT, IM_END, WEIGHT_STD, TinyModelSpec, config_json, trained_tokenizer, write_json, write_tokenizer_files,
)

SHAPED_MAX_POSITIONS = 131072  # a dense shape's: the agent replay's conversations reach ~115k tokens
BPE_VOCAB = 512  # the tiny model's trained tokenizer: every replay word (trace.WORDS) is one token in it
RANDOM_ELEMENTS = 67_108_859  # a prime (2^26 - 5): 128 MB of bf16 values, cycled through by every matrix
SHARD_BYTES = 4 << 30  # about Hugging Face's shard size
BF16 = np.dtype(ml_dtypes.bfloat16)
U8 = np.dtype(np.uint8)
SAFETENSORS_DTYPE = {BF16: "BF16", U8: "U8"}
GROUP_SIZE = 128


@dataclass(frozen=True)
class Quantized:
    """Weights written in the groupwise format: `bits` per weight, a bf16 scale per `group_size` inputs."""

    bits: int
    group_size: int = GROUP_SIZE

    @property
    def scale(self) -> float:
        """Uniform codes over 2^bits levels have standard deviation ~2^bits / sqrt(12) steps."""
        return WEIGHT_STD / (2**self.bits / 12**0.5)


def make_shaped_model(
    out_dir: str | Path, shape: Mapping[str, int | float], seed: int = 0, quantized: Quantized | None = None
) -> Path:
    """Writes a random-weight checkpoint of `shape` (Hugging Face config field -> value, as in
    ninfer_rt.model.shapes.SHAPES) to `out_dir`, groupwise-int where `quantized` says. config.json is
    written last: a directory that has it is complete."""
    if quantized is not None:
        check_group_size(quantized.group_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = _spec(shape, seed)
    ids = write_tokenizer_files(out, filler_tokenizer(spec.vocab), spec.max_positions)
    if is_hybrid_shape(shape):
        config = hybrid_text_config(shape) | {
            "max_position_embeddings": spec.max_positions, "bos_token_id": ids[ENDOFTEXT], "eos_token_id": ids[IM_END],
        }
    else:
        config = config_json(spec, bos_id=ids[ENDOFTEXT], eos_id=ids[IM_END])
    if quantized is not None:
        config["quantization_config"] = quantization_config(quantized.bits, quantized.group_size, lm_head=False)
    write_random_weights(out, ModelConfig.from_dict(config), seed, zero_logit_rows=BPE_VOCAB, quantized=quantized)
    write_json(out / "config.json", config)
    return out


def _spec(shape: Mapping[str, int | float], seed: int) -> TinyModelSpec:
    sizes = {key: int(value) for key, value in shape.items()}
    return TinyModelSpec(
        arch="qwen3", hidden=sizes["hidden_size"], layers=sizes["num_hidden_layers"],
        heads=sizes["num_attention_heads"], kv_heads=sizes["num_key_value_heads"], head_dim=sizes["head_dim"],
        intermediate=sizes["intermediate_size"], vocab=sizes["vocab_size"], tie=False, seed=seed,
        max_positions=HYBRID_MAX_POSITIONS if is_hybrid_shape(shape) else SHAPED_MAX_POSITIONS,
    )


def filler_token(token_id: int) -> str:
    return f"<t{token_id}>"


def filler_tokenizer(vocab_size: int) -> Tokenizer:
    """The trained BPE (ids 0..BPE_VOCAB-1) plus filler tokens for every id up to `vocab_size`."""
    if vocab_size <= BPE_VOCAB:
        raise ValueError(f"vocab_size must exceed the {BPE_VOCAB} BPE tokens, got {vocab_size}")
    tokenizer = trained_tokenizer(BPE_VOCAB)
    fillers = [AddedToken(filler_token(i), special=False, normalized=False) for i in range(BPE_VOCAB, vocab_size)]
    tokenizer.add_tokens(fillers)
    return tokenizer


# -- weights -------------------------------------------------------------------------------------------------


class RandomSource:
    """A cyclic sequence of random values (N(0, WEIGHT_STD) bf16, or uniform bytes: int4/int8 codes); a
    tensor is a window of it."""

    def __init__(self, seed: int, elements: int = RANDOM_ELEMENTS, dtype: np.dtype = BF16) -> None:
        rng = np.random.default_rng(seed)
        if dtype == U8:
            values = rng.integers(0, 256, elements, dtype=np.uint8)
        else:
            values = (rng.standard_normal(elements, dtype=np.float32) * WEIGHT_STD).astype(BF16)
        self._bytes = memoryview(values.view(np.uint8))
        self.itemsize = values.itemsize
        self.elements = elements

    def write(self, f: BinaryIO, start: int, count: int) -> None:
        """Writes `count` values of the sequence from element `start`, wrapping around its end."""
        position, size = start % self.elements, self.itemsize
        while count:
            take = min(count, self.elements - position)
            f.write(self._bytes[size * position : size * (position + take)])
            count -= take
            position = 0


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: Shape
    start: int  # where its window of the random sequence of its dtype begins
    dtype: np.dtype = BF16
    constant: float | None = None  # every value (norm gains, groupwise scales) instead of a random window
    zero_rows: int = 0  # leading rows written as zeros (lm_head's BPE rows)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def write(self, f: BinaryIO, sources: Mapping[np.dtype, RandomSource]) -> None:
        if self.constant is not None:
            f.write(np.full(self.shape, self.constant, self.dtype).tobytes())
            return
        row = int(np.prod(self.shape[1:]))  # a conv weight [channels, 1, kernel] too
        f.write(bytes(self.zero_rows * row * self.dtype.itemsize))
        sources[self.dtype].write(f, self.start, (self.shape[0] - self.zero_rows) * row)


def planned_tensors(cfg: ModelConfig, seed: int, zero_logit_rows: int = 0, quantized: Quantized | None = None) -> list[_Tensor]:
    """Every tensor of `cfg`'s checkpoint, in order: 1-D ones are norm gains (1.0, or 0.0 where the model
    applies 1 + w) and the hybrids' A_log / dt_bias (1.0); the weights `ninfer-rt quantize` quantizes are
    codes and scales when `quantized`."""
    expected = expected_tensors(cfg)
    names = set(quantized_names(expected, quantize_lm_head=False)) if quantized is not None else set()
    starts = iter(np.random.default_rng(seed + 1).integers(RANDOM_ELEMENTS, size=2 * len(expected)).tolist())
    tensors = []
    for name, shape in expected.items():
        if len(shape) == 1:
            zero_centred = cfg.zero_centered_norms and name.endswith("norm.weight") and ".linear_attn." not in name
            tensors.append(_Tensor(name, shape, 0, constant=0.0 if zero_centred else 1.0))
        elif name in names:
            (out, in_features), base = shape, name.removesuffix(".weight")
            codes = (out, in_features * quantized.bits // 8)
            tensors.append(_Tensor(f"{base}.qweight", codes, next(starts), U8))
            tensors.append(_Tensor(f"{base}.scales", (out, in_features // quantized.group_size), 0, constant=quantized.scale))
        else:
            tensors.append(_Tensor(name, shape, next(starts), zero_rows=zero_logit_rows if name == "lm_head.weight" else 0))
    return tensors


def write_random_weights(out: Path, cfg: ModelConfig, seed: int, zero_logit_rows: int = 0,
                         shard_bytes: int = SHARD_BYTES, quantized: Quantized | None = None) -> None:
    """Sharded safetensors and their index for `cfg`, the shards written in parallel threads."""
    sources = {BF16: RandomSource(seed)}
    if quantized is not None:
        sources[U8] = RandomSource(seed + 2, dtype=U8)
    tensors = planned_tensors(cfg, seed, zero_logit_rows, quantized)
    shards = _shards(tensors, shard_bytes)
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    with ThreadPoolExecutor(max_workers=min(len(shards), os.cpu_count() or 1)) as pool:
        # list(): re-raise the first failed shard's exception here
        list(pool.map(lambda name, shard: _write_safetensors(out / name, shard, sources), names, shards))
    weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
    total_size = sum(t.nbytes for t in tensors)
    write_json(out / SHARD_INDEX, {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _shards(tensors: list[_Tensor], shard_bytes: int) -> list[list[_Tensor]]:
    """Consecutive tensors, each shard at most `shard_bytes` unless one tensor alone is bigger."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def _write_safetensors(path: Path, tensors: list[_Tensor], sources: Mapping[np.dtype, RandomSource]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": SAFETENSORS_DTYPE[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header so the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors:
            tensor.write(f, sources)
