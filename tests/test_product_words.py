"""The product speaks of the product: no work-process words in the docs, code, tools or benchmark records."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACES = ("README.md", "docs", "ninfer_rt", "kernels_src", "tools", "bench")
WORK_PROCESS = re.compile(rb"session [0-9]|call [0-9]|wip-", re.IGNORECASE)


def _files() -> list[Path]:
    found = []
    for place in PLACES:
        path = ROOT / place
        found += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return found


def test_no_work_process_words_anywhere_the_product_speaks() -> None:
    hits = []
    for path in _files():
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if WORK_PROCESS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line[:120].decode(errors='replace')}")
    assert not hits, "\n".join(hits[:20])


def test_the_logs_are_named_by_gpu_date_topic_and_commit() -> None:
    for log in (ROOT / "bench" / "logs").iterdir():
        assert re.fullmatch(r"(h200|cpu)-\d{4}-\d{2}-\d{2}-[a-z0-9.-]+-[0-9a-f]{7}\.(txt|log)", log.name), log.name
