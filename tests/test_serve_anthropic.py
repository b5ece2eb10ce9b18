"""The Anthropic Messages API end to end with the official `anthropic` client against a real local server
and the tiny model: whole and streamed answers, a forced tool_use block, a tool_result turn that hits the
prefix cache, count_tokens, and Anthropic-shaped errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")  # a test dependency ([dev]); the GPU machine's image lacks it
from test_serve_http import LONG_SYSTEM, MODEL, Server, running_server

TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
USER = [{"role": "user", "content": "Open a.py"}]
GREEDY = {"temperature": 0.0}  # the client no longer takes sampling parameters as arguments; the API still does


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[Server]:
    with running_server(tiny_qwen3, api_key="sekrit") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)


def test_a_whole_message_has_text_a_stop_reason_and_usage(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=6, system="Be brief.", messages=USER, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens >= 1 and message.usage.input_tokens > 0
    assert all(block.type in ("text", "thinking") for block in message.content)


def test_a_streamed_forced_tool_call_is_a_tool_use_block_and_its_result_turn_hits_the_cache(
    client: anthropic.Anthropic,
) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "extra_body": GREEDY, "system": LONG_SYSTEM,
                              "tools": [TOOL], "tool_choice": {"type": "tool", "name": "read_file"}}
    events = list(client.messages.create(messages=USER, stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    [tool_use] = [e.content_block for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert tool_use.name == "read_file" and tool_use.id.startswith("toolu_")
    final = events[-2]
    assert final.delta.stop_reason in ("tool_use", "max_tokens")
    first_input = final.usage.input_tokens + final.usage.cache_read_input_tokens

    # the whole message agrees with the stream, and its tool_use goes back with a tool_result
    whole = client.messages.create(messages=USER, **kwargs)
    [block] = [b for b in whole.content if b.type == "tool_use"]
    assert block.name == "read_file"
    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "print(1)"}]}]
    second = client.messages.create(model=MODEL, max_tokens=2, system=LONG_SYSTEM, tools=[TOOL], messages=history)
    assert second.usage.cache_read_input_tokens >= 0.9 * first_input
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first_input


def test_the_streams_text_matches_the_whole_answer(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "extra_body": GREEDY, "messages": USER}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_thinking_disabled_renders_an_empty_think_block(client: anthropic.Anthropic) -> None:
    on = client.messages.count_tokens(model=MODEL, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024})
    off = client.messages.count_tokens(model=MODEL, messages=USER, thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens  # the template closes the think block itself


THINKING_ON = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def opening_thinker(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    """The tiny model under a template that opens the think block itself when thinking is on, as the
    Qwen3.5/3.6 templates do: its first tokens are reasoning."""
    model = tmp_path_factory.mktemp("opening_thinker") / "model"
    shutil.copytree(tiny_qwen3, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    closing = "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    assert closing in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(closing, "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}")
    config_path.write_text(json.dumps(config))
    with running_server(model) as running:
        yield anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0)


def test_a_streamed_reply_with_thinking_on_opens_with_a_thinking_block(opening_thinker: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "messages": USER, "thinking": THINKING_ON, "extra_body": GREEDY}
    events = list(opening_thinker.messages.create(stream=True, **kwargs))
    [first_block, *_] = [e.content_block for e in events if e.type == "content_block_start"]
    assert first_block.type == "thinking"
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.index == 0]
    assert deltas and all(d.type == "thinking_delta" for d in deltas)
    whole = opening_thinker.messages.create(**kwargs)
    assert whole.content[0].type == "thinking"
    assert whole.content[0].thinking == "".join(d.thinking for d in deltas)


def test_count_tokens_counts_what_generation_would_see(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=USER)
    message = client.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=USER)
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_errors_are_anthropic_shaped(server: Server, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=USER)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus", max_tokens=4, messages=USER)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=USER
        )
    raw = httpx.post(server.url + "/v1/messages", content=b"{", headers={"x-api-key": "sekrit"})
    assert raw.status_code == 400 and set(raw.json()) == {"type", "error"}
