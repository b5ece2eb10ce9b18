"""The numpy executor's attention, KV storage and declared accesses, on random data."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from forward_helpers import PAGE_SIZE, SeqStep, relative_error, step_batch
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.numpy_exec import NumpyExecutor, quantize_int8
from ninfer_rt.kv.cache import KVCache, KVSpec, page_resource
from ninfer_rt.model.executor import AttentionParams, AttentionShape
from ninfer_rt.ordering import OrderingViolation

SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=32, norm_eps=1e-6)
NUM_PAGES = 8
# A prefill of 40 tokens over shuffled pages next to a sequence decoding its 31st token.
STEP = [SeqStep([0] * 40, 0, [5, 1, 6]), SeqStep([0], 30, [2, 7])]


def attention_setup(kv_dtype: str, streams: StreamSet | None = None) -> tuple[NumpyExecutor, AttentionParams, KVCache]:
    streams = streams or StreamSet()
    executor = NumpyExecutor(streams)
    inv_freq = 1.0 / 10000 ** (np.arange(0, SHAPE.head_dim, 2) / SHAPE.head_dim)
    params = AttentionParams(SHAPE, executor.prepare_rope(inv_freq, 1.0), q_norm=None, k_norm=None)
    spec = KVSpec(num_layers=1, num_pages=NUM_PAGES, n_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim,
                  dtype=kv_dtype, page_size=PAGE_SIZE)
    return executor, params, KVCache(streams, spec)


def random_qkv(rows: int, seed: int = 0) -> np.ndarray:
    width = SHAPE.q_size + 2 * SHAPE.kv_size
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def run_attention(kv_dtype: str, parts: list[SeqStep], qkv: np.ndarray) -> np.ndarray:
    executor, params, kv = attention_setup(kv_dtype)
    executor.begin_step(step_batch(parts), kv)
    return executor.to_host(executor.attention(qkv, params, kv, 0))


def test_int8_kv_attention_is_within_two_percent_of_bf16_kv() -> None:
    # The decoding sequence's 30 cached tokens are written by an earlier prefill step of its own.
    history = random_qkv(30, seed=1)
    qkv = random_qkv(41)
    outputs = {}
    for kv_dtype in ("bf16", "int8"):
        executor, params, kv = attention_setup(kv_dtype)
        executor.begin_step(step_batch([SeqStep([0] * 30, 0, [2, 7])]), kv)
        executor.attention(history, params, kv, 0)
        executor.begin_step(step_batch(STEP), kv)
        outputs[kv_dtype] = executor.to_host(executor.attention(qkv, params, kv, 0))
    assert relative_error(outputs["int8"], outputs["bf16"]) < 2e-2


def test_bf16_kv_attention_is_close_to_f32_kv() -> None:
    qkv = random_qkv(40)
    parts = STEP[:1]
    assert relative_error(run_attention("bf16", parts, qkv), run_attention("f32", parts, qkv)) < 1e-2


def test_attention_writes_bf16_values_only_at_the_step_slots() -> None:
    executor, params, kv = attention_setup("bf16")
    qkv = random_qkv(41)
    executor.begin_step(step_batch(STEP), kv)
    executor.attention(qkv, params, kv, 0)
    values = kv.layers[0].v.view(kv.spec.element_dtype, (NUM_PAGES, *kv.spec.page_shape))
    written = values.reshape(-1, SHAPE.num_kv_heads, SHAPE.head_dim)[step_batch(STEP).slot_mapping]
    expected_v = qkv[:, SHAPE.q_size + SHAPE.kv_size :].reshape(41, SHAPE.num_kv_heads, SHAPE.head_dim)
    np.testing.assert_array_equal(written, expected_v.astype(ml_dtypes.bfloat16))
    assert np.count_nonzero(values.astype(np.float32)) == np.count_nonzero(written.astype(np.float32))


def test_int8_quantization_rounds_each_head_to_within_half_a_step() -> None:
    x = np.random.default_rng(3).standard_normal((10, 2, 32)).astype(np.float32)
    quantized, scale = quantize_int8(x)
    assert np.abs(quantized.astype(np.float32) * scale[..., None] - x).max() <= scale.max() / 2 + 1e-7
    assert np.abs(quantized).max() == 127


def test_ops_read_the_published_step_inputs_not_the_host_batch() -> None:
    executor, _, kv = attention_setup("f32")
    batch = step_batch([SeqStep([3, 1, 2], 0, [0])])
    executor.begin_step(batch, kv)
    batch.token_ids[:] = 0  # the host may reuse its arrays once the step is published
    table = np.arange(5, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(executor.to_host(executor.embed(table))[:, 0], [3, 1, 2])


def test_reading_a_page_written_on_an_unordered_stream_raises() -> None:
    streams = StreamSet(verify=True)
    executor, params, kv = attention_setup("bf16", streams)
    loader = streams.create("loader")
    loader.host_op(lambda: None, label="load page 7", writes=[page_resource(7)])
    executor.begin_step(step_batch(STEP), kv)
    with pytest.raises(OrderingViolation, match="page|kv"):
        executor.attention(random_qkv(41), params, kv, 0)


def test_reading_a_page_after_waiting_for_its_writer_is_allowed() -> None:
    streams = StreamSet(verify=True)
    executor, params, kv = attention_setup("bf16", streams)
    loader = streams.create("loader")
    loader.host_op(lambda: None, label="load page 7", writes=[page_resource(7)])
    executor.compute.wait(loader.record())
    executor.begin_step(step_batch(STEP), kv)
    out = executor.to_host(executor.attention(random_qkv(41), params, kv, 0))
    assert np.isfinite(out).all()
