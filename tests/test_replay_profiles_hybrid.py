"""The seven replay profiles against a real CPU server on the tiny Qwen3.5 hybrid, with the seed's flags
(int8 KV, two lanes, MTP drafting 3 tokens over a reduced head) and the ordering verifier on: zero errors,
zero ordering violations, and at idle the KV pages, the Gated DeltaNet state slots and the snapshot
records all balanced; the agent profile (a retained conversation re-activated turn after turn beside a
second lane, prompts at 41 mod 64) resumes from state snapshots for >= 90% of its prompts from turn 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_rt.replay.profiles import PROFILES, make_profile
from ninfer_rt.replay.trace import write_trace
from tests.replay_helpers import verified_server
from tests.test_replay_profiles import ALIGNED, CI_SCALE, KV_PAGES, MIN_CACHED_RATIO, ROOMY_PAGES, replay

SEED_FLAGS = dict(kv_dtype="int8", spec="mtp", draft_tokens=3, lm_head_draft=64)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_profile_replays_cleanly_on_the_hybrid(profile: str, tiny_qwen3_5: Path, tmp_path: Path) -> None:
    trace = tmp_path / f"{profile}.jsonl"
    requests = write_trace(make_profile(profile, CI_SCALE), trace)
    with verified_server(tiny_qwen3_5, kv_pages=KV_PAGES.get(profile, ROOMY_PAGES), **SEED_FLAGS) as server:
        code, summary, output = replay(server.url, trace)
        engine = server.engine()
        slots, snapshots = engine.state_stats(), engine.snapshot_stats()
        records_held = engine.ledger.states.snapshots.records_in_use()
    print(f"\n{profile}: {requests} requests, cached ratio {summary.get('cached_ratio_after_first')}, "
          f"{summary.get('wall_s')} s, snapshots {snapshots}\n{output}")
    assert code == 0, output
    assert summary["requests"] == requests and summary["errors"] == 0
    assert summary["server"]["ordering_violations"] == 0
    assert summary["server"]["kv_pages"]["idle"], summary["server"]
    assert slots.in_use == 0 and slots.balanced, slots
    assert records_held == snapshots.count  # no restore holds a record at idle
    if profile in MIN_CACHED_RATIO:
        assert summary["cached_ratio_after_first"] >= MIN_CACHED_RATIO[profile]
    if profile in ALIGNED:
        assert summary["aligned"] > 0 and summary["misaligned"] == 0
