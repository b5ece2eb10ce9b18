from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer_rt.model.tokenizer import REPLACEMENT_CHAR, Tokenizer

MULTIBYTE_TEXT = "héllo 世界 🎉"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]

# An agent conversation: reasoning on every assistant turn, parallel tool calls, two tool results.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the failing test in tests/test_app.py."},
    {
        "role": "assistant",
        "reasoning_content": "I should read the test and the module.",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": {"path": "tests/test_app.py"}}},
            {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "app.py"}'}},
        ],
    },
    {"role": "tool", "content": "def test_sum(): assert total([1, 2]) == 3"},
    {"role": "tool", "content": "def total(xs): return sum(xs[1:])"},
    {"role": "assistant", "reasoning_content": "The slice drops the first element.", "content": "Use sum(xs)."},
    {"role": "user", "content": "Thanks — now explain 世界 🎉."},
    {"role": "assistant", "reasoning_content": "", "content": "It means world."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


def _render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """Renders like transformers' apply_chat_template (same Jinja environment settings and tojson)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(template).render(messages=messages, **kwargs)


def _stream(tokenizer: Tokenizer, ids: list[int], **kwargs: Any) -> list[str]:
    detok = tokenizer.detokenizer(**kwargs)
    deltas = [detok.add(token_id) for token_id in ids]
    return [*deltas, detok.flush()]


def test_encode_decode_round_trips_code_and_unicode(tokenizer: Tokenizer) -> None:
    text = 'def f(x):\n    return {"ok": x}  # café ' + MULTIBYTE_TEXT
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_and_markup_tokens_encode_as_single_ids(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>")
    assert ids[0] == tokenizer.special_tokens["<|im_start|>"]
    assert ids[-1] == tokenizer.special_tokens["<|im_end|>"]
    assert tokenizer.token_to_id("<think>") in ids
    assert tokenizer.token_to_id("</think>") in ids


def test_markup_tokens_are_not_special(tokenizer: Tokenizer) -> None:
    assert set(tokenizer.special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    ids = tokenizer.encode("<think>x</think><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_eos_ids_come_from_generation_config_and_tokenizer_config(tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_to_id("<|im_end|>")
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.eos_token_ids == (im_end, endoftext)
    assert tokenizer.bos_token_id is None


def test_chat_template_jinja_file_takes_precedence(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_qwen3, tmp_path / "m"))
    (model_dir / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert Tokenizer(model_dir).chat_template == "{{ messages[0].content }}"


def test_multibyte_characters_split_across_tokens_stream_without_replacement_chars(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    deltas = _stream(tokenizer, ids)
    assert "" in deltas[:-1], "some token must end inside a character for this test to mean anything"
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE_TEXT


def test_streaming_after_a_prompt_emits_only_the_new_text(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("Say hi: ")
    output_ids = tokenizer.encode("hi 🎉")
    deltas = _stream(tokenizer, output_ids, prompt_ids=prompt_ids)
    assert "".join(deltas) == "hi 🎉"


def test_streaming_can_skip_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<think>a</think>done<|im_end|>")
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=True)) == "<think>a</think>done"


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=REPLACEMENT_CHAR)))
def test_streamed_deltas_concatenate_to_the_full_decode(tiny_qwen3: Path, text: str) -> None:
    tokenizer = Tokenizer(tiny_qwen3)
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids)
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_chat_template_renders_roles_reasoning_tools_and_tool_calls(tokenizer: Tokenizer) -> None:
    prompt = _render(tokenizer.chat_template, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in prompt
    assert (
        "<|im_start|>assistant\n<think>\nI should read the test and the module.\n</think>\n\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "tests/test_app.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "app.py"}}\n</tool_call><|im_end|>\n'
    ) in prompt
    assert (
        "<|im_start|>user\n<tool_response>\ndef test_sum(): assert total([1, 2]) == 3\n</tool_response>\n"
        "<tool_response>\ndef total(xs): return sum(xs[1:])\n</tool_response><|im_end|>\n"
    ) in prompt
    assert "<think>\nThe slice drops the first element.\n</think>\n\nUse sum(xs).<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt means world.<|im_end|>\n<|im_start|>assistant\n")


def test_each_turn_prompt_is_a_prefix_of_the_next(tokenizer: Tokenizer) -> None:
    full = _render(tokenizer.chat_template, CONVERSATION, tools=TOOLS)
    full_ids = tokenizer.encode(full)
    for end, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        enable_thinking = message["reasoning_content"] != ""
        turn_prompt = _render(
            tokenizer.chat_template,
            CONVERSATION[:end],
            tools=TOOLS,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        assert full.startswith(turn_prompt), f"prompt before message {end} is not a prefix of the history"
        turn_ids = tokenizer.encode(turn_prompt)
        assert full_ids[: len(turn_ids)] == turn_ids, f"tokens before message {end} are not a prefix"
        earlier_history = _render(tokenizer.chat_template, CONVERSATION[:end], tools=TOOLS)
        assert full.startswith(earlier_history)


def test_preserve_thinking_false_drops_reasoning_before_the_last_user_turn(tokenizer: Tokenizer) -> None:
    prompt = _render(tokenizer.chat_template, CONVERSATION, tools=TOOLS, preserve_thinking=False)
    assert "I should read the test" not in prompt
    assert "The slice drops the first element." not in prompt
    assert "<think>\n\n</think>\n\nIt means world." in prompt


def test_transformers_renders_the_template_identically(tiny_qwen3: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_qwen3)
    kwargs = {"tools": TOOLS, "add_generation_prompt": True, "enable_thinking": False}
    hf_prompt = hf.apply_chat_template(CONVERSATION, tokenize=False, **kwargs)
    assert hf_prompt == _render(tokenizer.chat_template, CONVERSATION, **kwargs)
    assert hf.encode(hf_prompt, add_special_tokens=False) == tokenizer.encode(hf_prompt)
