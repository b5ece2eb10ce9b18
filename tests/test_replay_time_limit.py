"""A replay that must fit a slot of machine time (tools/replay_gpu.sh): `--time-limit` starts no turn after
it and counts the rest as not sent, `--min-requests` fails a replay that sent too few, and the results line
(tools/replay_result.py, bench/results/replay.jsonl) carries the figures the GPU run is judged by."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner

from ninfer_rt.cli import main
from ninfer_rt.replay.report import results_line, summarize
from ninfer_rt.replay.runner import RequestRecord
from ninfer_rt.replay.server import KVPages, ServerState
from ninfer_rt.replay.trace import Turn, write_trace
from tests.replay_helpers import verified_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import replay_result  # noqa: E402 -- lives in tools/, importable once tools/ is on the path

PAUSE_S = 2.0  # before each turn; the limit falls between the first turn's start and the second's
LIMIT_S = 3.0


def test_no_turn_starts_after_the_time_limit(tiny_qwen3: Path, tmp_path: Path) -> None:
    trace, summary_file = tmp_path / "paused.jsonl", tmp_path / "summary.json"
    write_trace([Turn(lane="main", content=8, max_tokens=4, think_s=PAUSE_S, seed=t) for t in range(3)], trace)
    with verified_server(tiny_qwen3, kv_pages=32) as server:
        args = ["replay", str(trace), "--url", server.url, "--no-progress", "--time-limit", str(LIMIT_S),
                "--summary-json", str(summary_file)]
        enough = CliRunner().invoke(main, args)
        too_few = CliRunner().invoke(main, [*args, "--min-requests", "2"])
    summary = json.loads(summary_file.read_text())
    assert enough.exit_code == 0, enough.output
    assert "1 (0 errors)" in enough.output and "2 not sent (time limit)" in enough.output
    assert (summary["requests"], summary["not_sent"], summary["errors"]) == (1, 2, 0)
    assert too_few.exit_code == 1
    assert "only 1 request(s) sent (2 left by the time limit), fewer than 2" in too_few.output


def _record(index: int, turn: int, ttft_s: float, gaps: list[float]) -> RequestRecord:
    return RequestRecord(index, "agent", "agent", turn, "chat", True, status=200, prompt_tokens=1000,
                         cached_tokens=900 if turn > 1 else 0, completion_tokens=len(gaps) + 1, ttft_s=ttft_s,
                         token_gaps_s=gaps, token_chunks=len(gaps) + 1)


def _summary_json() -> dict:
    records = [_record(0, 1, 0.5, [0.01, 0.02]), _record(1, 2, 0.1, [0.03])]
    server = ServerState(reachable=True, healthy=True, kv=KVPages(free=90, in_use=0, cached=10, total=100))
    return summarize(records, wall_s=12.5, server=server, server_died=None, not_sent=3).as_json()


def test_the_results_line_has_the_figures_in_milliseconds_and_the_runs_context() -> None:
    line = results_line(_summary_json(), date="2026-11-30", gpu="NVIDIA H200", commit="abc123", model="qwen3-8b")
    assert {k: line[k] for k in ("date", "gpu", "commit", "model")} == {
        "date": "2026-11-30", "gpu": "NVIDIA H200", "commit": "abc123", "model": "qwen3-8b"}
    assert (line["requests"], line["not_sent"], line["errors"], line["wall_s"]) == (2, 3, 0, 12.5)
    assert line["ttft_ms"] == {"p50": 100.0, "p90": 500.0, "p99": 500.0}
    assert line["itl_ms"] == {"p50": 20.0, "p90": 30.0, "p99": 30.0}
    assert line["cached_ratio"] == 0.9
    assert line["ordering_violations"] == 0 and line["server_alive"] is True
    assert line["kv_pages"] == {"free": 90, "in_use": 0, "cached": 10, "total": 100, "evictions": 0, "idle": True}


def test_the_results_tool_prints_one_json_line_with_the_verdict(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    summary_file.write_text(json.dumps(_summary_json()))
    args = [str(summary_file), "--model", "qwen3-8b", "--profile", "agent", "--scale", "1", "--kv-dtype", "int8",
            "--lanes", "2", "--gpu", "NVIDIA H200", "--commit", "abc123"]
    passed = CliRunner().invoke(replay_result.main, [*args, "--replay-exit", "0"])
    failed = CliRunner().invoke(replay_result.main, [*args, "--replay-exit", "1"])
    assert passed.exit_code == 0 and len(passed.output.splitlines()) == 1
    line = json.loads(passed.output)
    run = (line["model"], line["profile"], line["scale"], line["kv_dtype"], line["lanes"])
    assert run == ("qwen3-8b", "agent", 1.0, "int8", 2)
    assert line["passed"] is True and json.loads(failed.output)["passed"] is False
    assert line["date"].endswith("+00:00")
