"""tools/bench_engine.py on the CPU, on the tiny hybrid with an MTP layer: the decode rows of plain and
speculative decoding and the agent turn, whose second request skips the whole first prompt (its KV pages
and the state snapshot at its end). The GPU runs the same tool at the 27B shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_engine_bench_times_decode_mtp_rounds_and_an_agent_turn(tiny_qwen3_5: Path) -> None:
    results = sorted((REPO / "bench" / "results").glob("*.jsonl"))
    before = [path.read_bytes() for path in results]
    command = [sys.executable, str(REPO / "tools" / "bench_engine.py"), "--model", str(tiny_qwen3_5), "--device", "cpu",
               "--kv-capacity", "64", "--context", "40", "--max-tokens", "6", "--draft-tokens", "0,2",
               "--agent-turn", "130,20", "--no-append"]
    table = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()
    header, *rows = [line.split() for line in table]
    assert header[:4] == ["context", "kv_dtype", "overlap", "draft_tokens"]
    plain, plain_turn, speculative, speculative_turn = rows
    assert plain[:4] == ["40", "bf16", "True", "0"] and float(plain[4]) > 0
    assert speculative[3] == "2" and float(speculative[6]) >= 1.0  # tokens per round: the verified bonus token at least
    for turn in (plain_turn, speculative_turn):
        assert turn[0] == "150" and turn[-3] == "20" and float(turn[-2]) > 0
        assert turn[-1] == "130"  # the first turn's prompt, skipped whole: its pages and its end-of-input snapshot
    assert [path.read_bytes() for path in results] == before  # --no-append leaves bench/results alone


def test_the_engine_bench_refuses_flags_that_cannot_combine(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "tools" / "bench_engine.py"), "--model", str(tmp_path), "--no-append"]
    for flags, named in ((["--device", "cpu", "--trace"], "--device cuda"), (["--trace", "--profile-host"], "--profile-host")):
        run = subprocess.run(command + flags, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and named in run.stderr.splitlines()[-1]
