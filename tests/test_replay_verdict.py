"""What `ninfer-rt replay` concludes when things go wrong: an ordering violation inside the engine fails
its request with a 500 that names the violation and the crash-context file, is counted on /metrics, and
makes the replay exit non-zero; so does a server that dies or was never there. Plus the two routes the
harness relies on: /tokenize (exact prompt lengths) and /debug/crash-context."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from ninfer_rt.cli import main
from ninfer_rt.engine.engine import Engine
from ninfer_rt.replay.profiles import make_profile
from ninfer_rt.replay.trace import write_trace
from tests.replay_helpers import MODEL, verified_server

KV_PAGES = 64


def inject_unordered_publish(engine: Engine, at_step: int = 3) -> None:
    """From step `at_step` on, a rogue stream writes a block table the compute stream then reads without
    waiting on it: the seed's bug, injected into a running engine."""
    rogue = engine.streams.create("rogue")
    launch = engine.runner.launch  # every step's forward, with overlap or without
    steps = itertools.count()

    def launch_with_race(*args: Any, **kwargs: Any) -> Any:
        if next(steps) >= at_step:
            rogue.declare("publish block table", writes=["block-table"])
            engine.executor.compute.declare("attention", reads=["block-table"])
        return launch(*args, **kwargs)

    engine.runner.launch = launch_with_race  # type: ignore[method-assign]


def replay(url: str, tmp_path: Path, profile: str = "long-conversation") -> tuple[int, dict[str, Any], str]:
    trace, summary_file = tmp_path / "trace.jsonl", tmp_path / "summary.json"
    write_trace(make_profile(profile, 0.01), trace)
    result = CliRunner().invoke(main, ["replay", str(trace), "--url", url, "--no-progress",
                                       "--summary-json", str(summary_file)])
    return result.exit_code, json.loads(summary_file.read_text()), result.output


def test_an_ordering_violation_fails_the_request_is_counted_and_fails_the_replay(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NINFER_CRASH_DIR", str(tmp_path / "crashes"))
    with verified_server(tiny_qwen3, KV_PAGES, on_engine=inject_unordered_publish) as server:
        code, summary, output = replay(server.url, tmp_path)
    assert code == 1
    assert "HTTP 500" in summary["first_error"] and "unordered access to 'block-table'" in summary["first_error"]
    assert summary["server"]["ordering_violations"] == 1
    dumped, live = summary["crash_files"]  # the dump the 500 named, and the live context saved by the replay
    assert json.loads(Path(dumped).read_text())["error"].startswith("ordering violation")
    assert "stream:rogue" in json.loads(Path(live).read_text())["streams"]
    assert "ordering violation(s) on the server" in output


def test_a_server_that_exits_after_a_violation_fails_the_replay(tiny_qwen3: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_CRASH_DIR", str(tmp_path / "crashes"))
    with verified_server(tiny_qwen3, KV_PAGES, on_engine=inject_unordered_publish, exit_on_fatal=True) as server:
        code, summary, output = replay(server.url, tmp_path, profile="dual-lane")
    assert code == 1
    assert "ordering violation" in summary["first_error"] and summary["crash_files"]
    assert summary["server_died"] and "the server died" in output


def test_a_replay_against_no_server_fails(tmp_path: Path) -> None:
    code, summary, output = replay("http://127.0.0.1:9", tmp_path)
    assert code == 1 and summary["requests"] == 0
    assert "the server died" in output


def test_tokenize_counts_what_a_chat_request_will_prefill(tiny_qwen3: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "read main.py"}]
    body = {"model": MODEL, "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    with verified_server(tiny_qwen3, KV_PAGES) as server:
        counted = httpx.post(server.url + "/tokenize", json=body).json()
        chat = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 2}).json()
        ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": [300, 301, 302]}).json()
    assert counted["count"] == len(counted["tokens"]) == chat["usage"]["prompt_tokens"]
    assert ids["tokens"] == [300, 301, 302] and ids["max_model_len"] == 4096


def test_the_crash_context_is_served_with_verify_ordering(tiny_qwen3: Path) -> None:
    with verified_server(tiny_qwen3, KV_PAGES) as server:
        context = httpx.get(server.url + "/debug/crash-context").json()
    assert context["error"] is None
    assert context["kv"]["pages"]["total"] == KV_PAGES and "engine" in context
