"""tools/bench_hybrid_model.py's random-weight hybrid, without a GPU: at the qwen3.6-27b shape its plan holds
the bytes tools/step_bytes.py counts from the checkpoint's tensor list, in the formats `ninfer-rt quantize`
leaves (every layer projection groupwise-int but in_proj_a/b; embedding and lm_head bf16; gains and
parameters f32); on a tiny checkpoint transformers wrote, the model it assembles has the geometry
prepare_model gives the loaded weights, and runs a decode step on the numpy executor."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_hybrid_model as hybrid  # noqa: E402 -- lives in tools/
import step_bytes  # noqa: E402

from forward_helpers import SeqStep, step_batch  # noqa: E402
from ninfer_rt.cuda.streams import StreamSet  # noqa: E402
from ninfer_rt.exec.numpy_exec import NumpyExecutor  # noqa: E402
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec  # noqa: E402
from ninfer_rt.kv.states import StateSlotPool, StateSpec  # noqa: E402
from ninfer_rt.model.executor import WeightRole  # noqa: E402
from ninfer_rt.model.layers import PreparedModel, forward, prepare_model  # noqa: E402
from ninfer_rt.model.mixers import PreparedAttention, PreparedLinearAttention  # noqa: E402
from ninfer_rt.model.weights import load_model_weights  # noqa: E402

SHAPE = "qwen3.6-27b"


def plan_step_bytes(bits: int) -> int:
    cfg = hybrid.hybrid_config(SHAPE)
    plan = hybrid.model_plan(cfg, bits)
    return sum(part.nbytes for name, part in plan.items() if name != "embed") + 2 * cfg.hidden_size


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_the_27b_plan_reads_the_bytes_step_bytes_counts_from_the_checkpoint(bits: int) -> None:
    assert plan_step_bytes(bits) == step_bytes.weight_bytes(hybrid.hybrid_config(SHAPE), bits)


def test_the_int4_27b_plan_quantizes_every_layer_projection_but_b_and_a() -> None:
    plan = hybrid.model_plan(hybrid.hybrid_config(SHAPE), 4)
    linear, full = plan["layers.0.in_proj"], plan["layers.3.qkv"]
    assert isinstance(linear, hybrid.SplitMatrix)  # one projection: quantized q|k|v|z, then b|a in bf16
    assert (linear.quantized.rows, linear.quantized.cols, linear.quantized.bits) == (2 * 16 * 128 + 48 * 128 + 48 * 128, 5120, 4)
    assert (linear.dense.rows, linear.dense.bits) == (2 * 48, 16)
    assert (full.rows, full.bits) == (24 * 256 + 2 * 4 * 256 + 24 * 256, 4)  # q|k|v|gate
    assert sum(name.endswith(".in_proj") for name in plan) == 48 and sum(name.endswith(".qkv") for name in plan) == 16
    assert plan["embed"].bits == plan["lm_head"].bits == 16
    quantized = {name.split(".")[-1] for name, part in plan.items() if isinstance(part, hybrid.Matrix) and part.bits == 4}
    assert quantized == {"qkv", "o_proj", "out_proj", "gate_up", "down"}
    roles = {name.split(".")[-1]: part.role for name, part in plan.items() if isinstance(part, hybrid.Values)}
    assert roles == {
        "input_norm": WeightRole.ZERO_CENTRED_NORM, "post_norm": WeightRole.ZERO_CENTRED_NORM,
        "q_norm": WeightRole.ZERO_CENTRED_NORM, "k_norm": WeightRole.ZERO_CENTRED_NORM, "norm": WeightRole.ZERO_CENTRED_NORM,
        "conv": WeightRole.PARAMETER, "A_log": WeightRole.PARAMETER, "dt_bias": WeightRole.PARAMETER,
        "linear_norm": WeightRole.PARAMETER,
    }


def test_a_bf16_plan_fuses_the_whole_input_projection_into_one_matrix() -> None:
    plan = hybrid.model_plan(hybrid.hybrid_config(SHAPE), 16)
    in_proj = plan["layers.0.in_proj"]
    assert isinstance(in_proj, hybrid.Matrix) and in_proj.rows == 2 * 16 * 128 + 2 * 48 * 128 + 2 * 48


def test_a_quantized_matrix_the_device_layout_would_pad_is_refused() -> None:
    with pytest.raises(ValueError, match="rows % 16"):
        hybrid.Matrix(88, 5120, 4)  # 11 octets of 8 rows: padded to 12


def assembled_on_numpy(executor: NumpyExecutor, cfg: object) -> PreparedModel:
    rng = np.random.default_rng(0)

    def make(name: str, part: hybrid.Matrix | hybrid.Values) -> np.ndarray:
        if isinstance(part, hybrid.Values):
            return executor.prepare_weight(name, [hybrid.host_values(part)], part.role)
        return executor.prepare_weight(name, [rng.standard_normal((part.rows, part.cols)) * 0.02], part.role)

    return hybrid.assemble(executor, cfg, 16, make)


def geometry(value: object) -> object:
    """Shapes of the arrays, the other fields as they are, through the prepared model's dataclasses."""
    if isinstance(value, np.ndarray):
        return value.shape
    if isinstance(value, (list, tuple)):
        return [geometry(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: geometry(getattr(value, f.name)) for f in fields(value) if f.name not in ("rope", "config")}
    return value


def test_the_assembled_tiny_hybrid_has_the_loaded_checkpoints_geometry_and_decodes(tiny_qwen3_5: Path) -> None:
    weights = load_model_weights(tiny_qwen3_5)
    cfg = weights.config
    executor = NumpyExecutor(StreamSet(), dtype=np.float32)
    ours = assembled_on_numpy(executor, cfg)
    assert geometry(ours) == geometry(prepare_model(executor, weights))
    assert {type(layer.mixer) for layer in ours.layers} == {PreparedAttention, PreparedLinearAttention}

    kv = KVCache(executor.streams, KVSpec(len(cfg.full_attention_layers), 1, cfg.num_key_value_heads, cfg.head_dim, KVDtype.parse("f32"), 16))
    states = StateSlotPool(executor.streams, StateSpec.for_model(cfg, np.float32, np.float32), 1)
    states.zero(states.acquire(executor.compute), executor.compute)
    logits = executor.to_host(forward(executor, ours, step_batch([SeqStep([3], 0, [0], state_slot=0)], 16), kv, states).logits)
    assert logits.shape == (1, cfg.vocab_size) and np.isfinite(logits).all()
