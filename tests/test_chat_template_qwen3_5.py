"""The published Qwen3.5 / Qwen3.6 chat template with tool calls: a conversation renders, its assistant turns
parse back to the same calls, and the parsed messages, sent back as an OpenAI client sends them (arguments
as JSON text), render to the same text and tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from server_helpers import healthy_server
from test_serve_tools import ScriptedBackend

from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.app import ServeConfig, create_app
from ninfer_rt.serve.chat import ChatTemplate, ChatTemplateError
from ninfer_rt.serve.parsed_reply import message_fields
from ninfer_rt.serve.parsing import OutputParser
from ninfer_rt.serve.protocol import ChatMessage

TEMPLATE_SOURCE = (Path(__file__).parent / "fixtures" / "qwen3_6_chat_template.jinja").read_text()
TEMPLATE = ChatTemplate(TEMPLATE_SOURCE)
PROPERTIES = {
    "path": {"type": "string"},
    "start": {"type": "integer"},
    "follow": {"type": "boolean"},
    "ranges": {"type": "array"},
    "options": {"type": "object"},
    "budget": {"type": ["number", "null"]},
}
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": PROPERTIES}}},
    {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {}}}},
]
READ = {
    "path": "src/ünïcode.py",
    "start": 10,
    "follow": True,
    "ranges": [[1, 5]],
    "options": {"mode": "r"},
    "budget": None,
}
LIST = {"path": "src/\n  nested  "}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Why does test_sum fail?"},
    {
        "role": "assistant",
        "reasoning_content": "I need the file and the directory.",
        "content": "Reading them.",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "read_file", "arguments": READ}},
            {"id": "b", "type": "function", "function": {"name": "list_dir", "arguments": LIST}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "def total(xs): return sum(xs[1:])"},
    {"role": "tool", "tool_call_id": "b", "content": "test_sum.py"},
    {"role": "assistant", "reasoning_content": "The slice drops xs[0].", "content": "Use sum(xs)."},
]
ASSISTANT = "<|im_start|>assistant\n"


def assistant_turns(text: str) -> list[str]:
    """The text of each assistant turn after its header, up to (without) its <|im_end|>."""
    return [part.split("<|im_end|>")[0] for part in text.split(ASSISTANT)[1:]]


def parsed_reply(turn: str) -> dict[str, Any]:
    """The message an OpenAI client sends back after the server parsed `turn` (the model's output after the
    generation prompt "<|im_start|>assistant\\n<think>\\n")."""
    parser = OutputParser(in_reasoning=True, syntax=TEMPLATE.render(CONVERSATION[:2], tools=TOOLS).tool_syntax)
    out = parser.feed(turn.removeprefix("<think>\n"))
    out.extend(parser.finish())
    fields = message_fields(out, parser.has_reasoning)
    wire = {"role": "assistant", **{k: v for k, v in fields.items() if v is not None}}
    return ChatMessage.model_validate(wire).for_template()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


def test_the_conversation_renders_its_calls_in_the_xml_form() -> None:
    text = TEMPLATE.render(CONVERSATION, tools=TOOLS, add_generation_prompt=False).text
    first = assistant_turns(text)[0]
    assert first.startswith("<think>\nI need the file and the directory.\n</think>\n\nReading them.\n\n<tool_call>\n")
    assert "<parameter=start>\n10\n</parameter>\n<parameter=follow>\ntrue\n</parameter>\n" in first
    assert '<parameter=ranges>\n[[1, 5]]\n</parameter>\n<parameter=options>\n{"mode": "r"}\n</parameter>\n' in first
    assert "</tool_call>\n<tool_call>\n<function=list_dir>\n<parameter=path>\nsrc/\n  nested  \n</parameter>" in first
    assert "<|im_start|>user\n<tool_response>\ndef total" in text


def test_the_rendered_assistant_turns_parse_back_to_the_same_calls() -> None:
    text = TEMPLATE.render(CONVERSATION, tools=TOOLS, add_generation_prompt=False, preserve_thinking=True).text
    tool_turn, answer_turn = (parsed_reply(turn) for turn in assistant_turns(text))
    assert tool_turn["reasoning_content"] == "I need the file and the directory."
    assert tool_turn["content"] == "Reading them."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_turn["tool_calls"]]
    assert calls == [("read_file", READ), ("list_dir", LIST)]
    assert [list(arguments) for _, arguments in calls] == [list(READ), list(LIST)]  # key order kept
    assert (answer_turn["reasoning_content"], answer_turn["content"]) == ("The slice drops xs[0].", "Use sum(xs).")


def test_rerendering_the_parsed_messages_gives_the_same_text_and_tokens(tokenizer: Tokenizer) -> None:
    original = TEMPLATE.render(CONVERSATION, tools=TOOLS, add_generation_prompt=False, preserve_thinking=True).text
    replies = iter(parsed_reply(turn) for turn in assistant_turns(original))
    sent_back = [next(replies) if m["role"] == "assistant" else m for m in CONVERSATION]
    assert all(isinstance(c["function"]["arguments"], str) for c in sent_back[2]["tool_calls"])  # JSON text, as sent
    again = TEMPLATE.render(sent_back, tools=TOOLS, add_generation_prompt=False, preserve_thinking=True).text
    assert again == original
    assert tokenizer.encode(again) == tokenizer.encode(original)


def test_each_prompt_plus_the_model_output_is_a_token_prefix_of_the_next_prompt(tokenizer: Tokenizer) -> None:
    messages = CONVERSATION[:2]
    first = TEMPLATE.render(messages, tools=TOOLS, preserve_thinking=True)
    output = assistant_turns(TEMPLATE.render(CONVERSATION[:3], tools=TOOLS, add_generation_prompt=False).text)[0]
    output = output.removeprefix("<think>\n")  # the generation prompt already holds it
    history = [*messages, parsed_reply("<think>\n" + output), *CONVERSATION[3:5]]
    second = TEMPLATE.render(history, tools=TOOLS, preserve_thinking=True)
    seen = tokenizer.encode(first.text + output)
    assert tokenizer.encode(second.text)[: len(seen)] == seen


def test_the_template_itself_needs_a_mapping_and_json_text_is_decoded_before_it_renders() -> None:
    as_text = [*CONVERSATION[:2], json.loads(json.dumps(CONVERSATION[2]))]
    for call in as_text[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    raw = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE_SOURCE)
    with pytest.raises(TypeError, match="mapping"):
        raw.render(messages=as_text, tools=TOOLS)  # the published template iterates arguments|items
    mapping_text = TEMPLATE.render(CONVERSATION[:3], tools=TOOLS).text
    assert TEMPLATE.render(as_text, tools=TOOLS).text == mapping_text


def test_arguments_that_are_not_a_json_object_are_a_client_error_naming_the_call() -> None:
    broken = {**CONVERSATION[2], "tool_calls": [{"type": "function", "function": {"name": "x", "arguments": "[1]"}}]}
    with pytest.raises(ChatTemplateError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments"):
        TEMPLATE.render([*CONVERSATION[:2], broken], tools=TOOLS)


# -- through the server and the official openai client -----------------------------------------------------

TOOL_OUTPUT = (
    "I should read it.\n</think>\n\nReading.\n\n<tool_call>\n<function=read_file>\n"
    "<parameter=path>\na.py\n</parameter>\n<parameter=start>\n3\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def backend(tiny_qwen3: Path) -> ScriptedBackend:
    tokenizer = Tokenizer(tiny_qwen3)
    tokenizer.chat_template = TEMPLATE_SOURCE
    return ScriptedBackend(tokenizer, script=TOOL_OUTPUT, vocab_size=tokenizer.vocab_size)


@pytest.fixture(scope="module")
def client(backend: ScriptedBackend) -> Iterator[openai.OpenAI]:
    app = create_app(lambda: backend, ServeConfig(served_model_name="scripted"))
    with healthy_server(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, **kwargs)  # type: ignore[arg-type]


def test_the_server_returns_typed_calls_streamed_or_not_and_renders_them_back(
    client: openai.OpenAI, backend: ScriptedBackend
) -> None:
    question = [{"role": "user", "content": "Read a.py"}]
    choice = ask(client, question).choices[0]
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("read_file", '{"path": "a.py", "start": 3}')
    assert (choice.message.content, choice.finish_reason) == ("Reading.", "tool_calls")

    chunks = list(ask(client, question, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "read_file" and len(pieces) >= 3
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments

    tool_result = {"role": "tool", "tool_call_id": call.id, "content": "x"}
    history = [*question, choice.message.model_dump(exclude_none=True), tool_result]
    ask(client, history)
    prompt = backend.tokenizer.decode(backend.generations[-1].prompt_ids)
    assert "<think>\n" + TOOL_OUTPUT + "<|im_end|>\n<|im_start|>user\n<tool_response>\nx\n" in prompt
