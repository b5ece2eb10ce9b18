"""The Qwen3.5/3.6 hybrid family's config.json (``qwen3_5``, ``qwen3_5_text``): layer pattern, Gated DeltaNet
sizes, partial RoPE, and what the family has that ninfer-rt does not run (the MoE variant).

Read as transformers' ``Qwen3_5TextConfig`` / ``Qwen3_5Config`` read it, defaults included. Two things the
config carries are deliberately not read:
- ``attn_output_gate`` and ``output_gate_type``: the gates are fixed by the architecture (attention output
  * sigmoid(gate), Gated DeltaNet norm * silu(z)); transformers reads neither field, and the published
  ``output_gate_type: "swish"`` describes the DeltaNet gate, not the attention one.
- ``mrope_section`` / ``mrope_interleaved``: multimodal RoPE gives each of the rotary frequency pairs a
  position from the temporal, height or width grid. For text every token's three positions are the same
  integer (transformers expands one ``position_ids`` row to all three), so the recomposed cos/sin equal
  plain 1-D RoPE over the first ``rotary_dim`` dims with the usual inverse frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer_rt.model.config_error import ModelConfigError

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)

MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# Qwen3_5TextConfig's defaults, used when config.json omits the field
DEFAULT_FULL_ATTENTION_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_LINEAR_ATTENTION = {
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Sizes of a Gated DeltaNet layer. ``in_proj_qkv`` rows (and the conv channels) are [q | k | v]."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the causal depthwise conv: all of q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def value_heads_per_key_head(self) -> int:
        """Value head j reads key head j // this."""
        return self.num_value_heads // self.num_key_heads

    @property
    def conv_state_columns(self) -> int:
        """Pre-conv columns a sequence carries between steps (the conv window minus the current token)."""
        return self.conv_kernel_size - 1

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """The fp32 recurrent state of one sequence in one layer: [value heads, dk, dv]."""
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a composite (vision-language) config, or ``raw`` itself if it is not one."""
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict):
        raise ModelConfigError("config.json field 'text_config' is not an object")
    merged = {key: raw[key] for key in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype") if key in raw}
    merged.update(text)
    merged["architectures"] = raw.get("architectures")
    merged["model_type"] = raw.get("model_type", text.get("model_type"))
    # transformers ties lm_head through the top-level config of the composite model (default: untied)
    merged["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    return merged


def refuse_mixture_of_experts(raw: dict[str, Any]) -> None:
    """The MoE sibling shares the family's names; say so rather than 'unsupported architecture'."""
    model_type = raw.get("model_type")
    if model_type in MOE_MODEL_TYPES:
        raise ModelConfigError(
            f"model_type {model_type!r} (the mixture-of-experts Qwen3.5) is not supported; "
            "ninfer-rt runs the dense qwen3_5 hybrids"
        )


def refuse_unsupported_hybrid_features(raw: dict[str, Any]) -> None:
    # Each would change the math if ignored.
    if raw.get("num_experts"):
        raise ModelConfigError(f"num_experts={raw['num_experts']}: mixture-of-experts MLPs are not supported")
    if raw.get("mtp_use_dedicated_embeddings"):
        raise ModelConfigError("mtp_use_dedicated_embeddings=true is not supported (the MTP layer shares the embedding)")


def layer_types_of(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types`` as given, else every ``full_attention_interval``-th layer full (as transformers)."""
    given = raw.get("layer_types")
    if given is None:
        interval = int(raw.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
        if interval < 1:
            raise ModelConfigError(f"full_attention_interval={interval} must be at least 1")
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
    if len(given) != num_layers:
        raise ModelConfigError(f"layer_types has {len(given)} entries for num_hidden_layers={num_layers}")
    for i, kind in enumerate(given):
        if kind not in LAYER_TYPES:
            raise ModelConfigError(
                f"layer_types[{i}]={kind!r} is not supported (only {', '.join(LAYER_TYPES)})"
            )
    return tuple(given)


def linear_attention_of(raw: dict[str, Any]) -> LinearAttentionConfig:
    sizes = {key: int(raw.get(key, default)) for key, default in DEFAULT_LINEAR_ATTENTION.items()}
    for key, value in sizes.items():
        if value < 1:
            raise ModelConfigError(f"{key}={value} must be positive")
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise ModelConfigError(
            f"linear_num_value_heads={sizes['linear_num_value_heads']} is not a multiple of "
            f"linear_num_key_heads={sizes['linear_num_key_heads']}"
        )
    return LinearAttentionConfig(
        num_key_heads=sizes["linear_num_key_heads"],
        num_value_heads=sizes["linear_num_value_heads"],
        key_head_dim=sizes["linear_key_head_dim"],
        value_head_dim=sizes["linear_value_head_dim"],
        conv_kernel_size=sizes["linear_conv_kernel_dim"],
    )


def partial_rotary_factor_of(raw: dict[str, Any], head_dim: int) -> float:
    """The rotated fraction of head_dim: ``rope_parameters`` first, then the top-level field (as transformers)."""
    params = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)))
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise ModelConfigError(
            f"partial_rotary_factor={factor} with head_dim={head_dim} gives {rotary_dim} rotary dims; "
            "they must be even and at least 2"
        )
    return factor
