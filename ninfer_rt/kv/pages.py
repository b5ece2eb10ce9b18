"""PagePool: which KV pages are free, in use (reference-counted) or cached, and when each may be reused.

Every page is in exactly one state, so `free + in_use + cached == total` always holds (`stats()`, /metrics):
- free: nobody references it and it holds nothing worth keeping;
- in_use: reference count > 0 (one per sequence whose block table lists it);
- cached: reference count 0 but it holds a prefix-cache entry (`retain`); evictable, least recently
  released first. `share` re-activates it; `allocate` evicts it when the free list runs dry and tells the
  prefix cache through `on_evict` so the entry disappears with the contents.

Rule 4 (page frees are fenced): `release(pages, fence)` takes the event recorded after the last op that
touched the pages. A page collects the fences of every release since it was last handed out; whoever gets
it next (`allocate` or `share`) makes its stream wait on all of them before returning, so the next owner's
first access is ordered after every earlier access, on the GPU and in the verifier. Waiting (rather than
handing out only pages whose fence has completed) keeps the host from ever blocking on the GPU. After the
wait the fence list is cleared: the next owner's own release fence is recorded behind that wait and so
covers the old ones.

Running out is the scheduler's business: it asks `can_allocate(n)` before admitting or growing a sequence;
`allocate` raising `OutOfPages` means the scheduler skipped that check.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ninfer_rt.cuda.streams import Event, Stream


class OutOfPages(RuntimeError):
    """allocate() asked for more pages than are free or evictable (the scheduler must check first)."""


@dataclass(frozen=True)
class PoolStats:
    total: int
    free: int
    in_use: int
    cached: int
    evictions: int

    @property
    def balanced(self) -> bool:
        return self.free + self.in_use + self.cached == self.total


@dataclass
class _Page:
    refcount: int = 0
    retained: bool = False  # holds a prefix-cache entry: goes to `cached`, not `free`, at refcount 0
    fences: list[Event] = field(default_factory=list)


class PagePool:
    def __init__(self, num_pages: int, on_evict: Callable[[int], None] | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.total = num_pages
        self.on_evict = on_evict
        self.evictions = 0
        self._pages = [_Page() for _ in range(num_pages)]
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._in_use = 0

    # -- queries ---------------------------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + len(self._cached)

    def refcount(self, page: int) -> int:
        return self._pages[page].refcount

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def stats(self) -> PoolStats:
        return PoolStats(self.total, len(self._free), self._in_use, len(self._cached), self.evictions)

    # -- hand-out --------------------------------------------------------------------------------------

    def allocate(self, n: int, stream: Stream) -> list[int]:
        """`n` private pages (reference count 1), usable on `stream` once this returns."""
        if not self.can_allocate(n):
            stats = self.stats()
            raise OutOfPages(f"asked for {n} pages; {stats.free} free and {stats.cached} evictable")
        pages = [self._take_free_or_evict() for _ in range(n)]
        for page in pages:
            self._hand_to(page, stream)
        return pages

    def share(self, pages: Iterable[int], stream: Stream) -> None:
        """One more reference to each page (a prefix hit); cached pages become in use again."""
        for page in pages:
            state = self._pages[page]
            if state.refcount == 0:
                if page not in self._cached:
                    raise ValueError(f"page {page} is free: only in-use or cached pages can be shared")
                del self._cached[page]
            self._hand_to(page, stream)

    def release(self, pages: Iterable[int], fence: Event) -> None:
        """Drop one reference to each page; `fence` was recorded after the last op touching them.

        Pages reaching zero references become cached (if retained) or free. Release a sequence's pages
        last-to-first so its deepest pages are the first evicted and its shared root stays longest."""
        for page in pages:
            state = self._pages[page]
            if state.refcount <= 0:
                raise ValueError(f"page {page} released more often than it was referenced")
            state.fences.append(fence)
            state.refcount -= 1
            if state.refcount == 0:
                self._in_use -= 1
                if state.retained:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    # -- prefix-cache membership -----------------------------------------------------------------------

    def retain(self, page: int) -> None:
        """The page now holds a prefix-cache entry: keep it cached instead of freeing it at refcount 0."""
        if self._pages[page].refcount == 0:
            raise ValueError(f"page {page} must be in use to be retained (its contents are being cached)")
        self._pages[page].retained = True

    def evict(self, n: int) -> int:
        """Free up to `n` cached pages, least recently released first; returns how many were evicted."""
        count = min(n, len(self._cached))
        for _ in range(count):
            self._free.append(self._evict_oldest())
        return count

    # -- internals -------------------------------------------------------------------------------------

    def _take_free_or_evict(self) -> int:
        return self._free.pop() if self._free else self._evict_oldest()

    def _evict_oldest(self) -> int:
        page, _ = self._cached.popitem(last=False)
        self._pages[page].retained = False
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def _hand_to(self, page: int, stream: Stream) -> None:
        state = self._pages[page]
        self._wait_for_fences(state, stream)
        state.fences = []
        if state.refcount == 0:
            self._in_use += 1
        state.refcount += 1

    def _wait_for_fences(self, state: _Page, stream: Stream) -> None:
        for fence in state.fences:
            stream.wait(fence)
