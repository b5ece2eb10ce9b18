"""Tool calls through a real server and the official openai client, with a backend that plays scripted
model text (the tiny model writes gibberish, never a well-formed call)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import healthy_server
from test_tokenizer import TOOLS

from ninfer_rt.engine.output import RequestOutput, RequestStats
from ninfer_rt.engine.request import FinishReason, SamplingParams
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.app import ServeConfig, create_app

MODEL = "scripted"
WEATHER_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@dataclass
class ScriptedBackend:
    """Answers every request with `script`, a few characters per output, like a model's token deltas."""

    tokenizer: Tokenizer
    script: str = WEATHER_CALL
    context_limit: int = 4096
    piece: int = 3
    prompts: list[list[int]] = field(default_factory=list)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        pass

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        self.prompts.append(list(prompt_ids))
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
    return ScriptedBackend(Tokenizer(tiny_qwen3))


@pytest.fixture(scope="module")
def client(backend: ScriptedBackend) -> Iterator[openai.OpenAI]:
    app = create_app(lambda: backend, ServeConfig(served_model_name=MODEL))
    with healthy_server(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kwargs)  # type: ignore[arg-type]


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
