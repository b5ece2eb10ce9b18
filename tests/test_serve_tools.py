"""Tool calls through a real server and the official openai client, with a backend that plays scripted
model text (the tiny model writes gibberish, never a well-formed call)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import healthy_server
from test_tokenizer import TOOLS

from ninfer_rt.engine.output import RequestOutput, RequestStats
from ninfer_rt.engine.request import FinishReason
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.app import create_app
from ninfer_rt.serve.state import Generation, ServeConfig

MODEL = "scripted"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
AGENT_TOOLS = [*TOOLS, WEATHER]
WEATHER_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@dataclass
class ScriptedBackend:
    """Answers every request with `script`, a few characters per output, like a model's token deltas."""

    tokenizer: Tokenizer
    script: str = WEATHER_CALL
    context_limit: int = 4096
    vocab_size: int = 1000
    piece: int = 3
    generations: list[Generation] = field(default_factory=list)

    async def generate(self, generation: Generation, request_id: str) -> AsyncIterator[RequestOutput]:
        self.generations.append(generation)
        prompt_ids = generation.prompt_ids
        pieces = [self.script[i : i + self.piece] for i in range(0, len(self.script), self.piece)]
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            stats = RequestStats(len(prompt_ids), 0, len(pieces), 0, 0.0, 0.0, 0.0) if last else None
            yield RequestOutput(request_id, [0], text, finish_reason=FinishReason.STOP if last else None, stats=stats)

    def kv_stats(self) -> PoolStats:
        return PoolStats(total=1, free=1, in_use=0, cached=0, evictions=0)

    def crash_context(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def backend(tiny_qwen3: Path) -> ScriptedBackend:
    tokenizer = Tokenizer(tiny_qwen3)
    return ScriptedBackend(tokenizer, vocab_size=tokenizer.vocab_size)


@pytest.fixture
def script(backend: ScriptedBackend) -> Iterator[Callable[[str], None]]:
    """Sets what the backend answers for one test."""
    yield lambda text: setattr(backend, "script", text)
    backend.script = WEATHER_CALL


@pytest.fixture(scope="module")
def client(backend: ScriptedBackend) -> Iterator[openai.OpenAI]:
    app = create_app(lambda: backend, ServeConfig(served_model_name=MODEL))
    with healthy_server(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    return client.chat.completions.create(model=MODEL, messages=messages, tools=AGENT_TOOLS, **kwargs)  # type: ignore[arg-type]


def test_streamed_tool_call_arguments_arrive_incrementally_and_add_up(client: openai.OpenAI) -> None:
    whole = ask(client).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    [call] = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "unit": "celsius"})

    chunks = list(ask(client, stream=True))
    pieces = [tc for chunk in chunks if chunk.choices for tc in (chunk.choices[0].delta.tool_calls or [])]
    first, rest = pieces[0], pieces[1:]
    # the first piece names the call, as OpenAI's does; the arguments follow as they are generated
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert len(rest) > 5 and all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    assert first.function.arguments + "".join(p.function.arguments for p in rest) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def prompt_text(backend: ScriptedBackend) -> str:
    return backend.tokenizer.decode(backend.generations[-1].prompt_ids)


def test_a_named_tool_choice_prefills_the_call_so_the_model_writes_only_its_arguments(
    client: openai.OpenAI, backend: ScriptedBackend, script: Callable[[str], None]
) -> None:
    script(' {"path": "main.py"}}\n</tool_call>')
    choice = ask(client, tool_choice={"type": "function", "function": {"name": "read_file"}}).choices[0]
    assert prompt_text(backend).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments":')
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("read_file", '{"path": "main.py"}')
    assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")


def test_a_named_tool_choice_streams_the_call_from_the_first_chunk(
    client: openai.OpenAI, script: Callable[[str], None]
) -> None:
    script(' {"path": "main.py"}}\n</tool_call>')
    chunks = list(ask(client, stream=True, tool_choice={"type": "function", "function": {"name": "read_file"}}))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.tool_calls[0].function.name == "read_file"
    pieces = [tc.function.arguments for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert "".join(pieces) == '{"path": "main.py"}'


def test_required_tool_choice_opens_a_call_and_the_model_picks_the_function(
    client: openai.OpenAI, backend: ScriptedBackend, script: Callable[[str], None]
) -> None:
    script('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    choice = ask(client, tool_choice="required").choices[0]
    assert prompt_text(backend).endswith("<|im_start|>assistant\n<tool_call>")
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_required_tool_choice_with_one_tool_names_it(
    client: openai.OpenAI, backend: ScriptedBackend, script: Callable[[str], None]
) -> None:
    script(' {"city": "Paris"}}\n</tool_call>')
    messages = [{"role": "user", "content": "Weather?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS[:1], tool_choice="required")  # type: ignore[arg-type]
    assert prompt_text(backend).endswith('<tool_call>\n{"name": "' + TOOLS[0]["function"]["name"] + '", "arguments":')
    assert response.choices[0].message.tool_calls[0].function.name == TOOLS[0]["function"]["name"]


@pytest.mark.parametrize(
    "tool_choice,tools,word",
    [
        ({"type": "function", "function": {"name": "rm_rf"}}, AGENT_TOOLS, "rm_rf"),
        ("required", None, "no tools"),
        ({"type": "function", "function": {"name": "read_file"}}, None, "no tools"),
    ],
)
def test_a_tool_choice_that_cannot_be_honoured_is_a_400(client: openai.OpenAI, tool_choice: Any, tools: Any, word: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=tool_choice)  # type: ignore[arg-type]
    assert word in caught.value.message and caught.value.body["param"] == "tool_choice"  # type: ignore[index,call-overload]


def test_the_backend_receives_one_validated_generation(client: openai.OpenAI, backend: ScriptedBackend) -> None:
    # validated once at the edge: the backend has no validate() to call and gets the final parameters
    assert not hasattr(backend, "validate")
    response = ask(client, max_tokens=7, temperature=0.5)
    generation = backend.generations[-1]
    assert len(generation.prompt_ids) == response.usage.prompt_tokens
    assert (generation.params.max_tokens, generation.params.temperature) == (7, 0.5)
