"""A coding agent's conversation on the tiny hybrid, turn after turn through the chat template (system
prompt, tools, tool calls and results, history rendered with preserve_thinking): every turn resumes from a
Gated DeltaNet state snapshot and its logits equal a from-scratch prefill (float64), it recomputes no more
than its new tokens (those neither in the previous prompt nor among its generated tokens) plus a page, and
from the second turn on at least 98% of the prompt tokens are never computed. A client whose history
differs from what was generated (reasoning added or edited by the client, so the re-rendered reply is not
the generated tokens) still resumes from the deepest valid snapshot and stays exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.chat import ChatTemplate

TURNS = 20
PAGE = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
SYSTEM = "You are a coding agent working in a repository.\n" + "\n".join(
    f"def helper_{i}(values):\n    return sorted(v * {i} for v in values if v % {i + 2})" for i in range(34)
)
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def engine(model_dir: Path, **config: object) -> Engine:
    defaults = dict(device="cpu", cpu_precision="float64", kv_dtype="f32", kv_capacity="256", page_size=PAGE,
                    token_budget=4096, max_context=8192, snapshot_interval=1024)
    return Engine.load(model_dir, EngineConfig(**{**defaults, **config}))  # type: ignore[arg-type]


def generate(eng: Engine, ids: list[int]) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their top-5 logprobs flattened, and the prompt tokens the engine skipped."""
    request = eng.add_request(ids, PARAMS)
    tokens, logprobs, cached = [], [], None
    while eng.has_work:
        for out in eng.step():
            if out.request_id == request:
                tokens += out.token_ids
                logprobs += [lp for entry in out.logprobs for _, lp in entry.top]
                cached = out.stats.cached_tokens if out.stats is not None else cached
    return tokens, logprobs, cached


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differs[0]) if differs.size else n


def next_messages(messages: list[dict], turn: int, reply: str, edited: bool) -> list[dict]:
    """The history a client sends back: the reply as generated, a tool call and its result every fifth
    turn; `edited`: with reasoning the model never wrote (the re-render is not the generated tokens)."""
    assistant = {"role": "assistant", "content": reply}
    if edited:
        assistant["reasoning_content"] = f"step {turn}: look at the helpers"
    if turn % 5 == 0:
        assistant["tool_calls"] = [{"type": "function", "function": {"name": "read_file", "arguments": {"path": f"src/m{turn}.py"}}}]
        return messages + [assistant, {"role": "tool", "content": f"x = {turn}"}]
    return messages + [assistant, {"role": "user", "content": f"fix {turn}"}]


def conversation(model_dir: Path, edited: bool, turns: int) -> list[dict]:
    tokenizer = Tokenizer(model_dir)
    template = ChatTemplate(tokenizer.chat_template)
    warm, cold = engine(model_dir), engine(model_dir, prefix_caching=False)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "read the helpers"}]
    seen: list[int] = []
    report = []
    for turn in range(turns):
        ids = tokenizer.encode(template.render(messages, tools=TOOLS, preserve_thinking=True).text)
        tokens, logprobs, cached = generate(warm, ids)
        cold_tokens, cold_logprobs, _ = generate(cold, ids)
        error = np.max(np.abs(np.subtract(logprobs, cold_logprobs)) / np.maximum(np.abs(cold_logprobs), 1e-30))
        report.append(dict(prompt=len(ids), cached=cached, new=len(ids) - common_prefix(ids, seen),
                           same=tokens == cold_tokens, error=float(error)))
        seen = ids + tokens
        messages = next_messages(messages, turn, tokenizer.decode(tokens), edited)
    assert warm.state_stats().in_use == 0 and warm.state_stats().balanced
    return report


@pytest.fixture(scope="module")
def kept(tiny_qwen3_5: Path) -> list[dict]:
    return conversation(tiny_qwen3_5, edited=False, turns=TURNS)


def test_every_turn_after_a_resume_equals_a_from_scratch_prefill(kept: list[dict]) -> None:
    assert all(turn["same"] for turn in kept)
    assert max(turn["error"] for turn in kept) < 1e-9


def test_each_turn_recomputes_at_most_its_new_tokens_and_a_page(kept: list[dict]) -> None:
    print(json.dumps(kept[:3] + kept[-2:]))
    assert all(turn["prompt"] - turn["cached"] <= turn["new"] + PAGE for turn in kept)


def test_from_the_second_turn_98_percent_of_prompt_tokens_are_skipped(kept: list[dict]) -> None:
    later = kept[1:]
    ratio = sum(t["cached"] for t in later) / sum(t["prompt"] for t in later)
    print(f"cached ratio from turn 2: {ratio:.4f}")
    assert ratio >= 0.98


def test_an_edited_history_resumes_from_the_deepest_valid_snapshot(tiny_qwen3_5: Path) -> None:
    edited = conversation(tiny_qwen3_5, edited=True, turns=6)
    assert all(turn["same"] and turn["error"] < 1e-9 for turn in edited)
    for previous, turn in zip(edited, edited[1:]):  # the end of the previous input: the reply is not reused
        assert turn["cached"] == previous["prompt"]
