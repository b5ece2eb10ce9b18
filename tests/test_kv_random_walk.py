"""10,000 random allocate/share/release/retain/evict operations on the PagePool, verifier on.

Pages are written only by their allocating stream and read by every holder, on several logical streams, so
any hand-over the pool fails to fence is an OrderingViolation. After every operation the accounting
invariant holds and the pool's reference counts equal a model's."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.kv.cache import page_resource
from ninfer_rt.kv.pages import PagePool

WALKS = 10
STEPS_PER_WALK = 1_000
PAGES = 24


@dataclass
class Holder:
    stream: Stream
    pages: list[int]


class Walk:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        streams = StreamSet(verify=True)
        self.streams = [streams.create(f"s{i}") for i in range(3)]
        self.pool = PagePool(PAGES)
        self.holders: list[Holder] = []
        self.writer: dict[int, Stream] = {}

    def step(self) -> None:
        action = self.rng.choice([self.allocate, self.share_in_use, self.reactivate, self.release, self.retain, self.evict])
        action()
        self.check()

    def allocate(self) -> None:
        n, stream = self.rng.randint(1, 4), self.rng.choice(self.streams)
        if not self.pool.can_allocate(n):
            return
        referenced = self.model_refcounts()
        pages = self.pool.allocate(n, stream)
        assert not any(referenced[p] for p in pages), "handed out a page that is still referenced"
        stream.declare("write new pages", writes=[page_resource(p) for p in pages])
        self.writer.update({p: stream for p in pages})
        self.holders.append(Holder(stream, pages))

    def share_in_use(self) -> None:
        """A prefix hit on a page still being used: same stream as its writer, as with one compute stream."""
        if self.holders:
            page = self.rng.choice(self.rng.choice(self.holders).pages)
            self.add_reader(self.writer[page], [page])

    def reactivate(self) -> None:
        cached = [p for p in range(PAGES) if self.pool.is_cached(p)]
        if cached:
            self.add_reader(self.rng.choice(self.streams), self.rng.sample(cached, min(len(cached), 3)))

    def add_reader(self, stream: Stream, pages: list[int]) -> None:
        self.pool.share(pages, stream)
        stream.declare("read shared pages", reads=[page_resource(p) for p in pages])
        self.holders.append(Holder(stream, pages))

    def release(self) -> None:
        if self.holders:
            holder = self.holders.pop(self.rng.randrange(len(self.holders)))
            holder.stream.declare("last read", reads=[page_resource(p) for p in holder.pages])
            self.pool.release(holder.pages, holder.stream.record())

    def retain(self) -> None:
        if self.holders:
            self.pool.retain(self.rng.choice(self.rng.choice(self.holders).pages))

    def evict(self) -> None:
        self.pool.evict(self.rng.randint(0, 3))

    def model_refcounts(self) -> Counter[int]:
        return Counter(p for holder in self.holders for p in holder.pages)

    def check(self) -> None:
        stats = self.pool.stats()
        assert stats.balanced, stats
        referenced = self.model_refcounts()
        assert all(self.pool.refcount(p) == referenced[p] for p in range(PAGES))
        assert stats.in_use == len(referenced)


@settings(max_examples=WALKS, deadline=None, derandomize=True)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_random_page_operations_keep_the_invariant_and_fence_every_hand_over(seed: int) -> None:
    walk = Walk(seed)
    for _ in range(STEPS_PER_WALK):
        walk.step()
