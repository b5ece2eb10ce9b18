"""kernels_src/kv_widen.cu on the GPU against numpy: every prefill sequence's int8 pages, in step order, as f16
pages of the same values with their scales copied, and nothing else written (the widening buffers are poisoned
first)."""

from __future__ import annotations

import numpy as np
import pytest

from attention_refs import Batch, make_batch, make_pages
from gpu_session import POISON, OneStream

from ninfer_rt.cuda import attention_ops
from ninfer_rt.cuda.attention_ops import StepInputs, WidenedKV
from ninfer_rt.exec.base import AttentionShape
from ninfer_rt.kv.cache import KVLayer, page_resource

pytestmark = pytest.mark.gpu
HQ, HKV, D = 16, 4, 128


@pytest.fixture(scope="module")
def gpu() -> OneStream:
    return OneStream.open()


def widen(gpu: OneStream, batch: Batch) -> tuple[WidenedKV, list, list, list[int]]:
    """Random int8 K and V for `batch`, widened; (the buffers, K and V as made, each sequence's page count)."""
    rng = np.random.default_rng(int(batch.context_lens.sum()))
    k, v = (make_pages(rng, batch.num_pages, HKV, D, "int8", batch.all_slots()) for _ in range(2))
    layer = KVLayer(gpu.upload(k.raw), gpu.upload(v.raw), gpu.upload(k.scale), gpu.upload(v.scale))
    inputs = StepInputs(*(gpu.upload(a) for a in (batch.positions, batch.query_start, batch.context_lens, batch.block_tables, batch.slot_mapping)))
    shape = AttentionShape(num_heads=HQ, num_kv_heads=HKV, head_dim=D, norm_eps=1e-6)
    owner = gpu.upload(np.zeros(16, np.uint8))
    widened = attention_ops.widened_kv(gpu.lib, owner, HKV, D, inputs.block_tables.nbytes)
    for buffer in (widened.k, widened.v, widened.k_scale, widened.v_scale, widened.tables):
        gpu.stream.memset(buffer, POISON)
    decode = attention_ops.decode_max_queries(HQ, HKV)
    pages = [-(-int(c) // 64) if q > decode else 0 for q, c in zip(batch.query_lens, batch.context_lens)]
    read = [page_resource(p) for p in np.unique(batch.block_tables[batch.block_tables >= 0])]
    result = attention_ops.widen_int8_kv(
        gpu.lib, gpu.stream, layer, shape, inputs, len(pages), batch.block_tables.shape[1], sum(pages), max(pages),
        owner_buffer=owner, pages_read=read,
    )
    assert result is widened
    return widened, k, v, pages


def download_widened(gpu: OneStream, widened: WidenedKV, num_seqs: int, max_pages: int) -> dict[str, np.ndarray]:
    pages, slots = (widened.capacity, 64, HKV, D), (widened.capacity, 64, HKV)
    return {
        "k": gpu.download(widened.k, np.float16, pages), "v": gpu.download(widened.v, np.float16, pages),
        "k_scale": gpu.download(widened.k_scale, np.uint32, slots), "v_scale": gpu.download(widened.v_scale, np.uint32, slots),
        "tables": gpu.download(widened.tables, np.int32, (num_seqs, max_pages)),
    }


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([70], [70]), ([531], [4700]), ([70, 3, 200, 65], [70, 500, 1100, 4097]), ([2, 100], [900, 129])],
    ids=["one_page_set", "long_prefix", "mixed_with_decode", "decode_first"],
)
def test_widening_copies_each_prefill_page_exactly_in_step_order_and_nothing_else(
    gpu: OneStream, query_lens: list[int], context_lens: list[int]
) -> None:
    batch = make_batch(np.random.default_rng(len(query_lens)), query_lens, context_lens)
    widened, k, v, pages = widen(gpu, batch)
    got = download_widened(gpu, widened, len(pages), batch.block_tables.shape[1])
    first = np.concatenate([[0], np.cumsum(pages)[:-1]])
    poison_int = np.int32(-1)  # 0xFFFFFFFF
    for s, count in enumerate(pages):
        row = got["tables"][s]
        assert (row[:count] == first[s] + np.arange(count)).all(), f"sequence {s}: widened table {row[:count]}"
        assert (row[count:] == poison_int).all(), f"sequence {s}: table entries past its pages written"
        for i in range(count):
            page, to = batch.block_tables[s, i], first[s] + i
            for name, source in (("k", k), ("v", v)):
                assert np.array_equal(got[name][to], source.raw[page].astype(np.float16)), f"{name} page {i} of sequence {s}"
                assert np.array_equal(got[f"{name}_scale"][to], source.scale[page].view(np.uint32)), f"{name} scales, page {i} of sequence {s}"
    past = int(sum(pages))
    for name in ("k", "v"):
        assert (got[name][past:].view(np.uint16) == 0xFFFF).all(), f"{name}: pages past the step's written"
