"""Prefix cache: which pages already hold the K/V of a given token prefix.

Full pages (page_size tokens) are identified by a chained hash: `chain_hash(parent_hash, its token ids)`,
where the parent is the hash of the page before it (None for a sequence's first page). A page's hash thus
names its whole prefix, and `match` walks the chain from the root. A hash hit is confirmed by comparing
the stored token ids, so a collision costs a miss, never wrong K/V.

Tails: a finished sequence's last, partial page is catalogued by (parent hash, its token ids). The next
turn of the conversation, whose prompt starts with the previous turn, hits the full pages and then the tail;
since the new turn will write into the rest of that page, it gets a private copy (cow.py, rule 5). A prompt
that diverges inside a cached full page (a re-rendered reply that differs from the generated one) hits that
page's leading tokens the same way, so the match ends where the tokens do, not at the page boundary
before: a hybrid model's state snapshot there (kv/snapshots.py) stays reachable.

The cache owns no pages: it marks the pages it indexes as retained in the PagePool, so they are cached
(evictable, LRU) rather than freed when their last sequence lets go, and the pool tells it when it evicts one
(`forget`). A finished conversation's pages thus stay matchable until memory pressure evicts them: the
"retained catalog" of docs/ARCHITECTURE.md ("Prefix cache and the retained catalog") is simply this index plus
the pool's cached state. What else is tied to a page's contents (the state snapshots of kv/snapshots.py)
subscribes with `on_forget` and goes with it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ninfer_rt.kv.pages import PagePool


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """64-bit hash of a full page's token ids chained to its parent page's hash."""
    return _chain_hash(parent, array("q", tokens))


def _chain_hash(parent: int | None, token_ids: array | memoryview) -> int:
    """chain_hash over the page's ids as int64 (native order, as numpy's int64 bytes)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    digest.update(token_ids)
    return int.from_bytes(digest.digest(), "little")


@dataclass(frozen=True)
class TailHit:
    page: int
    num_tokens: int  # leading tokens of the page that match the prompt


@dataclass
class PrefixMatch:
    """The longest cached prefix of a prompt: full pages in order, then perhaps a partial tail."""

    page_size: int
    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    tail: TailHit | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.page_size + (self.tail.num_tokens if self.tail else 0)

    @property
    def last_hash(self) -> int | None:
        return self.hashes[-1] if self.hashes else None

    def truncated(self, position: int) -> PrefixMatch:
        """The match cut to its first `position` tokens: the full pages below it, and the page holding
        `position` (a full page of this match or its tail) as a tail hit of `position % page_size` tokens."""
        if not 0 <= position <= self.num_tokens:
            raise ValueError(f"cannot cut a match of {self.num_tokens} tokens at {position}")
        full, partial = divmod(position, self.page_size)
        tail = None
        if partial:
            page = self.pages[full] if full < len(self.pages) else self.tail.page
            tail = TailHit(page, partial)
        return PrefixMatch(self.page_size, self.pages[:full], self.hashes[:full], tail)


@dataclass(frozen=True)
class _FullEntry:
    page: int
    tokens: tuple[int, ...]
    parent: int | None


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._full: dict[int, _FullEntry] = {}
        self._children: dict[int | None, set[int]] = {}  # parent hash -> keys of its full pages
        self._tails: dict[int | None, dict[tuple[int, ...], int]] = {}
        self._hash_of_page: dict[int, int] = {}
        self._tail_of_page: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self._forget_listeners: list[Callable[[int], None]] = []
        pool.on_evict = self.forget

    def __len__(self) -> int:
        return len(self._hash_of_page) + len(self._tail_of_page)

    def indexes(self, page: int) -> bool:
        return page in self._hash_of_page or page in self._tail_of_page

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens`. Callers pass the prompt minus its last token, which must be
        computed anyway to produce logits."""
        found = PrefixMatch(self.page_size)
        size = self.page_size
        ids = memoryview(array("q", tokens))  # converted once: a 114k-token prompt is ~1,800 pages to hash
        while (len(found.pages) + 1) * size <= len(tokens):
            start = len(found.pages) * size
            page_tokens = tuple(tokens[start : start + size])
            key = _chain_hash(found.last_hash, ids[start : start + size])
            entry = self._full.get(key)
            if entry is None or entry.tokens != page_tokens:
                break
            found.pages.append(entry.page)
            found.hashes.append(key)
        found.tail = self._best_tail(found.last_hash, tokens[len(found.pages) * size :])
        return found

    def insert_full(self, parent: int | None, tokens: Sequence[int], page: int) -> int:
        """Index a just-filled page; returns its chain hash. An existing entry for the same tokens wins (the
        duplicate page is then simply freed when its sequence ends)."""
        key = chain_hash(parent, tokens)
        if key not in self._full and not self.indexes(page):
            self._full[key] = _FullEntry(page, tuple(tokens), parent)
            self._children.setdefault(parent, set()).add(key)
            self._hash_of_page[page] = key
            self.pool.retain(page)
        return key

    def insert_tail(self, parent: int | None, tokens: Sequence[int], page: int) -> None:
        """Catalogue a finished sequence's partial last page under its parent's hash and its token ids."""
        key = tuple(tokens)
        if not key or self.indexes(page) or key in self._tails.get(parent, {}):
            return
        self._tails.setdefault(parent, {})[key] = page
        self._tail_of_page[page] = (parent, key)
        self.pool.retain(page)

    def page_holding(self, parent: int | None, tokens: Sequence[int]) -> int | None:
        """The indexed page that holds the K/V of `tokens` right after the prefix `parent` names (no tokens:
        the full page `parent` itself), or None. A sequence whose page duplicated an indexed one lets its
        own go unindexed: what was tied to it (a state snapshot) moves to this one."""
        if not tokens:
            entry = self._full.get(parent)
            return None if entry is None else entry.page
        hit = self._best_tail(parent, tokens)
        return hit.page if hit is not None and hit.num_tokens == len(tokens) else None

    def on_forget(self, listener: Callable[[int], None]) -> None:
        """Call `listener(page)` whenever an indexed page is evicted, after its entry is gone."""
        self._forget_listeners.append(listener)

    def forget(self, page: int) -> None:
        """Drop the entry of an evicted page (the pool calls this)."""
        if page in self._hash_of_page:
            key = self._hash_of_page.pop(page)
            parent = self._full.pop(key).parent
            self._children[parent].discard(key)
            if not self._children[parent]:
                del self._children[parent]
        else:
            parent, tail_tokens = self._tail_of_page.pop(page)
            siblings = self._tails[parent]
            del siblings[tail_tokens]
            if not siblings:
                del self._tails[parent]
        for listener in self._forget_listeners:
            listener(page)

    def _best_tail(self, parent: int | None, rest: Sequence[int]) -> TailHit | None:
        """The cached page under `parent` that shares the most leading tokens with `rest`: a catalogued
        tail, or a full page whose first tokens match (a prompt that diverges inside it, or ends there)."""
        candidates = [*self._tails.get(parent, {}).items()]
        candidates += [(self._full[key].tokens, self._full[key].page) for key in self._children.get(parent, ())]
        best: TailHit | None = None
        for page_tokens, page in candidates:
            common = min(_common_prefix_length(page_tokens, rest), self.page_size - 1)
            if common and (best is None or common > best.num_tokens):
                best = TailHit(page, common)
        return best


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if mismatch.size else n
