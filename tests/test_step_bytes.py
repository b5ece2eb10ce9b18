"""The decode roofline's bytes per step at the qwen3.6-27b shape (tools/step_bytes.py), against arithmetic
done by hand from the model card's sizes: int4 g128 layer projections (in_proj_a/b bf16), bf16 embedding
row and lm_head, f32 gains and parameters, int8 K/V of the 16 full-attention layers, and the 48 linear
layers' states read and written."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import step_bytes  # noqa: E402 -- lives in tools/

from ninfer_rt.model.config import ModelConfig  # noqa: E402
from ninfer_rt.model.shapes import SHAPES, hybrid_text_config  # noqa: E402

H, I, V = 5120, 17408, 248320
INT4 = lambda rows, cols: rows * cols // 2 + rows * cols // 128 * 2  # noqa: E731 -- codes + bf16 scales


def config() -> ModelConfig:
    return ModelConfig.from_dict(hybrid_text_config(SHAPES["qwen3.6-27b"]) | {"max_position_embeddings": 262144})


def test_int4_weights_of_a_27b_step() -> None:
    mlp = INT4(I, H) * 2 + INT4(H, I)
    linear = INT4(10240, H) + INT4(6144, H) + INT4(H, 6144) + 2 * (48 * H * 2)  # qkv, z, out; a, b bf16
    linear += 4 * (10240 * 4 + 48 + 48 + 128)  # conv taps, A_log, dt_bias, gated-norm gain (f32)
    full = INT4(24 * 2 * 256, H) + 2 * INT4(4 * 256, H) + INT4(H, 24 * 256) + 4 * (256 + 256)  # q|gate, k, v, o; q/k norms
    norms = 4 * 2 * H  # input and post norms of a layer
    expected = 48 * (linear + mlp + norms) + 16 * (full + mlp + norms) + 4 * H + 2 * V * H + 2 * H  # final norm, lm_head, row
    assert step_bytes.weight_bytes(config(), 4) == expected


def test_int8_kv_and_states_of_a_27b_step() -> None:
    cfg = config()
    assert step_bytes.kv_bytes(cfg, 256, "int8") == 16 * 256 * 2 * 4 * (256 + 4)
    assert step_bytes.kv_bytes(cfg, 256, "bf16") == 16 * 256 * 2 * 4 * 256 * 2
    per_layer = 48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2  # 3 MiB state + 60 KiB window
    assert step_bytes.state_bytes(cfg) == 2 * 48 * per_layer  # read and written
    total = step_bytes.step_bytes(cfg, 256, "int8", 4)
    assert total.total == total.weights + total.kv + total.states
