"""A soak's verdict from tools/replay_gpu.sh's OUT_DIR: the rounds' replay summaries totalled (requests,
errors, seconds) and whether memory stayed flat, comparing the mean of the first tenth of memory.tsv's
samples (device MiB, the server's host RSS KiB) with the mean of the last tenth. Writes OUT_DIR/soak.json;
exits 1 on an error, fewer than --min-requests requests, growth above --max-growth or under 10 samples."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import click

MIN_SAMPLES = 10
COLUMNS = ("device_mib", "host_rss_kib")


def memory_growth(samples_tsv: Path) -> dict[str, Any]:
    with samples_tsv.open() as handle:
        rows = [row for row in csv.DictReader(handle, delimiter="\t") if all(row.get(c) for c in COLUMNS)]
    report: dict[str, Any] = {"samples": len(rows)}
    if len(rows) < MIN_SAMPLES:
        return report
    tenth = len(rows) // 10
    report["seconds"] = int(rows[-1]["elapsed_s"]) - int(rows[0]["elapsed_s"])
    for column in COLUMNS:
        first = sum(float(r[column]) for r in rows[:tenth]) / tenth
        last = sum(float(r[column]) for r in rows[-tenth:]) / tenth
        report[column] = {"first_tenth": round(first, 1), "last_tenth": round(last, 1),
                          "growth": round((last - first) / first, 4) if first else 0.0}
    return report


def rounds_total(out_dir: Path) -> dict[str, Any]:
    summaries = [json.loads(p.read_text()) for p in sorted(out_dir.glob("replay_summary.*.json"))]
    errors = [s["first_error"] for s in summaries if s["first_error"]]
    last_server = summaries[-1]["server"] if summaries else None
    return {"rounds": len(summaries), "requests": sum(s["requests"] for s in summaries),
            "errors": sum(s["errors"] for s in summaries), "first_error": errors[0] if errors else None,
            "wall_s": round(sum(s["wall_s"] for s in summaries), 1), "server_after": last_server}


@click.command()
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--max-growth", type=click.FloatRange(min=0), default=0.05, show_default=True)
@click.option("--min-requests", type=click.IntRange(min=0), default=1, show_default=True)
def main(out_dir: Path, max_growth: float, min_requests: int) -> None:
    report = {**rounds_total(out_dir), "memory": memory_growth(out_dir / "memory.tsv")}
    (out_dir / "soak.json").write_text(json.dumps(report, indent=1))
    click.echo(json.dumps(report))
    reasons = []
    if report["requests"] < min_requests:
        reasons.append(f"only {report['requests']} request(s), fewer than {min_requests}")
    if report["errors"]:
        reasons.append(f"{report['errors']} request(s) failed; first: {report['first_error']}")
    if report["memory"]["samples"] < MIN_SAMPLES:
        reasons.append(f"{report['memory']['samples']} memory samples, fewer than {MIN_SAMPLES} to compare tenths")
    grew = [c for c in COLUMNS if report["memory"].get(c, {}).get("growth", 0.0) > max_growth]
    if grew:
        reasons.append(f"memory grew by more than {max_growth:.0%} from the first tenth to the last: {', '.join(grew)}")
    for reason in reasons:
        click.echo(f"FAIL: {reason}", err=True)
    sys.exit(1 if reasons else 0)


if __name__ == "__main__":
    main()
