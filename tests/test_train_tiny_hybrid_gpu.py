"""Training the tiny hybrid on a GPU picks fla-core's delta rule only where its gradients agree with
transformers' torch rule at the model's own layer shape (fla-core 0.6.0 refuses, and with Triton 3.4-3.7.0 on
Hopper miscompiles, its gated backward at a key block of 64: fla #640), else the torch rule; either way the
layer's gradients in training match the torch rule's, computed in float32 on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import tiny_hybrid_model as hybrid  # noqa: E402 -- lives in tools/, importable once tools/ is on the path


def test_the_training_delta_rule_is_fla_only_where_its_gradients_agree() -> None:
    model = hybrid.TinyQwen3_5(hybrid.FULL_HYBRID_SHAPE, 1024, 1e-6, 0.02).to("cuda")
    layer = model.model.layers[0].linear_attn
    hidden = hybrid.probe_batch(model.config.hidden_size, "cuda") * 0.5  # not the probe's own batch
    reference = hybrid.torch_reference_gradients(layer, hidden)
    messages: list[str] = []
    with hybrid.fast_delta_rule(model, "cuda", messages.append) as chosen:
        trained = hybrid.layer_gradients(layer, hidden)
    assert chosen["delta_rule"] in ("fla-core", "torch") and len(messages) == 1, (chosen, messages)
    if chosen["delta_rule"] == "fla-core":
        assert chosen["probe_gradient_error"] <= hybrid.FLA_GRADIENT_TOLERANCE
    assert hybrid.gradient_error(trained, reference) <= hybrid.FLA_GRADIENT_TOLERANCE
