"""Hugging Face ``config.json`` -> :class:`ModelConfig`: the dense architectures and the Qwen3.5 hybrids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ninfer_rt.model.config_error import ModelConfigError
from ninfer_rt.model.hybrid_config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    LinearAttentionConfig,
    layer_types_of,
    linear_attention_of,
    partial_rotary_factor_of,
    refuse_mixture_of_experts,
    refuse_unsupported_hybrid_features,
    text_config_of,
)

__all__ = ["ModelConfig", "ModelConfigError", "RopeScaling", "LinearAttentionConfig", "SUPPORTED_ARCHITECTURES"]


@dataclass(frozen=True)
class _ArchitectureTraits:
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    default_head_dim: int | None  # what transformers assumes when config.json omits head_dim; None = hidden/heads
    hybrid: bool = False  # the Qwen3.5 family: Gated DeltaNet + gated attention layers, zero-centred norms


_QWEN3_5 = _ArchitectureTraits(qk_norm=True, default_head_dim=256, hybrid=True)

SUPPORTED_ARCHITECTURES: dict[str, _ArchitectureTraits] = {
    "Qwen3ForCausalLM": _ArchitectureTraits(qk_norm=True, default_head_dim=128),
    "LlamaForCausalLM": _ArchitectureTraits(qk_norm=False, default_head_dim=None),
    "Qwen3_5ForCausalLM": _QWEN3_5,
    "Qwen3_5ForConditionalGeneration": _QWEN3_5,  # vision-language checkpoint; ninfer-rt runs its text model
}

SUPPORTED_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters with Hugging Face's names; defaults already resolved as transformers resolves them,
    except the attention factor, whose default depends on mscale/mscale_all_dim (see ``rope.py``)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    mtp_layers: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    attention_bias: bool = False
    # The hybrids' fields; the defaults describe the dense architectures.
    layer_types: tuple[str, ...] = ()  # per layer linear_attention | full_attention; () = all full attention
    linear_attention: LinearAttentionConfig | None = None  # Gated DeltaNet sizes (hybrids only)
    attention_output_gate: bool = False  # q_proj rows per head [q | gate]; output * sigmoid(gate) before o_proj
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim dims of each head
    zero_centered_norms: bool = False  # RMSNorm gains are stored as w and applied as (1 + w), in f32

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        return self.linear_attention is not None

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == LINEAR_ATTENTION)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"{path}: no config.json in the model directory") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = text_config_of(raw)
        refuse_mixture_of_experts(raw)
        architecture = _single_architecture(raw)
        traits = SUPPORTED_ARCHITECTURES[architecture]
        _refuse_unsupported_features(raw, architecture, traits)
        hidden_size = _required_int(raw, "hidden_size")
        num_heads = _required_int(raw, "num_attention_heads")
        head_dim = int(raw.get("head_dim") or traits.default_head_dim or hidden_size // num_heads)
        max_position_embeddings = int(raw.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _rope(raw, max_position_embeddings)
        cfg = cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            vocab_size=_required_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_hidden_layers=_required_int(raw, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=traits.qk_norm,
            mtp_layers=int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 0),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            **(_hybrid_fields(raw, head_dim) if traits.hybrid else {}),
        )
        _check_consistency(cfg)
        return cfg


def _single_architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        named = ", ".join(architectures) if architectures else "none declared"
        raise ModelConfigError(f"unsupported architecture ({named}); ninfer-rt supports {supported}")
    return architectures[0]


def _hybrid_fields(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    refuse_unsupported_hybrid_features(raw)
    return {
        "layer_types": layer_types_of(raw, _required_int(raw, "num_hidden_layers")),
        "linear_attention": linear_attention_of(raw),
        "attention_output_gate": True,
        "partial_rotary_factor": partial_rotary_factor_of(raw, head_dim),
        "zero_centered_norms": True,
    }


def _refuse_unsupported_features(raw: dict[str, Any], architecture: str, traits: _ArchitectureTraits) -> None:
    # Each of these would silently change the math if ignored, so refuse instead of running a wrong model.
    if raw.get("attention_bias"):
        raise ModelConfigError(f"{architecture} with attention_bias=true is not supported")
    if raw.get("mlp_bias"):
        raise ModelConfigError(f"{architecture} with mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ModelConfigError(f"{architecture} with use_sliding_window=true is not supported")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelConfigError(f"{architecture} with hidden_act={hidden_act!r} is not supported (only 'silu')")
    if not traits.hybrid and float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError(f"{architecture} with partial_rotary_factor != 1 is not supported")


def _rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """Reads both HF layouts: legacy ``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters``."""
    # transformers lets a legacy rope_scaling dict win over rope_parameters; rope_theta inside the dict wins.
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope type {rope_type!r}; ninfer-rt supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    # A top-level original_max_position_embeddings wins over the rope dict's, as in transformers (Phi3 layout).
    original_max = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_position_embeddings
    )
    factor = params.get("factor")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(factor) if factor is not None else max_position_embeddings / original_max,
        original_max_position_embeddings=original_max,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=_optional_float(params.get("attention_factor")),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
    )
    return rope_theta, scaling


def _check_consistency(cfg: ModelConfig) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelConfigError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.mtp_layers > 1:
        raise ModelConfigError(f"{cfg.mtp_layers} MTP layers declared; ninfer-rt supports at most one")
    if cfg.head_dim % 2:
        raise ModelConfigError(f"head_dim={cfg.head_dim} must be even for RoPE")


def _required_int(raw: dict[str, Any], key: str) -> int:
    if key not in raw:
        raise ModelConfigError(f"config.json lacks required field {key!r}")
    return int(raw[key])


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
