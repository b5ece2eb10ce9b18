"""Writing a quantized checkpoint: a bf16 checkpoint -> the project's groupwise int4/int8 checkpoint.

Every linear weight of the decoder layers (and of the MTP module) is quantized; embeddings and norms stay
bf16, and so does lm_head unless asked (a tied lm_head is then stored as its own quantized matrix and the
config unties it). In the Qwen3.5 hybrids the Gated DeltaNet's conv weight, A_log and dt_bias stay as
stored, and so do in_proj_a / in_proj_b: one row per value head (48 of 10,000+ rows in the 27B layer),
whose outputs set the decay exp(g) and the write strength beta that every later token of the recurrence
inherits, so a rounding error there compounds instead of averaging out. Tensors are written under the
input checkpoint's own names (``model.language_model.*`` for a vision-language one). The output directory gets the tokenizer/generation files of the input, safetensors
shards, and config.json with a ``quantization_config`` that documents the layout. It streams: one tensor is
read (memory-mapped), quantized in row chunks and written at a time, so memory stays that of one tensor's
working set whatever the checkpoint's size (tools/bench_quantize_memory.py measures it). It is built in a
temporary sibling directory and renamed into place, so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.weights import SHARD_INDEX, Checkpoint, load_checkpoint, stored_name
from ninfer_rt.quantize_checkpoint.calibration import input_hessians
from ninfer_rt.quantize.format import BF16, SUPPORTED_BITS, QuantFormatError, QuantizedWeight, check_group_size
from ninfer_rt.quantize.quantizer import quantize
from ninfer_rt.quantize.scheme import quantization_config, scheme_from_dir
from ninfer_rt.quantize_checkpoint.shard_writer import PlannedTensor, plan_shards, write_shard

SHARD_BYTES = 2 << 30
COPY_CHUNK_BYTES = 64 << 20  # bytes of a pass-through tensor copied between page releases
QUANTIZE_ROWS = 4096  # rows of a matrix quantized at once (4096 x 17408 float32: 285 MB)
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
KEPT_AS_STORED = ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")  # module docstring says why


def quantized_names(shapes: dict[str, tuple[int, ...]], quantize_lm_head: bool) -> list[str]:
    """The weights to quantize: every 2-D weight but the embedding and the hybrids' gate projections, and
    lm_head only when asked."""
    return [
        name for name, shape in shapes.items()
        if len(shape) == 2 and name != EMBEDDING and (name != LM_HEAD or quantize_lm_head)
        and not name.endswith(KEPT_AS_STORED)
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
        planned = _planned_tensors(cfg, tensors, set(names), bits, group_size)
        _write_shards(staging, planned, _tensor_parts(checkpoint, tensors, set(names), bits, group_size, hessians))
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


def _planned_tensors(
    cfg: ModelConfig, tensors: dict[str, np.ndarray], names: set[str], bits: int, group_size: int
) -> list[PlannedTensor]:
    """The output tensors, in order, under the stored names: what _tensor_parts will produce."""
    planned: list[PlannedTensor] = []
    for name, tensor in tensors.items():
        stored = stored_name(cfg, name)
        if name not in names:
            planned.append(PlannedTensor(stored, tensor.dtype, tensor.shape))
            continue
        out, in_features = tensor.shape
        base = stored.removesuffix(".weight")
        planned.append(PlannedTensor(f"{base}.qweight", np.dtype(np.uint8), (out, in_features * bits // 8)))
        planned.append(PlannedTensor(f"{base}.scales", BF16, (out, in_features // group_size)))
    return planned


def _tensor_parts(
    checkpoint: Checkpoint, tensors: dict[str, np.ndarray], names: set[str], bits: int, group_size: int,
    hessians: dict[str, np.ndarray],
) -> Iterator[np.ndarray]:
    """The bytes of _planned_tensors in order: a pass-through tensor as mapped row chunks, a quantized one as
    qweight row chunks then its scales. Quantizing QUANTIZE_ROWS rows at a time (groups lie along the input, so rows are
    independent) bounds the float32 working set whatever the matrix; the pages each tensor mapped are
    released after it. GPTQ (with a hessian) runs on the whole matrix, as calibrated models are small."""
    progress = tqdm(tensors.items(), desc=f"quantizing to int{bits}", unit="tensor", disable=not sys.stderr.isatty())
    for name, tensor in progress:
        if name not in names:  # in row chunks too: an embedding alone is 2.5 GB in the 27B model
            rows = max(1, COPY_CHUNK_BYTES // max(1, tensor[:1].nbytes))
            for start in range(0, len(tensor), rows):
                yield tensor[start : start + rows]
                checkpoint.release_pages()
        else:
            hessian = hessians.get(name)
            step = len(tensor) if hessian is not None else QUANTIZE_ROWS
            scales = []
            for start in range(0, len(tensor), step):
                weight: QuantizedWeight = quantize(tensor[start : start + step], bits, group_size, hessian)
                scales.append(weight.scales)
                yield weight.qweight
            yield np.concatenate(scales)
        checkpoint.release_pages()


def _write_shards(out: Path, planned: list[PlannedTensor], parts: Iterator[np.ndarray]) -> None:
    """Shards of about SHARD_BYTES each, streamed (shard_writer.py), and the index mapping tensors to shards."""
    shards = plan_shards(planned, SHARD_BYTES)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_shard(out / file_name, shard, parts)
        weight_map.update(dict.fromkeys((t.name for t in shard), file_name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in planned)}, "weight_map": weight_map}
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
