"""The Qwen3.5 hybrid's two token mixers as checkpoint tensors: names, shapes and the load-time reshapes.

A Gated DeltaNet layer keeps ``in_proj_qkv`` fused: one GEMM gives the [q | k | v] channels the causal conv
runs over (and whose last pre-conv columns are the conv state); q, k and v are column slices of the conv's
output. The conv weight [channels, 1, kernel] is viewed as [channels, kernel]. A gated-attention layer's
``q_proj`` interleaves per head [q_h | gate_h]; it is split at load into q rows and gate rows. Norm gains are
kept as stored: the zero-centred ones are applied as (1 + w) in f32 by the math, never folded into bf16.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.hybrid_config import LinearAttentionConfig
from ninfer_rt.model.quant import LAYOUT_ROWS, Linear, QuantizedWeight
from ninfer_rt.model.safetensors_file import Shape


def linear_attention_tensors(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    """The ``linear_attn.*`` tensors of one Gated DeltaNet layer (linear weights are [out, in])."""
    linear = _linear_config(cfg)
    hidden = cfg.hidden_size
    tensors: dict[str, Shape] = {
        "in_proj_qkv.weight": (linear.conv_channels, hidden),
        "in_proj_z.weight": (linear.value_dim, hidden),
        "in_proj_b.weight": (linear.num_value_heads, hidden),
        "in_proj_a.weight": (linear.num_value_heads, hidden),
        "conv1d.weight": (linear.conv_channels, 1, linear.conv_kernel_size),
        "A_log": (linear.num_value_heads,),
        "dt_bias": (linear.num_value_heads,),
        "norm.weight": (linear.value_head_dim,),
        "out_proj.weight": (hidden, linear.value_dim),
    }
    return {f"{prefix}linear_attn.{name}": shape for name, shape in tensors.items()}


def gated_attention_tensors(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    """The ``self_attn.*`` tensors of one gated-attention layer: q_proj holds q and gate rows per head."""
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    tensors: dict[str, Shape] = {
        "q_proj.weight": (2 * q_dim, cfg.hidden_size),
        "k_proj.weight": (kv_dim, cfg.hidden_size),
        "v_proj.weight": (kv_dim, cfg.hidden_size),
        "o_proj.weight": (cfg.hidden_size, q_dim),
        "q_norm.weight": (cfg.head_dim,),
        "k_norm.weight": (cfg.head_dim,),
    }
    return {f"{prefix}self_attn.{name}": shape for name, shape in tensors.items()}


@dataclass(frozen=True)
class LinearAttentionWeights:
    """One Gated DeltaNet layer. Per value head h: beta = sigmoid(in_proj_b x), g = -exp(A_log) *
    softplus(in_proj_a x + dt_bias); the output norm is a plain-weight RMSNorm over value_head_dim."""

    in_proj_qkv: Linear  # [conv_channels, hidden], rows [q (key_dim) | k (key_dim) | v (value_dim)]
    in_proj_z: Linear  # [value_dim, hidden]: the output gate, silu(z)
    in_proj_b: Linear  # [value heads, hidden]
    in_proj_a: Linear  # [value heads, hidden]
    conv_weight: np.ndarray  # [conv_channels, kernel], depthwise, no bias
    A_log: np.ndarray  # [value heads]
    dt_bias: np.ndarray  # [value heads]
    norm: np.ndarray  # [value_head_dim], applied as w (not 1 + w)
    out_proj: Linear  # [hidden, value_dim]

    @classmethod
    def from_checkpoint(cls, ckpt: Mapping[str, Linear], prefix: str, cfg: ModelConfig) -> LinearAttentionWeights:
        p = prefix + "linear_attn."
        conv = ckpt[p + "conv1d.weight"]
        assert isinstance(conv, np.ndarray)
        channels, _, kernel = conv.shape
        return cls(
            in_proj_qkv=ckpt[p + "in_proj_qkv.weight"],
            in_proj_z=ckpt[p + "in_proj_z.weight"],
            in_proj_b=ckpt[p + "in_proj_b.weight"],
            in_proj_a=ckpt[p + "in_proj_a.weight"],
            conv_weight=conv.reshape(channels, kernel),
            A_log=_array(ckpt[p + "A_log"]),
            dt_bias=_array(ckpt[p + "dt_bias"]),
            norm=_array(ckpt[p + "norm.weight"]),
            out_proj=ckpt[p + "out_proj.weight"],
        )


@dataclass(frozen=True)
class GatedAttentionWeights:
    """One gated-attention layer: o_proj(attention(q, k, v) * sigmoid(gate_proj x)), q/k norms zero-centred."""

    q_proj: Linear  # [heads * head_dim, hidden]
    gate_proj: Linear  # [heads * head_dim, hidden]
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: np.ndarray  # [head_dim], applied as (1 + w)
    k_norm: np.ndarray

    @classmethod
    def from_checkpoint(cls, ckpt: Mapping[str, Linear], prefix: str, cfg: ModelConfig) -> GatedAttentionWeights:
        p = prefix + "self_attn."
        q_proj, gate_proj = split_query_gate(ckpt[p + "q_proj.weight"], cfg.num_attention_heads, cfg.head_dim)
        return cls(
            q_proj=q_proj,
            gate_proj=gate_proj,
            k_proj=ckpt[p + "k_proj.weight"],
            v_proj=ckpt[p + "v_proj.weight"],
            o_proj=ckpt[p + "o_proj.weight"],
            q_norm=_array(ckpt[p + "q_norm.weight"]),
            k_norm=_array(ckpt[p + "k_norm.weight"]),
        )


def split_query_gate(q_proj: Linear, num_heads: int, head_dim: int) -> tuple[Linear, Linear]:
    """Rows per head [q_h | gate_h] -> (the q rows, the gate rows), each [num_heads * head_dim, ...].

    The halves are copies: every other block of head_dim rows is not a 2-D view numpy can keep."""
    if isinstance(q_proj, QuantizedWeight):
        if q_proj.layout != LAYOUT_ROWS:
            raise ValueError(f"q_proj in layout {q_proj.layout!r} cannot be split (only {LAYOUT_ROWS!r})")
        qweight = _interleaved_halves(q_proj.qweight, num_heads, head_dim)
        scales = _interleaved_halves(q_proj.scales, num_heads, head_dim)
        return replace(q_proj, qweight=qweight[0], scales=scales[0]), replace(q_proj, qweight=qweight[1], scales=scales[1])
    return _interleaved_halves(q_proj, num_heads, head_dim)


def _interleaved_halves(rows: np.ndarray, num_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    per_head = rows.reshape(num_heads, 2, head_dim, *rows.shape[1:])
    out_shape = (num_heads * head_dim, *rows.shape[1:])
    return (
        np.ascontiguousarray(per_head[:, 0]).reshape(out_shape),
        np.ascontiguousarray(per_head[:, 1]).reshape(out_shape),
    )


def _linear_config(cfg: ModelConfig) -> LinearAttentionConfig:
    if cfg.linear_attention is None:
        raise ValueError(f"{cfg.architecture} has no linear-attention layers")
    return cfg.linear_attention


def _array(tensor: Linear) -> np.ndarray:
    assert isinstance(tensor, np.ndarray), "norms, gains and biases are never quantized"
    return tensor
