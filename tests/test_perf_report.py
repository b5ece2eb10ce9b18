"""docs/performance.md, its plots and the README's headline figures are what tools/perf_report.py makes of the
committed bench/results."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import perf_headline  # noqa: E402
import perf_report  # noqa: E402 -- lives in tools/
from perf_benches import BENCHES, DECODE, TORCH  # noqa: E402
from perf_data import current  # noqa: E402
from perf_plots import draw  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@pytest.fixture(scope="module")
def regenerated() -> perf_report.Report:
    return perf_report.build(RESULTS)


def test_the_committed_page_is_the_regenerated_one(regenerated: perf_report.Report) -> None:
    assert (ROOT / "docs" / "performance.md").read_text() == regenerated.page, "run: python tools/perf_report.py"


def test_the_committed_plot_data_is_the_regenerated_one(regenerated: perf_report.Report) -> None:
    committed = json.loads((ROOT / "docs" / "img" / "plots.json").read_text())
    assert committed == json.loads(perf_report.plots_json(regenerated.charts)), "run: python tools/perf_report.py"
    for chart in regenerated.charts:
        assert (ROOT / "docs" / "img" / f"{chart['name']}.png").is_file()
        assert f"img/{chart['name']}.png" in regenerated.page


def test_the_committed_readme_headline_table_is_the_regenerated_one(regenerated: perf_report.Report) -> None:
    readme = (ROOT / "README.md").read_text()
    assert perf_headline.with_headline(readme, regenerated.headline) == readme, "run: python tools/perf_report.py"


def test_every_headline_row_links_to_a_section_of_the_page(regenerated: perf_report.Report) -> None:
    anchors = [perf_headline.anchor(line[3:]) for line in regenerated.page.splitlines() if line.startswith("## ")]
    assert len(set(anchors)) == len(anchors)  # GitHub numbers a repeated heading's anchor; none repeats
    rows = [line for line in regenerated.headline.splitlines() if line.startswith("| ")][2:]
    links = [re.match(r"\| \[[^]]+\]\(docs/performance\.md#([^)]+)\) \|", row) for row in rows]
    assert len(rows) >= 8 and all(links), rows
    assert {link[1] for link in links if link} <= set(anchors)


def test_anchors_are_the_ones_github_gives_the_headings() -> None:
    assert perf_headline.anchor(DECODE.name) == "batch-1-decode-step-synthetic-weights-of-the-models-shape"
    assert perf_headline.anchor("Prefill and the agent turn (cached prefix + new tokens, time to first token)") == (
        "prefill-and-the-agent-turn-cached-prefix--new-tokens-time-to-first-token")
    assert perf_headline.anchor("ninfer-rt quantize_memory, 27B / 4 bits") == "ninfer-rt-quantize_memory-27b--4-bits"


def test_a_headline_whose_row_is_not_current_stops_the_report() -> None:
    found = {b.name: current(b, RESULTS) for b in BENCHES}
    found[TORCH.name].rows = [r for r in found[TORCH.name].rows if r["impl"] != "torch-eager"]
    with pytest.raises(LookupError, match="torch-eager"):
        perf_headline.headline(found)


def test_the_headline_block_replaces_only_what_lies_between_the_markers() -> None:
    start, end = perf_headline.START, perf_headline.END
    readme = f"intro\n{start}\nold table\n{end}\noutro\n"
    assert perf_headline.with_headline(readme, "new table") == f"intro\n{start}\nnew table\n{end}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        perf_headline.with_headline("intro\n", "new table")


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


def test_every_plot_draws(regenerated: perf_report.Report, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for chart in regenerated.charts:
        draw(chart, tmp_path)
        assert (tmp_path / f"{chart['name']}.png").stat().st_size > 10_000
