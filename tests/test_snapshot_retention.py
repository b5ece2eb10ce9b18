"""Snapshot retention under mixed load: N conversations take turns on the tiny hybrid (each turn's prompt is
the previous prompt, the reply and new tokens, as an agent sends it) with a snapshot budget of 2N records,
one end of input and one end of generation per conversation. Every turn writes snapshots (a periodic one
in a long first prompt, the end of its input, the end of its generation), yet each conversation's next
turn resumes: at the end of its previous generation when the reply comes back as generated, at the end of
its previous input when the client re-rendered it differently. A snapshot that a deeper one of the same
sequence supersedes is evicted before another conversation's resume points, and the one of a turn's two
resume points its conversation passed over goes first (kv/snapshots.py)."""

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


def turns(model_dir: Path, budget: int, edited: bool, merge: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """(cached tokens, where the turn should resume) of every turn after the first: the end of the previous
    generation, or with `edited` replies (other tokens than the generated ones) the previous input's end. With
    `merge` = (round, conversation) that turn's prompt re-tokenizes the previous prompt's last token (a
    byte-level BPE merge with the reply): it resumes at the end of the input before that one."""
    eng = engine(model_dir, budget)
    rng = np.random.default_rng(7)
    vocab = eng.runner.model.config.vocab_size
    prompts = [rng.integers(0, vocab, 300 + 40 * c).tolist() for c in range(CONVERSATIONS)]
    resumes, ends, input_ends = [], {}, {}
    for round_ in range(ROUNDS):
        for c in range(CONVERSATIONS):
            tokens, cached = run(eng, prompts[c])
            if round_:
                resumes.append((cached, ends[c]))
            previous_input_end, input_ends[c] = input_ends.get(c, 0), len(prompts[c])
            # the last generated token has no state yet: it is the next turn's first computed one
            ends[c] = len(prompts[c]) if edited else len(prompts[c]) + len(tokens) - 1
            reply = [(t + 1) % vocab for t in tokens] if edited else tokens
            if (round_ + 1, c) == merge:
                prompts[c][-1] = (prompts[c][-1] + 1) % vocab
                ends[c] = previous_input_end
            prompts[c] = prompts[c] + reply + rng.integers(0, vocab, 20).tolist()
    assert eng.snapshot_stats().count <= budget
    return resumes


@pytest.mark.parametrize("edited", [False, True], ids=["reply-as-generated", "reply-re-rendered"])
def test_with_two_snapshots_per_conversation_every_next_turn_resumes(tiny_qwen3_5: Path, edited: bool) -> None:
    resumes = turns(tiny_qwen3_5, budget=2 * CONVERSATIONS, edited=edited)
    print(resumes)
    assert all(cached == end for cached, end in resumes)


def test_below_that_budget_an_edited_conversation_loses_its_resume_point(tiny_qwen3_5: Path) -> None:
    # the bound is tight: with one record per conversation the end-of-input snapshots are evicted
    resumes = turns(tiny_qwen3_5, budget=CONVERSATIONS, edited=True)
    assert any(cached < end for cached, end in resumes)


def test_with_three_per_conversation_a_prompt_diverging_in_the_last_input_token_resumes_one_turn_back(
    tiny_qwen3_5: Path,
) -> None:
    # the end of generation a conversation passed over goes before the end of input it superseded: the
    # third record keeps that input end while every other conversation takes its turn
    resumes = turns(tiny_qwen3_5, budget=3 * CONVERSATIONS, edited=True, merge=(ROUNDS - 1, CONVERSATIONS - 1))
    print(resumes)
    assert all(cached == end for cached, end in resumes)
