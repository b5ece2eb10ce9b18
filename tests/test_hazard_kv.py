"""The seed's KV hazards, injected into the real PagePool and TailCopy code: the verifier must catch them."""

from __future__ import annotations

import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv.cache import KVCache, KVSpec, page_resource
from ninfer_rt.kv.cow import TailCopy
from ninfer_rt.kv.pages import PagePool
from ninfer_rt.ordering import OrderingViolation


def skip_fence_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PagePool, "_wait_for_fences", lambda self, state, stream: None)


def reuse_after_release(streams: StreamSet) -> None:
    """Stream A reads a page, the page is released behind A's fence, stream B gets it and writes it."""
    a, b = streams.create("a"), streams.create("b")
    pool = PagePool(1)
    [page] = pool.allocate(1, a)
    a.declare("attention reads page", reads=[page_resource(page)])
    pool.release([page], a.record())
    [reused] = pool.allocate(1, b)
    b.declare("kv write of the next owner", writes=[page_resource(reused)])


def test_hazard_unfenced_page_release_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    skip_fence_waits(monkeypatch)
    with pytest.raises(OrderingViolation, match=r"\('kv', 0\)"):
        reuse_after_release(StreamSet(verify=True))


def test_hazard_fenced_page_release_is_clean() -> None:
    reuse_after_release(StreamSet(verify=True))


def copy_tail_then_write(streams: StreamSet) -> None:
    """Step i: prepare the copy of a 41-token tail on the copy stream. Step i+1: complete it on the
    compute stream and write token 42 into the private page."""
    compute, copy = streams.create("compute"), streams.create("copy")
    cache = KVCache(streams, KVSpec(num_layers=2, num_pages=4, n_kv_heads=1, head_dim=8))
    pool = PagePool(4)
    [source] = pool.allocate(1, compute)
    compute.declare("prefill writes 41 tokens", writes=[page_resource(source)])
    pool.retain(source)
    pool.release([source], compute.record())

    transaction = TailCopy.prepare(pool, cache, source, tuple(range(41)), copy)
    private = transaction.complete(compute)
    compute.declare("kv write of token 42", writes=[page_resource(private)])


def test_hazard_tail_copy_completed_without_its_fence_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TailCopy, "_await_copy", lambda self, consumer: None)
    with pytest.raises(OrderingViolation, match="kv write of token 42"):
        copy_tail_then_write(StreamSet(verify=True))


def test_hazard_tail_copy_completed_after_its_fence_is_clean() -> None:
    copy_tail_then_write(StreamSet(verify=True))
