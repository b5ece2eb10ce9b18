"""The tiny model's corpus: Python sources already on the machine (standard library + installed packages).

Shared by tools/train_tiny_model.py and tools/eval_ppl.py (no torch here), so both draw the same held-out
split. A file's split is decided by the hash of its path *relative to its root* (the stdlib or a
site-packages dir), not its absolute path: the same module is held out on every machine, so a model
trained on one machine is never scored on its own training files elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELDOUT_PERCENT = 3
# Generated tables and vendored blobs are not code a model should learn from, and one of them can fill a cap.
MAX_FILE_BYTES = 400_000
SKIPPED_DIRS = frozenset({"test", "tests", "__pycache__"})
PROJECT_NAME = "ninfer_rt"  # the project's own sources and tests stay out of its training data


@dataclass(frozen=True)
class SourceFile:
    path: Path
    relative: str  # path relative to its root: the split key and the deterministic order key

    @property
    def key(self) -> int:
        return int.from_bytes(hashlib.sha1(self.relative.encode()).digest()[:8], "little")

    @property
    def heldout(self) -> bool:
        return self.key % 100 < HELDOUT_PERCENT


def source_roots() -> list[Path]:
    """The stdlib and every site-packages dir, most specific first (pyenv nests site-packages in the stdlib)."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    roots = {Path(p).resolve() for p in candidates if p and Path(p).is_dir()}
    return sorted(roots, key=lambda p: len(p.parts), reverse=True)


def python_sources(roots: list[Path], max_files: int | None = None) -> list[SourceFile]:
    """Every eligible .py file under `roots` once, in a fixed pseudo-random order (by key)."""
    found: dict[Path, SourceFile] = {}
    for root in roots:
        nested = {r for r in roots if r != root and root in r.parents}
        for path in _walk(root, nested):
            found.setdefault(path, SourceFile(path, path.relative_to(root).as_posix()))
    files = sorted(found.values(), key=lambda f: (f.key, f.relative))
    return files[:max_files] if max_files is not None else files


def _walk(root: Path, nested_roots: set[Path]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        # Pruning in place stops os.walk descending; nested roots are walked as roots of their own.
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIPPED_DIRS and PROJECT_NAME not in d and here / d not in nested_roots
        )
        for name in sorted(filenames):
            path = here / name
            # A symlinked file may point outside its root (Debian links sitecustomize.py into /etc).
            if name.endswith(".py") and PROJECT_NAME not in name and not path.is_symlink():
                yield path


def read_texts(files: list[SourceFile], max_bytes: int) -> list[str]:
    """UTF-8 texts of `files` in order until `max_bytes` are read; unreadable and oversized files are skipped."""
    texts, total = [], 0
    for source in files:
        if total >= max_bytes:
            break
        try:
            if source.path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = source.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(text)
            total += len(text)
    return texts


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held-out) by each file's key."""
    return [f for f in files if not f.heldout], [f for f in files if f.heldout]


def token_stream(encoded: list[list[int]], separator: int) -> np.ndarray:
    """Documents joined into one uint16 stream, each followed by `separator` (<|endoftext|>)."""
    total = sum(len(ids) + 1 for ids in encoded)
    stream = np.empty(total, dtype=np.uint16)
    offset = 0
    for ids in encoded:
        stream[offset : offset + len(ids)] = ids
        stream[offset + len(ids)] = separator
        offset += len(ids) + 1
    return stream


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens (inputs + the last target), at most ~max_tokens scored."""
    count = min(len(stream) // (seq_len + 1), max(1, max_tokens // seq_len))
    return stream[: count * (seq_len + 1)].reshape(count, seq_len + 1).astype(np.int64)
