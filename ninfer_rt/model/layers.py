"""The model, written once against the Executor interface (CPU and GPU run this code): the dense
Qwen3/Llama forward and the Qwen3.5 hybrid's (Gated DeltaNet and gated-attention layers, 3 : 1).

Every decoder layer is pre-norm: rmsnorm (fused residual add), a token mixer, rmsnorm, the SwiGLU MLP.
The mixer is full attention over the paged KV (`PreparedAttention`: dense, or gated with the output
multiplied by sigmoid(gate)) or linear attention over a per-sequence recurrent state
(`PreparedLinearAttention`, model/hybrid_layers.py prepares it). Preparation decides which matrices exist:
q/k/v (and the gate) are fused into one matrix, gate/up into one, a Gated DeltaNet's four input projections
into one, so a step runs one GEMM per group; each executor converts/uploads them its own way through
`prepare_weight`, told each weight's role. A step is: embed; the layers; final norm; lm_head for the
step's logit rows only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import AttentionParams, Executor, PagedKV, RecurrentStates, StepBatch, Tensor, WeightRole
from ninfer_rt.model.hybrid_layers import prepare_mixer
from ninfer_rt.model.mixers import Caches, Mixer, PreparedAttention, attention_shape, norm_role
from ninfer_rt.model.rope import rope_attention_scaling, rope_inv_freq
from ninfer_rt.model.weights import HybridLayerWeights, LayerWeights, ModelWeights
from ninfer_rt.quantize.format import Linear

@dataclass(frozen=True)
class PreparedLayer:
    input_norm: Tensor
    mixer: Mixer
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


def prepare_mlp_parts(executor: Executor, cfg: ModelConfig, weights: object, name: str) -> dict[str, Tensor]:
    """The norms and the MLP, which every decoder layer kind has (weights: LayerWeights or HybridLayerWeights)."""
    norm = norm_role(cfg)
    return {
        "input_norm": executor.prepare_weight(f"{name}.input_norm", [weights.input_norm], norm),
        "post_norm": executor.prepare_weight(f"{name}.post_norm", [weights.post_norm], norm),
        "gate_up": executor.prepare_weight(f"{name}.gate_up", [weights.gate_proj, weights.up_proj], WeightRole.GATE_UP),
        "down": executor.prepare_weight(f"{name}.down", [weights.down_proj], WeightRole.LINEAR),
    }


def prepare_layer(
    executor: Executor, cfg: ModelConfig, rope: Tensor, weights: LayerWeights, name: str, kv_layer: int
) -> PreparedLayer:
    """A dense (Qwen3/Llama) decoder layer."""

    def prepare(suffix: str, role: WeightRole, *parts: Linear) -> Tensor:
        return executor.prepare_weight(f"{name}.{suffix}", parts, role)

    has_qk_norm = weights.q_norm is not None
    attention = PreparedAttention(
        qkv=prepare("qkv", WeightRole.LINEAR, weights.q_proj, weights.k_proj, weights.v_proj),
        params=AttentionParams(
            shape=attention_shape(cfg),
            rope=rope,
            q_norm=prepare("q_norm", WeightRole.NORM, weights.q_norm) if has_qk_norm else None,
            k_norm=prepare("k_norm", WeightRole.NORM, weights.k_norm) if has_qk_norm else None,
        ),
        o_proj=prepare("o_proj", WeightRole.LINEAR, weights.o_proj),
        kv_layer=kv_layer,
    )
    return PreparedLayer(mixer=attention, **prepare_mlp_parts(executor, cfg, weights, name))


def prepare_hybrid_layer(
    executor: Executor, cfg: ModelConfig, rope: Tensor, weights: HybridLayerWeights, name: str, cache_index: int
) -> PreparedLayer:
    """A Qwen3.5 decoder layer: its mixer by kind (cache_index counts the layers of that kind before it)."""
    mixer = prepare_mixer(executor, cfg, rope, weights.mixer, name, cache_index)
    return PreparedLayer(mixer=mixer, **prepare_mlp_parts(executor, cfg, weights, name))


def prepare_decoder_layers(executor: Executor, cfg: ModelConfig, rope: Tensor, weights: ModelWeights) -> list[PreparedLayer]:
    if not cfg.is_hybrid:
        return [prepare_layer(executor, cfg, rope, layer, f"layers.{i}", i) for i, layer in enumerate(weights.layers)]
    kinds = [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)]
    return [
        prepare_hybrid_layer(executor, cfg, rope, layer, f"layers.{i}", kinds[:i].count(kinds[i]))
        for i, layer in enumerate(weights.layers)
    ]


def prepare_model(executor: Executor, weights: ModelWeights) -> PreparedModel:
    cfg = weights.config
    rope = executor.prepare_rope(rope_inv_freq(cfg), rope_attention_scaling(cfg))
    embed = executor.prepare_weight("embed", [weights.embed], WeightRole.EMBEDDING)
    return PreparedModel(
        config=cfg,
        embed=embed,
        layers=prepare_decoder_layers(executor, cfg, rope, weights),
        norm=executor.prepare_weight("norm", [weights.norm], norm_role(cfg)),
        lm_head=embed if cfg.tie_word_embeddings else executor.prepare_weight("lm_head", [weights.lm_head], WeightRole.LINEAR),
        rope=rope,
    )


def decoder_layer(
    executor: Executor, layer: PreparedLayer, eps: float, x: Tensor, residual: Tensor | None, caches: Caches
) -> tuple[Tensor, Tensor]:
    """One pre-norm decoder layer; returns (layer output, residual) with the final residual add deferred
    to the next rmsnorm, which fuses it."""
    normed, residual = executor.rmsnorm(x, layer.input_norm, eps, residual)
    x = layer.mixer.mix(executor, normed, caches)
    normed, residual = executor.rmsnorm(x, layer.post_norm, eps, residual)
    x = executor.linear(executor.silu_mul(executor.linear(normed, layer.gate_up)), layer.down)
    return x, residual


def forward(
    executor: Executor, model: PreparedModel, batch: StepBatch, kv: PagedKV, states: RecurrentStates | None = None
) -> ForwardOutput:
    """One step of the main model over `batch` (any mix of prefill chunks and decode tokens)."""
    eps = model.config.rms_norm_eps
    caches = Caches(kv, states)
    executor.begin_step(batch, kv)
    x, residual = executor.embed(model.embed), None
    for layer in model.layers:
        x, residual = decoder_layer(executor, layer, eps, x, residual, caches)
    hidden, _ = executor.rmsnorm(x, model.norm, eps, residual)
    return ForwardOutput(hidden=hidden, logits=executor.logits(hidden, model.lm_head))
