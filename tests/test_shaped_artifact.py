"""The random-weight qwen3_6_27b artifact of a model shape (testing/shaped_artifact.py, what the GPU's
27B artifact figures load): its objects have the shapes the converter writes from a real checkpoint, its
random codes decode to weights of the intended spread, it is written one object at a time, and the
engine serves it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.artifact import Artifact
from ninfer_rt.artifact import qwen3_6_27b as inv
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.testing.shaped_artifact import WEIGHT_SPREAD, object_shapes, shaped_config, write_shaped_artifact
from ninfer_rt.testing.tiny_artifact import write_tiny_artifact

DRAFT_ROWS = 96
SMALL_HYBRID = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    intermediate_size=256, vocab_size=1024, full_attention_interval=4, linear_num_key_heads=1,
    linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
    partial_rotary_factor=0.25, rope_theta=10_000_000.0, mtp_num_hidden_layers=1,
)


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, int]]]:
    written: list[tuple[str, int]] = []
    path = tmp_path_factory.mktemp("shaped") / "small.ninfer"
    write_shaped_artifact(path, SMALL_HYBRID, DRAFT_ROWS, progress=lambda name, nbytes: written.append((name, nbytes)))
    return path, written


def test_object_shapes_are_the_ones_the_converter_writes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5

    source = make_tiny_qwen3_5(tmp_path / "source", hidden=128, intermediate=256, layers=4)
    write_tiny_artifact(source, tmp_path / "tiny.ninfer", DRAFT_ROWS, Tokenizer(source).vocab_size)
    with Artifact(tmp_path / "tiny.ninfer") as artifact:
        converted = {name: tuple(obj.shape) for name, obj in artifact.objects.items() if obj.shape is not None}
    assert object_shapes(ModelConfig.from_dir(source), DRAFT_ROWS) == converted


def test_every_object_is_written_once_in_inventory_order(shaped) -> None:
    path, written = shaped
    resources = [inv.FRONTEND_PREFIX + name for name in inv.FRONTEND_RESOURCES]
    assert [name for name, _ in written] == resources + list(inv.inventory(4))
    with Artifact(path) as artifact:
        assert [artifact.objects[name].bytes for name, _ in written] == [nbytes for _, nbytes in written]


@pytest.mark.parametrize("name", ["text/layers/0/gdn/query_key", "text/layers/3/attention/gate_value", inv.OUTPUT_HEAD, "mtp/layer/mlp/down"])
def test_random_codes_decode_to_weights_of_the_intended_spread(shaped, name: str) -> None:
    with Artifact(shaped[0]) as artifact:
        values = artifact.tensor_values(name)
    assert values.shape == object_shapes(shaped_config(SMALL_HYBRID), DRAFT_ROWS)[name]
    assert 0.8 * WEIGHT_SPREAD < float(values.std()) < 1.2 * WEIGHT_SPREAD
    # codes drawn uniformly from [-2^(b-1), 2^(b-1)) average -1/2: a scale's half, 0.11 of the spread at 4 bits
    assert abs(float(values.mean())) < 0.15 * WEIGHT_SPREAD


def test_the_engine_serves_the_shaped_artifact(shaped) -> None:
    engine = Engine.load(shaped[0], EngineConfig(device="cpu", max_context=512, kv_capacity="16", spec="mtp", lm_head_draft=64))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    final = [out for out in engine.generate(["def f(x):"], params) if out.stats is not None][0]
    assert final.stats.completion_tokens == 12
