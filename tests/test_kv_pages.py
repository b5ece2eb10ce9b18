"""PagePool: states, reference counts, fenced hand-over, LRU eviction of cached pages."""

from __future__ import annotations

import pytest

from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.kv.cache import page_resource
from ninfer_rt.kv.pages import OutOfPages, PagePool


@pytest.fixture
def streams() -> StreamSet:
    return StreamSet(verify=True)


def cached_page(pool: PagePool, compute: Stream) -> int:
    """A page allocated, retained and released: cached, with no references."""
    [page] = pool.allocate(1, compute)
    pool.retain(page)
    pool.release([page], compute.record())
    return page


def cached_free_and_in_use(compute: Stream) -> PagePool:
    """A pool of three pages: one cached, one free, one in use."""
    pool = PagePool(3)
    a, b, _ = pool.allocate(3, compute)
    pool.retain(a)
    pool.release([a, b], compute.record())
    return pool


def test_a_new_pool_is_all_free() -> None:
    stats = PagePool(8).stats()
    assert (stats.free, stats.in_use, stats.cached, stats.total) == (8, 0, 0, 8)


def test_allocated_pages_are_distinct_and_in_use(streams: StreamSet) -> None:
    pool = PagePool(8)
    pages = pool.allocate(5, streams.create("compute"))
    assert len(set(pages)) == 5
    assert all(pool.refcount(p) == 1 for p in pages)
    assert (pool.stats().free, pool.stats().in_use) == (3, 5)


def test_shared_page_stays_in_use_until_the_last_reference_is_released(streams: StreamSet) -> None:
    pool = PagePool(4)
    compute = streams.create("compute")
    [page] = pool.allocate(1, compute)
    pool.share([page], compute)
    pool.release([page], compute.record())
    assert pool.refcount(page) == 1 and pool.stats().in_use == 1
    pool.release([page], compute.record())
    assert pool.stats().free == 4


def test_retained_page_becomes_cached_not_free_at_zero_references(streams: StreamSet) -> None:
    pool = PagePool(4)
    compute = streams.create("compute")
    [page] = pool.allocate(1, compute)
    pool.retain(page)
    pool.release([page], compute.record())
    assert pool.is_cached(page)
    assert (pool.stats().free, pool.stats().cached) == (3, 1)


def test_sharing_a_cached_page_reactivates_it(streams: StreamSet) -> None:
    pool = PagePool(4)
    compute = streams.create("compute")
    page = cached_page(pool, compute)
    pool.share([page], compute)
    assert not pool.is_cached(page) and pool.refcount(page) == 1


def test_sharing_a_free_page_is_refused(streams: StreamSet) -> None:
    with pytest.raises(ValueError, match="free"):
        PagePool(4).share([0], streams.create("compute"))


def test_releasing_more_often_than_referenced_is_refused(streams: StreamSet) -> None:
    pool = PagePool(4)
    compute = streams.create("compute")
    [page] = pool.allocate(1, compute)
    pool.release([page], compute.record())
    with pytest.raises(ValueError, match="more often"):
        pool.release([page], compute.record())


def test_allocation_evicts_least_recently_released_cached_page_and_reports_it(streams: StreamSet) -> None:
    evicted: list[int] = []
    pool = PagePool(2, on_evict=evicted.append)
    compute = streams.create("compute")
    first, second = pool.allocate(2, compute)
    for page in (first, second):
        pool.retain(page)
        pool.release([page], compute.record())
    assert pool.allocate(1, compute) == [first]
    assert evicted == [first] and pool.stats().evictions == 1
    assert pool.stats().balanced


def test_can_allocate_counts_free_and_evictable_pages(streams: StreamSet) -> None:
    pool = cached_free_and_in_use(streams.create("compute"))
    assert pool.can_allocate(2) and not pool.can_allocate(3)


def test_allocating_beyond_capacity_raises_out_of_pages(streams: StreamSet) -> None:
    pool = PagePool(2)
    with pytest.raises(OutOfPages, match="asked for 3 pages"):
        pool.allocate(3, streams.create("compute"))


def test_explicit_eviction_frees_cached_pages_only(streams: StreamSet) -> None:
    pool = cached_free_and_in_use(streams.create("compute"))
    assert pool.evict(5) == 1
    assert (pool.stats().free, pool.stats().in_use, pool.stats().cached) == (2, 1, 0)


def test_next_owner_on_another_stream_is_ordered_after_the_release_fence(streams: StreamSet) -> None:
    pool = PagePool(1)
    a, b = streams.create("a"), streams.create("b")
    [page] = pool.allocate(1, a)
    a.declare("attention reads page", reads=[page_resource(page)])
    pool.release([page], a.record())
    [again] = pool.allocate(1, b)
    b.declare("kv write", writes=[page_resource(again)])  # would raise OrderingViolation without the wait
    assert again == page
