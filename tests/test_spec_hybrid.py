"""--spec mtp on the Qwen3.5 hybrid (numpy executor): greedy output is token for token plain greedy (K = 1..4,
with and without a reduced draft vocabulary); seeded sampling keeps the target distribution (every emitted
token's randomised CDF value under transformers' distribution for its prefix is uniform); and a drafter
that forces each accepted count a = 0..K shows that after every round the live state slot holds exactly
the state of plain decoding of the accepted tokens (conv windows and recurrent states)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import Request, SamplingParams
from ninfer_rt.engine.spec import Drafter, SpecRunner
from engine_helpers import prompt, run
from test_engine_hybrid import engine, slots_all_back
from test_spec_verify import SIGNIFICANCE, chi_square_p_value

pytest.importorskip("transformers")

PROMPTS = [prompt(37, 1), prompt(9, 2)]


@pytest.mark.parametrize("lm_head_draft", [None, 64], ids=["full-vocab", "draft-vocab-64"])
@pytest.mark.parametrize("draft_tokens", [1, 2, 3, 4])
def test_greedy_with_mtp_drafts_is_token_for_token_greedy_without(tiny_qwen3_5: Path, draft_tokens: int, lm_head_draft: int | None) -> None:
    plain, _ = run(engine(tiny_qwen3_5), PROMPTS)
    eng = engine(tiny_qwen3_5, spec="mtp", draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    speculative, _ = run(eng, PROMPTS)
    assert speculative == plain
    assert slots_all_back(eng) and eng.kv_stats().in_use == 0


def test_greedy_with_mtp_drafts_matches_under_preemption(tiny_qwen3_5: Path) -> None:
    prompts = [prompt(30, 5), prompt(30, 6), prompt(20, 7)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = run(engine(tiny_qwen3_5, kv_capacity="9", max_concurrency=3), prompts, params)
    eng = engine(tiny_qwen3_5, kv_capacity="9", max_concurrency=3, spec="mtp", draft_tokens=3)
    speculative, stats = run(eng, prompts, params)
    assert sum(s.preemptions for s in stats) > 0
    assert speculative == plain
    assert slots_all_back(eng)


# -- sampling keeps the target distribution ---------------------------------------------------------


def target_probs(model_dir: Path, sequences: np.ndarray, temperature: float) -> np.ndarray:
    """transformers' next-token distribution after every prefix of each sequence: [N, L, vocab]."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(sequences)).logits.double().numpy()
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


def randomised_cdf(probs: np.ndarray, token: int, rng: np.random.Generator) -> float:
    """P(X before token) + U * P(X = token), tokens ordered from the most probable: uniform on [0, 1)
    exactly when token ~ probs, and pushed towards 1 by tokens drawn from anything less like probs."""
    return float(probs[probs > probs[token]].sum() + rng.random() * probs[token])


def test_seeded_sampling_with_mtp_drafts_keeps_the_target_distribution(tiny_qwen3_5: Path) -> None:
    # Rejection sampling is what keeps the distribution here: accepting every draft fails this test. (The
    # tiny model's states move these distributions too little for a sampling test to see a wrong
    # rollback; the forced-acceptance test below compares the states themselves.)
    temperature, requests, length = 0.2, 64, 8
    eng = engine(tiny_qwen3_5, spec="mtp", draft_tokens=3, kv_dtype="f32", max_concurrency=4)
    the_prompt = prompt(6, 0)
    params = [SamplingParams(temperature=temperature, max_tokens=length, ignore_eos=True, seed=s) for s in range(requests)]
    ids = [eng.add_request(the_prompt, p) for p in params]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    accepted = 0
    while eng.has_work:
        for output in eng.step():
            outputs[output.request_id] += output.token_ids
            if output.stats is not None and output.stats.acceptance is not None:
                accepted += sum(output.stats.acceptance.accepted)
    assert accepted > requests, "drafts must be accepted often enough for the rollback to matter"
    sequences = np.array([the_prompt + outputs[i] for i in ids])
    probs = target_probs(tiny_qwen3_5, sequences, temperature)
    rng = np.random.default_rng(0)
    values = [
        randomised_cdf(probs[n, position - 1], int(sequences[n, position]), rng)
        for n in range(requests)
        for position in range(len(the_prompt), sequences.shape[1])
    ]
    observed = np.histogram(values, bins=10, range=(0, 1))[0]
    assert chi_square_p_value(observed, np.full(10, 0.1)) > SIGNIFICANCE


# -- forced acceptance: every a = 0..K, and the state after each rollback -----------------------------


class ForcedDrafts(SpecRunner):
    """Replaces each round's drafts by the plain greedy continuation (`reference`, the whole sequence) for
    the first `a` positions and a wrong token after, a cycling through `pattern`; records each round's
    accepted count."""

    def __init__(self, eng: Engine, reference: Sequence[int], pattern: Iterator[int]) -> None:
        base = eng.runner
        drafter = Drafter(base.mtp, base.head, base.draft_tokens)
        super().__init__(base.executor, base.model, base.kv, base.ledger, drafter)
        self.reference = list(reference)
        self.vocab = base.model.config.vocab_size
        self.pattern = pattern
        self.accepted: list[int] = []

    def run(self, chunks):  # noqa: ANN001, ANN201 -- SpecRunner.run's signature
        results = super().run(chunks)
        self.accepted += [len(r.samples) - 1 for r in results if r.drafted]
        return results

    def _draft(self, chunks, parts, batch, hidden, verified):  # noqa: ANN001, ANN201 -- SpecRunner._draft's
        drafts = super()._draft(chunks, parts, batch, hidden, verified)
        for v in verified:
            draft, start, keep = drafts[v.request.request_id], v.num_tokens, next(self.pattern)
            right = self.reference[start : start + len(draft.tokens)]
            draft.tokens = [t if j < keep else (t + 1) % self.vocab for j, t in enumerate(right)]
        return drafts


def live_state(eng: Engine, request: Request) -> list[np.ndarray]:
    states = eng.ledger.states
    slot = states.live_slot(request)
    layers = range(states.pool.spec.num_layers)
    return [np.array(states.pool.conv_window(slot, layer)) for layer in layers] + [
        np.array(states.pool.recurrent(slot, layer)) for layer in layers
    ]


def states_by_length(eng: Engine, prompt_ids: list[int], params: SamplingParams) -> tuple[dict[int, list[np.ndarray]], list[int]]:
    """Plain decoding: the live state after each computed length, and the generated tokens."""
    request_id = eng.add_request(prompt_ids, params)
    states, tokens = {}, []
    while eng.has_work:
        tokens += [t for o in eng.step() for t in o.token_ids]
        for request in eng.scheduler.running:
            states[request.num_computed] = live_state(eng, request)
    assert request_id
    return states, tokens


@pytest.mark.parametrize("draft_tokens", [1, 2, 3, 4])
def test_every_accepted_count_leaves_the_state_of_plain_decoding(tiny_qwen3_5: Path, draft_tokens: int) -> None:
    prompt_ids = prompt(20, 11)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    longer = SamplingParams(temperature=0, max_tokens=30 + 2 * draft_tokens, ignore_eos=True)
    plain_states, plain_tokens = states_by_length(engine(tiny_qwen3_5, kv_dtype="f32"), prompt_ids, longer)

    eng = engine(tiny_qwen3_5, kv_dtype="f32", spec="mtp", draft_tokens=draft_tokens)
    eng.runner = ForcedDrafts(eng, prompt_ids + plain_tokens, itertools.cycle(range(draft_tokens + 1)))
    eng.add_request(prompt_ids, params)
    tokens, compared = [], 0
    while eng.has_work:
        tokens += [t for o in eng.step() for t in o.token_ids]
        for request in eng.scheduler.running:
            expected = plain_states[request.num_computed]
            for got, want in zip(live_state(eng, request), expected):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            compared += 1
    assert tokens == plain_tokens[:30]
    assert set(eng.runner.accepted) == set(range(draft_tokens + 1))
    assert compared >= len(eng.runner.accepted) - 1
    assert slots_all_back(eng)
