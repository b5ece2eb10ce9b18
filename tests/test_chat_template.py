"""Chat template rendering (HF semantics) and the property agents depend on: turn N's prompt plus the model's
output, parsed and sent back as history, is an exact token prefix of turn N+1's prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.chat import ChatTemplate, ChatTemplateError
from ninfer_rt.serve.parsed_reply import message_fields
from ninfer_rt.serve.parsing import OutputParser
from ninfer_rt.serve.protocol import ChatMessage

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
# What a Qwen3 model writes in each turn of the conversation below (the tiny model writes gibberish).
TOOL_TURN = (
    "<think>\nI need to read the file first.\n</think>\n\nReading it.\n"
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/ünïcode.py"}}\n</tool_call>'
)
ANSWER_TURN = "<think>\nThe bug is the slice.\n</think>\n\nUse sum(xs) instead of sum(xs[1:])."
PLAIN_TURN = "It means world."
THINKING_SESSION = (TOOL_TURN, ANSWER_TURN, PLAIN_TURN)
# enable_thinking=false: the prompt closes the think block, the model answers directly
NO_THINKING_SESSION = (
    'Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>',
    "Use sum(xs).",
    PLAIN_TURN,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def template(tokenizer: Tokenizer) -> ChatTemplate:
    assert tokenizer.chat_template is not None
    return ChatTemplate(tokenizer.chat_template)


def reply(generation_prompt: str, text: str, tools: bool = True) -> dict[str, Any]:
    """The assistant message an OpenAI client sends back after receiving the parsed reply to `text`."""
    parser = OutputParser.for_prompt(generation_prompt, parse_tool_calls=tools)
    out = parser.feed(text)
    out.extend(parser.finish())
    fields = message_fields(out, parser.has_reasoning)
    wire = {"role": "assistant", **{k: v for k, v in fields.items() if v is not None}}
    return ChatMessage.model_validate(wire).for_template()


def agent_session(template: ChatTemplate, outputs: tuple[str, str, str], **kwargs: Any) -> list[tuple[str, str]]:
    """(prompt, model output) for each turn of a tool-using session, history sent back as a client would."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Why does test_sum fail?"},
    ]
    turns = []
    follow_ups = (
        {"role": "tool", "tool_call_id": "x", "content": "def total(xs): return sum(xs[1:])"},
        {"role": "user", "content": "Thanks — what does 世界 mean?"},
        None,
    )
    for output, follow_up in zip(outputs, follow_ups):
        prompt = template.render(messages, tools=TOOLS, **kwargs)
        turns.append((prompt.text, output))
        messages.append(reply(prompt.generation_prompt, output))
        if follow_up is not None:
            messages.append(follow_up)
    return turns


def test_each_prompt_plus_its_output_is_a_token_prefix_of_the_next_prompt(
    template: ChatTemplate, tokenizer: Tokenizer
) -> None:
    turns = agent_session(template, THINKING_SESSION, preserve_thinking=True)
    for (prompt, output), (next_prompt, _) in zip(turns, turns[1:]):
        seen = tokenizer.encode(prompt + output)
        assert tokenizer.encode(next_prompt)[: len(seen)] == seen


def test_with_thinking_disabled_the_empty_think_block_survives_the_round_trip(
    template: ChatTemplate, tokenizer: Tokenizer
) -> None:
    turns = agent_session(template, NO_THINKING_SESSION, enable_thinking=False)
    for (prompt, output), (next_prompt, _) in zip(turns, turns[1:]):
        seen = tokenizer.encode(prompt + output)
        assert tokenizer.encode(next_prompt)[: len(seen)] == seen


def test_without_preserve_thinking_history_is_rewritten_and_the_prefix_breaks(
    template: ChatTemplate, tokenizer: Tokenizer
) -> None:
    # Documents why --preserve-thinking is the default: the template drops old reasoning once a new user
    # turn arrives, so turn 3's prompt no longer starts with turn 2's and the prefix cache misses from there.
    turns = agent_session(template, THINKING_SESSION, preserve_thinking=False)
    (_, _), (second, _), (third, _) = turns
    second_ids, third_ids = tokenizer.encode(second), tokenizer.encode(third)
    common = next(i for i, (a, b) in enumerate(zip(second_ids, third_ids)) if a != b)
    assert common < 0.9 * len(second_ids)


def test_generation_prompt_is_what_add_generation_prompt_appends(template: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages).generation_prompt == "<|im_start|>assistant\n"
    no_think = template.render(messages, enable_thinking=False)
    assert no_think.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert template.render(messages, add_generation_prompt=False).generation_prompt == ""


def test_raise_exception_in_the_template_is_a_client_error() -> None:
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render([{"role": "assistant", "content": "x"}])


def test_template_failing_on_the_messages_is_a_client_error() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_hf_globals_and_filters_are_available() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') | length }} {{ {'city': 'Zürich'} | tojson }} {{ bos_token }}", "<s>")
    assert template.render([], add_generation_prompt=False).text == '4 {"city": "Zürich"} <s>'


def test_the_sandbox_refuses_to_reach_python_internals() -> None:
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escape.render([{"role": "user", "content": "x"}])


def test_client_kwargs_cannot_override_the_server_variables(template: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="eos_token"):
        template.render([{"role": "user", "content": "x"}], eos_token="<oops>")
