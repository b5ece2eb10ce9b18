"""Crash context: what each stream was last asked to do, written to one JSON file when CUDA fails.

A sticky CUDA error (e.g. CUDA_ERROR_LAUNCH_FAILED) surfaces at the next sync point, long after the op
that caused it was enqueued. The ring of recent ops per stream, the engine's per-lane frontier and the
open KV transactions are what a post-mortem needs, so they are kept always (a deque append per op) and
dumped before the error propagates.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RING_LENGTH = 64
_RESERVED_SECTIONS = frozenset({"time", "error", "streams"})


@dataclass(frozen=True)
class OpRecord:
    seq: int
    label: str
    lane: object
    reads: tuple
    writes: tuple

    def as_json(self) -> dict:
        return {
            "seq": self.seq,
            "label": self.label,
            "lane": _jsonable(self.lane),
            "reads": [_jsonable(r) for r in self.reads],
            "writes": [_jsonable(w) for w in self.writes],
        }


class OpRing:
    """The last RING_LENGTH ops of one stream (or host thread).

    `note` runs on every enqueue whether or not the verifier is on, so it only appends a plain tuple;
    the records are built when a dump asks for them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seq = 0
        self._ops: deque[tuple] = deque(maxlen=RING_LENGTH)

    def note(self, label: str, lane: object, reads: tuple, writes: tuple) -> int:
        self.seq += 1
        self._ops.append((self.seq, label, lane, reads, writes))
        return self.seq

    def records(self) -> list[OpRecord]:
        # list() copies the deque in one C call, so a thread still enqueueing cannot break the dump.
        return [OpRecord(*op) for op in list(self._ops)]


class CrashContext:
    """Per-stream op rings plus named sections that other layers (engine, KV) contribute."""

    def __init__(self) -> None:
        self.rings: list[OpRing] = []
        self._sections: dict[str, Callable[[], object]] = {}

    def ring(self, name: str) -> OpRing:
        ring = OpRing(name)
        self.rings.append(ring)
        return ring

    def add_section(self, name: str, provider: Callable[[], object]) -> None:
        """`provider()` is called at dump time and returns JSON-able data: the engine adds its per-lane
        frontier and the KV layer its open transactions and page table summary this way."""
        if name in _RESERVED_SECTIONS:
            raise ValueError(f"crash-context section {name!r} would overwrite the dump's own {name!r} field")
        self._sections[name] = provider

    def snapshot(self, error: str | None = None) -> dict:
        doc: dict = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "error": error,
            "streams": {r.name: [op.as_json() for op in r.records()] for r in list(self.rings)},
        }
        for name, provider in self._sections.items():
            try:
                doc[name] = _jsonable(provider())
            except Exception as exc:  # a broken provider must not hide the crash being reported
                doc[name] = f"<section failed: {exc!r}>"
        return doc

    def dump(self, path: str | os.PathLike | None = None, error: str | None = None) -> Path:
        """Write the snapshot atomically; returns the path written."""
        if path is None:
            directory = Path(os.environ.get("NINFER_CRASH_DIR", tempfile.gettempdir()))
            path = directory / f"ninfer-crash-{os.getpid()}-{time.time_ns()}.json"
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.snapshot(error), indent=1))
        tmp.replace(path)
        return path


def _jsonable(value: object) -> object:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "as_json"):  # ordering.Span, and any section object that knows its JSON form
        return _jsonable(value.as_json())
    if hasattr(value, "item") and callable(value.item):  # numpy scalars (page ids, lane ids)
        return _jsonable(value.item())
    return repr(value)
