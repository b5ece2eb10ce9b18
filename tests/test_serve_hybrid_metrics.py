"""/metrics of a server on the tiny hybrid: the second turn of a conversation resumes from a state snapshot
(`ninfer_state_snapshot_restores_total` counts it, a Prometheus counter, beside the restores of the replies'
warm-ups, `ninfer_reply_warmups_ended_total`) and the prompt tokens it computes
(`ninfer_prompt_tokens_computed_total`) are the turn's new ones, not the conversation so far."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_serve_http import LONG_SYSTEM, Server, chat, running_server


@pytest.fixture(scope="module")
def hybrid_server(tiny_qwen3_5: Path) -> Iterator[Server]:
    with running_server(tiny_qwen3_5) as running:
        yield running


def scrape(server: Server) -> dict[str, float]:
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return {line.split()[0]: float(line.split()[-1]) for line in lines if line and not line.startswith("#")}


def idle_scrape(server: Server) -> dict[str, float]:
    """The metrics once no reply warm-up is queued or running (they restore snapshots too)."""
    deadline = time.monotonic() + 30
    while True:
        metrics = scrape(server)
        warming = metrics.get('ninfer_reply_warmups{state="queued"}', 0) + metrics.get('ninfer_reply_warmups{state="running"}', 0)
        if not warming or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_a_second_turn_restores_a_snapshot_and_computes_only_its_new_tokens(hybrid_server: Server) -> None:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    first = chat(hybrid_server, messages, max_tokens=8, temperature=0.0)
    before = idle_scrape(hybrid_server)
    reply = {"role": "assistant", "content": first.choices[0].message.content}
    second = chat(hybrid_server, [*messages, reply, {"role": "user", "content": "Run it."}], max_tokens=8, temperature=0.0)
    after = idle_scrape(hybrid_server)
    computed = after["ninfer_prompt_tokens_computed_total"] - before["ninfer_prompt_tokens_computed_total"]
    grown = second.usage.prompt_tokens - first.usage.prompt_tokens  # the reply and the new user turn
    print(f"turn 2: {second.usage.prompt_tokens} prompt tokens, {computed:.0f} computed, {grown} past turn 1's prompt")
    # a warm-up of a re-tokenized reply (turn 2's, if its tokens are not its text's) restores one more
    warmups = sum(after.get(f'ninfer_reply_warmups_ended_total{{outcome="{o}"}}', 0)
                  - before.get(f'ninfer_reply_warmups_ended_total{{outcome="{o}"}}', 0) for o in ("completed", "aborted"))
    assert after["ninfer_state_snapshot_restores_total"] - before["ninfer_state_snapshot_restores_total"] == 1 + warmups
    assert computed == second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    assert grown - first.usage.completion_tokens <= computed <= grown  # resumed at the end of turn 1's input or later
    assert "ninfer_state_snapshot_restores " not in httpx.get(hybrid_server.url + "/metrics").text  # a counter: _total
