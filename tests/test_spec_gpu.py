"""--spec mtp on the CUDA executor: verify steps replay CUDA graphs keyed by batch and verify width, and
greedy output equals greedy output without speculation. Uses the agreeable MTP model (spec_models.py),
whose wide logit margins leave no near-ties for bf16 to flip, so equality is exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.engine import Engine, EngineConfig
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.exec.cuda_exec import StepShape
from spec_models import make_agreeable_mtp_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def agreeable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: the smallest head size the attention kernels instantiate.
    return make_agreeable_mtp_model(tmp_path_factory.mktemp("agreeable_mtp_gpu"), layer_scale=100.0, head_dim=64)


def engine(model_dir: Path, **config: object) -> Engine:
    return Engine.load(model_dir, EngineConfig(**{"device": "cuda", "kv_capacity": "64", "token_budget": 64, **config}))  # type: ignore[arg-type]


def greedy(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for out in eng.generate(prompts, GREEDY):
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [tokens[key] for key in sorted(tokens, key=lambda k: int(k.split("-")[-1]))]


PROMPTS = [np.random.default_rng(s).integers(0, 500, n).tolist() for s, n in [(1, 70), (2, 9)]]


@pytest.mark.parametrize("lm_head_draft", [None, 64])
@pytest.mark.parametrize("draft_tokens", [1, 2, 3, 4])
def test_cuda_greedy_with_mtp_drafts_is_greedy_without(agreeable: Path, draft_tokens: int, lm_head_draft: int | None) -> None:
    plain = greedy(engine(agreeable), PROMPTS)
    eng = engine(agreeable, spec="mtp", draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    assert greedy(eng, PROMPTS) == plain
    stats = eng.kv_stats()
    assert stats.in_use == 0 and stats.balanced


def test_cuda_verify_steps_replay_a_graph_per_verify_width(agreeable: Path) -> None:
    eng = engine(agreeable, spec="mtp", draft_tokens=3)
    greedy(eng, PROMPTS[:1])
    assert StepShape((4,), 4) in eng.runner.forward.graphs  # one sequence, 1 + 3 verify rows, all sampled
