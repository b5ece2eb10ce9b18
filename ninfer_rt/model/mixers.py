"""The token mixers a decoder layer can have, prepared: full attention over the paged KV and linear
attention (Gated DeltaNet) over per-sequence recurrent states. `mix` is the layer's part between its first
RMSNorm and its residual add; the executor ops it calls declare the caches they read and write."""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import (
    AttentionParams,
    AttentionShape,
    Executor,
    LinearAttentionParams,
    PagedKV,
    RecurrentStates,
    Tensor,
    WeightRole,
)


@dataclass(frozen=True)
class Caches:
    """The per-sequence device state a step reads and writes: KV pages, and linear-attention states."""

    kv: PagedKV
    states: RecurrentStates | None = None


@dataclass(frozen=True)
class PreparedAttention:
    qkv: Tensor  # rows: q heads, k heads, v heads (then gate heads when params.output_gate)
    params: AttentionParams
    o_proj: Tensor
    kv_layer: int  # this layer's index in the KV cache (full-attention layers only are counted)

    def mix(self, executor: Executor, normed: Tensor, caches: Caches) -> Tensor:
        attended = executor.attention(executor.linear(normed, self.qkv), self.params, caches.kv, self.kv_layer)
        return executor.linear(attended, self.o_proj)


@dataclass(frozen=True)
class PreparedLinearAttention:
    # rows [q | k | v | z | b | a], one weight even where the parts' formats differ (a quantized checkpoint
    # keeps in_proj_b / in_proj_a as stored): the executor multiplies it as one projection
    in_proj: Tensor
    params: LinearAttentionParams
    out_proj: Tensor
    state_layer: int  # this layer's index among the linear-attention layers (its part of a state slot)

    def mix(self, executor: Executor, normed: Tensor, caches: Caches) -> Tensor:
        if caches.states is None:
            raise ValueError("a linear-attention layer needs the sequences' recurrent states")
        projected = executor.linear(normed, self.in_proj)
        mixed = executor.linear_attention(projected, self.params, caches.states, self.state_layer)
        return executor.linear(mixed, self.out_proj)


Mixer = PreparedAttention | PreparedLinearAttention


def attention_shape(cfg: ModelConfig) -> AttentionShape:
    return AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps)


def norm_role(cfg: ModelConfig) -> WeightRole:
    """The hybrids store RMSNorm gains as w and apply (1 + w); the dense models apply w."""
    return WeightRole.ZERO_CENTRED_NORM if cfg.zero_centered_norms else WeightRole.NORM
