"""The engine with --spec mtp on the numpy executor: greedy output is token-for-token the output without
speculation (K = 1..4, with and without a reduced draft vocabulary, across prefix-cache hits and
preemption), the pages balance after many speculative steps with random rejections, and a checkpoint
without MTP weights is refused at start-up. Two models: the random tiny MTP model (drafts almost always
rejected) and an "agreeable" one (spec_models.py) whose drafts are often accepted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_helpers import GREEDY, prompt, run
from ninfer_rt.engine.build import EngineConfig, EngineError, max_step_rows
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from spec_models import make_agreeable_mtp_model

PAGE_SIZE = 16  # small pages: verify and drafting rows cross page boundaries often


@pytest.fixture(scope="module")
def agreeable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_agreeable_mtp_model(tmp_path_factory.mktemp("agreeable_mtp"), layer_scale=100.0)


@pytest.fixture(params=["random", "agreeable"])
def mtp_model(request: pytest.FixtureRequest, tiny_qwen3_mtp: Path, agreeable: Path) -> Path:
    return tiny_qwen3_mtp if request.param == "random" else agreeable


def engine(model_dir: Path, **config: object) -> Engine:
    defaults = {"device": "cpu", "kv_capacity": "96", "token_budget": 64, "page_size": PAGE_SIZE}
    return Engine.load(model_dir, EngineConfig(**{**defaults, **config}))  # type: ignore[arg-type]


def pages_all_back(eng: Engine) -> bool:
    stats = eng.kv_stats()
    return stats.in_use == 0 and stats.balanced


PROMPTS = [prompt(37, 1), prompt(9, 2)]


@pytest.mark.parametrize("lm_head_draft", [None, 64], ids=["full-vocab", "draft-vocab-64"])
@pytest.mark.parametrize("draft_tokens", [1, 2, 3, 4])
def test_greedy_with_mtp_drafts_is_token_for_token_greedy_without(mtp_model: Path, draft_tokens: int, lm_head_draft: int | None) -> None:
    plain, _ = run(engine(mtp_model), PROMPTS)
    eng = engine(mtp_model, spec="mtp", draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    speculative, _ = run(eng, PROMPTS)
    assert speculative == plain
    assert pages_all_back(eng)


def test_drafts_of_the_agreeable_model_are_mostly_accepted(agreeable: Path) -> None:
    _, stats = run(engine(agreeable, spec="mtp", draft_tokens=3), PROMPTS)
    for acceptance in (s.acceptance for s in stats):
        assert acceptance is not None and acceptance.mean_acceptance_length > 1.5
        assert len(acceptance.position_rates) == 3


def test_without_speculation_requests_report_no_acceptance(agreeable: Path) -> None:
    _, stats = run(engine(agreeable), PROMPTS)
    assert all(s.acceptance is None for s in stats)


def test_greedy_with_mtp_drafts_matches_across_a_prefix_cache_hit(mtp_model: Path) -> None:
    def two_turns(eng: Engine) -> tuple[list[int], list[int], int]:
        first = prompt(40, 3)
        (reply,), _ = run(eng, [first])
        (second,), (stats,) = run(eng, [first + reply + prompt(5, 4)])
        return reply, second, stats.cached_tokens

    *plain, _ = two_turns(engine(mtp_model))
    eng = engine(mtp_model, spec="mtp", draft_tokens=3)
    *speculative, cached = two_turns(eng)
    assert cached > 40, "the second turn should hit the first turn's prompt and reply"
    assert speculative == plain
    assert pages_all_back(eng)


def test_greedy_with_mtp_drafts_matches_under_preemption(mtp_model: Path) -> None:
    prompts = [prompt(30, 5), prompt(30, 6), prompt(20, 7)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = run(engine(mtp_model, kv_capacity="9", max_concurrency=3), prompts, params)
    eng = engine(mtp_model, kv_capacity="9", max_concurrency=3, spec="mtp", draft_tokens=3)
    speculative, stats = run(eng, prompts, params)
    assert sum(s.preemptions for s in stats) > 0
    assert speculative == plain
    assert pages_all_back(eng)


def test_pages_balance_after_a_thousand_speculative_steps_with_random_rejections(agreeable: Path) -> None:
    eng = engine(agreeable, kv_capacity="12", max_concurrency=2, spec="mtp", draft_tokens=3)
    params = SamplingParams(temperature=1.0, max_tokens=150, ignore_eos=True, seed=0)
    for seed in range(18):
        eng.add_request(prompt(20, seed), params)
    verify_steps = 0
    while eng.has_work:
        for output in eng.step():
            if output.stats is not None and output.stats.acceptance is not None:
                verify_steps += output.stats.acceptance.steps
        assert eng.kv_stats().balanced
        for request in eng.scheduler.running:  # nothing held past the computed tokens between steps
            assert len(eng.ledger.sequence(request).pages) == -(-request.num_computed // PAGE_SIZE)
    assert verify_steps >= 1000
    assert pages_all_back(eng)


def test_spec_mtp_on_a_checkpoint_without_mtp_weights_fails_at_start_up(tiny_qwen3: Path) -> None:
    with pytest.raises(EngineError, match="no MTP weights"):
        engine(tiny_qwen3, spec="mtp")


def test_outputs_stop_at_eos_inside_accepted_drafts(agreeable: Path) -> None:
    plain, _ = run(engine(agreeable), PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    speculative, _ = run(engine(agreeable, spec="mtp", draft_tokens=4), PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert speculative == plain


def test_no_step_holds_more_rows_than_the_executor_is_sized_for(agreeable: Path) -> None:
    # A prefill chunk takes the whole budget while the other lane verifies 1 + K rows: the CUDA executor's
    # activation pool is sized by max_step_rows, so every step must fit it, and the drafts must need it.
    config = {"token_budget": 16, "max_concurrency": 2, "spec": "mtp", "draft_tokens": 3}
    eng = engine(agreeable, **config)
    rows: list[int] = []
    begin_step = eng.executor.begin_step
    eng.executor.begin_step = lambda batch, kv: (rows.append(batch.num_tokens), begin_step(batch, kv))[1]
    eng.add_request(prompt(9, 2), GREEDY)
    eng.step()
    eng.add_request(prompt(120, 1), GREEDY)
    while eng.has_work:
        eng.step()
    assert max(rows) <= max_step_rows(EngineConfig(**config))  # type: ignore[arg-type]
    assert max(rows) > config["token_budget"]


def host_copies(eng: Engine) -> list[np.ndarray]:
    """Everything the engine brings to the host from now on."""
    copies: list[np.ndarray] = []
    to_host = eng.executor.to_host
    eng.executor.to_host = lambda x: (copies.append(to_host(x)), copies[-1])[1]
    return copies


def test_greedy_speculative_steps_bring_only_token_ids_to_the_host(agreeable: Path) -> None:
    eng = engine(agreeable, spec="mtp", draft_tokens=3)
    copies = host_copies(eng)
    run(eng, PROMPTS)
    assert copies and all(c.dtype == np.int32 and c.shape[1] == 1 for c in copies)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=1),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5),
    ],
    ids=["sampling", "logprobs", "penalty"],
)
def test_requests_that_need_the_distribution_still_get_full_logits(agreeable: Path, params: SamplingParams) -> None:
    eng = engine(agreeable, spec="mtp", draft_tokens=3)
    copies = host_copies(eng)
    run(eng, PROMPTS, params)
    assert any(c.shape[1] == eng.runner.model.config.vocab_size for c in copies)


def test_greedy_with_a_penalty_and_logprobs_is_the_same_with_and_without_drafts(agreeable: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, logprobs=True, top_logprobs=2)

    def tokens_and_logprobs(eng: Engine) -> tuple[list[int], list[float]]:
        outputs = list(eng.generate([PROMPTS[0]], params))
        return [t for o in outputs for t in o.token_ids], [lp.logprob for o in outputs for lp in o.logprobs]

    plain_tokens, plain_logprobs = tokens_and_logprobs(engine(agreeable))
    tokens, logprobs = tokens_and_logprobs(engine(agreeable, spec="mtp", draft_tokens=3))
    assert tokens == plain_tokens
    np.testing.assert_allclose(logprobs, plain_logprobs, atol=1e-4)
