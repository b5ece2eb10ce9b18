"""Chunks and workspace of the split chunked delta rule (kernels_src/gdn_chunked_split.cu): pure functions.

A sequence of more than RECURRENT_MAX_ROWS rows is cut into chunks at every multiple of CHUNK from its first
row and at every row count a target may ask for (len - S + 1 .. len - 1 with S the step's target width; a
padded target cuts too, so the cuts depend only on the query lengths and S, as a captured launch's must).
Chunk c of a sequence covers the row counts [chunk_point(c), chunk_point(c + 1)); the kernels compute the
same points in closed form (gdn_chunked_split.cu's chunk_point), so any block finds its chunk without a
scan. The chunks of the step's chunked sequences are numbered consecutively (chunk_bases): that number
indexes the per-chunk states the sequential pass stores for the output pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CHUNK = 64
RECURRENT_MAX_ROWS = 8  # kRecurrentMaxRows: decode and k+1-row verification; longer sequences are chunked


def _extra_cuts(length: int, num_targets: int) -> range:
    """Target row counts strictly inside the sequence (those on the 64-grid are cuts anyway)."""
    return range(max(1, length - num_targets + 1), length)


def chunk_count(length: int, num_targets: int) -> int:
    extra = sum(1 for n in _extra_cuts(length, num_targets) if n % CHUNK)
    return 1 + (length - 1) // CHUNK + extra


def chunk_point(length: int, num_targets: int, c: int) -> int:
    """The row count at which chunk c starts (chunk_count's point is the length): the extra cut whose place
    among the sorted cuts is c, else the multiple of CHUNK left once the extra cuts before c are counted."""
    if c == 0:
        return 0
    before = rank = 0
    for n in _extra_cuts(length, num_targets):
        if n % CHUNK == 0:
            continue
        place = 1 + (n - 1) // CHUNK + rank
        rank += 1
        if place == c:
            return n
        before += place < c
    return min(length, CHUNK * (c - before))


def is_chunked(length: int) -> bool:
    return length > RECURRENT_MAX_ROWS


def chunk_bases(query_lens: Sequence[int], num_targets: int) -> list[int]:
    """The number of each sequence's first chunk among the step's chunks (short sequences have none);
    the last entry is the step's total."""
    bases = [0]
    for n in query_lens:
        bases.append(bases[-1] + (chunk_count(n, num_targets) if is_chunked(n) else 0))
    return bases


def max_chunks(query_lens: Sequence[int], num_targets: int) -> int:
    """The most chunks of one sequence: the x extent of the per-chunk passes' grids."""
    return max((chunk_count(n, num_targets) for n in query_lens if is_chunked(n)), default=0)


def max_step_chunks(rows: int, seqs: int, num_targets: int) -> int:
    """A bound on chunk_bases' total over any step of at most `rows` rows in `seqs` sequences: a sequence of
    n rows has at most ceil(n / CHUNK) grid chunks plus num_targets - 1 extra cuts."""
    return -(-rows // CHUNK) + seqs * num_targets


@dataclass(frozen=True)
class SplitWorkspace:
    """Bytes of the arrays passed between the passes, for `rows` rows and `chunks` chunks: the scales that
    L2-normalise each row's q and k [rows, Hk, 2] f32, w [rows, Hv, dk] as a pair of bf16 planes (hi, lo: an
    f32's bytes), u (then v_new) [rows, Hv, dv] f32, cum [rows, Hv] f32, and by chunk the state before it
    transposed [chunks, Hv, dv, dk] and its k transposed and zero-padded to 64 rows [chunks, Hk, dk, 64],
    both as pairs of bf16 planes."""

    rows: int
    chunks: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    def sizes(self) -> dict[str, int]:
        rows, f32 = self.rows, 4
        return {
            "norms": rows * self.key_heads * 2 * f32,
            "w": rows * self.value_heads * self.key_dim * f32,
            "u": rows * self.value_heads * self.value_dim * f32,
            "cum": rows * self.value_heads * f32,
            "h": self.chunks * self.value_heads * self.key_dim * self.value_dim * f32,
            "kt": self.chunks * self.key_heads * self.key_dim * CHUNK * f32,
        }

    @property
    def nbytes(self) -> int:
        return sum(self.sizes().values())

    def covers(self, other: SplitWorkspace) -> bool:
        geometry = (self.key_heads, self.value_heads, self.key_dim, self.value_dim)
        same = geometry == (other.key_heads, other.value_heads, other.key_dim, other.value_dim)
        return same and self.rows >= other.rows and self.chunks >= other.chunks
