"""The model names each weight's role when it prepares it (model/executor.py WeightRole): executors
dispatch on the role, never on the weight's name."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.model.executor import WeightRole
from ninfer_rt.model.layers import prepare_model
from ninfer_rt.model.mtp import prepare_mtp
from ninfer_rt.model.weights import load_model_weights


class RoleRecorder(NumpyExecutor):
    def __init__(self) -> None:
        super().__init__(StreamSet())
        self.roles: dict[str, WeightRole] = {}

    def prepare_weight(self, name: str, parts: Sequence[np.ndarray], role: WeightRole) -> np.ndarray:
        self.roles[name] = role
        return super().prepare_weight(name, parts, role)


def test_every_prepared_weight_has_the_role_its_ops_read_it_in(tiny_qwen3_mtp: Path) -> None:
    weights = load_model_weights(tiny_qwen3_mtp)
    executor = RoleRecorder()
    prepare_mtp(executor, weights, prepare_model(executor, weights))
    layer = {"input_norm": "norm", "q_norm": "norm", "k_norm": "norm", "post_norm": "norm",
             "qkv": "linear", "o_proj": "linear", "gate_up": "gate_up", "down": "linear"}
    expected = {"embed": "embedding", "norm": "norm", "mtp.fc": "linear", "mtp.norm_embedding": "norm",
                "mtp.norm_hidden": "norm", "mtp.norm": "norm"}
    if not weights.config.tie_word_embeddings:
        expected["lm_head"] = "linear"
    for prefix in [f"layers.{i}" for i in range(weights.config.num_hidden_layers)] + ["mtp.layer"]:
        expected |= {f"{prefix}.{name}": role for name, role in layer.items()}
    assert {name: role.value for name, role in executor.roles.items()} == expected
