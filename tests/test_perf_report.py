"""docs/performance.md and its plots are what tools/perf_report.py makes of the committed bench/results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import perf_report  # noqa: E402 -- lives in tools/
from perf_benches import DECODE  # noqa: E402
from perf_data import current  # noqa: E402
from perf_plots import draw  # noqa: E402


@pytest.fixture(scope="module")
def regenerated() -> tuple[str, list[dict]]:
    return perf_report.build(ROOT / "bench" / "results")


def test_the_committed_page_is_the_regenerated_one(regenerated: tuple[str, list[dict]]) -> None:
    text, _ = regenerated
    assert (ROOT / "docs" / "performance.md").read_text() == text, "run: python tools/perf_report.py"


def test_the_committed_plot_data_is_the_regenerated_one(regenerated: tuple[str, list[dict]]) -> None:
    _, charts = regenerated
    committed = json.loads((ROOT / "docs" / "img" / "plots.json").read_text())
    assert committed == json.loads(perf_report.plots_json(charts)), "run: python tools/perf_report.py"
    for chart in charts:
        assert (ROOT / "docs" / "img" / f"{chart['name']}.png").is_file()
        assert f"img/{chart['name']}.png" in regenerated[0]


def _decode_row(**fields: object) -> dict[str, object]:
    row = {"date": "2026-11-30T10:00:00+00:00", "gpu": "G", "commit": "abcdef0", "shape": "qwen3-8b", "context": 256,
           "kv_dtype": "bf16", "dependent_launch": True, "tok_s": 200.0, "graph_ms": 4.0, "roofline_fraction": 0.8,
           "copy_bw_TBs": 4.2}
    return row | fields


def test_the_newest_committed_row_of_a_configuration_is_current_and_the_rest_is_counted(tmp_path: Path) -> None:
    rows = [
        _decode_row(tok_s=100.0, date="2026-11-30T09:00:00+00:00"),
        _decode_row(tok_s=150.0),  # newest of its configuration
        _decode_row(tok_s=999.0, commit="abcdef0-var-faster", date="2026-11-30T11:00:00+00:00"),  # a variant
        _decode_row(tok_s=998.0, note="launches skipped", date="2026-11-30T11:00:00+00:00"),  # timing only
        _decode_row(tok_s=50.0, context=114812, weights="int8"),
        {k: v for k, v in _decode_row().items() if k != "graph_ms"},
        _decode_row(commit="unknown"),
    ]
    (tmp_path / "decode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = current(DECODE, tmp_path)
    assert [(r["context"], r["weights"], r["tok_s"]) for r in found.rows] == [(256, "bf16", 150.0), (114812, "int8", 50.0)]
    assert found.read == 7 and found.variants == 2
    assert dict(found.skipped) == {"no `graph_ms`": 1, "no commit recorded": 1}
    assert "2 variant or timing-only rows not current" in perf_report.accounting(found)


def test_every_plot_draws(regenerated: tuple[str, list[dict]], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for chart in regenerated[1]:
        draw(chart, tmp_path)
        assert (tmp_path / f"{chart['name']}.png").stat().st_size > 10_000
