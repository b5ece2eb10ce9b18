"""KVCache: paged K/V storage in bf16 or int8 (scale per page, slot, kv head) and page-to-page copies."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec, dequantize_int8, quantize_int8
from ninfer_rt.ordering import OrderingViolation

SPEC = KVSpec(num_layers=3, num_pages=6, n_kv_heads=2, head_dim=8, page_size=4)


def kv_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.normal(size=(n, SPEC.n_kv_heads, SPEC.head_dim)).astype(np.float32)


def make_cache(dtype: str) -> KVCache:
    return KVCache(StreamSet(verify=True), KVSpec(**{**SPEC.__dict__, "dtype": KVDtype.parse(dtype)}))


def test_int8_quantization_error_is_within_half_a_step_per_head() -> None:
    x = kv_tokens(np.random.default_rng(0), 10)
    values, scale = quantize_int8(x)
    error = np.abs(dequantize_int8(values, scale) - x)
    assert scale.shape == (10, SPEC.n_kv_heads)
    assert np.all(error <= scale[..., None] / 2 + 1e-7)


def test_int8_quantization_keeps_an_all_zero_head_exact() -> None:
    values, scale = quantize_int8(np.zeros((1, 1, 4), np.float32))
    assert np.all(dequantize_int8(values, scale) == 0)


@pytest.mark.parametrize("dtype, tolerance", [("bf16", 1e-2), ("int8", 2e-2)])
def test_tokens_written_at_slots_read_back_in_block_table_order(dtype: str, tolerance: float) -> None:
    cache = make_cache(dtype)
    rng = np.random.default_rng(1)
    k, v = kv_tokens(rng, 6), kv_tokens(rng, 6)
    pages = [4, 1]  # a block table: logical page 0 is physical page 4
    slots = np.array([4 * 4 + i for i in range(4)] + [1 * 4 + i for i in range(2)])
    cache.write_tokens(2, slots, k, v)
    k_out, v_out = cache.read_tokens(2, pages, 6)
    np.testing.assert_allclose(k_out, k, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(v_out, v, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_copy_page_copies_values_and_scales_of_every_layer(dtype: str) -> None:
    cache = make_cache(dtype)
    rng = np.random.default_rng(2)
    for layer in range(SPEC.num_layers):
        cache.write_tokens(layer, np.arange(8, 12), kv_tokens(rng, 4), kv_tokens(rng, 4))  # page 2
    stream = cache.layers[0].k.owner.create("copy")
    cache.copy_page(2, 5, stream)
    for layer in range(SPEC.num_layers):
        for before, after in zip(cache.read_tokens(layer, [2], 4), cache.read_tokens(layer, [5], 4)):
            np.testing.assert_array_equal(before, after)


def test_copy_page_declares_its_pages_to_the_verifier() -> None:
    cache = make_cache("bf16")
    streams = cache.layers[0].k.owner
    compute, copy = streams.create("compute"), streams.create("copy")
    compute.declare("attention writes page 2", writes=[("kv", 2)])
    with pytest.raises(OrderingViolation, match="'kv', 2"):
        cache.copy_page(2, 5, copy)


def test_unknown_kv_dtype_is_rejected_where_the_text_is_parsed() -> None:
    with pytest.raises(ValueError, match="kv dtype must be one of"):
        KVDtype.parse("fp8")
    with pytest.raises(TypeError, match="KVDtype"):
        KVSpec(num_layers=1, num_pages=1, n_kv_heads=1, head_dim=8, dtype="int8")


def test_a_kv_dtype_knows_its_element_bytes_and_whether_it_has_scales() -> None:
    assert [(d.itemsize, d.has_scales) for d in (KVDtype.BF16, KVDtype.INT8, KVDtype.F32)] == [(2, False), (1, True), (4, False)]
