"""The OpenAI server end to end on CPU: a real uvicorn on a free port, the tiny model, the official openai
client and raw HTTP. The tiny model writes gibberish, so these tests check shapes, counts, caching and
robustness; what the parser makes of real model text is tested in test_parsing.py."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import healthy_server
from test_tokenizer import TOOLS

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.app import create_app
from ninfer_rt.serve.backend import EngineBackend
from ninfer_rt.serve.chat import ChatTemplate
from ninfer_rt.serve.state import ServeConfig, ServerState

MODEL = "tiny"
MAX_CONTEXT = 1024
LONG_SYSTEM = "You are a careful coding agent. " + "Read the code before you change it. " * 10


@dataclass
class Server:
    url: str
    state: ServerState

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kwargs)

    def pages_in_use(self) -> int:
        assert self.state.backend is not None
        return self.state.backend.kv_stats().in_use


@contextmanager
def running_server(model_dir: Path, engine_options: dict[str, Any] | None = None, **serve_options: Any) -> Iterator[Server]:
    engine_config = EngineConfig(
        device="cpu", max_context=MAX_CONTEXT, kv_capacity="64", max_concurrency=2, **(engine_options or {})
    )
    config = ServeConfig(served_model_name=MODEL, **serve_options)
    app = create_app(lambda: EngineBackend.start(lambda: Engine.load(model_dir, engine_config)), config)
    with healthy_server(app) as url:
        yield Server(url, app.state.server)


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[Server]:
    with running_server(tiny_qwen3) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


def chat(server: Server, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return server.client().chat.completions.create(model=MODEL, messages=messages, **kwargs)  # type: ignore[arg-type]


def assistant_turn(response: Any) -> dict[str, Any]:
    """The assistant message as an agent sends it back: content, reasoning_content and tool calls."""
    message = response.choices[0].message
    turn: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    return turn


# -- happy paths --------------------------------------------------------------------------------------------


def test_health_models_and_metrics_answer(server: Server) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'ninfer_kv_pages{state="free"}' in metrics


def test_models_can_be_read_one_by_one(server: Server) -> None:
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_CONTEXT
    assert server.client().models.retrieve(MODEL).id == MODEL
    missing = httpx.get(server.url + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_chat_completion_reports_exact_usage(server: Server, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    response = chat(server, messages, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
    assert tokenizer.chat_template is not None
    prompt = ChatTemplate(tokenizer.chat_template).render(messages, preserve_thinking=True).text
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
    # one logprob entry per generated token, EOS included, is what completion_tokens counts
    assert response.usage.completion_tokens == len(response.choices[0].logprobs.content)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.choices[0].finish_reason in ("stop", "length")
    assert all(len(entry.top_logprobs) == 2 for entry in response.choices[0].logprobs.content)


def test_streaming_chat_matches_the_non_streaming_answer_and_ends_with_usage(server: Server) -> None:
    messages = [{"role": "user", "content": "Count to three"}]
    kwargs: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole = chat(server, messages, **kwargs)
    chunks = list(chat(server, messages, stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join((c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", None) or "")
                   for c in chunks if c.choices)
    whole_message = whole.choices[0].message
    assert text == (whole_message.content or "") + (getattr(whole_message, "reasoning_content", None) or "")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_text_completion_plain_and_streamed(server: Server) -> None:
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=5, temperature=0.0,
                                      logprobs=1, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 5 and len(whole.choices[0].logprobs.token_logprobs) == 5
    streamed = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=5, temperature=0.0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text


def test_a_batch_of_prompts_gets_one_choice_each_with_summed_usage(server: Server, tokenizer: Tokenizer) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {"max_tokens": 4, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    prompts = ["def fibonacci(n):", "import os", "class Stack:"]
    singles = [client.completions.create(model=MODEL, prompt=p, **kwargs) for p in prompts]
    for batch in (prompts, [tokenizer.encode(p) for p in prompts]):  # texts, or token ids
        response = client.completions.create(model=MODEL, prompt=batch, **kwargs)
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert [c.text for c in response.choices] == [s.choices[0].text for s in singles]
        assert response.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        assert response.usage.completion_tokens == 3 * 4


def test_a_streamed_batch_interleaves_its_choices_by_index(server: Server) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    prompts = ["def fibonacci(n):", "import os"]
    whole = client.completions.create(model=MODEL, prompt=prompts, **kwargs)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    indices = [c.choices[0].index for c in chunks if c.choices]
    assert indices != sorted(indices)  # both prompts ran at once (two lanes), not one after the other
    assert chunks[-1].usage.completion_tokens == 12
    deadline = time.monotonic() + 1.0  # the slots are released just after [DONE] is sent
    while server.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.state.in_flight == 0


def test_a_tool_call_round_trip_is_accepted(server: Server) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Open main.py"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should read it.",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "print('hello')"},
    ]
    response = chat(server, messages, tools=TOOLS, max_tokens=4)
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens > 0


def test_a_named_tool_choice_makes_even_a_babbling_model_call_that_function(server: Server) -> None:
    # The tiny model never writes a call by itself; the prefilled opening makes its reply one, streamed or not.
    messages: list[dict[str, Any]] = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Open a.py"}]
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read_file"}},
                              "max_tokens": 8, "temperature": 0.0}
    whole = chat(server, messages, **kwargs)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "read_file"
    chunks = list(chat(server, messages, stream=True, **kwargs))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "read_file"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    # sent back, the forced turn renders as the model saw and wrote it: the next turn hits the cache
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    reply = {"role": "tool", "tool_call_id": call.id, "content": "print(1)"}
    second = chat(server, [*messages, turn, reply], tools=TOOLS, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * whole.usage.prompt_tokens


def test_reasoning_content_is_a_string_not_null_when_thinking_is_disabled(server: Server) -> None:
    # enable_thinking=false puts an empty think block in the prompt; a string ("" from a real model; the tiny
    # one may babble a <think>) is what renders that block again when the client sends the turn back
    response = chat(server, [{"role": "user", "content": "hi"}], max_tokens=3,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert isinstance(response.choices[0].message.reasoning_content, str)  # type: ignore[attr-defined]


def _agent_turns(server: Server, messages: list[dict[str, Any]], follow_up: dict[str, Any]) -> tuple[Any, Any]:
    first = chat(server, messages, tools=TOOLS, max_tokens=8, temperature=0.0)
    second = chat(server, [*messages, assistant_turn(first), follow_up], tools=TOOLS, max_tokens=8, temperature=0.0)
    return first, second


def test_the_second_turn_of_a_conversation_hits_the_prefix_cache(server: Server) -> None:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    _, second = _agent_turns(server, messages, {"role": "user", "content": "Now run it again."})
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens >= 0.9 * second.usage.prompt_tokens


THINKING_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the failing test."},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The loop bound looks wrong; I must read the file first. " * 8,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "for i in range(n - 1): total += i"},
]


def test_preserve_thinking_keeps_the_cache_hitting_after_a_new_user_turn(server: Server) -> None:
    _, second = _agent_turns(server, THINKING_HISTORY, {"role": "user", "content": "Thanks. Anything else?"})
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * second.usage.prompt_tokens


def test_without_preserve_thinking_a_new_user_turn_drops_old_reasoning_and_the_cache_misses(tiny_qwen3: Path) -> None:
    # Documents the cost of --no-preserve-thinking: the template removes reasoning before the last user
    # message, so the new prompt diverges from the cached one where that reasoning was: only the system
    # prompt, tools, first user message and the reply's opening before its reasoning (about 77% here: the
    # match ends at the diverging token, inside its page) still hit.
    with running_server(tiny_qwen3, preserve_thinking=False) as plain:
        _, second = _agent_turns(plain, THINKING_HISTORY, {"role": "user", "content": "Thanks. Anything else?"})
    assert second.usage.prompt_tokens_details.cached_tokens < 0.8 * second.usage.prompt_tokens


def test_with_prefix_caching_off_nothing_is_cached_and_every_page_is_freed(tiny_qwen3: Path) -> None:
    # Off must mean off: no hit, and no page left cached (indexed) after the requests end.
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    with running_server(tiny_qwen3, engine_options={"prefix_caching": False}) as cold:
        first = chat(cold, messages, max_tokens=4, temperature=0.0)
        second = chat(cold, messages, max_tokens=4, temperature=0.0)
        assert cold.state.backend is not None
        stats = cold.state.backend.kv_stats()
    assert first.usage.prompt_tokens > 2 * 64  # whole pages were filled, so there was something to index
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert (stats.cached, stats.in_use, stats.free) == (0, 0, stats.total)


def test_a_client_that_disconnects_mid_stream_has_its_pages_freed(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story"}],
            "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.pages_in_use() > 0
    deadline = time.monotonic() + 1.0
    while server.pages_in_use() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.pages_in_use() == 0
    assert server.state.in_flight == 0


def test_clients_that_drop_the_connection_right_after_sending_leave_no_slot_or_page_taken(server: Server) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
                       "stream": True, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(5):  # whatever moment the server notices, no slot may stay taken
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 2.0
    while (server.state.in_flight or server.pages_in_use()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.state.in_flight == 0 and server.pages_in_use() == 0


def test_metrics_count_requests_tokens_and_cache_hits(server: Server) -> None:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "again"}]
    chat(server, messages, max_tokens=2)
    chat(server, messages, max_tokens=2)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'ninfer_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert _metric(metrics, "ninfer_prefix_cache_hits_total") >= 1
    assert _metric(metrics, "ninfer_cached_tokens_total") > 0
    assert _metric(metrics, "ninfer_time_to_first_token_seconds_count") >= 2


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
