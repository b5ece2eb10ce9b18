"""A random-weight Qwen3.5/3.6 hybrid (Gated DeltaNet + gated attention, 3 : 1) built directly on the GPU,
for tools/bench_decode.py: no checkpoint (the bf16 27B is ~54 GB), every matrix tiled from one random
device buffer and the int4/int8 ones written in the device format (tools/random_weights.py).

The plan (`model_plan`, pure: which weights, their formats and sizes) is the layout prepare_model gives a
checkpoint's weights (model/hybrid_layers.py; tests/test_bench_hybrid_model.py compares the two): a
gated-attention layer's qkv rows are [q | k | v | gate]; a Gated DeltaNet layer's input projection is one
matrix [q | k | v | z | b | a] in bf16, or one split-format weight, [q | k | v | z] quantized then [b | a]
in bf16 (as `ninfer-rt quantize` leaves in_proj_a/b); norm gains are zero-centred (f32 1 + w, w = 0) and conv taps, A_log,
dt_bias and the gated norm's gain f32 parameters. Embedding and lm_head stay bf16. The MTP module is not
built (a plain decode step does not run it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from random_weights import BENCH_SLOT, QUANT_GROUP, RandomModel, RandomWeights
from step_bytes import weight_bytes
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_weights import SplitFormatWeight
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import AttentionParams, Executor, LinearAttentionParams, Tensor, WeightRole
from ninfer_rt.model.hybrid_config import LINEAR_ATTENTION
from ninfer_rt.model.hybrid_layers import linear_attention_shape
from ninfer_rt.model.layers import PreparedLayer, PreparedModel
from ninfer_rt.model.mixers import Mixer, PreparedAttention, PreparedLinearAttention, attention_shape
from ninfer_rt.model.rope import rope_attention_scaling, rope_inv_freq
from ninfer_rt.model.shapes import HYBRID_MAX_POSITIONS, SHAPES, hybrid_text_config

CONV_TAP = 0.25  # every conv tap: the conv averages its window, so the activations stay of the inputs' size
_QUANT_ROWS = 16  # the device layout's octets of 8 rows come in pairs


@dataclass(frozen=True)
class Matrix:
    """A [rows, cols] weight in bf16 (bits 16) or groupwise-int (codes + a bf16 scale per QUANT_GROUP inputs)."""

    rows: int
    cols: int
    bits: int = 16
    role: WeightRole = WeightRole.LINEAR

    def __post_init__(self) -> None:
        if self.bits < 16 and (self.rows % _QUANT_ROWS or self.cols % QUANT_GROUP):
            raise ValueError(f"a quantized {self.rows}x{self.cols} matrix needs rows % {_QUANT_ROWS} and cols % {QUANT_GROUP} == 0")

    @property
    def nbytes(self) -> int:
        elements = self.rows * self.cols
        return 2 * elements if self.bits == 16 else elements * self.bits // 8 + elements // QUANT_GROUP * 2


@dataclass(frozen=True)
class SplitMatrix:
    """One projection of quantized rows, then bf16 rows (exec/cuda_weights.py SplitFormatWeight)."""

    quantized: Matrix
    dense: Matrix
    role: WeightRole = WeightRole.LINEAR

    @property
    def rows(self) -> int:
        return self.quantized.rows + self.dense.rows

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes + self.dense.nbytes


@dataclass(frozen=True)
class Values:
    """f32 values, every one `value` as the model stores it (a zero-centred gain's w; a parameter as is)."""

    shape: tuple[int, ...]
    role: WeightRole
    value: float

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape))


Plan = dict[str, Matrix | SplitMatrix | Values]


def hybrid_config(name: str, layers: int | None = None) -> ModelConfig:
    shape = dict(SHAPES[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    return ModelConfig.from_dict(hybrid_text_config(shape) | {"max_position_embeddings": HYBRID_MAX_POSITIONS})


def _gain(size: int) -> Values:
    return Values((size,), WeightRole.ZERO_CENTRED_NORM, 0.0)  # applied as 1 + w = 1


def mlp_plan(cfg: ModelConfig, bits: int) -> Plan:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "input_norm": _gain(h), "post_norm": _gain(h),
        "gate_up": Matrix(2 * i, h, bits, WeightRole.GATE_UP), "down": Matrix(h, i, bits),
    }


def gated_attention_plan(cfg: ModelConfig, bits: int) -> Plan:
    shape = attention_shape(cfg)
    qkv_gate = 2 * shape.q_size + 2 * shape.kv_size
    return {
        "qkv": Matrix(qkv_gate, cfg.hidden_size, bits), "q_norm": _gain(shape.head_dim), "k_norm": _gain(shape.head_dim),
        "o_proj": Matrix(cfg.hidden_size, shape.q_size, bits),
    }


def linear_attention_plan(cfg: ModelConfig, bits: int) -> Plan:
    shape, h = linear_attention_shape(cfg), cfg.hidden_size
    gates = 2 * shape.num_value_heads  # b and a: kept bf16 beside quantized projections
    quantized = SplitMatrix(Matrix(shape.projection_rows - gates, h, bits), Matrix(gates, h))
    parameter = WeightRole.PARAMETER
    return {
        "in_proj": Matrix(shape.projection_rows, h) if bits == 16 else quantized,
        "conv": Values((shape.conv_channels, shape.conv_kernel), parameter, CONV_TAP),
        "A_log": Values((shape.num_value_heads,), parameter, 0.0),
        "dt_bias": Values((shape.num_value_heads,), parameter, 0.0),
        "linear_norm": Values((shape.value_head_dim,), parameter, 1.0),
        "out_proj": Matrix(h, shape.value_size, bits),
    }


def layer_plan(cfg: ModelConfig, layer: int, bits: int) -> Plan:
    linear = cfg.layer_type(layer) == LINEAR_ATTENTION
    return (linear_attention_plan if linear else gated_attention_plan)(cfg, bits) | mlp_plan(cfg, bits)


def model_plan(cfg: ModelConfig, bits: int) -> Plan:
    """Every weight of the main model by name; the decoder layers' projections in `bits`."""
    h, vocab = cfg.hidden_size, cfg.vocab_size
    layers = {f"layers.{n}.{key}": part for n in range(cfg.num_hidden_layers) for key, part in layer_plan(cfg, n, bits).items()}
    return {"embed": Matrix(vocab, h, role=WeightRole.EMBEDDING), **layers, "norm": _gain(h), "lm_head": Matrix(vocab, h)}


Make = Callable[[str, Matrix | SplitMatrix | Values], Tensor]


def assemble(executor: Executor, cfg: ModelConfig, bits: int, make: Make) -> PreparedModel:
    """The PreparedModel of `model_plan`, each weight made by `make` (on the GPU: `build_hybrid_model`'s)."""
    rope = executor.prepare_rope(rope_inv_freq(cfg), rope_attention_scaling(cfg))
    kinds = [cfg.layer_type(n) for n in range(cfg.num_hidden_layers)]
    layers = []
    for n, kind in enumerate(kinds):
        made = {key: make(f"layers.{n}.{key}", part) for key, part in layer_plan(cfg, n, bits).items()}
        mixer = _mixer(cfg, rope, made, kind, kinds[:n].count(kind))
        layers.append(PreparedLayer(made["input_norm"], mixer, made["post_norm"], made["gate_up"], made["down"]))
    plan = model_plan(cfg, bits)
    embed = make("embed", plan["embed"])
    return PreparedModel(cfg, embed, layers, make("norm", plan["norm"]), make("lm_head", plan["lm_head"]), rope)


def _mixer(cfg: ModelConfig, rope: Tensor, made: dict[str, Tensor], kind: str, cache_index: int) -> Mixer:
    if kind == LINEAR_ATTENTION:
        params = LinearAttentionParams(linear_attention_shape(cfg), made["conv"], made["A_log"], made["dt_bias"], made["linear_norm"])
        return PreparedLinearAttention(made["in_proj"], params, made["out_proj"], state_layer=cache_index)
    params = AttentionParams(
        attention_shape(cfg), rope, made["q_norm"], made["k_norm"], rotary_dim=cfg.rotary_dim, output_gate=True
    )
    return PreparedAttention(made["qkv"], params, made["o_proj"], kv_layer=cache_index)


def host_values(part: Values) -> np.ndarray:
    return np.full(part.shape, part.value, np.float32)


def build_hybrid_model(executor: CudaExecutor, cfg: ModelConfig, seed: int = 0, weight_bits: int = 16) -> RandomModel:
    """The hybrid on the GPU and its one-slot state pool (the slot acquired; zeroed before each measurement)."""
    random = RandomWeights(executor, seed)

    def make(name: str, part: Matrix | SplitMatrix | Values) -> Tensor:
        if isinstance(part, Values):
            return executor.prepare_weight(name, [host_values(part)], part.role)
        if isinstance(part, SplitMatrix):
            quantized, dense = make(name, part.quantized), make(f"{name}.dense", part.dense)
            return executor.adopt_weight(SplitFormatWeight(quantized, dense), part.role)
        if part.bits < 16:
            return random.quantized(name, part.rows, part.cols, part.bits, part.role)
        return random.dense(name, part.rows, part.cols, part.role)

    model = assemble(executor, cfg, weight_bits, make)
    random.close()
    states = StateSlotPool(executor.streams, StateSpec.for_model(cfg), 1, "bench state slots")
    if states.acquire(executor.compute) != BENCH_SLOT:
        raise RuntimeError("a fresh one-slot state pool handed out a slot other than 0")
    return RandomModel(executor, model, weight_bytes(cfg, weight_bits), states)
