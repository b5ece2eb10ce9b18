"""Device bytes of a model's weights in a given format, from its config alone (no checkpoint needed).

What `ninfer-rt quantize` leaves by default: every decoder-layer projection in groupwise int (codes at
bits/8 bytes a weight plus one bf16 scale per group), the Gated DeltaNet's in_proj_a / in_proj_b, conv taps,
A_log, dt_bias and every norm as stored (bf16), the embedding and lm_head bf16 (tied: one matrix). Used to
plan memory for a device the model has not been loaded on (kv/memory_plan.py); a loaded engine measures
what is free instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.model.config import ModelConfig

BF16 = 2


@dataclass(frozen=True)
class WeightFormat:
    bits: int | None = None  # None: bf16 projections
    group_size: int = 128

    def projection_bytes(self, rows: int, cols: int) -> int:
        if self.bits is None:
            return rows * cols * BF16
        return rows * cols * self.bits // 8 + rows * (cols // self.group_size) * BF16


def _attention_matrices(cfg: ModelConfig) -> list[tuple[int, int]]:
    q_rows = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attention_output_gate else 1)
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    h = cfg.hidden_size
    return [(q_rows, h), (kv_rows, h), (kv_rows, h), (h, cfg.num_attention_heads * cfg.head_dim)]


def _layer_bytes(cfg: ModelConfig, layer_type: str, fmt: WeightFormat) -> int:
    h, i = cfg.hidden_size, cfg.intermediate_size
    matrices = [(i, h), (i, h), (h, i)]  # gate, up, down
    stored = 2 * h  # input and post-attention norms
    linear = cfg.linear_attention
    if layer_type == "linear_attention" and linear is not None:
        matrices += [(linear.conv_channels, h), (linear.value_dim, h), (h, linear.value_dim)]
        stored += 2 * linear.num_value_heads * h  # in_proj_a, in_proj_b stay as stored
        stored += linear.conv_channels * linear.conv_kernel_size + 2 * linear.num_value_heads + linear.value_head_dim
    else:
        matrices += _attention_matrices(cfg)
        stored += 2 * cfg.head_dim if cfg.qk_norm or cfg.is_hybrid else 0
    return sum(fmt.projection_bytes(r, c) for r, c in matrices) + stored * BF16


def weight_bytes(cfg: ModelConfig, fmt: WeightFormat = WeightFormat()) -> int:
    """Every weight the engine uploads: decoder layers, the MTP module, embedding, lm_head, final norm."""
    layers = sum(_layer_bytes(cfg, cfg.layer_type(i), fmt) for i in range(cfg.num_hidden_layers))
    mtp = 0
    if cfg.mtp_layers:
        mtp = _layer_bytes(cfg, "full_attention", fmt) + fmt.projection_bytes(cfg.hidden_size, 2 * cfg.hidden_size)
        mtp += 3 * cfg.hidden_size * BF16
    table = cfg.vocab_size * cfg.hidden_size * BF16
    heads = table if cfg.tie_word_embeddings else 2 * table
    return layers + mtp + heads + cfg.hidden_size * BF16
