"""kernels_src/kv_widen.cu on the GPU against numpy: every prefill sequence's int8 pages, in step order, as f16
pages of their dequantized values (the f32 product rounded once), and nothing else written (the widening
buffers are poisoned first)."""

from __future__ import annotations

import numpy as np
import pytest

from attention_refs import Batch, make_batch, make_pages
from gpu_session import POISON, OneStream

from ninfer_rt.cuda import attention_ops
from ninfer_rt.cuda import attention_plan as plan
from ninfer_rt.cuda import attention_prefill_plan as prefill_plan
from ninfer_rt.cuda.attention_buffers import AttentionStep, PagedKV, StepInputs, WidenedKV
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.kv.cache import KVDtype, page_resource
from ninfer_rt.model.executor import AttentionShape

pytestmark = pytest.mark.gpu
HQ, HKV, D = 16, 4, 128
F16_MAX = np.float32(65504.0)


@pytest.fixture(scope="module")
def gpu() -> OneStream:
    return OneStream.open()


def widen(gpu: OneStream, batch: Batch, scale_factor: float = 1.0) -> tuple[WidenedKV, list, list, list[int]]:
    """Random int8 K and V for `batch` (scales times `scale_factor`), widened; (the buffers, K and V as made,
    each sequence's page count)."""
    rng = np.random.default_rng(int(batch.context_lens.sum()))
    k, v = (make_pages(rng, batch.num_pages, HKV, D, "int8", batch.all_slots()) for _ in range(2))
    for pages in (k, v):
        pages.scale[...] *= np.float32(scale_factor)
    layer = PagedKV(gpu.upload(k.raw), gpu.upload(v.raw), gpu.upload(k.scale), gpu.upload(v.scale))
    inputs = StepInputs(*(gpu.upload(a) for a in (batch.positions, batch.query_start, batch.context_lens, batch.block_tables, batch.slot_mapping)))
    shape = AttentionShape(num_heads=HQ, num_kv_heads=HKV, head_dim=D, norm_eps=1e-6)
    max_pages = batch.block_tables.shape[1]
    decode = plan.decode_max_queries(HQ, HKV)
    pages = [-(-int(c) // 64) if q > decode else 0 for q, c in zip(batch.query_lens, batch.context_lens)]
    capacity = sum(1 for n in pages if n) * max(pages)  # what widen_int8_kv requires: prefill sequences x the longest
    widened = WidenedKV.allocate(gpu.streams, HKV, D, capacity, inputs.block_tables.nbytes)
    for buffer in (widened.k, widened.v, widened.tables):
        gpu.stream.memset(buffer, POISON)
    read = [page_resource(p) for p in np.unique(batch.block_tables[batch.block_tables >= 0])]
    step = AttentionStep(inputs, tuple(int(q) for q in batch.query_lens), max_pages, read)
    # the longest prefill context bounds the walk (the executor passes the block table's width)
    attention_ops.widen_int8_kv(gpu.lib, gpu.stream, step, shape, layer, widened, 64 * max(pages))
    return widened, k, v, pages


def download_widened(gpu: OneStream, widened: WidenedKV, num_seqs: int, max_pages: int) -> dict[str, np.ndarray]:
    pages = (widened.capacity, 64, HKV, D)
    return {
        "k": gpu.download(widened.k, np.float16, pages), "v": gpu.download(widened.v, np.float16, pages),
        "tables": gpu.download(widened.tables, np.int32, (num_seqs, max_pages)),
    }


def dequantized_f16(raw: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 x f32 scale in f32, saturated to f16's range and rounded to f16 (slots no token was written hold NaN
    scales: NaN)."""
    return np.clip(raw.astype(np.float32) * scale[..., None], -F16_MAX, F16_MAX).astype(np.float16)


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
                expected = dequantized_f16(source.raw[page], source.scale[page])
                assert np.array_equal(got[name][to], expected, equal_nan=True), f"{name} page {i} of sequence {s}"
    past = int(sum(pages))
    for name in ("k", "v"):
        assert (got[name][past:].view(np.uint16) == 0xFFFF).all(), f"{name}: pages past the step's written"


def test_values_beyond_f16_range_saturate_instead_of_becoming_inf(gpu: OneStream) -> None:
    batch = make_batch(np.random.default_rng(3), [100], [300])
    widened, k, v, pages = widen(gpu, batch, scale_factor=1e5)  # |q| * scale up to ~1e6
    got = download_widened(gpu, widened, 1, batch.block_tables.shape[1])
    written = got["k"][: pages[0]]
    assert np.isfinite(written[:, :44]).all() and (np.abs(written) == F16_MAX).any()  # 300 keys: 4 full pages + 44
    for i in range(pages[0]):
        expected = dequantized_f16(k.raw[batch.block_tables[0, i]], k.scale[batch.block_tables[0, i]])
        assert np.array_equal(got["k"][i], expected, equal_nan=True), f"k page {i}"


def test_an_executor_reserves_the_widening_buffers_before_the_kv_cache_is_sized() -> None:
    # what Engine does before `--kv-capacity auto` measures free memory: the buffers exist from then on, and a
    # long int8 prefill step later finds them instead of allocating
    streams = StreamSet(open_device(0))
    executor = CudaExecutor(streams, max_tokens=512, max_seqs=4, max_pages_per_seq=100, max_positions=6400)
    if not prefill_plan.prefill_wgmma_applies(executor.library.target_arch, D):
        pytest.skip(f"int8 KV is widened on sm_90a only (this GPU: {executor.library.target_arch})")
    shape = AttentionShape(HQ, HKV, D, 1e-6)
    free = streams.device.free_memory()
    executor.reserve_step_buffers(shape, KVDtype.INT8)
    allocated = free - streams.device.free_memory()
    reserved = executor.attention_backend.widened_kv(shape)
    assert reserved.capacity == prefill_plan.PREFILL_WIDEN_SEQUENCES * 100
    assert reserved.tables.nbytes == 4 * 4 * 100  # the executor's widest block table: 4 sequences of 100 pages
    assert allocated >= 2 * reserved.capacity * 64 * HKV * D * 2
    executor.reserve_step_buffers(shape, KVDtype.INT8)  # idempotent
    assert executor.attention_backend.widened_kv(shape) == reserved
    assert free - streams.device.free_memory() == allocated
