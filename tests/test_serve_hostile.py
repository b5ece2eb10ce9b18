"""What a hostile client found, each case pinned: every failure is a JSON error with the right status and
the field named, never a plain-text 500, never a non-finite number in JSON or SSE; and a property-based
fuzz over the request schemas and over raw bytes: never a 5xx, always JSON, and the server keeps serving."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_errors import GOOD, assert_error, assert_still_serving, with_
from test_serve_http import MODEL, Server, running_server


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[Server]:
    with running_server(tiny_qwen3) as running:
        yield running


def strict_json(text: str) -> Any:
    """JSON as the spec defines it: NaN and Infinity (which Python's json writes and reads) are refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def sse_events(response: httpx.Response) -> list[Any]:
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [strict_json(item) for item in data if item != "[DONE]"]


# -- logprobs beyond the sampling support ---------------------------------------------------------------

NARROW = {"temperature": 1.0, "top_k": 2, "seed": 7, "max_tokens": 4, "ignore_eos": True}


def test_top_logprobs_beyond_the_top_k_support_are_left_out_not_infinite(server: Server) -> None:
    response = server.post("/v1/chat/completions", with_(**NARROW, logprobs=True, top_logprobs=5))
    assert response.status_code == 200, response.text
    entries = strict_json(response.text)["choices"][0]["logprobs"]["content"]
    assert len(entries) == 4
    for entry in entries:
        assert math.isfinite(entry["logprob"])
        # two tokens have probability > 0; the other three asked for have none and are not listed
        assert len(entry["top_logprobs"]) == 2


def test_streamed_logprobs_stay_json(server: Server) -> None:
    response = server.post("/v1/chat/completions", with_(**NARROW, logprobs=True, top_logprobs=5, stream=True))
    chunks = sse_events(response)
    entries = [e for c in chunks for e in ((c["choices"] or [{}])[0].get("logprobs") or {}).get("content", [])]
    assert len(entries) == 4 and all(len(e["top_logprobs"]) == 2 for e in entries)


def test_completion_logprobs_leave_out_impossible_alternatives(server: Server) -> None:
    body = {"model": MODEL, "prompt": "hi", "logprobs": 5, **NARROW}
    for stream in (False, True):
        response = server.post("/v1/completions", {**body, "stream": stream})
        assert response.status_code == 200, response.text
        chunks = sse_events(response) if stream else [strict_json(response.text)]
        tops = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["top_logprobs"]]
        # keyed by token text, so two tokens that decode alike share one key
        assert len(tops) == 4 and all(1 <= len(top) <= 2 for top in tops)


# -- input the server cannot take ------------------------------------------------------------------------

LONE_SURROGATE = b'"hi \\ud800 there"'


def test_text_the_tokenizer_cannot_encode_is_a_400_naming_the_field(server: Server) -> None:
    chat = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": ' + LONE_SURROGATE + b"}]}"
    response = server.post("/v1/chat/completions", chat)
    assert_error(response, 400, "tokenized")
    assert response.json()["error"]["param"] == "messages"
    completion = b'{"model": "tiny", "max_tokens": 2, "prompt": ' + LONE_SURROGATE + b"}"
    response = server.post("/v1/completions", completion)
    assert_error(response, 400, "tokenized")
    assert response.json()["error"]["param"] == "prompt"
    assert_still_serving(server)


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "raise_exception"])
def test_chat_template_kwargs_may_not_replace_the_templates_own_variables(server: Server, key: str) -> None:
    response = server.post("/v1/chat/completions", with_(chat_template_kwargs={key: []}))
    assert_error(response, 400, key)
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_may_use_names_of_python_parameters(server: Server) -> None:
    assert server.post("/v1/chat/completions", with_(chat_template_kwargs={"self": 1, "variables": 2})).status_code == 200


@pytest.mark.parametrize("depth", [100, 100_000])
def test_pathologically_nested_json_is_a_400(server: Server, depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
    assert_error(server.post("/v1/chat/completions", body + nested + b"}}"), 400, "nests deeper")
    assert_still_serving(server)


RANGES = {
    "temperature above OpenAI's 2.0": ({"temperature": 1e9}, "temperature"),
    "temperature NaN": (b"NaN", "temperature"),
    "top_p 0": ({"top_p": 0.0}, "top_p"),
    "top_p above 1": ({"top_p": 1.5}, "top_p"),
    "min_p above 1": ({"min_p": 2.0}, "min_p"),
    "presence_penalty below -2": ({"presence_penalty": -3.0}, "presence_penalty"),
    "frequency_penalty Infinity": (b"Infinity", "frequency_penalty"),
    "repetition_penalty 0": ({"repetition_penalty": 0.0}, "repetition_penalty"),
    "top_k below -1": ({"top_k": -2}, "top_k"),
    "negative stop token id": ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
}


@pytest.mark.parametrize("change,param", RANGES.values(), ids=RANGES.keys())
def test_a_sampling_value_out_of_range_is_a_400_with_param_set(server: Server, change: Any, param: str) -> None:
    if isinstance(change, bytes):  # not expressible through json.dumps of a dict: raw JSON-ish text
        body = json.dumps(GOOD)[:-1].encode() + b', "' + param.encode() + b'": ' + change + b"}"
    else:
        body = json.dumps(with_(**change)).encode()
    response = server.post("/v1/chat/completions", body)
    assert_error(response, 400, param.split(".")[0])
    assert response.json()["error"]["param"] == param


# -- routing and unexpected failures ---------------------------------------------------------------------


def test_unknown_paths_and_wrong_methods_get_openai_shaped_errors(server: Server) -> None:
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404, "/v1/nothing-here")
    assert_error(httpx.get(server.url + "/v1/chat/completions"), 405, "GET")
    assert httpx.get(server.url + "/v1/nothing-here").json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_exception_is_a_logged_counted_json_500(
    server: Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("a bug")
        yield  # an async generator, as the backend's is: the bug shows once the response is under way

    monkeypatch.setattr(server.state.backend, "generate", broken)
    before = _unexpected(server)
    with caplog.at_level(logging.ERROR, logger="ninfer_rt.serve"):
        response = server.post("/v1/chat/completions", with_(stream=stream))
    if stream:  # the stream had started: its last event is the error
        assert sse_events(response)[-1]["error"]["type"] == "server_error"
    else:
        assert_error(response, 500, "KeyError")
    assert _unexpected(server) == before + 1
    assert any(record.exc_info for record in caplog.records)
    monkeypatch.undo()
    assert_still_serving(server)


def _unexpected(server: Server) -> float:
    line = next(x for x in httpx.get(server.url + "/metrics").text.splitlines() if x.startswith("ninfer_unexpected_errors_total"))
    return float(line.split()[-1])


# -- max_completion_tokens ---------------------------------------------------------------------------------


def test_max_completion_tokens_caps_the_reply_and_wins_over_max_tokens(server: Server) -> None:
    capped = server.post("/v1/chat/completions", with_(max_completion_tokens=3, max_tokens=9, ignore_eos=True))
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 3
    assert capped.json()["choices"][0]["finish_reason"] == "length"
    over = server.post("/v1/chat/completions", with_(max_completion_tokens=10**9))
    assert_error(over, 400, "maximum context length")
    assert over.json()["error"]["param"] == "max_completion_tokens"


# -- fuzz ------------------------------------------------------------------------------------------------

ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize"]
JSON_LEAVES = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
# A valid max_tokens is kept small so that an accepted request is quick; junk is anything.
MAX_TOKENS = st.integers(-2, 3) | st.integers(10**6, 2**70) | JSON_VALUES
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"]) | JSON_VALUES},
    optional={"content": st.text(max_size=20) | JSON_VALUES, "tool_calls": JSON_VALUES, "name": JSON_VALUES},
)
OPTIONAL_FIELDS = {
    key: JSON_VALUES | st.floats(-5, 5)
    for key in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "top_logprobs", "tools",
                "tool_choice", "chat_template_kwargs", "stream", "stream_options", "n", "presence_penalty",
                "stop_token_ids", "repetition_penalty")
}
REQUESTS = st.fixed_dictionaries(
    {"max_tokens": MAX_TOKENS},
    optional={
        "model": st.just(MODEL) | JSON_VALUES,
        "messages": st.lists(MESSAGE, max_size=3) | JSON_VALUES,
        "prompt": st.text(max_size=20) | st.lists(st.integers(-3, 300), max_size=4) | JSON_VALUES,
        "max_completion_tokens": MAX_TOKENS,
        **OPTIONAL_FIELDS,
    },
)
BODIES = REQUESTS.map(lambda body: json.dumps(body).encode()) | st.binary(max_size=64)


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(ROUTES), body=BODIES)
def test_fuzzed_requests_never_get_a_5xx_and_always_json(server: Server, route: str, body: bytes) -> None:
    response = server.post(route, body)
    assert response.status_code < 500, response.text
    data = sse_events(response) if response.headers["content-type"].startswith("text/event-stream") else strict_json(response.text)
    if response.status_code >= 400:
        assert set(data["error"]) == {"message", "type", "param", "code"}


BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result", "image"]) | JSON_VALUES},
    optional={"text": JSON_VALUES, "thinking": JSON_VALUES, "id": JSON_VALUES, "name": JSON_VALUES,
              "input": JSON_VALUES, "tool_use_id": JSON_VALUES, "content": JSON_VALUES},
)
ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | JSON_VALUES,
     "content": st.text(max_size=20) | st.lists(BLOCK, max_size=3) | JSON_VALUES},
)
ANTHROPIC_REQUESTS = st.fixed_dictionaries(
    {"model": st.just(MODEL) | JSON_VALUES, "max_tokens": MAX_TOKENS},
    optional={
        "messages": st.lists(ANTHROPIC_MESSAGE, max_size=3) | JSON_VALUES,
        **{key: JSON_VALUES | st.floats(-5, 5)
           for key in ("system", "tools", "tool_choice", "thinking", "stream", "temperature", "top_p", "top_k",
                       "stop_sequences", "metadata")},
    },
)
ANTHROPIC_BODIES = ANTHROPIC_REQUESTS.map(lambda body: json.dumps(body).encode()) | st.binary(max_size=64)


@settings(max_examples=40, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]), body=ANTHROPIC_BODIES)
def test_fuzzed_anthropic_requests_never_get_a_5xx_and_errors_are_anthropic_shaped(
    server: Server, route: str, body: bytes
) -> None:
    response = server.post(route, body)
    assert response.status_code < 500, response.text
    data = sse_events(response) if response.headers["content-type"].startswith("text/event-stream") else strict_json(response.text)
    if response.status_code >= 400:
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}


def test_after_the_fuzz_the_server_still_serves(server: Server) -> None:
    assert_still_serving(server)
    assert server.state.in_flight == 0 and server.pages_in_use() == 0


# -- metrics ---------------------------------------------------------------------------------------------


def _gauge(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def test_metrics_count_errors_by_status_and_sample_the_engine(server: Server) -> None:
    server.post("/v1/chat/completions", with_(temperature=5.0))
    httpx.get(server.url + "/no/such/route")
    assert_still_serving(server)
    assert_still_serving(server)  # the second turn is a prefix-cache hit
    text = httpx.get(server.url + "/metrics").text
    assert 'ninfer_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
    assert 'ninfer_requests_total{endpoint="unmatched",status="404"}' in text
    assert _gauge(text, "ninfer_requests_running") == 0 and _gauge(text, "ninfer_requests_waiting") == 0
    assert 0 < _gauge(text, "ninfer_prefix_cache_hit_ratio") <= 1
    assert _gauge(text, "ninfer_spec_decode_num_drafts_total") == 0


def test_requests_running_counts_a_request_in_progress(server: Server) -> None:
    body = with_(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        text = httpx.get(server.url + "/metrics").text
        assert _gauge(text, "ninfer_requests_running") == 1 and _gauge(text, "ninfer_requests_in_flight") == 1
