"""The dense Qwen3/Llama forward, written once against the Executor interface (CPU and GPU run this code).

Preparation decides which matrices exist: q/k/v are fused into one `qkv` matrix and gate/up into one
`gate_up` matrix, so a step runs one projection GEMM per group; each executor converts/uploads them its own
way through `prepare_weight`. A step is: embed; per layer rmsnorm (fused residual add), qkv, attention
(q/k norm, RoPE, KV write, paged causal attention), o_proj, rmsnorm, gate_up, SwiGLU, down; final norm;
lm_head for the step's logit rows only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import AttentionParams, AttentionShape, Executor, PagedKV, StepBatch, Tensor
from ninfer_rt.model.quant import Linear
from ninfer_rt.model.rope import rope_attention_scaling, rope_inv_freq
from ninfer_rt.model.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class PreparedLayer:
    input_norm: Tensor
    qkv: Tensor  # rows: q heads, k heads, v heads
    attention: AttentionParams
    o_proj: Tensor
    post_norm: Tensor
    gate_up: Tensor  # rows: gate, then up
    down: Tensor


@dataclass(frozen=True)
class PreparedModel:
    config: ModelConfig
    embed: Tensor
    layers: list[PreparedLayer]
    norm: Tensor
    lm_head: Tensor  # the embed tensor itself when the embeddings are tied
    rope: Tensor


@dataclass(frozen=True)
class ForwardOutput:
    hidden: Tensor  # [rows, hidden]: final-normed hidden states of every row (the MTP module's input)
    logits: Tensor  # [len(logit_rows), vocab]


def attention_shape(cfg: ModelConfig) -> AttentionShape:
    return AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps)


def prepare_layer(
    executor: Executor, cfg: ModelConfig, rope: Tensor, weights: LayerWeights, name: str
) -> PreparedLayer:
    def prepare(suffix: str, *parts: Linear) -> Tensor:
        return executor.prepare_weight(f"{name}.{suffix}", parts)

    has_qk_norm = weights.q_norm is not None
    return PreparedLayer(
        input_norm=prepare("input_norm", weights.input_norm),
        qkv=prepare("qkv", weights.q_proj, weights.k_proj, weights.v_proj),
        attention=AttentionParams(
            shape=attention_shape(cfg),
            rope=rope,
            q_norm=prepare("q_norm", weights.q_norm) if has_qk_norm else None,
            k_norm=prepare("k_norm", weights.k_norm) if has_qk_norm else None,
        ),
        o_proj=prepare("o_proj", weights.o_proj),
        post_norm=prepare("post_norm", weights.post_norm),
        gate_up=prepare("gate_up", weights.gate_proj, weights.up_proj),
        down=prepare("down", weights.down_proj),
    )


def prepare_model(executor: Executor, weights: ModelWeights) -> PreparedModel:
    cfg = weights.config
    rope = executor.prepare_rope(rope_inv_freq(cfg), rope_attention_scaling(cfg))
    embed = executor.prepare_weight("embed", [weights.embed])
    return PreparedModel(
        config=cfg,
        embed=embed,
        layers=[
            prepare_layer(executor, cfg, rope, layer, f"layers.{i}") for i, layer in enumerate(weights.layers)
        ],
        norm=executor.prepare_weight("norm", [weights.norm]),
        lm_head=embed if cfg.tie_word_embeddings else executor.prepare_weight("lm_head", [weights.lm_head]),
        rope=rope,
    )


def decoder_layer(
    executor: Executor,
    layer: PreparedLayer,
    eps: float,
    x: Tensor,
    residual: Tensor | None,
    kv: PagedKV,
    kv_layer: int,
) -> tuple[Tensor, Tensor]:
    """One pre-norm decoder layer; returns (layer output, residual) with the final residual add deferred
    to the next rmsnorm, which fuses it."""
    normed, residual = executor.rmsnorm(x, layer.input_norm, eps, residual)
    attended = executor.attention(executor.linear(normed, layer.qkv), layer.attention, kv, kv_layer)
    x = executor.linear(attended, layer.o_proj)
    normed, residual = executor.rmsnorm(x, layer.post_norm, eps, residual)
    x = executor.linear(executor.silu_mul(executor.linear(normed, layer.gate_up)), layer.down)
    return x, residual


def forward(executor: Executor, model: PreparedModel, batch: StepBatch, kv: PagedKV) -> ForwardOutput:
    """One step of the main model over `batch` (any mix of prefill chunks and decode tokens)."""
    eps = model.config.rms_norm_eps
    executor.begin_step(batch, kv)
    x, residual = executor.embed(model.embed), None
    for index, layer in enumerate(model.layers):
        x, residual = decoder_layer(executor, layer, eps, x, residual, kv, index)
    hidden, _ = executor.rmsnorm(x, model.norm, eps, residual)
    return ForwardOutput(hidden=hidden, logits=executor.logits(hidden, model.lm_head))
