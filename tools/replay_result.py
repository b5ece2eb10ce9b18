"""Prints the bench/results/replay.jsonl line of a replay from its --summary-json file (tools/replay_gpu.sh
appends it to $OUT/results/replay.jsonl; the line says which model, GPU and commit it measured)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import click

from ninfer_rt.replay.report import results_line


@click.command()
@click.argument("summary_json", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, help="The model's shape name (qwen3-8b) or directory.")
@click.option("--profile", required=True)
@click.option("--scale", type=float, required=True)
@click.option("--kv-dtype", required=True)
@click.option("--lanes", type=int, required=True, help="The server's --max-concurrency.")
@click.option("--gpu", default="unknown")
@click.option("--commit", default="unknown")
@click.option("--replay-exit", type=int, required=True, help="`ninfer-rt replay`'s exit status (0: passed).")
@click.option("--server-exit", type=int, default=None, help="The server's exit status after SIGTERM (0: drained).")
def main(summary_json: Path, replay_exit: int, server_exit: int | None, **run: object) -> None:
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    line = results_line(json.loads(summary_json.read_text()), date=date, **run)
    passed = replay_exit == 0 and server_exit in (None, 0)
    click.echo(json.dumps({**line, "server_exit": server_exit, "passed": passed}))


if __name__ == "__main__":
    main()
