"""Which requests' replies come back as text, so that the engine warms their re-tokenized reply once they end
(engine/reply_warmup.py): a chat (OpenAI or Anthropic) and a completion of a text prompt do; a completion of
token ids does not (the client re-sends exactly the ids it got)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.prepare import ModelLimits, Preparer
from ninfer_rt.serve.state import ServeConfig


@pytest.fixture(scope="module")
def preparer(tiny_qwen3_5: Path) -> Preparer:
    return Preparer(Tokenizer(tiny_qwen3_5), ModelLimits(context_limit=4096, vocab_size=512), ServeConfig(served_model_name="tiny"))


def body(**fields: object) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 8, **fields}).encode()


def test_a_chat_reply_comes_back_as_text(preparer: Preparer) -> None:
    prepared = preparer.chat(body(messages=[{"role": "user", "content": "hi"}]))
    assert [g.text_round_trip for g in prepared.generations] == [True]


def test_an_anthropic_reply_comes_back_as_text(preparer: Preparer) -> None:
    prepared = preparer.messages(body(messages=[{"role": "user", "content": "hi"}]))
    assert [g.text_round_trip for g in prepared.generations] == [True]


def test_a_completion_comes_back_as_what_its_prompt_was(preparer: Preparer) -> None:
    texts = preparer.completion(body(prompt=["def main(", "import os"]))
    ids = preparer.completion(body(prompt=[[5, 6, 7], [8, 9]]))
    assert [g.text_round_trip for g in texts.generations + ids.generations] == [True, True, False, False]
