"""The server survives whatever clients send: each bad input is an OpenAI-shaped error with the right status,
and the next good request is answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import serving_in_thread
from test_serve_http import MAX_CONTEXT, MODEL, Server, running_server

from ninfer_rt.serve.app import create_app
from ninfer_rt.serve.state import ServeConfig

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[Server]:
    with running_server(tiny_qwen3) as running:
        yield running


def with_(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


def assert_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"]


def assert_still_serving(server: Server) -> None:
    response = server.post("/v1/chat/completions", GOOD)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


BAD_REQUESTS = {
    "malformed json": (b'{"model": "tiny", "messages": [', "not valid JSON"),
    "not an object": (b"[1, 2]", "JSON object"),
    "messages not a list": (with_(messages="hi"), "messages"),
    "max_tokens a string": (with_(max_tokens="5"), "max_tokens"),
    "temperature a string": (with_(temperature="hot"), "temperature"),
    "empty messages": (with_(messages=[]), "messages"),
    "unknown role": (with_(messages=[{"role": "wizard", "content": "x"}]), "role"),
    "user without content": (with_(messages=[{"role": "user"}]), "content"),
    "negative max_tokens": (with_(max_tokens=-1), "max_tokens"),
    "huge max_tokens": (with_(max_tokens=10**12), "max_tokens"),
    "max_tokens past the context": (with_(max_tokens=MAX_CONTEXT), str(MAX_CONTEXT)),
    "negative temperature": (with_(temperature=-1.0), "temperature"),
    "n > 1": (with_(n=2), "n=1"),
    "tool parameters not an object": (
        with_(tools=[{"type": "function", "function": {"name": "f", "parameters": "a string"}}]),
        "parameters",
    ),
    "tool schema of type string": (
        with_(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
        '"object"',
    ),
    "forced tool choice without tools": (with_(tool_choice="required"), "tool_choice"),
    "too many top_logprobs": (with_(logprobs=True, top_logprobs=50), "top_logprobs"),
}


@pytest.mark.parametrize("body,word", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_a_400_and_the_server_keeps_serving(server: Server, body: Any, word: str) -> None:
    assert_error(server.post("/v1/chat/completions", body), 400, word)
    assert_still_serving(server)


def test_a_prompt_over_the_context_limit_names_both_numbers(server: Server) -> None:
    long = "word " * (2 * MAX_CONTEXT)
    response = server.post("/v1/chat/completions", with_(messages=[{"role": "user", "content": long}]))
    assert_error(response, 400, str(MAX_CONTEXT), "prompt has")
    prompt_tokens = int(response.json()["error"]["message"].split("prompt has ")[1].split()[0])
    assert prompt_tokens > MAX_CONTEXT
    assert_still_serving(server)


def test_an_unknown_model_is_a_404_naming_the_served_one(server: Server) -> None:
    assert_error(server.post("/v1/chat/completions", with_(model="gpt-4")), 404, "gpt-4", MODEL)
    assert_still_serving(server)


def test_completions_validate_too(server: Server) -> None:
    assert_error(server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    assert_error(server.post("/v1/completions", {"model": MODEL, "prompt": ""}), 400, "prompt")


BAD_PROMPTS = {
    "empty text": "",
    "empty token list in a batch": [[1, 2], []],
    "token id past the vocabulary": [1, 10**6],
    "negative token id": [[-1]],
    "one prompt of a batch too long": ["hi", "word " * (2 * MAX_CONTEXT)],
}


@pytest.mark.parametrize("prompt", BAD_PROMPTS.values(), ids=BAD_PROMPTS.keys())
def test_a_bad_prompt_is_a_400_that_names_the_prompt_before_anything_runs(server: Server, prompt: Any) -> None:
    # validated once, at the edge: the error names the field, and nothing was queued for the engine
    response = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True})
    assert_error(response, 400, "prompt")
    assert response.json()["error"]["param"] == "prompt"
    assert server.state.in_flight == 0 and server.pages_in_use() == 0


def test_more_prompts_than_the_server_can_ever_hold_is_a_400_not_a_429(tiny_qwen3: Path) -> None:
    with running_server(tiny_qwen3, max_concurrency=1, max_queue=1) as small:
        response = small.post("/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1})
        assert_error(response, 400, "at most 2 prompts")
        assert small.post("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}).status_code == 200


def test_a_wrong_or_missing_api_key_is_a_401(tiny_qwen3: Path) -> None:
    with running_server(tiny_qwen3, api_key="sekrit") as guarded:
        assert_error(guarded.post("/v1/chat/completions", GOOD), 401, "API key")
        assert_error(guarded.post("/v1/chat/completions", GOOD, headers={"authorization": "Bearer nope"}), 401)
        ok = guarded.post("/v1/chat/completions", GOOD, headers={"authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert httpx.get(guarded.url + "/health").status_code == 200  # probes need no key


def test_a_full_queue_is_a_429_with_retry_after(tiny_qwen3: Path) -> None:
    with running_server(tiny_qwen3, max_concurrency=1, max_queue=0) as small:
        long = with_(max_tokens=MAX_CONTEXT - 64, ignore_eos=True, stream=True)
        with httpx.stream("POST", small.url + "/v1/chat/completions", json=long, timeout=60) as first:
            lines = first.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)
            response = small.post("/v1/chat/completions", GOOD)
            assert_error(response, 429, "capacity")
            assert response.headers["retry-after"] == "1"
        deadline = time.monotonic() + 2
        while small.state.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert small.post("/v1/chat/completions", GOOD).status_code == 200


def test_an_engine_failure_fails_the_request_and_marks_the_server_unhealthy(tiny_qwen3: Path) -> None:
    with running_server(tiny_qwen3) as doomed:
        assert doomed.state.backend is not None

        def broken_step() -> None:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED (crash context in /tmp/crash.json)")

        doomed.state.backend._loop.engine.step = broken_step  # type: ignore[attr-defined]
        assert_error(doomed.post("/v1/chat/completions", GOOD), 500, "CUDA_ERROR_LAUNCH_FAILED", "crash.json")
        health = httpx.get(doomed.url + "/health")
        assert health.status_code == 503 and "CUDA_ERROR_LAUNCH_FAILED" in health.json()["error"]


def test_health_is_503_while_the_model_loads(tiny_qwen3: Path) -> None:
    release = threading.Event()

    def slow_load() -> Any:
        release.wait(30)
        raise RuntimeError("no model today")

    app = create_app(slow_load, ServeConfig(served_model_name=MODEL))
    with serving_in_thread(app) as url:
        deadline = time.monotonic() + 10
        while True:
            try:
                health = httpx.get(url + "/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        release.set()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/health").status_code == 503
        assert "no model today" in httpx.get(url + "/health").json()["error"]
