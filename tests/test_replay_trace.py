"""The trace format and the profile generator, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.replay.profiles import PROFILES, TAIL_ALIGN, make_profile
from ninfer_rt.replay.report import percentiles
from ninfer_rt.replay.trace import WORDS, Turn, read_trace, synth_ids, synth_words, write_trace


def test_a_trace_round_trips_through_json_lines(tmp_path: Path) -> None:
    turns = make_profile("system-rotation", 0.05) + make_profile("unaligned-tail", 0.05)
    path = tmp_path / "trace.jsonl"
    assert write_trace(turns, path) == len(turns)
    assert read_trace(path) == turns


def test_a_line_stores_only_what_differs_from_the_defaults() -> None:
    assert Turn(lane="a", content=5).to_json() == {"lane": "a", "content": 5}
    assert Turn(lane="a", content="hi", stream=True, tools=("read_file",)).to_json() == {
        "lane": "a", "content": "hi", "stream": True, "tools": ["read_file"]}


def test_a_bad_line_is_reported_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"lane": "a", "content": 3}\n{"lane": "a", "content": 3, "tempo": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: unknown trace fields \['tempo'\]"):
        read_trace(path)


@pytest.mark.parametrize("turn", [
    dict(lane="a", content=1, tools=("rm_rf",)),
    dict(lane="a", content="text", route="completions"),
    dict(lane="a", content=1, max_tokens=0),
])
def test_impossible_turns_are_refused(turn: dict) -> None:
    with pytest.raises(ValueError):
        Turn(**turn)


def test_a_conversation_defaults_to_its_lane() -> None:
    assert Turn(lane="side", content=1).conversation == "side"


def test_synthesized_content_is_deterministic() -> None:
    assert synth_words(50, seed=7) == synth_words(50, seed=7) != synth_words(50, seed=8)
    assert synth_ids(50, seed=7) == synth_ids(50, seed=7)


def test_every_word_is_one_token_after_a_space(tiny_qwen3: Path) -> None:
    # what makes "N words" about N tokens, and /tokenize-guided alignment converge in one step
    tokenizer = Tokenizer(tiny_qwen3)
    assert [w for w in WORDS if len(tokenizer.encode(" " + w)) != 1] == []
    assert len(tokenizer.encode(" " + synth_words(200, seed=1))) == 200


def test_profiles_are_known_by_name_and_number() -> None:
    assert make_profile("7", 0.05) == make_profile("agent", 0.05)
    with pytest.raises(ValueError, match="unknown profile"):
        make_profile("8")


@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_smaller_scale_is_a_smaller_trace(profile: str) -> None:
    small, full = make_profile(profile, 0.05), make_profile(profile, 1.0)
    assert 0 < len(small) <= len(full)
    assert sum(t.max_tokens for t in small) < sum(t.max_tokens for t in full)


def test_the_full_agent_profile_is_the_gpu_run_the_issue_asks_for() -> None:
    turns = make_profile("agent", 1.0)
    agent = [t for t in turns if t.lane == "agent"]
    side = [t for t in turns if t.lane == "side"]
    assert len(turns) >= 120 and side
    # each turn adds its new content, the reply it got back and about 190 tokens of template, tool-call
    # and think markup (measured on the H200 run): the conversation ends near 115k tokens
    assert isinstance(agent[0].system, str)
    markup = 190 * len(agent)
    grown = len(agent[0].system.split()) + sum(int(t.content) + t.max_tokens for t in agent) + markup
    assert 105_000 <= grown <= 125_000
    assert any(t.align == TAIL_ALIGN for t in agent) and all(t.align == TAIL_ALIGN for t in side)
    assert all(t.stream and t.thinking and t.tools for t in agent)


def test_percentiles_are_values_that_happened() -> None:
    assert percentiles([0.3, 0.1, 0.2]) == {"p50": 0.2, "p90": 0.3, "p99": 0.3}
    assert percentiles(list(range(1, 101))) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([]) == {}
