"""Copy-on-write of a shared partial tail page: a two-step transaction with its own fence (rule 5).

A prefix hit that ends inside a page (prefix length mod page_size != 0) cannot hand that page out: the new
sequence will write its next tokens into the same page, and the page may be shared or cached. So:

- step i, `TailCopy.prepare`: take a reference on the source (keeps it from eviction; waits on its release
  fences, so the copy reads what its last writer wrote), allocate a private destination page, enqueue the
  copy of every layer's K/V for that page on the copy stream, record the transaction's fence, and release
  the source behind that fence (the copy is its last reader);
- step i+1, `TailCopy.complete`: the consuming (compute) stream waits on the fence; only then does the
  destination join the sequence's block table and get written.

Completing without that wait lets the compute stream write the destination while the copy may still be
writing it: the verifier reports exactly that (tests/test_hazard_kv.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.cuda.streams import Event, Stream
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.kv.pages import PagePool


class TransactionStateError(RuntimeError):
    """complete() called twice on one copy-on-write transaction."""


@dataclass
class TailCopy:
    source: int
    destination: int
    tokens: tuple[int, ...]  # the leading token ids of the copied page that belong to the new sequence
    fence: Event
    completed: bool = False

    @classmethod
    def prepare(
        cls, pool: PagePool, cache: KVCache, source: int, tokens: tuple[int, ...], stream: Stream, *, lane: object = None
    ) -> TailCopy:
        pool.share([source], stream)
        [destination] = pool.allocate(1, stream)
        cache.copy_page(source, destination, stream, lane=lane)
        fence = stream.record()
        pool.release([source], fence)
        return cls(source, destination, tokens, fence)

    def complete(self, consumer: Stream) -> int:
        """Order `consumer` after the copy; returns the private page that now holds the tail."""
        if self.completed:
            raise TransactionStateError(f"copy of page {self.source} -> {self.destination} already completed")
        self._await_copy(consumer)
        self.completed = True
        return self.destination

    def describe(self) -> dict:
        """For the crash context's list of open KV transactions."""
        return {
            "kind": "tail copy-on-write",
            "source": self.source,
            "destination": self.destination,
            "tokens": len(self.tokens),
            "fence_stream": self.fence.stream_name,
            "completed": self.completed,
        }

    def _await_copy(self, consumer: Stream) -> None:
        consumer.wait(self.fence)
