"""PrefixCache: chained hashes over full pages, confirmed by token ids; tails catalogued by exact tokens."""

from __future__ import annotations

import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv import prefix as prefix_module
from ninfer_rt.kv.pages import PagePool
from ninfer_rt.kv.prefix import PrefixCache, TailHit, chain_hash

PAGE = 4


@pytest.fixture
def pool() -> PagePool:
    return PagePool(16)


@pytest.fixture
def cache(pool: PagePool) -> PrefixCache:
    return PrefixCache(pool, PAGE)


def index_pages(cache: PrefixCache, pool: PagePool, tokens: list[int]) -> list[int]:
    """Allocate and index one page per full page of `tokens`, as a finished prefill would."""
    pages = pool.allocate(len(tokens) // PAGE, StreamSet(verify=False).create("compute"))
    parent = None
    for i, page in enumerate(pages):
        parent = cache.insert_full(parent, tokens[i * PAGE : (i + 1) * PAGE], page)
    return pages


def test_chain_hash_depends_on_the_parent() -> None:
    assert chain_hash(None, [1, 2, 3, 4]) != chain_hash(chain_hash(None, [9, 9, 9, 9]), [1, 2, 3, 4])


def test_match_returns_the_longest_chain_of_full_pages(cache: PrefixCache, pool: PagePool) -> None:
    pages = index_pages(cache, pool, list(range(12)))
    found = cache.match(list(range(8)) + [99, 99, 99])
    assert found.pages == pages[:2] and found.num_tokens == 8 and found.tail is None


def test_a_prompt_diverging_inside_a_full_page_hits_its_leading_tokens(cache: PrefixCache, pool: PagePool) -> None:
    pages = index_pages(cache, pool, list(range(12)))
    found = cache.match(list(range(10)) + [99, 99, 99])
    assert found.pages == pages[:2]
    assert found.tail == TailHit(pages[2], 2) and found.num_tokens == 10  # copied on write like a tail


def test_the_same_page_tokens_after_a_different_prefix_do_not_match(cache: PrefixCache, pool: PagePool) -> None:
    index_pages(cache, pool, [0, 1, 2, 3, 4, 5, 6, 7])
    assert cache.match([9, 9, 9, 9, 4, 5, 6, 7]).pages == []


def test_a_hash_collision_is_a_miss_because_token_ids_are_compared(
    cache: PrefixCache, pool: PagePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefix_module, "chain_hash", lambda parent, tokens: 42)
    index_pages(cache, pool, [1, 2, 3, 4])
    assert cache.match([5, 6, 7, 8]).pages == []


def test_indexed_pages_are_retained_by_the_pool(cache: PrefixCache, pool: PagePool) -> None:
    stream = StreamSet(verify=False).create("compute")
    [page] = index_pages(cache, pool, [1, 2, 3, 4])
    pool.release([page], stream.record())
    assert pool.is_cached(page)


def test_evicting_a_page_removes_its_entry(cache: PrefixCache, pool: PagePool) -> None:
    stream = StreamSet(verify=False).create("compute")
    [page] = index_pages(cache, pool, [1, 2, 3, 4])
    pool.release([page], stream.record())
    pool.evict(1)
    assert cache.match([1, 2, 3, 4, 5]).pages == [] and len(cache) == 0


def test_a_catalogued_tail_matches_the_longest_common_prefix_after_its_parent(cache: PrefixCache, pool: PagePool) -> None:
    [full] = index_pages(cache, pool, [0, 1, 2, 3])
    [tail_page] = pool.allocate(1, StreamSet(verify=False).create("compute"))
    cache.insert_tail(chain_hash(None, [0, 1, 2, 3]), [4, 5, 6], tail_page)
    found = cache.match([0, 1, 2, 3, 4, 5, 7])
    assert found.pages == [full]
    assert (found.tail.page, found.tail.num_tokens) == (tail_page, 2)
    assert found.num_tokens == 6


def test_a_tail_under_another_parent_does_not_match(cache: PrefixCache, pool: PagePool) -> None:
    [tail_page] = pool.allocate(1, StreamSet(verify=False).create("compute"))
    cache.insert_tail(chain_hash(None, [0, 1, 2, 3]), [4, 5], tail_page)
    assert cache.match([4, 5, 6]).tail is None
