"""Prefill speed of the numpy executor on a small hybrid (hidden 256, 8 layers: 6 Gated DeltaNet + 2 gated
attention, head dims 64), through the whole engine: a 2,000-token prompt prefills in under a second per
1,000 tokens on the 2-core CI machine, and the linear-attention layers run the chunked form, never the
token-by-token recurrence (which would take several times longer)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.exec import numpy_delta_rule
from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5

PROMPT = 2000


@pytest.fixture(scope="module")
def small_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return make_tiny_qwen3_5(
        tmp_path_factory.mktemp("small_hybrid"), hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64,
        linear_key_heads=2, linear_value_heads=6, linear_head_dim=64, intermediate=768, mtp=False,
    )


def test_a_2000_token_prompt_prefills_in_under_a_second_per_1000_tokens(
    small_hybrid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recurrent = numpy_delta_rule.recurrent_gated_delta_rule

    def only_short(x: numpy_delta_rule.DeltaRuleInputs, *args: object) -> numpy_delta_rule.DeltaRuleResult:
        assert max(x.lengths) <= numpy_delta_rule.RECURRENT_MAX_ROWS, "prefill ran the recurrent form"
        return recurrent(x, *args)

    monkeypatch.setattr(numpy_delta_rule, "recurrent_gated_delta_rule", only_short)
    engine = Engine.load(small_hybrid, EngineConfig(device="cpu", token_budget=PROMPT, kv_capacity="64"))
    prompt = np.random.default_rng(0).integers(0, 500, PROMPT).tolist()
    engine.generate([prompt[:100]], SamplingParams(max_tokens=1)).__next__()  # warm-up
    began = time.perf_counter()
    for _ in engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1)):
        pass
    per_thousand = (time.perf_counter() - began) / PROMPT * 1000
    print(f"\nhybrid prefill (hidden 256, 8 layers, head dims 64): {per_thousand:.3f} s per 1,000 tokens")
    assert per_thousand < 1.0
