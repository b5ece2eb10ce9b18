"""--kv-capacity auto|PAGES and --max-context: how many pages, and which requests can ever fit."""

from __future__ import annotations

import pytest

from ninfer_rt.kv.cache import KVDtype, KVSpec
from ninfer_rt.kv.capacity import (
    CPU_DEFAULT_PAGES,
    ContextTooLong,
    bytes_per_page,
    check_fits,
    context_limit,
    pages_for_capacity,
    resolve_kv_capacity,
)

SPEC = KVSpec(num_layers=4, num_pages=0, n_kv_heads=2, head_dim=64)


def test_a_bf16_page_costs_k_and_v_of_every_layer() -> None:
    assert bytes_per_page(SPEC) == 4 * 2 * 64 * 2 * 64 * 2


def test_an_int8_page_costs_values_plus_a_float32_scale_per_slot_and_head() -> None:
    spec = KVSpec(num_layers=4, num_pages=0, n_kv_heads=2, head_dim=64, dtype=KVDtype.INT8)
    assert bytes_per_page(spec) == 4 * 2 * (64 * 2 * 64 + 64 * 2 * 4)


def test_auto_capacity_uses_free_memory_minus_the_margin() -> None:
    page = bytes_per_page(SPEC)
    assert pages_for_capacity(SPEC, free_bytes=10 * page + 1000, margin=1000) == 10


def test_auto_capacity_without_room_for_one_page_is_an_error() -> None:
    with pytest.raises(ValueError, match="no room for KV pages"):
        pages_for_capacity(SPEC, free_bytes=1000, margin=1000)


def test_auto_on_the_cpu_executor_is_the_default_page_count() -> None:
    assert resolve_kv_capacity("auto", SPEC, free_bytes=None) == CPU_DEFAULT_PAGES


def test_an_explicit_page_count_is_taken_as_given() -> None:
    assert resolve_kv_capacity("300", SPEC, free_bytes=1) == 300


def test_a_non_positive_page_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="--kv-capacity"):
        resolve_kv_capacity("0", SPEC, free_bytes=None)


def test_the_context_limit_is_the_smaller_of_max_context_and_the_pool() -> None:
    assert context_limit(max_context=10_000, num_pages=100, page_size=64) == 6400
    assert context_limit(max_context=5_000, num_pages=100, page_size=64) == 5000


def test_a_request_over_the_limit_names_what_it_needs_and_the_limit() -> None:
    with pytest.raises(ContextTooLong, match="needs 5001 tokens.*limit is 5000"):
        check_fits(5001, 5000)
