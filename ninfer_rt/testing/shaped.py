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
from ninfer_rt.model.weights import SHARD_INDEX, Shape, expected_tensors
from ninfer_rt.testing.tiny import (
    ENDOFTEXT, IM_END, WEIGHT_STD, TinyModelSpec, config_json, trained_tokenizer, write_json, write_tokenizer_files,
)

SHAPED_MAX_POSITIONS = 131072  # the agent replay's conversations reach ~115k tokens
BPE_VOCAB = 512  # the tiny model's trained tokenizer: every replay word (trace.WORDS) is one token in it
RANDOM_ELEMENTS = 67_108_859  # a prime (2^26 - 5): 128 MB of bf16 values, cycled through by every matrix
SHARD_BYTES = 4 << 30  # about Hugging Face's shard size
BF16 = np.dtype(ml_dtypes.bfloat16)


def make_shaped_model(out_dir: str | Path, shape: Mapping[str, int], seed: int = 0) -> Path:
    """Writes a random-weight qwen3 checkpoint of `shape` (Hugging Face config field -> value, as in
    ninfer_rt.model.shapes.SHAPES) to `out_dir`. config.json is written last: a directory that has it is
    complete."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = _spec(shape, seed)
    ids = write_tokenizer_files(out, filler_tokenizer(spec.vocab), spec.max_positions)
    config = config_json(spec, bos_id=ids[ENDOFTEXT], eos_id=ids[IM_END])
    write_random_weights(out, ModelConfig.from_dict(config), seed, zero_logit_rows=BPE_VOCAB)
    write_json(out / "config.json", config)
    return out


def _spec(shape: Mapping[str, int], seed: int) -> TinyModelSpec:
    return TinyModelSpec(
        arch="qwen3", hidden=shape["hidden_size"], layers=shape["num_hidden_layers"],
        heads=shape["num_attention_heads"], kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
        intermediate=shape["intermediate_size"], vocab=shape["vocab_size"], tie=False, seed=seed,
        max_positions=SHAPED_MAX_POSITIONS,
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
    """A cyclic sequence of N(0, WEIGHT_STD) bf16 values; a tensor is a window of it."""

    def __init__(self, seed: int, elements: int = RANDOM_ELEMENTS) -> None:
        rng = np.random.default_rng(seed)
        values = rng.standard_normal(elements, dtype=np.float32)
        values *= WEIGHT_STD
        self._bytes = memoryview(values.astype(BF16).view(np.uint8))
        self.elements = elements

    def write(self, f: BinaryIO, start: int, count: int) -> None:
        """Writes `count` values of the sequence from element `start`, wrapping around its end."""
        position = start % self.elements
        while count:
            take = min(count, self.elements - position)
            f.write(self._bytes[2 * position : 2 * (position + take)])
            count -= take
            position = 0


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: Shape
    start: int  # where its window of the random sequence begins
    zero_rows: int = 0  # leading rows written as zeros (lm_head's BPE rows)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * BF16.itemsize

    def write(self, f: BinaryIO, source: RandomSource) -> None:
        if len(self.shape) == 1:  # RMSNorm gains
            f.write(np.ones(self.shape, BF16).tobytes())
            return
        row = int(np.prod(self.shape[1:]))  # a conv weight [channels, 1, kernel] too
        f.write(bytes(self.zero_rows * row * BF16.itemsize))
        source.write(f, self.start, (self.shape[0] - self.zero_rows) * row)


def write_random_weights(out: Path, cfg: ModelConfig, seed: int, zero_logit_rows: int = 0,
                         shard_bytes: int = SHARD_BYTES) -> None:
    """Sharded safetensors and their index for `cfg`, the shards written in parallel threads."""
    source = RandomSource(seed)
    starts = np.random.default_rng(seed + 1).integers(source.elements, size=len(expected_tensors(cfg)))
    tensors = [
        _Tensor(name, shape, int(start), zero_logit_rows if name == "lm_head.weight" else 0)
        for (name, shape), start in zip(expected_tensors(cfg).items(), starts)
    ]
    shards = _shards(tensors, shard_bytes)
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    with ThreadPoolExecutor(max_workers=min(len(shards), os.cpu_count() or 1)) as pool:
        # list(): re-raise the first failed shard's exception here
        list(pool.map(lambda name, shard: _write_safetensors(out / name, shard, source), names, shards))
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


def _write_safetensors(path: Path, tensors: list[_Tensor], source: RandomSource) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": "BF16", "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header so the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors:
            tensor.write(f, source)
