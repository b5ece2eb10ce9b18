"""`ninfer-rt quantize`: a bf16 checkpoint -> the project's groupwise int4/int8 checkpoint (model/quant.py).

Every linear weight of the decoder layers (and of the MTP module) is quantized; embeddings and norms stay
bf16, and so does lm_head unless --quantize-lm-head (a tied lm_head is then stored as its own quantized
matrix and the config unties it). The output directory gets the tokenizer/generation files of the input,
safetensors shards, and config.json with a ``quantization_config`` that documents the layout. It is built
in a temporary sibling directory and renamed into place, so an interrupted run leaves nothing half-written.

With --calibration-text, windows of that text run through the numpy executor first; each linear layer's
mean x x^T (over its inputs) then weights the scale search and drives GPTQ's choice of codes (model/quant.py).
Layers the forward never runs (the MTP module, an untied lm_head) keep the weight-only scale search.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import click
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from ninfer_rt.cli_errors import BadUsage, OneLineErrors as _OneLineErrors
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.cache import KVCache, KVSpec
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import StepBatch, WeightRole
from ninfer_rt.model.layers import forward, prepare_model
from ninfer_rt.model.quant import (
    SUPPORTED_BITS,
    Linear,
    QuantFormatError,
    QuantizedWeight,
    check_group_size,
    quantization_config,
    quantize,
    scheme_from_dir,
)
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.model.weights import SHARD_INDEX, load_checkpoint, load_model_weights

SHARD_BYTES = 2 << 30
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
CALIBRATION_WINDOW = 512  # tokens per calibration sequence
# The checkpoint weights behind each matrix prepare_layer (model/layers.py) builds: they share its input.
PREPARED_INPUTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def quantized_names(shapes: dict[str, tuple[int, ...]], quantize_lm_head: bool) -> list[str]:
    """The weights to quantize: every 2-D weight but the embedding, and lm_head only when asked."""
    return [
        name for name, shape in shapes.items()
        if len(shape) == 2 and name != EMBEDDING and (name != LM_HEAD or quantize_lm_head)
    ]


def quantize_checkpoint(
    model_dir: Path,
    out_dir: Path,
    bits: int,
    group_size: int,
    quantize_lm_head: bool = False,
    force: bool = False,
    calibration_text: str | None = None,
    calibration_tokens: int = 32768,
) -> Path:
    """Writes the quantized checkpoint of ``model_dir`` to ``out_dir``; raises ValueError on bad input."""
    _check_request(model_dir, out_dir, bits, group_size, force)
    hessians = {} if calibration_text is None else input_hessians(model_dir, calibration_text, calibration_tokens)
    checkpoint = load_checkpoint(model_dir)
    cfg = checkpoint.config
    tensors = dict(checkpoint.items())
    if quantize_lm_head and cfg.tie_word_embeddings:
        tensors[LM_HEAD] = tensors[EMBEDDING]  # untied: the embedding stays bf16, the head is quantized
    names = quantized_names({name: t.shape for name, t in tensors.items()}, quantize_lm_head)
    misfit = [name for name in names if tensors[name].shape[1] % group_size]
    if misfit:
        raise QuantFormatError(
            f"{misfit[0]} has {tensors[misfit[0]].shape[1]} inputs, not a multiple of --group-size {group_size}"
        )
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        _write_shards(staging, _stored_tensors(tensors, set(names), bits, group_size, hessians))
        _copy_side_files(model_dir, staging)
        _write_config(model_dir, staging, bits, group_size, quantize_lm_head)
        _apply_umask(staging)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _check_request(model_dir: Path, out_dir: Path, bits: int, group_size: int, force: bool) -> None:
    if bits not in SUPPORTED_BITS:
        raise QuantFormatError(f"--bits {bits} is not supported (choose {' or '.join(map(str, SUPPORTED_BITS))})")
    check_group_size(group_size)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: not a model directory (no config.json)")
    if scheme_from_dir(model_dir) is not None:
        raise ValueError(f"--model {model_dir}: already quantized (its config.json has a quantization_config)")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must differ from --model")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ValueError(f"--out {out_dir}: not empty (pass --force to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)


def _stored_tensors(
    tensors: dict[str, np.ndarray], names: set[str], bits: int, group_size: int, hessians: dict[str, np.ndarray]
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) in the stored layout, quantizing as it goes (one matrix in float32 at a time)."""
    progress = tqdm(tensors.items(), desc=f"quantizing to int{bits}", unit="tensor", disable=not sys.stderr.isatty())
    for name, tensor in progress:
        if name not in names:
            yield name, np.ascontiguousarray(tensor)
            continue
        weight: QuantizedWeight = quantize(tensor, bits, group_size, hessians.get(name))
        base = name.removesuffix(".weight")
        yield f"{base}.qweight", weight.qweight
        yield f"{base}.scales", weight.scales


class _InputRecorder(NumpyExecutor):
    """The numpy executor, also summing x^T x of every linear layer's input by the weight it multiplies."""

    def __init__(self, streams: StreamSet) -> None:
        super().__init__(streams)
        self.names: dict[int, str] = {}  # id(prepared weight) -> its prepare_weight name
        self.sums: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}

    def prepare_weight(self, name: str, parts: Sequence[Linear], role: WeightRole) -> np.ndarray:
        prepared = super().prepare_weight(name, parts, role)
        self.names[id(prepared)] = name
        return prepared

    def linear(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        name = self.names[id(weight)]
        x64 = np.asarray(x, np.float64)  # float64 sums: thousands of rows without losing the small channels
        self.sums[name] = self.sums.get(name, 0.0) + x64.T @ x64
        self.rows[name] = self.rows.get(name, 0) + x.shape[0]
        return super().linear(x, weight)


def input_hessians(model_dir: Path, text_path: str, tokens: int) -> dict[str, np.ndarray]:
    """Checkpoint weight name -> mean x x^T of its inputs over up to ``tokens`` tokens of the text, run in
    windows of CALIBRATION_WINDOW through the numpy executor (the reference forward)."""
    ids = np.asarray(Tokenizer(model_dir).encode(Path(text_path).read_text()), dtype=np.int32)[:tokens]
    if len(ids) < CALIBRATION_WINDOW:
        raise ValueError(f"--calibration-text {text_path}: {len(ids)} tokens, fewer than one {CALIBRATION_WINDOW}-token window")
    weights = load_model_weights(model_dir)
    cfg = weights.config
    streams = StreamSet(None)
    recorder = _InputRecorder(streams)
    model = prepare_model(recorder, weights)
    kv = KVCache(streams, KVSpec(
        num_pages=-(-CALIBRATION_WINDOW // 16), num_layers=cfg.num_hidden_layers, n_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, dtype="bf16", page_size=16,
    ))
    for start in range(0, len(ids) - CALIBRATION_WINDOW + 1, CALIBRATION_WINDOW):
        forward(recorder, model, _window_batch(ids[start:start + CALIBRATION_WINDOW], kv.spec.page_size), kv)
    return {
        f"model.{prepared.rsplit('.', 1)[0]}.{module}.weight": total / recorder.rows[prepared]
        for prepared, total in recorder.sums.items()
        if prepared.rsplit(".", 1)[-1] in PREPARED_INPUTS
        for module in PREPARED_INPUTS[prepared.rsplit(".", 1)[-1]]
    }


def _window_batch(tokens: np.ndarray, page_size: int) -> StepBatch:
    """One fresh sequence prefilled in one step on pages 0, 1, ...; only its last row's logits."""
    positions = np.arange(len(tokens), dtype=np.int32)
    return StepBatch(
        token_ids=tokens,
        positions=positions,
        query_start=np.array([0, len(tokens)], np.int32),
        context_lens=np.array([len(tokens)], np.int32),
        block_tables=np.arange(-(-len(tokens) // page_size), dtype=np.int32)[None, :],
        slot_mapping=positions,  # consecutive pages from 0: slot == position
        logit_rows=positions[-1:],
        lanes=("calibration",),
    )


def _write_shards(out: Path, tensors: Iterator[tuple[str, np.ndarray]]) -> None:
    """Shards of about SHARD_BYTES each and the index that maps every tensor to its shard."""
    weight_map: dict[str, str] = {}
    shard: dict[str, np.ndarray] = {}
    total = 0

    def flush() -> None:
        file_name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        shard.clear()

    for name, array in tensors:
        shard[name] = array
        total += array.nbytes
        if sum(a.nbytes for a in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _copy_side_files(model_dir: Path, out: Path) -> None:
    """Tokenizer, chat template, generation config...: everything but the weights and config.json."""
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (SHARD_INDEX, "config.json"):
            shutil.copy2(path, out / path.name)


def _write_config(model_dir: Path, out: Path, bits: int, group_size: int, quantize_lm_head: bool) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = quantization_config(bits, group_size, quantize_lm_head)
    if quantize_lm_head:
        raw["tie_word_embeddings"] = False
    ModelConfig.from_dict(raw)  # the written config must load
    (out / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")


def _apply_umask(directory: Path) -> None:
    """mkdtemp makes the directory private (0700); the result gets ordinary permissions, as cp would."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Moves the finished staging directory to out_dir; an existing out_dir is removed only after."""
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    retired = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
    os.rename(out_dir, retired / out_dir.name)
    os.rename(staging, out_dir)
    shutil.rmtree(retired)


@click.command("quantize", cls=_OneLineErrors)
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path), help="bf16 model directory.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Output directory.")
@click.option("--bits", default=4, show_default=True, type=click.Choice(["4", "8"]), help="Bits per weight.")
@click.option("--group-size", default=128, show_default=True, type=int, help="Inputs per scale (power of two >= 32).")
@click.option("--quantize-lm-head", is_flag=True, help="Quantize lm_head too (embeddings always stay bf16).")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@click.option("--calibration-text", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Text whose activations weight the scale search and drive GPTQ (numpy forward: small models).")
@click.option("--calibration-tokens", default=32768, show_default=True, type=click.IntRange(min=1),
              help="Tokens of --calibration-text used.")
def quantize_command(
    model_dir: Path, out_dir: Path, bits: str, group_size: int, quantize_lm_head: bool, force: bool,
    calibration_text: str | None, calibration_tokens: int,
) -> None:
    """Quantize a checkpoint's linear weights to symmetric groupwise int4/int8 with bf16 scales."""
    try:
        quantize_checkpoint(
            model_dir, out_dir, int(bits), group_size, quantize_lm_head, force, calibration_text, calibration_tokens
        )
    except ValueError as err:  # bad flags, an unreadable or unsuitable checkpoint
        raise BadUsage(str(err)) from None
    click.echo(f"wrote int{bits} (group {group_size}) checkpoint to {out_dir}")
