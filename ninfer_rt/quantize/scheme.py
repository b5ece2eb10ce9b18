"""A checkpoint's ``quantization_config`` (ours, GPTQ, AWQ or block-scaled FP8): the scheme, its stored
tensors, and their conversion when the checkpoint is loaded (into QuantizedWeights; FP8 into bf16 arrays).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ninfer_rt.quantize.format import (
    LAYOUT_DOC,
    QUANT_METHOD,
    SUPPORTED_BITS,
    QuantFormatError,
    QuantizedWeight,
    ScaleFormat,
    Shape,
    check_group_size,
)
from ninfer_rt.quantize.fp8 import SCALE_SUFFIX, from_fp8_blocks, scale_shape
from ninfer_rt.quantize.gptq_awq import from_awq, from_gptq

FP8 = "fp8"


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's ``quantization_config`` says, validated."""

    method: str  # QUANT_METHOD | "gptq" | "awq" | FP8
    bits: int
    group_size: int  # 0 for FP8, which has blocks instead
    zero_stored_minus_one: bool = False  # GPTQ's original format
    block: tuple[int, int] = (0, 0)  # FP8's weight_block_size

    @property
    def marker(self) -> str:
        """The stored suffix whose presence says a linear ``X.weight`` is quantized."""
        return SCALE_SUFFIX if self.method == FP8 else "qweight"

    def tensor_shapes(self, out: int, in_features: int) -> dict[str, Shape]:
        """The stored tensors (suffix -> shape) of one quantized [out, in] linear weight."""
        if self.method == FP8:
            return {"weight": (out, in_features), SCALE_SUFFIX: scale_shape((out, in_features), self.block)}
        groups = in_features // self.group_size
        if self.method == QUANT_METHOD:
            return {"qweight": (out, in_features * self.bits // 8), "scales": (out, groups)}
        if self.method == "gptq":
            return {"qweight": (in_features // 8, out), "qzeros": (groups, out // 8), "scales": (groups, out)}
        return {"qweight": (in_features, out // 8), "qzeros": (groups, out // 8), "scales": (groups, out)}

    def convert(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight | np.ndarray:
        if self.method == FP8:
            return from_fp8_blocks(stored["weight"], stored[SCALE_SUFFIX], self.block)
        if self.method == QUANT_METHOD:
            if stored["scales"].dtype != ScaleFormat.BF16.dtype:  # the checkpoint layout's (LAYOUT_DOC)
                raise QuantFormatError(f"{QUANT_METHOD} scales must be bf16, got {stored['scales'].dtype}")
            return QuantizedWeight(self.bits, self.group_size, stored["qweight"], stored["scales"])
        if self.method == "gptq":
            return from_gptq(
                stored["qweight"], stored["qzeros"], stored["scales"], stored.get("g_idx"), self.group_size,
                self.zero_stored_minus_one,
            )
        return from_awq(stored["qweight"], stored["qzeros"], stored["scales"], self.group_size)


def scheme_from_dir(model_dir: str | Path) -> QuantScheme | None:
    """The checkpoint's quantization scheme, or None for a plain (bf16) checkpoint."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    return None if config is None else scheme_from_config(config)


def scheme_from_config(config: Mapping[str, Any]) -> QuantScheme:
    method = str(config.get("quant_method", "")).lower()
    if method == FP8:
        return QuantScheme(FP8, 8, 0, block=_fp8_block(config))
    bits = int(config.get("bits", config.get("w_bit", 0)))
    group_size = int(config.get("group_size", config.get("q_group_size", 0)))
    if method == QUANT_METHOD:
        if bits not in SUPPORTED_BITS:
            raise QuantFormatError(f"{QUANT_METHOD} checkpoint with bits={bits} (supported: {SUPPORTED_BITS})")
    elif method == "gptq":
        _check_gptq(config, bits)
    elif method == "awq":
        _check_awq(config, bits)
    else:
        raise QuantFormatError(f"quant_method {method!r} is not supported (supported: {QUANT_METHOD}, gptq, awq, {FP8})")
    check_group_size(group_size)
    zero_minus_one = method == "gptq" and str(config.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
    return QuantScheme(method, bits, group_size, zero_minus_one)


def _fp8_block(config: Mapping[str, Any]) -> tuple[int, int]:
    block = config.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantFormatError(f"FP8 with weight_block_size={block!r} is not supported (only block scales, e.g. [128, 128])")
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise QuantFormatError(f"FP8 with fmt={fmt!r} is not supported (only e4m3)")
    return block[0], block[1]


def _check_gptq(config: Mapping[str, Any], bits: int) -> None:
    if bits != 4:
        raise QuantFormatError(f"GPTQ with bits={bits} is not supported (only 4-bit)")
    if config.get("desc_act"):
        raise QuantFormatError("GPTQ with desc_act=true (act-order) is not supported")
    if not config.get("sym", True):
        raise QuantFormatError("GPTQ with sym=false (asymmetric) is not supported")


def _check_awq(config: Mapping[str, Any], bits: int) -> None:
    if bits != 4:
        raise QuantFormatError(f"AWQ with bits={bits} is not supported (only 4-bit)")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantFormatError(f"AWQ version {version!r} is not supported (only the GEMM layout)")


def quantized_layout(
    scheme: QuantScheme, expected: Mapping[str, Shape], found: Mapping[str, Shape]
) -> tuple[dict[str, Shape], list[str]]:
    """(expected tensors of the stored checkpoint, names of the linear weights stored quantized).

    A linear ``X.weight`` counts as quantized when ``X.qweight`` (FP8: ``X.weight_scale_inv``) is stored, so
    checkpoints that keep some modules in bf16 (lm_head, modules_to_not_convert) load too. Embeddings are
    never quantized."""
    stored: dict[str, Shape] = {}
    quantized: list[str] = []  # in checkpoint order, so a refusal names the first offending tensor
    for name, shape in expected.items():
        base = name.removesuffix(".weight")
        if len(shape) != 2 or f"{base}.{scheme.marker}" not in found or name == "model.embed_tokens.weight":
            stored[name] = shape
            continue
        quantized.append(name)
        if scheme.group_size and shape[1] % scheme.group_size:
            stored[name] = shape  # reported as a misshapen weight; the kernels need whole groups
            continue
        stored.update({f"{base}.{suffix}": s for suffix, s in scheme.tensor_shapes(*shape).items()})
        if scheme.method == "gptq" and f"{base}.g_idx" in found:
            stored[f"{base}.g_idx"] = (shape[1],)
    return stored, quantized


def convert_quantized(
    scheme: QuantScheme, tensors: Mapping[str, np.ndarray], quantized: Sequence[str]
) -> dict[str, np.ndarray | QuantizedWeight]:
    """Stored tensors -> name -> array, with each quantized linear converted under X.weight (a QuantizedWeight;
    FP8: a bf16 array)."""
    out: dict[str, np.ndarray | QuantizedWeight] = {}
    consumed: set[str] = set()
    for name in quantized:
        base = name.removesuffix(".weight")
        prefix = base + "."
        stored = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix) and "." not in key[len(prefix):]}
        consumed.update(prefix + suffix for suffix in stored)
        try:
            out[name] = scheme.convert(stored)
        except QuantFormatError as err:
            raise QuantFormatError(f"{base}: {err}") from None
    out.update({name: value for name, value in tensors.items() if name not in consumed})
    return out


def quantization_config(bits: int, group_size: int, lm_head: bool) -> dict[str, Any]:
    """The ``quantization_config`` block ``ninfer-rt quantize`` writes into config.json."""
    return {
        "quant_method": QUANT_METHOD,
        "bits": bits,
        "group_size": group_size,
        "sym": True,
        "lm_head": lm_head,
        "layout": LAYOUT_DOC,
    }
