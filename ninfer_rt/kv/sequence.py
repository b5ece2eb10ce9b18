"""SequenceKV: one request's view of the paged KV — its block table and the tokens stored in it.

`pages[i]` holds token positions [i * page_size, (i + 1) * page_size). `token_ids` are the tokens whose
K/V are stored (committed after the step that wrote them); `hashes[i]` is the chain hash of full page i
once it has been indexed by the prefix cache. Pure bookkeeping: the pool and the prefix cache are driven by
KVManager, so this object never touches streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ninfer_rt.kv.cow import TailCopy


@dataclass
class SequenceKV:
    page_size: int
    pages: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # tokens the prefix cache supplied at admission (skipped by prefill)
    pending_copy: TailCopy | None = None  # a tail copy-on-write prepared but not yet completed
    lane: object = None
    # `pages` as an array, rebuilt only when the list changed (every page_size tokens): converting a
    # 114k-token sequence's ~1,800 page ids twice per decode step cost ~0.1 ms of host time.
    _page_snapshot: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    _page_array: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def full_pages(self) -> int:
        return self.num_tokens // self.page_size

    def pages_needed(self, new_tokens: int) -> int:
        """Pages to allocate before `new_tokens` more tokens can be written."""
        required = -(-(self.num_tokens + new_tokens) // self.page_size)
        return max(0, required - len(self.pages))

    def slot_mapping(self, new_tokens: int) -> np.ndarray:
        """int32 slot (page * page_size + offset) for each of the next `new_tokens` tokens."""
        return self.slots(np.arange(self.num_tokens, self.num_tokens + new_tokens))

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """int32 slot (page * page_size + offset) of each token position."""
        pages = self.page_array()[positions // self.page_size]
        return (pages * self.page_size + positions % self.page_size).astype(np.int32)

    def block_table_row(self, width: int) -> np.ndarray:
        """int32 [width]: page ids in order, -1 where unused."""
        if len(self.pages) > width:
            raise ValueError(f"sequence holds {len(self.pages)} pages; the block table has room for {width}")
        row = np.full(width, -1, np.int32)
        row[: len(self.pages)] = self.page_array()
        return row

    def page_array(self) -> np.ndarray:
        """int64 page ids, as `pages` holds them now (a list compare, not a conversion, when unchanged)."""
        if self._page_snapshot != self.pages:
            self._page_snapshot = list(self.pages)
            self._page_array = np.asarray(self.pages, np.int64)
        return self._page_array

    def tail(self) -> tuple[int, list[int]] | None:
        """(page, token ids) of the partial last page, or None when every stored token is in a full page."""
        stored = self.num_tokens % self.page_size
        if stored == 0:
            return None
        return self.pages[self.full_pages], self.token_ids[-stored:]
