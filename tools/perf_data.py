"""The current figure of every benchmark in bench/results: rows read, sorted into configurations, the newest kept.

A row's `commit` is the tree it measured. A bare commit id is that commit as committed; `<commit>-<variant>` is
that commit with a variant applied (an experiment, reported in docs/findings.md, not a current figure), except
the labels in MAIN_TREES, whose variant is the code main runs. Rows carrying a `note` measured something other
than the committed code (launches skipped for timing, a tree edited in place) and are not current either.
Within a benchmark a configuration is the values of its key fields; its current figure is its newest row.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMIT_ID = re.compile(r"[0-9a-f]{7,40}")

# Labelled trees whose measured kernels are the ones main has run since (the logs in bench/logs say which).
MAIN_TREES = {
    "6f07f36-kernels-early": "6f07f36's kernels: the dependent launch triggered before the wait",
    "efd1f84-kernels-early": "6f07f36's kernels, measured beside a later-combine variant",
    "f3f3ff1-kernels-addr": "the weight-pointer batches that landed as d2ba9d6",
    "3bfa9fb-kernels-addr": "the weight-pointer batches that landed as d2ba9d6",
    "22c344a-kernels-tested": "gemv_quant.cu as committed, measured beside a cursor variant",
    "e7b3a74-splits-default": "the default decode-attention split count, measured beside capped counts",
}


@dataclass(frozen=True)
class Column:
    header: str
    field: str  # a row's key; "a.b" reads row["a"]["b"]
    fmt: str = "{:.3g}"
    optional: bool = False  # older rows may lack it: shown as a dash, not skipped


@dataclass(frozen=True)
class Bench:
    name: str
    file: str  # under bench/results
    command: str
    key: tuple[Column, ...]
    figures: tuple[Column, ...]
    defaults: dict[str, Any] = field(default_factory=dict)  # key values older rows omit
    exclude_fields: tuple[str, ...] = ()  # rows with any of these are variants
    provenance: dict[str, str] = field(default_factory=dict)  # date/commit of a file that does not carry them
    retired: tuple[str, ...] = ()  # kernels since removed from kernels_src: their rows are history


@dataclass
class Current:
    bench: Bench
    rows: list[dict[str, Any]]  # the newest row of each configuration, in key order
    read: int = 0
    variants: int = 0
    retired: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> rows


def value(row: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


def cell(row: dict[str, Any], column: Column) -> str:
    got = value(row, column.field)
    if got is None:
        return "—"
    if isinstance(got, bool) or isinstance(got, str):
        return str(got)
    return column.fmt.format(got)


def is_current_tree(row: dict[str, Any]) -> bool:
    label = str(row.get("commit", ""))
    return "note" not in row and (COMMIT_ID.fullmatch(label) is not None or label in MAIN_TREES)


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".json":
        return [json.loads(path.read_text())]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def with_defaults(bench: Bench, row: dict[str, Any]) -> dict[str, Any]:
    """The row, its absent or null key fields given the bench's defaults and provenance."""
    filled = {k: v for k, v in (bench.provenance | bench.defaults).items() if row.get(k) is None}
    return row | filled


def current(bench: Bench, results: Path) -> Current:
    rows = [with_defaults(bench, row) for row in read_rows(results / bench.file)]
    out = Current(bench, [], read=len(rows))
    newest: dict[tuple[str, ...], dict[str, Any]] = {}
    needed = ("date", "commit") + tuple(c.field for c in bench.key + bench.figures if not c.optional)
    for row in sorted(rows, key=lambda r: str(r.get("date", ""))):
        missing = [name for name in needed if value(row, name) is None]
        if row.get("commit") == "unknown":
            out.skipped["no commit recorded"] += 1
        elif missing:
            out.skipped[f"no `{missing[0]}`"] += 1
        elif row.get("kernel") in bench.retired:
            out.retired += 1
        elif not is_current_tree(row) or any(name in row for name in bench.exclude_fields):
            out.variants += 1
        else:
            newest[tuple(cell(row, c) for c in bench.key)] = row
    out.rows = [newest[k] for k in sorted(newest, key=lambda k: tuple(_sort_key(v) for v in k))]
    return out


def _sort_key(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text.replace(",", "")), "")
    except ValueError:
        return (1, 0.0, text)


def history(bench: Bench, results: Path, where: dict[str, Any], figure: str) -> list[tuple[str, str, float]]:
    """(date, commit, figure) of every committed-tree row matching `where`, oldest first."""
    rows = [with_defaults(bench, row) for row in read_rows(results / bench.file)]
    chosen = [r for r in rows if is_current_tree(r) and all(r.get(k) == v for k, v in where.items())]
    chosen = [r for r in chosen if value(r, figure) is not None and r.get("commit") != "unknown"]
    return [(r["date"], r["commit"], value(r, figure)) for r in sorted(chosen, key=lambda r: r["date"])]
