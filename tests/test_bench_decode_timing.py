"""tools/bench_decode.py's overlap figure: `steps` steps of the overlapped loop are timed as `steps` token
periods (each step returns when the previous step's token arrives; the last token is awaited untimed)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_decode  # noqa: E402 -- lives in tools/

PERIOD = 0.05  # seconds per token of the stand-in GPU


class PipelinedLoop:
    """OverlappedLoop on a GPU that emits a token every PERIOD: step() and finish() return when the next
    token arrives, on a fixed schedule (a late wake-up does not delay later tokens)."""

    def __init__(self, executor: object, graphed: object, context: int) -> None:
        self.next_token = time.perf_counter() + PERIOD

    def step(self) -> None:
        self._wait_for_token()

    def finish(self) -> None:
        self._wait_for_token()

    def _wait_for_token(self) -> None:
        time.sleep(max(0.0, self.next_token - time.perf_counter()))
        self.next_token += PERIOD


def test_overlapped_steps_are_timed_one_token_period_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_decode, "OverlappedLoop", PipelinedLoop)
    seconds = bench_decode.time_overlapped(None, None, 256, steps=4)  # type: ignore[arg-type]
    assert seconds == pytest.approx(PERIOD, rel=0.1)  # timing the last token too reads 5 periods over 4 steps
