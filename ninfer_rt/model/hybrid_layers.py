"""The Qwen3.5 hybrid's two mixers, prepared from checkpoint weights (model/hybrid_weights.py).

Gated attention: q, k, v and the gate rows fuse into one matrix [q | k | v | gate] (the gate rows were split
out of q_proj's per-head [q_h | gate_h] interleave at load); q/k norms are zero-centred, RoPE turns the first
rotary_dim dims of each head, the output is multiplied by sigmoid(gate). Gated DeltaNet: in_proj_qkv,
in_proj_z, in_proj_b and in_proj_a fuse into one matrix [q | k | v | z | b | a], so the two 48-row
projections ride along with the big one instead of running alone. A quantized checkpoint keeps b and a as
stored (bf16): the projection is still one weight whose parts have different formats, and each executor
decides how to multiply it (the CUDA one in a single GEMV launch); the conv taps, A_log, dt_bias and the
output norm's gain are read at f32 or wider (WeightRole.PARAMETER).
"""

from __future__ import annotations

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import AttentionParams, Executor, LinearAttentionParams, LinearAttentionShape, Tensor, WeightRole
from ninfer_rt.model.hybrid_weights import GatedAttentionWeights, LinearAttentionWeights
from ninfer_rt.model.mixers import Mixer, PreparedAttention, PreparedLinearAttention, attention_shape


def linear_attention_shape(cfg: ModelConfig) -> LinearAttentionShape:
    linear = cfg.linear_attention
    if linear is None:
        raise ValueError(f"{cfg.architecture} has no linear-attention layers")
    return LinearAttentionShape(
        num_key_heads=linear.num_key_heads,
        num_value_heads=linear.num_value_heads,
        key_head_dim=linear.key_head_dim,
        value_head_dim=linear.value_head_dim,
        conv_kernel=linear.conv_kernel_size,
        norm_eps=cfg.rms_norm_eps,
    )


def prepare_gated_attention(
    executor: Executor, cfg: ModelConfig, rope: Tensor, weights: GatedAttentionWeights, name: str, kv_layer: int
) -> PreparedAttention:
    def prepare(suffix: str, role: WeightRole, *parts: object) -> Tensor:
        return executor.prepare_weight(f"{name}.{suffix}", parts, role)

    return PreparedAttention(
        qkv=prepare("qkv", WeightRole.LINEAR, weights.q_proj, weights.k_proj, weights.v_proj, weights.gate_proj),
        params=AttentionParams(
            shape=attention_shape(cfg),
            rope=rope,
            q_norm=prepare("q_norm", WeightRole.ZERO_CENTRED_NORM, weights.q_norm),
            k_norm=prepare("k_norm", WeightRole.ZERO_CENTRED_NORM, weights.k_norm),
            rotary_dim=cfg.rotary_dim,
            output_gate=True,
        ),
        o_proj=prepare("o_proj", WeightRole.LINEAR, weights.o_proj),
        kv_layer=kv_layer,
    )


def prepare_linear_attention(
    executor: Executor, cfg: ModelConfig, weights: LinearAttentionWeights, name: str, state_layer: int
) -> PreparedLinearAttention:
    def prepare(suffix: str, role: WeightRole, *parts: object) -> Tensor:
        return executor.prepare_weight(f"{name}.{suffix}", parts, role)

    return PreparedLinearAttention(
        in_proj=prepare(
            "in_proj", WeightRole.LINEAR, weights.in_proj_qkv, weights.in_proj_z, weights.in_proj_b, weights.in_proj_a
        ),
        params=LinearAttentionParams(
            shape=linear_attention_shape(cfg),
            conv_weight=prepare("conv", WeightRole.PARAMETER, weights.conv_weight),
            a_log=prepare("A_log", WeightRole.PARAMETER, weights.A_log),
            dt_bias=prepare("dt_bias", WeightRole.PARAMETER, weights.dt_bias),
            norm=prepare("linear_norm", WeightRole.PARAMETER, weights.norm),
        ),
        out_proj=prepare("out_proj", WeightRole.LINEAR, weights.out_proj),
        state_layer=state_layer,
    )


def prepare_mixer(
    executor: Executor, cfg: ModelConfig, rope: Tensor, weights: GatedAttentionWeights | LinearAttentionWeights,
    name: str, cache_index: int,
) -> Mixer:
    if isinstance(weights, LinearAttentionWeights):
        return prepare_linear_attention(executor, cfg, weights, name, cache_index)
    return prepare_gated_attention(executor, cfg, rope, weights, name, cache_index)
