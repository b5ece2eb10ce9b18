"""`ninfer-rt replay TRACE --url URL`: replay a trace against a running server and judge the run.

Exits 0 only if every request succeeded, the server is still up with no ordering violation, and its KV
pages are back to idle (nothing in use, every page free or cached); otherwise 1, with the reasons.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
from tqdm import tqdm

from ninfer_rt.replay.report import Summary, format_table, summarize, write_records
from ninfer_rt.replay.runner import ReplayConfig, Replayer, RequestRecord
from ninfer_rt.replay.server import crash_context, wait_idle
from ninfer_rt.replay.trace import Turn, read_trace


@click.command("replay")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--url", required=True, help="The server's base URL, e.g. http://127.0.0.1:8000")
@click.option("--lanes", type=click.IntRange(min=1), default=None, help="Most requests in flight (default: one per lane).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Per-request JSON lines (default: TRACE with .results.jsonl).")
@click.option("--summary-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the summary as JSON.")
@click.option("--api-key", default=None, envvar="NINFER_API_KEY")
@click.option("--model", default=None, help="Model id (default: the first /v1/models lists).")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, help="Seconds one request may take.")
@click.option("--time-limit", "time_limit_s", type=click.FloatRange(min=0), default=None,
              help="Start no turn later than this many seconds into the replay; the rest count as not sent.")
@click.option("--min-requests", type=click.IntRange(min=0), default=0,
              help="Fail unless at least this many requests were sent (with --time-limit).")
@click.option("--min-cached-ratio", type=click.FloatRange(0, 1), default=None,
              help="Fail if cached/prompt tokens over turns 2.. is below this.")
@click.option("--min-skipped-of-ideal", type=click.FloatRange(0, 1), default=None,
              help="Fail if the server skipped less than this share of the reusable prefix tokens from turn 2, "
                   "or a turn recomputed more than its new tokens + 64.")
@click.option("--expect-idle/--no-expect-idle", default=True, show_default=True,
              help="Fail unless the server's KV pages are back to idle at the end.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def replay(trace: Path, url: str, lanes: int | None, out_path: Path | None, summary_json: Path | None,
           api_key: str | None, model: str | None, timeout_s: float, time_limit_s: float | None,
           min_requests: int, min_cached_ratio: float | None, min_skipped_of_ideal: float | None, expect_idle: bool,
           progress: bool) -> None:
    """Replay TRACE (JSON lines, see ninfer_rt/replay/trace.py) through the OpenAI API."""
    turns = read_trace(trace)
    url = url.rstrip("/")
    out_path = out_path or trace.with_suffix(".results.jsonl")
    outcome = run_replay(turns, ReplayConfig(url, api_key, model, lanes, timeout_s, time_limit_s), progress)
    write_records(outcome.records, out_path)
    result = outcome.summary
    _save_crash_context(url, result, out_path)
    click.echo(format_table(result))
    click.echo(f"per-request records: {out_path}")
    if summary_json is not None:
        summary_json.write_text(json.dumps(result.as_json(), indent=1))
    reasons = result.failures(expect_idle=expect_idle, min_cached_ratio=min_cached_ratio, min_requests=min_requests,
                              min_skipped_of_ideal=min_skipped_of_ideal)
    for reason in reasons:
        click.echo(f"FAIL: {reason}", err=True)
    sys.exit(1 if reasons else 0)


@dataclass(frozen=True)
class Outcome:
    records: list[RequestRecord]
    summary: Summary


def run_replay(turns: list[Turn], config: ReplayConfig, progress: bool) -> Outcome:
    """Replay, then read the server's state once its pages have settled."""
    bar = tqdm(total=len(turns), unit="req", disable=not progress, file=sys.stderr)

    def on_record(record: RequestRecord) -> None:
        bar.update(1)
        if record.error:
            bar.set_postfix_str("errors!", refresh=False)

    replayer = Replayer(config, on_record)
    start = time.monotonic()
    try:
        records = asyncio.run(replayer.run(turns))
    finally:
        bar.close()
    wall_s = time.monotonic() - start
    server = wait_idle(config.url)
    died = replayer.server_died or (None if server.reachable else "unreachable after the replay")
    return Outcome(records, summarize(records, wall_s, server, died, replayer.not_sent))


def _save_crash_context(url: str, summary: Summary, out_path: Path) -> None:
    """With a violation on a still-running server, keep its live crash context next to the records."""
    if not (summary.server and summary.server["ordering_violations"]):
        return
    context = crash_context(url)
    if context is not None:
        path = out_path.with_suffix(".crash-context.json")
        path.write_text(json.dumps(context, indent=1))
        summary.crash_files.append(str(path))
