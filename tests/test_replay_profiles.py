"""Issue 11's CI gate: every profile, at small scale, replayed by `ninfer-rt replay` against a real CPU
server with the ordering verifier on. Each must finish with zero errors and zero ordering violations and
leave the KV pages idle; the long conversation and the agent profile must hit the prefix cache for >= 90%
of every prompt from turn 2 on; the profiles that ask for prompts ≡ 41 (mod 64) must get them."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ninfer_rt.cli import main
from ninfer_rt.replay.profiles import PROFILES, make_profile
from ninfer_rt.replay.trace import write_trace
from tests.replay_helpers import verified_server

CI_SCALE = 0.05
ROOMY_PAGES = 128  # 8192 tokens: the agent profile's ~3k-token conversation and its side lane fit
SATURATED_PAGES = 40  # fewer than the distinct prompts of profiles 1 and 6 need: the cache must evict

KV_PAGES = {"prefix-saturation": SATURATED_PAGES, "unaligned-tail": SATURATED_PAGES}
MIN_CACHED_RATIO = {"long-conversation": 0.9, "agent": 0.9}
ALIGNED = {"unaligned-tail", "agent"}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # numpy's BLAS threads only fight the server, the engine loop and the replayer on a small CI machine
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def replay(url: str, turns_file: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    summary_file = turns_file.with_suffix(".summary.json")
    result = CliRunner().invoke(main, ["replay", str(turns_file), "--url", url, "--no-progress",
                                       "--summary-json", str(summary_file), *args])
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    # an exception inside the replayer leaves no output of its own: show its traceback instead
    output = result.output + ("".join(traceback.format_exception(result.exception)) if crashed else "")
    return result.exit_code, summary, output


@pytest.mark.parametrize("profile", list(PROFILES))
def test_profile_replays_cleanly_at_small_scale(profile: str, tiny_qwen3: Path, tmp_path: Path) -> None:
    trace = tmp_path / f"{profile}.jsonl"
    requests = write_trace(make_profile(profile, CI_SCALE), trace)
    with verified_server(tiny_qwen3, kv_pages=KV_PAGES.get(profile, ROOMY_PAGES)) as server:
        code, summary, output = replay(server.url, trace)
    print(f"\n{profile}: {requests} requests, cached ratio {summary.get('cached_ratio_after_first')}, "
          f"{summary.get('wall_s')} s\n{output}")
    assert code == 0, output
    assert summary["requests"] == requests and summary["errors"] == 0
    assert summary["server"]["ordering_violations"] == 0
    assert summary["server"]["kv_pages"]["idle"], summary["server"]
    if profile in MIN_CACHED_RATIO:
        assert summary["cached_ratio_after_first"] >= MIN_CACHED_RATIO[profile]
    if profile in ALIGNED:
        assert summary["aligned"] > 0 and summary["misaligned"] == 0
    if profile in KV_PAGES:
        # whether a page or two is free at the end depends on which lane finished last; evictions do not
        assert summary["server"]["kv_pages"]["evictions"] > 0, "the profile should have overflowed the cache"


def test_records_are_written_one_json_line_per_request(tiny_qwen3: Path, tmp_path: Path) -> None:
    trace = tmp_path / "agent.jsonl"
    requests = write_trace(make_profile("agent", 0.01), trace)
    records_file = tmp_path / "records.jsonl"
    with verified_server(tiny_qwen3, kv_pages=ROOMY_PAGES) as server:
        code, _, output = replay(server.url, trace, "--out", str(records_file))
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert code == 0, output
    assert [r["index"] for r in records] == list(range(requests))
    assert {r["lane"] for r in records} == {"agent", "side"}
    assert all(r["status"] == 200 and r["prompt_tokens"] > 0 for r in records)


def test_the_mixed_profile_holds_every_profile_with_its_lanes_and_conversations_kept_apart() -> None:
    mixed = make_profile("mixed", 0.02)
    alone = {name: make_profile(name, 0.02) for name in PROFILES}
    assert len(mixed) == sum(len(turns) for turns in alone.values())
    for name, turns in alone.items():
        mine = [t for t in mixed if t.lane.startswith(f"{name}/")]
        assert [(t.lane, t.conversation) for t in mine] == [(f"{name}/{t.lane}", f"{name}/{t.conversation}") for t in turns]
        assert [t.content for t in mine] == [t.content for t in turns]
