"""Snapshot retention under mixed load: N conversations take turns on the tiny hybrid (each turn's prompt is
the previous prompt, the generated reply and new tokens, as an agent sends it) with a snapshot budget of
only N records. Every turn writes more snapshots than that (the end of its input, the end of its
generation, a periodic one in a long first prompt), yet each conversation's next turn still resumes at the
end of its previous generation: a snapshot that a deeper one of the same sequence supersedes is evicted
before the deepest snapshot of another conversation (kv/snapshots.py, eviction order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams

CONVERSATIONS = 4
ROUNDS = 4
REPLY = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=REPLY, ignore_eos=True)


def engine(model_dir: Path, budget: int) -> Engine:
    config = EngineConfig(device="cpu", kv_dtype="f32", kv_capacity="512", max_context=8192, token_budget=1024,
                          state_snapshot_budget=str(budget), snapshot_interval=256)
    return Engine.load(model_dir, config)


def run(eng: Engine, ids: list[int]) -> tuple[list[int], int]:
    request = eng.add_request(ids, PARAMS)
    tokens, cached = [], 0
    while eng.has_work:
        for out in eng.step():
            if out.request_id == request:
                tokens += out.token_ids
                cached = out.stats.cached_tokens if out.stats is not None else cached
    return tokens, cached


def turns(model_dir: Path, budget: int) -> list[tuple[int, int]]:
    """(cached tokens, the end of the conversation's previous generation) of every turn after the first."""
    eng = engine(model_dir, budget)
    rng = np.random.default_rng(7)
    vocab = eng.runner.model.config.vocab_size
    prompts = [rng.integers(0, vocab, 300 + 40 * c).tolist() for c in range(CONVERSATIONS)]
    resumes, ends = [], {}
    for round_ in range(ROUNDS):
        for c in range(CONVERSATIONS):
            tokens, cached = run(eng, prompts[c])
            if round_:
                resumes.append((cached, ends[c]))
            ends[c] = len(prompts[c]) + len(tokens) - 1  # the last token is generated, not yet computed
            prompts[c] = prompts[c] + tokens + rng.integers(0, vocab, 20).tolist()
    assert eng.snapshot_stats().count <= budget
    return resumes


def test_with_a_budget_of_one_snapshot_per_conversation_every_next_turn_resumes(tiny_qwen3_5: Path) -> None:
    resumes = turns(tiny_qwen3_5, budget=CONVERSATIONS)
    print(resumes)
    assert all(cached == end for cached, end in resumes)


def test_below_one_snapshot_per_conversation_some_turn_starts_over(tiny_qwen3_5: Path) -> None:
    # the bound is tight: a budget smaller than the conversations loses some conversation's resume point
    resumes = turns(tiny_qwen3_5, budget=CONVERSATIONS - 1)
    assert any(cached < end for cached, end in resumes)
