"""KVManager: a request's KV from admission to retirement, for the scheduler and the runner.

Lifecycle of one request (every call is made by the engine between steps, never inside one):

1. `match(prompt)` — the cached prefix (full pages, maybe a partial tail); raises ContextTooLong if the
   prompt can never fit. The prompt's last token is never matched: it must be computed for its logits.
   A hybrid's caller cuts the match at its deepest state snapshot (`PrefixMatch.truncated`) before
   admitting it: the pages past that point are computed again, into private pages.
2. `can_admit(match, prefill_tokens)` — whether admitting it now, plus the pages for its first chunk, fits.
3. `admit(prompt, match, stream, copy_stream)` — shares the full-page hits (reference counts) and, for a
   tail hit, prepares the copy-on-write (step i).
4. `complete_copy(seq, stream)` — at step i+1, before the sequence's first compute: the compute stream waits
   on the copy's fence and the private tail page joins the block table.
5. each step: `can_grow(seq, n)` / `grow(seq, n, stream)` then `seq.slot_mapping(n)` and
   `seq.block_table_row(width)` for the StepBatch; after the step, `commit(seq, tokens)` with the tokens whose
   K/V it wrote — newly filled pages enter the prefix cache, shareable by any later request.
6. `finish(seq, fence)` — the fence is recorded after the last op that read the sequence's pages. Its
   partial last page is catalogued as a tail, and its pages are released: the indexed ones stay cached
   (the retained catalog: the next turn re-activates them), the rest become free. Preemption is the same
   call; re-admission later hits whatever has not been evicted meanwhile.

With prefix caching off (`prefix_caching=False`) nothing is indexed, so `finish` frees every page of the
sequence (none stays cached); the caller (engine/kv_ledger.py) skips `match` for the same flag.
"""

from __future__ import annotations

from collections.abc import Sequence

from ninfer_rt.cuda.streams import Event, Stream, StreamSet
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.kv.capacity import check_fits, context_limit
from ninfer_rt.kv.cow import TailCopy
from ninfer_rt.kv.pages import PagePool, PoolStats
from ninfer_rt.kv.prefix import PrefixCache, PrefixMatch
from ninfer_rt.kv.sequence import SequenceKV


class KVManager:
    def __init__(self, streams: StreamSet, cache: KVCache, max_context: int, prefix_caching: bool = True) -> None:
        self.cache = cache
        self.prefix_caching = prefix_caching
        self.page_size = cache.spec.page_size
        self.pool = PagePool(cache.spec.num_pages)
        self.prefix = PrefixCache(self.pool, self.page_size)
        self.context_limit = context_limit(max_context, cache.spec.num_pages, self.page_size)
        self._open_copies: list[TailCopy] = []
        streams.crash.add_section("kv", self.crash_summary)

    # -- admission -------------------------------------------------------------------------------------

    def match(self, prompt: Sequence[int], max_new_tokens: int = 0) -> PrefixMatch:
        check_fits(len(prompt) + max_new_tokens, self.context_limit)
        return self.prefix.match(prompt[:-1])

    def can_admit(self, match: PrefixMatch, prefill_tokens: int = 0) -> bool:
        """Pages admission takes out of the allocatable set: cached hits it re-activates, the tail copy's
        source and destination, and the pages its first `prefill_tokens` need beyond the hits."""
        reactivated = sum(self.pool.is_cached(p) for p in match.pages)
        tail = 0
        if match.tail is not None:
            tail = 1 + self.pool.is_cached(match.tail.page)
        covered = len(match.pages) * self.page_size + (self.page_size if match.tail else 0)
        first_chunk = max(0, -(-(match.num_tokens + prefill_tokens - covered) // self.page_size))
        return self.pool.can_allocate(reactivated + tail + first_chunk)

    def admit(
        self, prompt: Sequence[int], match: PrefixMatch, stream: Stream, copy_stream: Stream, *, lane: object = None
    ) -> SequenceKV:
        """`stream` is the one that will read the hit pages; `copy_stream` runs the tail copy."""
        full_tokens = len(match.pages) * self.page_size
        self.pool.share(match.pages, stream)
        seq = SequenceKV(
            self.page_size,
            pages=list(match.pages),
            token_ids=list(prompt[:full_tokens]),
            hashes=list(match.hashes),
            cached_tokens=match.num_tokens,
            lane=lane,
        )
        if match.tail is not None:
            tail_tokens = tuple(prompt[full_tokens : full_tokens + match.tail.num_tokens])
            seq.pending_copy = TailCopy.prepare(self.pool, self.cache, match.tail.page, tail_tokens, copy_stream, lane=lane)
            self._open_copies.append(seq.pending_copy)
        return seq

    def complete_copy(self, seq: SequenceKV, stream: Stream) -> None:
        """Second half of the tail copy-on-write; a no-op for sequences without one."""
        copy = seq.pending_copy
        if copy is None:
            return
        seq.pages.append(copy.complete(stream))
        seq.token_ids.extend(copy.tokens)
        seq.pending_copy = None
        self._open_copies.remove(copy)

    # -- growth ----------------------------------------------------------------------------------------

    def can_grow(self, seq: SequenceKV, new_tokens: int) -> bool:
        return seq.num_tokens + new_tokens <= self.context_limit and self.pool.can_allocate(seq.pages_needed(new_tokens))

    def grow(self, seq: SequenceKV, new_tokens: int, stream: Stream) -> None:
        """Allocate the pages `new_tokens` more tokens will be written into (on `stream`)."""
        if seq.pending_copy is not None:
            raise RuntimeError("complete the sequence's tail copy before writing into it")
        check_fits(seq.num_tokens + new_tokens, self.context_limit)
        seq.pages.extend(self.pool.allocate(seq.pages_needed(new_tokens), stream))

    def commit(self, seq: SequenceKV, tokens: Sequence[int]) -> None:
        """The step wrote these tokens' K/V; index every page they completed."""
        seq.token_ids.extend(tokens)
        if not self.prefix_caching:
            return
        for index in range(len(seq.hashes), seq.full_pages):
            parent = seq.hashes[-1] if seq.hashes else None
            page_tokens = seq.token_ids[index * self.page_size : (index + 1) * self.page_size]
            seq.hashes.append(self.prefix.insert_full(parent, page_tokens, seq.pages[index]))

    # -- retirement ------------------------------------------------------------------------------------

    def finish(self, seq: SequenceKV, fence: Event) -> None:
        """Release a finished (or preempted) sequence's pages behind `fence`, keeping its prefix cached."""
        if seq.pending_copy is not None:
            # never joined the block table: its last access is the copy itself
            self.pool.release([seq.pending_copy.destination], seq.pending_copy.fence)
            self._open_copies.remove(seq.pending_copy)
            seq.pending_copy = None
        tail = seq.tail() if self.prefix_caching else None
        if tail is not None:
            self.prefix.insert_tail(seq.hashes[-1] if seq.hashes else None, tail[1], tail[0])
        self.pool.release(reversed(seq.pages), fence)
        seq.pages = []

    # -- observability ---------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def crash_summary(self) -> dict:
        stats = self.pool.stats()
        return {
            "pages": {"total": stats.total, "free": stats.free, "in_use": stats.in_use, "cached": stats.cached},
            "evictions": stats.evictions,
            "prefix_entries": len(self.prefix),
            "open_transactions": [copy.describe() for copy in self._open_copies],
        }
