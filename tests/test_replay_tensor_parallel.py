"""Replay profile 7 (agent: a retained conversation re-activated turn after turn beside a second lane)
against a real CPU server on the tiny Qwen3.5 hybrid split over two simulated ranks, int8 KV and MTP
drafting, the ordering verifier on: no errors, no ordering violations, pages and state slots balanced at
idle. The collectives and every rank's share of the pages and slots are checked with the engine's ops."""

from __future__ import annotations

from pathlib import Path

from ninfer_rt.replay.profiles import PROFILES, make_profile
from ninfer_rt.replay.trace import write_trace
from tests.replay_helpers import verified_server
from tests.test_replay_profiles import ROOMY_PAGES, replay

AGENT = list(PROFILES)[6]
SCALE = 0.03  # a few turns: every rank runs every op, so a step costs about twice the unsharded one


def test_agent_profile_replays_cleanly_on_two_simulated_ranks(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    trace = tmp_path / f"{AGENT}.jsonl"
    requests = write_trace(make_profile(AGENT, SCALE), trace)
    with verified_server(tiny_qwen3_5, kv_pages=ROOMY_PAGES, kv_dtype="int8", spec="mtp", tensor_parallel=2) as server:
        code, summary, output = replay(server.url, trace)
        slots = server.engine().state_stats()
    assert code == 0, (output, summary)
    assert summary["requests"] == requests and summary["errors"] == 0
    assert summary["server"]["ordering_violations"] == 0
    assert summary["server"]["kv_pages"]["idle"], summary["server"]
    assert slots.in_use == 0 and slots.balanced, slots
