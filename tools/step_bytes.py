"""Bytes a batch-1 decode step of a model reads and writes, the roofline's numerator (tools/bench_decode.py):
every weight of the main model once in its format, one embedding row, the context's K/V in the
full-attention layers, and a hybrid's Gated DeltaNet states (each linear layer's slot read and written
back: the f32 recurrent state and the bf16 conv window).

Weight formats as `ninfer-rt quantize` leaves them by default: with `weight_bits` 4 or 8 every layer
projection is groupwise-int (codes + a bf16 scale per 128 inputs) except in_proj_a/b; embedding and
lm_head bf16. Norm gains and the linear layers' parameters (conv taps, A_log, dt_bias) are read as f32,
as the CUDA executor prepares them. The MTP module is not part of a plain decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.weights import expected_tensors
from ninfer_rt.quantize_checkpoint.writer import EMBEDDING, quantized_names

QUANT_GROUP = 128


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int
    states: int  # read + written

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.states


def weight_bytes(cfg: ModelConfig, weight_bits: int = 16) -> int:
    main = {name: shape for name, shape in expected_tensors(cfg).items() if not name.startswith("mtp.")}
    quantized = set(quantized_names(main, quantize_lm_head=False)) if weight_bits < 16 else set()
    total = 2 * cfg.hidden_size  # the step's embedding row
    for name, shape in main.items():
        elements = int(np.prod(shape))
        if name == EMBEDDING:
            continue
        if name in quantized:
            total += elements * weight_bits // 8 + elements // QUANT_GROUP * 2
        elif len(shape) == 2:
            total += 2 * elements
        else:  # gains, conv taps, A_log, dt_bias: f32
            total += 4 * elements
    return total


def kv_bytes(cfg: ModelConfig, context: int, kv_dtype: str) -> int:
    """K and V of `context` tokens in every full-attention layer (int8: a f32 scale per token and head)."""
    element, scale = (1, 4) if kv_dtype == "int8" else (2, 0)
    per_token = 2 * cfg.num_key_value_heads * (cfg.head_dim * element + scale)
    return per_token * context * len(cfg.full_attention_layers)


def state_bytes(cfg: ModelConfig) -> int:
    """Every linear layer's slot read and written: f32 [Hv, dk, dv] state + bf16 [C, kernel - 1] window."""
    if cfg.linear_attention is None:
        return 0
    la = cfg.linear_attention
    recurrent = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
    channels = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    window = channels * (la.conv_kernel_size - 1) * 2
    return 2 * (recurrent + window) * len(cfg.linear_attention_layers)


def step_bytes(cfg: ModelConfig, context: int, kv_dtype: str, weight_bits: int = 16) -> StepBytes:
    return StepBytes(weight_bytes(cfg, weight_bits), kv_bytes(cfg, context, kv_dtype), state_bytes(cfg))
