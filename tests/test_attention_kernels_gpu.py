"""Attention kernels on the GPU against float64 numpy (kernels_src/{rope_kv,decode_attention,prefill_attention}.cu).

Every output buffer is poisoned (0xFF bytes: NaN in bf16 and f32) before the launch and every element is
checked; pages no sequence owns and slots past each context hold NaN, so a kernel that reads outside its
context, or writes outside its rows, fails loudly. Failures print the relative L2 error, the max error and
the first bad index.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from attention_refs import (
    BF16,
    PAGE,
    Batch,
    PagedKV,
    closeness_report,
    dequantized,
    gated_reference,
    make_batch,
    make_pages,
    neox_rope_ref,
    p_rounding_slack,
    paged_attention_ref,
    quantize_int8_ref,
    rms_normalize_ref,
)
from gpu_session import POISON, OneStream

from ninfer_rt.cuda import attention_ops
from ninfer_rt.cuda import attention_plan as plan
from ninfer_rt.cuda import attention_prefill_plan as prefill_plan
from ninfer_rt.cuda.attention_buffers import (
    STEP_INPUT_NAMES,
    AttentionStep,
    DecodeWorkspace,
    OutputGate,
    PrefillWorkspace,
    RopeArgs,
    StepInputs,
    WidenedKV,
)
from ninfer_rt.cuda.attention_buffers import PagedKV as DevicePages
from ninfer_rt.cuda.attention_plan import KVVariant
from ninfer_rt.cuda.memory import StagingRing
from ninfer_rt.exec.cuda_attention import AttentionBackend
from ninfer_rt.exec.layer_backend import PublishedStep
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec, page_resource
from ninfer_rt.model.executor import AttentionParams, AttentionShape

pytestmark = pytest.mark.gpu
RTOL = 1e-2  # relative L2 bound for bf16 results


class Gpu(OneStream):
    """OneStream, plus the step inputs and KV layers the attention kernels take."""

    def inputs(self, batch: Batch) -> StepInputs:
        return StepInputs(
            positions=self.upload(batch.positions),
            query_start=self.upload(batch.query_start),
            context_lens=self.upload(batch.context_lens),
            block_tables=self.upload(batch.block_tables),
            slot_mapping=self.upload(batch.slot_mapping),
        )

    def kv_layer(self, k: PagedKV, v: PagedKV) -> DevicePages:
        scales = (self.upload(k.scale), self.upload(v.scale)) if k.scale is not None else (None, None)
        return DevicePages(self.upload(k.raw), self.upload(v.raw), *scales)

    def step(self, batch: Batch) -> AttentionStep:
        read, written = pages_of(batch)
        return AttentionStep(self.inputs(batch), tuple(batch.query_lens.tolist()), batch.block_tables.shape[1], read, written)


@pytest.fixture(scope="module")
def gpu() -> Gpu:
    return Gpu.open()


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str, rtol: float = RTOL, slack: np.ndarray | float = 0.0) -> None:
    rel_l2, problem = closeness_report(actual, expected, rtol=2 * rtol, slack=slack)
    print(f"{what}: rel L2 {rel_l2:.3e}")
    assert problem is None, f"{what}: {problem}"
    assert rel_l2 < rtol, f"{what}: relative L2 error {rel_l2:.3e} >= {rtol}"


def pages_of(batch: Batch) -> tuple[list, list]:
    read = [page_resource(p) for p in np.unique(batch.block_tables[batch.block_tables >= 0])]
    written = [page_resource(p) for p in np.unique(batch.slot_mapping[batch.slot_mapping >= 0] // PAGE)]
    return read, written


def shape_of(hq: int, hkv: int, d: int) -> AttentionShape:
    return AttentionShape(num_heads=hq, num_kv_heads=hkv, head_dim=d, norm_eps=1e-6)


# -- rope_kv --------------------------------------------------------------------------------------------


def rope_inv_freq(d: int) -> np.ndarray:
    return 1.0 / 1_000_000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 128), (16, 2, 128), (8, 2, 64), (4, 1, 256)])
@pytest.mark.parametrize("norms", [True, False], ids=["qk_norm", "no_norm"])
def test_rope_kv_normalizes_rotates_and_writes_only_the_mapped_slots(
    gpu: Gpu, kv_dtype: str, hq: int, hkv: int, d: int, norms: bool
) -> None:
    rng = np.random.default_rng(hq * 131 + d + norms)
    batch = make_batch(rng, query_lens=[5, 1, 70], context_lens=[5, 1000, 200])
    batch.slot_mapping[3] = -1  # a padding row: its K/V must not be written anywhere
    t = batch.num_rows
    qkv = (rng.standard_normal((t, (hq + 2 * hkv) * d)) * 2).astype(BF16)
    q_norm = (1 + 0.1 * rng.standard_normal(d)).astype(BF16) if norms else None
    k_norm = (1 + 0.1 * rng.standard_normal(d)).astype(BF16) if norms else None
    scaling = 1.1  # a YaRN-like attention factor must reach both cos and sin
    table = plan.rope_table(rope_inv_freq(d), scaling, 4096)

    elem = np.int8 if kv_dtype == "int8" else BF16
    cache_shape = (batch.num_pages, PAGE, hkv, d)
    k_buf, v_buf = gpu.poisoned(int(np.prod(cache_shape)) * np.dtype(elem).itemsize), gpu.poisoned(int(np.prod(cache_shape)) * np.dtype(elem).itemsize)
    scales = (gpu.poisoned(batch.num_pages * PAGE * hkv * 4), gpu.poisoned(batch.num_pages * PAGE * hkv * 4)) if kv_dtype == "int8" else (None, None)
    cache = DevicePages(k_buf, v_buf, *scales)
    q_out = gpu.poisoned(t * hq * d * 2)
    rope = RopeArgs(gpu.upload(table), gpu.upload(q_norm) if norms else None, gpu.upload(k_norm) if norms else None, 1e-6)
    attention_ops.rope_kv(gpu.lib, gpu.stream, gpu.step(batch), shape_of(hq, hkv, d), gpu.upload(qkv), q_out, cache, rope)

    x = qkv.astype(np.float64).reshape(t, hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq : hq + hkv], x[:, hq + hkv :]
    if norms:
        q, k = rms_normalize_ref(q, q_norm, 1e-6), rms_normalize_ref(k, k_norm, 1e-6)
    q_ref = neox_rope_ref(q, batch.positions, rope_inv_freq(d), scaling)
    k_ref = neox_rope_ref(k, batch.positions, rope_inv_freq(d), scaling)
    assert_close(gpu.download(q_out, BF16, (t, hq, d)), q_ref, "q_out", rtol=5e-3)

    written = batch.slot_mapping >= 0
    slots = batch.slot_mapping[written]
    k_raw = gpu.download(k_buf, elem, (batch.num_pages * PAGE, hkv, d))
    v_raw = gpu.download(v_buf, elem, (batch.num_pages * PAGE, hkv, d))
    untouched = np.setdiff1d(np.arange(batch.num_pages * PAGE), slots)
    assert (k_raw[untouched].view(np.uint8) == POISON).all(), "K written outside slot_mapping"
    assert (v_raw[untouched].view(np.uint8) == POISON).all(), "V written outside slot_mapping"
    if kv_dtype == "bf16":
        assert_close(k_raw[slots], k_ref[written], "K pages", rtol=5e-3)
        np.testing.assert_array_equal(v_raw[slots].view(np.uint16), qkv.reshape(t, -1, d)[written, hq + hkv :].view(np.uint16))
        return
    k_scale = gpu.download(scales[0], np.float32, (batch.num_pages * PAGE, hkv))
    v_scale = gpu.download(scales[1], np.float32, (batch.num_pages * PAGE, hkv))
    assert (k_scale[untouched].view(np.uint32) == 0xFFFFFFFF).all(), "k_scale written outside slot_mapping"
    for name, raw, scale, ref in (("K", k_raw, k_scale, k_ref[written]), ("V", v_raw, v_scale, v[written])):
        _, ref_scale = quantize_int8_ref(ref)
        np.testing.assert_allclose(scale[slots], ref_scale, rtol=1e-3, err_msg=f"{name} int8 scales")
        step_error = np.abs(dequantized(raw[slots], scale[slots]) - ref) / ref_scale[..., None]
        worst = np.unravel_index(int(np.argmax(step_error)), step_error.shape)
        assert step_error.max() <= 1.0, f"{name} int8: {step_error.max():.3f} quantization steps off at {worst}"


@pytest.mark.parametrize(("hq", "hkv", "d", "rotary"), [(24, 4, 256, 64), (8, 2, 64, 16), (4, 2, 128, 32)])
def test_gated_rope_kv_turns_the_first_rotary_dims_of_strided_rows_with_f32_gains(
    gpu: Gpu, hq: int, hkv: int, d: int, rotary: int
) -> None:
    """The hybrid's gated attention: qkv rows end with a gate per q head, q/k gains are f32 (1 + w) and
    RoPE turns only the first `rotary` dims (i with i + rotary/2); the rest pass through the norm only."""
    rng = np.random.default_rng(hq * 7 + d)
    batch = make_batch(rng, query_lens=[3, 1, 66], context_lens=[3, 500, 66])
    t, stride = batch.num_rows, (2 * hq + 2 * hkv) * d
    qkv = (rng.standard_normal((t, stride)) * 2).astype(BF16)
    q_norm, k_norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32), (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    inv_freq = rope_inv_freq(rotary)
    table = plan.rope_table(inv_freq, 1.0, 4096)
    cache = DevicePages(gpu.poisoned(batch.num_pages * PAGE * hkv * d * 2), gpu.poisoned(batch.num_pages * PAGE * hkv * d * 2))
    q_out = gpu.poisoned(t * hq * d * 2)
    rope = RopeArgs(gpu.upload(table), gpu.upload(q_norm), gpu.upload(k_norm), 1e-6, rotary_dim=rotary, norm_f32=True)
    attention_ops.rope_kv(gpu.lib, gpu.stream, gpu.step(batch), shape_of(hq, hkv, d), gpu.upload(qkv), q_out, cache, rope, qkv_stride=stride)

    x = qkv.astype(np.float64)[:, : (hq + 2 * hkv) * d].reshape(t, hq + 2 * hkv, d)
    q, k = rms_normalize_ref(x[:, :hq], q_norm, 1e-6), rms_normalize_ref(x[:, hq : hq + hkv], k_norm, 1e-6)

    def partial(y: np.ndarray) -> np.ndarray:
        return np.concatenate([neox_rope_ref(y[..., :rotary], batch.positions, inv_freq, 1.0), y[..., rotary:]], axis=-1)

    assert_close(gpu.download(q_out, BF16, (t, hq, d)), partial(q), "q_out", rtol=5e-3)
    slots = batch.slot_mapping
    k_raw = gpu.download(cache.k, BF16, (batch.num_pages * PAGE, hkv, d))
    assert_close(k_raw[slots], partial(k), "K pages", rtol=5e-3)


def test_rope_kv_int8_zero_row_stores_zeros_with_scale_one(gpu: Gpu) -> None:
    hq, hkv, d = 2, 1, 128
    batch = make_batch(np.random.default_rng(0), query_lens=[1], context_lens=[1], spare_pages=0)
    qkv = np.zeros((1, (hq + 2 * hkv) * d), BF16)
    cache = DevicePages(gpu.poisoned(PAGE * hkv * d), gpu.poisoned(PAGE * hkv * d), gpu.poisoned(PAGE * hkv * 4), gpu.poisoned(PAGE * hkv * 4))
    rope = RopeArgs(gpu.upload(plan.rope_table(rope_inv_freq(d), 1.0, 8)))
    attention_ops.rope_kv(gpu.lib, gpu.stream, gpu.step(batch), shape_of(hq, hkv, d), gpu.upload(qkv), gpu.poisoned(hq * d * 2), cache, rope)
    slot = int(batch.slot_mapping[0])
    assert (gpu.download(cache.k, np.int8, (PAGE, hkv, d))[slot] == 0).all()
    assert gpu.download(cache.k_scale, np.float32, (PAGE, hkv))[slot, 0] == 1.0


# -- decode attention -----------------------------------------------------------------------------------


def fused_qkv_gate(gpu: Gpu, rng: np.random.Generator, rows: int, hq: int, hkv: int, d: int) -> tuple[OutputGate, np.ndarray]:
    """The gated attention's gates where the executor finds them, after q, k and v in fused qkv rows (random
    values elsewhere), N(0, 2) so the sigmoid spans (0, 1): (the launch's OutputGate, the gates [T, Hq D])."""
    column, stride = (hq + 2 * hkv) * d, (2 * hq + 2 * hkv) * d
    qkv = (rng.standard_normal((rows, stride)) * 2).astype(BF16)
    return OutputGate(gpu.upload(qkv), column, stride), qkv[:, column:].astype(np.float64)


def run_decode(
    gpu: Gpu, batch: Batch, hq: int, hkv: int, d: int, kv_dtype: str, num_splits: int | None = None, gated: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(kernel output, float64 reference) over random K/V at every cached position; `gated`: the output
    multiplied by sigmoid of gates in fused qkv rows, by the combine."""
    rng = np.random.default_rng(int(batch.context_lens.sum()) + hq + d)
    slots = batch.all_slots()
    k, v = (make_pages(rng, batch.num_pages, hkv, d, kv_dtype, slots) for _ in range(2))
    q = rng.standard_normal((batch.num_rows, hq, d)).astype(BF16)
    max_queries = plan.decode_max_queries(hq, hkv)
    row_groups = plan.decode_row_groups(int(batch.query_lens.max()) * (hq // hkv))
    resident = attention_ops.resident_blocks(gpu.lib.kernel(plan.decode_spec(d, KVVariant(kv_dtype))))
    splits = num_splits or plan.decode_num_splits(
        len(batch.query_lens), hkv, gpu.lib.device.sm_count, resident, int(batch.context_lens.max()), row_groups
    )
    acc_bytes, ml_bytes = plan.decode_workspace_bytes(splits, len(batch.query_lens), max_queries, hq, d)
    out = gpu.poisoned(batch.num_rows * hq * d * 2)
    workspace = DecodeWorkspace(gpu.poisoned(acc_bytes), gpu.poisoned(ml_bytes))
    gate, gates = fused_qkv_gate(gpu, rng, batch.num_rows, hq, hkv, d) if gated else (None, None)
    attention_ops.decode_attention(
        gpu.lib, gpu.stream, gpu.step(batch), shape_of(hq, hkv, d), gpu.upload(q), out, gpu.kv_layer(k, v),
        plan.DecodePlan(splits, row_groups), workspace, gate,
    )
    expected = paged_attention_ref(q, k.values, v.values, batch.block_tables, batch.context_lens, batch.query_start, d**-0.5)
    return gpu.download(out, BF16, (batch.num_rows, hq, d)), gated_reference(expected, gates)


CONTEXTS = [1, 63, 64, 65, 1000, 4097]


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (16, 4), (16, 2)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("queries", [1, 2, 3, 4])
def test_decode_attention_matches_float64(gpu: Gpu, kv_dtype: str, hq: int, hkv: int, context: int, queries: int) -> None:
    if queries > context:
        pytest.skip("a sequence cannot have more new rows than tokens")
    batch = make_batch(np.random.default_rng(context * 10 + queries), [queries], [context])
    out, expected = run_decode(gpu, batch, hq, hkv, 128, kv_dtype)
    assert_close(out, expected, f"decode {kv_dtype} hq={hq} hkv={hkv} L={context} Q={queries}")


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("d", [64, 256])
def test_decode_attention_other_head_dims(gpu: Gpu, kv_dtype: str, d: int) -> None:
    batch = make_batch(np.random.default_rng(d), [1, 3], [1000, 65])
    out, expected = run_decode(gpu, batch, 8, 2, d, kv_dtype)
    assert_close(out, expected, f"decode d={d} {kv_dtype}")


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("queries", [5, 8])
def test_decode_attention_full_verify_width_with_gqa8_uses_all_64_rows(gpu: Gpu, kv_dtype: str, queries: int) -> None:
    batch = make_batch(np.random.default_rng(queries), [queries, 1], [4097, 9])
    out, expected = run_decode(gpu, batch, 16, 2, 128, kv_dtype)
    assert_close(out, expected, f"decode verify width {queries}")


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64, 256])
def test_decode_attention_any_split_count_gives_the_same_result(gpu: Gpu, num_splits: int) -> None:
    # 256 splits over 17 pages: most splits are empty and must not disturb the combine
    batch = make_batch(np.random.default_rng(num_splits), [2, 1, 4], [1000, 1, 130])
    out, expected = run_decode(gpu, batch, 8, 2, 128, "bf16", num_splits=num_splits)
    assert_close(out, expected, f"decode with {num_splits} splits")


def test_decode_attention_batch_of_mixed_contexts_and_widths(gpu: Gpu) -> None:
    batch = make_batch(np.random.default_rng(7), [1, 2, 3, 4, 1, 1], [1, 63, 65, 1000, 4097, 128])
    out, expected = run_decode(gpu, batch, 32, 8, 128, "int8")
    assert_close(out, expected, "decode mixed batch")


def test_decode_attention_combines_splits_listed_past_the_first_32(gpu: Gpu) -> None:
    # 625 pages over 256 splits: 209 splits of 3 pages, listed by every lane group of the combine's warp;
    # two rows, so the last split holds keys the first row must not see
    batch = make_batch(np.random.default_rng(13), [2], [40_000])
    out, expected = run_decode(gpu, batch, 32, 8, 128, "bf16", num_splits=256)
    assert_close(out, expected, "decode 40000 tokens over 256 splits")


def test_decode_attention_long_context_fills_many_splits(gpu: Gpu) -> None:
    batch = make_batch(np.random.default_rng(11), [1], [114_812])
    out, expected = run_decode(gpu, batch, 32, 8, 128, "bf16")
    assert_close(out, expected, "decode 114812 tokens")


# -- prefill attention ----------------------------------------------------------------------------------


def prefill_splits(gpu: Gpu, batch: Batch, hq: int, hkv: int, d: int, kv_dtype: str, wgmma: bool | None = None) -> int:
    """The split count prefill_attention picks for this batch on this GPU (its default path)."""
    kernel = prefill_plan.prefill_kernel(gpu.lib.target_arch, d, KVVariant(kv_dtype), wgmma)
    blocks = prefill_plan.prefill_grid_blocks(int(batch.query_lens.max()), len(batch.query_lens), hq, hkv, kernel.tile_rows)
    resident = attention_ops.prefill_blocks_per_sm(gpu.lib, kernel)
    sm_count = gpu.lib.device.sm_count
    capacity = prefill_plan.prefill_workspace_rows(sm_count, d) // kernel.tile_rows
    return prefill_plan.prefill_num_splits(blocks, sm_count, resident, int(batch.context_lens.max()), capacity)


def run_prefill(
    gpu: Gpu, batch: Batch, hq: int, hkv: int, d: int, kv_dtype: str, num_splits: int | None = None,
    wgmma: bool | None = None, widen: bool | None = None, gated: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kernel output, float64 reference, P-rounding slack per element: p_rounding_slack for the kernel's P, bf16
    for bf16 KV, f16 for int8); the split partials live in a poisoned workspace of exactly the
    blocks the split grid has, so a combine that reads a split that never ran (or a row it never wrote) fails.
    `gated`: the output multiplied by sigmoid of gates in fused qkv rows, by the launch that stores it (the
    slack scaled alike)."""
    rng = np.random.default_rng(int(batch.context_lens.sum()) + 3 * hq + d)
    slots = batch.all_slots()
    k, v = (make_pages(rng, batch.num_pages, hkv, d, kv_dtype, slots) for _ in range(2))
    q = rng.standard_normal((batch.num_rows, hq, d)).astype(BF16)
    out = gpu.poisoned(batch.num_rows * hq * d * 2)
    longest = int(batch.query_lens.max())
    widened = prefill_plan.prefill_widens(gpu.lib.target_arch, d, KVVariant(kv_dtype), longest, wgmma) if widen is None else widen
    kind = "widened" if widened else kv_dtype
    splits = num_splits or prefill_splits(gpu, batch, hq, hkv, d, kind, wgmma)
    kernel = prefill_plan.prefill_kernel(gpu.lib.target_arch, d, KVVariant(kind), wgmma)
    blocks = prefill_plan.prefill_grid_blocks(longest, len(batch.query_lens), hq, hkv, kernel.tile_rows) * splits
    workspace = PrefillWorkspace(*(gpu.poisoned(n) for n in prefill_plan.prefill_workspace_bytes(blocks * kernel.tile_rows, d)))
    print(f"prefill: {'widen_int8_kv + ' if widened else ''}{kernel.spec.name}, {splits} split(s), {blocks} blocks")
    shape, step, pages = shape_of(hq, hkv, d), gpu.step(batch), gpu.kv_layer(k, v)
    context = batch.block_tables.shape[1] * PAGE  # the widening walks the block table's width, as the executor's
    if widened:
        capacity = prefill_plan.widening_pages(shape, step.query_lens, context)
        widened_pages = WidenedKV.allocate(gpu.streams, hkv, d, capacity, step.inputs.block_tables.nbytes)
        attention_ops.widen_int8_kv(gpu.lib, gpu.stream, step, shape, pages, widened_pages, context)
        pages = widened_pages
    prefill = prefill_plan.PrefillPlan(kernel, prefill_plan.prefill_tiles(shape, step.query_lens, kernel.tile_rows), splits, context)
    gate, gates = fused_qkv_gate(gpu, rng, batch.num_rows, hq, hkv, d) if gated else (None, None)
    attention_ops.prefill_attention(gpu.lib, gpu.stream, step, shape, gpu.upload(q), out, pages, prefill, workspace, gate)
    # int8: the int8 kernels multiply the exact int8 values and apply the scales in f32 (their headers), the widened
    # path the dequantized values rounded to f16 (kv_widen.cu); the reference is the dequantized values themselves.
    args = (batch.block_tables, batch.context_lens, batch.query_start, d**-0.5)
    expected = paged_attention_ref(q, k.values, v.values, *args)
    slack = p_rounding_slack(q, k.values, v.values, *args, unit=2.0**-11 if kv_dtype == "int8" else 2.0**-8)
    out_host = gpu.download(out, BF16, (batch.num_rows, hq, d))
    return out_host, gated_reference(expected, gates), gated_reference(slack, gates)


# (chunk, context): fresh prompts and chunks after a cached prefix, aligned and not; GQA 4 puts 32 chunk rows
# in a 128-row tile, so 300 and 1000 rows make many causal tiles, 9 a mostly-padding one
PREFILL_CASES = [(9, 9), (64, 64), (100, 100), (65, 1000), (130, 4097), (300, 300), (9, 4097), (1000, 1000), (257, 2113)]


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (16, 4), (16, 2)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize(("chunk", "context"), PREFILL_CASES)
def test_prefill_attention_matches_float64(gpu: Gpu, kv_dtype: str, hq: int, hkv: int, chunk: int, context: int) -> None:
    batch = make_batch(np.random.default_rng(chunk * 7 + context), [chunk], [context])
    out, expected, slack = run_prefill(gpu, batch, hq, hkv, 128, kv_dtype)
    assert_close(out, expected, f"prefill {kv_dtype} hq={hq} hkv={hkv} C={chunk} L={context}", slack=slack)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize(("chunk", "context"), PREFILL_CASES)
def test_prefill_attention_portable_kernel_matches_float64(gpu: Gpu, chunk: int, context: int, kv_dtype: str) -> None:
    # On sm_90a head_dim 128 runs the wgmma kernel; the mma.sync one (every other arch) is held to the same
    # reference here.
    batch = make_batch(np.random.default_rng(chunk * 7 + context), [chunk], [context])
    out, expected, slack = run_prefill(gpu, batch, 16, 4, 128, kv_dtype, wgmma=False)
    assert_close(out, expected, f"prefill mma.sync {kv_dtype} C={chunk} L={context}", slack=slack)


def sm90_only(gpu: Gpu) -> None:
    if not prefill_plan.prefill_wgmma_applies(gpu.lib.target_arch, 128):
        pytest.skip(f"int8 KV is widened on sm_90a only (this GPU: {gpu.lib.target_arch})")


@pytest.mark.parametrize("widen", [True, False], ids=["widened", "int8"])
@pytest.mark.parametrize(("chunk", "context"), PREFILL_CASES)
def test_prefill_attention_int8_widened_or_not_matches_float64(gpu: Gpu, chunk: int, context: int, widen: bool) -> None:
    # either way round the default (widened from PREFILL_WIDEN_MIN_QUERIES rows on)
    sm90_only(gpu)
    batch = make_batch(np.random.default_rng(chunk * 7 + context), [chunk], [context])
    out, expected, slack = run_prefill(gpu, batch, 16, 4, 128, "int8", widen=widen)
    assert_close(out, expected, f"prefill int8 widen={widen} C={chunk} L={context}", slack=slack)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_prefill_attention_widened_int8_differs_from_the_int8_kernel_by_f16_rounding_only(gpu: Gpu, num_splits: int) -> None:
    # widened: K and V rounded to f16 after dequantizing (kv_widen.cu), else the same f16 P and f32 sums as the
    # int8 kernel; a key too many or too few in a tile's first rows would be off by several bf16 steps
    sm90_only(gpu)
    batch = make_batch(np.random.default_rng(17), [300, 3, 130], [1300, 40, 4097])
    widened, _, _ = run_prefill(gpu, batch, 32, 8, 128, "int8", num_splits=num_splits, widen=True)
    plain, _, _ = run_prefill(gpu, batch, 32, 8, 128, "int8", num_splits=num_splits, widen=False)
    rows = np.setdiff1d(np.arange(batch.num_rows), np.arange(300, 303))
    a, b = widened[rows].astype(np.float64), plain[rows].astype(np.float64)
    print(f"widened vs int8 kernel: {np.mean(a == b):.4f} of elements equal, max |diff| {np.max(np.abs(a - b)):.3e}")
    # f16 K and V move the exact result by at most 0.0062 = 0.8% of its rms on this data (float64, numpy), and each
    # kernel rounds out to bf16: one bf16 step plus 1% of the rms apart at most
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(a), np.abs(b)) + 1e-30)) - 7)
    bound = step + 1e-2 * np.sqrt(np.mean(b**2))
    assert np.all(np.abs(a - b) <= bound), f"{int(np.sum(np.abs(a - b) > bound))} elements differ by more than a bf16 step"
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2.5e-3
    assert (widened[300:303].view(np.uint16) == 0xFFFF).all(), "the widened kernel wrote a decode sequence's rows"


@pytest.mark.parametrize("wgmma", [None, False], ids=["default", "portable"])
@pytest.mark.parametrize(("chunk", "context", "num_splits"), [(1000, 1000, None), (1000, 1000, 1), (300, 1000, 3)])
def test_prefill_attention_bf16_is_exact_but_for_rounding_p_and_out(
    gpu: Gpu, chunk: int, context: int, num_splits: int | None, wgmma: bool | None
) -> None:
    # No rms(e) term: every element within twice the worst case of rounding P to bf16 (p_rounding_slack) and out
    # to bf16 (2^-8 |e|), so the first rows of each causal tile (few keys, where an rms-relative bound is loosest
    # and a key too many or too few moves the output by ~p |v|) are held to what the arithmetic allows. A numpy
    # emulation of the kernel's math (f32 S, page-wise online softmax, bf16 P, f32 l, splits merged) stays within
    # 0.73 of the undoubled bound on these cases; a key added or dropped at each tile's first row exceeds it 13-60x.
    batch = make_batch(np.random.default_rng(chunk * 7 + context), [chunk], [context])
    out, expected, slack = run_prefill(gpu, batch, 16, 4, 128, "bf16", num_splits=num_splits, wgmma=wgmma)
    assert_within_p_and_out_rounding(out, expected, slack)


def assert_within_p_and_out_rounding(out: np.ndarray, expected: np.ndarray, slack: np.ndarray) -> None:
    error = np.abs(out.astype(np.float64) - expected)
    bound = 2 * (slack + 2.0**-8 * np.abs(expected)) + 2.0**-16
    bad = ~(error <= bound)
    first = np.unravel_index(int(np.argmax(bad)), bad.shape)
    assert not bad.any(), (
        f"{int(bad.sum())} elements past the rounding bound (rows {np.unique(np.argwhere(bad)[:, 0])[:10].tolist()}); "
        f"first {tuple(int(i) for i in first)}: got {float(out[first])}, expected {expected[first]}, bound {bound[first]:.3e}"
    )


# -- head_dim 256: the gated-attention layers of Qwen3.6-27B (24 q heads over 4 kv heads) ------------------
# GQA 6 puts 10 chunk rows in the mma.sync kernel's 64-row tile (4 padding rows), 21 in the sm_90a kernel's 128
# (2 padding rows); chunks and contexts off the page and tile grids, fresh and after a cached prefix; pages
# shuffled (make_batch). On sm_90a the default is the wgmma kernel (bf16; int8 widened from 256 rows) and
# "portable" forces the mma.sync one; elsewhere both are the mma.sync kernel.
D256_CASES = [(9, 9), (100, 100), (65, 1000), (130, 4097), (257, 2113), (531, 1231)]


def require_shared_memory(gpu: Gpu, d: int, kv_dtype: str) -> None:
    smem = prefill_plan.prefill_kernel(gpu.lib.target_arch, d, KVVariant(kv_dtype)).smem
    if smem > gpu.lib.device.max_shared_memory_per_block_optin:
        pytest.skip(f"prefill d{d} {kv_dtype}: {smem} bytes of shared memory, this GPU's blocks take {gpu.lib.device.max_shared_memory_per_block_optin}")


@pytest.mark.parametrize("wgmma", [None, False], ids=["default", "portable"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize(("chunk", "context"), D256_CASES)
def test_prefill_attention_head_dim_256_gated_attention_heads(
    gpu: Gpu, kv_dtype: str, chunk: int, context: int, wgmma: bool | None
) -> None:
    require_shared_memory(gpu, 256, kv_dtype)
    batch = make_batch(np.random.default_rng(chunk * 11 + context), [chunk], [context])
    out, expected, slack = run_prefill(gpu, batch, 24, 4, 256, kv_dtype, wgmma=wgmma)
    assert_close(out, expected, f"prefill d=256 {kv_dtype} hq=24 hkv=4 C={chunk} L={context} wgmma={wgmma}", slack=slack)


@pytest.mark.parametrize("widen", [True, False], ids=["widened", "int8"])
@pytest.mark.parametrize(("chunk", "context", "num_splits"), [(130, 4097, None), (531, 1231, None), (300, 1000, 3)])
def test_prefill_attention_head_dim_256_int8_widened_or_not_matches_float64(
    gpu: Gpu, chunk: int, context: int, num_splits: int | None, widen: bool
) -> None:
    # sm_90a: widened, the wgmma kernel's f16 twin over the f16 pages; not, the mma.sync int8 kernel
    sm90_only(gpu)
    batch = make_batch(np.random.default_rng(chunk * 5 + context), [chunk], [context])
    out, expected, slack = run_prefill(gpu, batch, 24, 4, 256, "int8", num_splits=num_splits, widen=widen)
    assert_close(out, expected, f"prefill d=256 int8 widen={widen} C={chunk} L={context}", slack=slack)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_prefill_attention_head_dim_256_any_split_count_leaves_decode_rows_alone(gpu: Gpu, kv_dtype: str, num_splits: int) -> None:
    # 32 splits of a 65-page context: 3 pages each, the last splits empty for the early tiles; the 3-row
    # sequence is decode_attention's
    require_shared_memory(gpu, 256, kv_dtype)
    batch = make_batch(np.random.default_rng(256 + num_splits), [130, 3, 77], [4097, 40, 1300])
    out, expected, slack = run_prefill(gpu, batch, 24, 4, 256, kv_dtype, num_splits=num_splits)
    decode_rows = np.arange(130, 133)
    prefill_rows = np.setdiff1d(np.arange(batch.num_rows), decode_rows)
    assert_close(out[prefill_rows], expected[prefill_rows], f"prefill d=256 {kv_dtype} {num_splits} splits", slack=slack[prefill_rows])
    assert (out[decode_rows].view(np.uint16) == 0xFFFF).all(), "prefill_attention wrote a decode sequence's rows"


@pytest.mark.parametrize("wgmma", [None, False], ids=["default", "portable"])
@pytest.mark.parametrize(("chunk", "context", "num_splits"), [(300, 1000, 1), (300, 1000, 3), (531, 1231, None)])
def test_prefill_attention_head_dim_256_bf16_is_exact_but_for_rounding_p_and_out(
    gpu: Gpu, chunk: int, context: int, num_splits: int | None, wgmma: bool | None
) -> None:
    # the bound of the head_dim 128 test above: each tile's first rows (few keys) held to what the arithmetic allows
    batch = make_batch(np.random.default_rng(chunk * 13 + context), [chunk], [context])
    out, expected, slack = run_prefill(gpu, batch, 24, 4, 256, "bf16", num_splits=num_splits, wgmma=wgmma)
    assert_within_p_and_out_rounding(out, expected, slack)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_prefill_attention_head_dim_64(gpu: Gpu, kv_dtype: str) -> None:
    batch = make_batch(np.random.default_rng(64), [77], [200])
    out, expected, slack = run_prefill(gpu, batch, 8, 2, 64, kv_dtype)
    assert_close(out, expected, f"prefill d=64 {kv_dtype}", slack=slack)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 32])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_prefill_attention_any_split_count_gives_the_same_result(gpu: Gpu, kv_dtype: str, num_splits: int) -> None:
    # 32 splits of a 65-page context: 3 pages each, the last splits empty for the early tiles
    batch = make_batch(np.random.default_rng(num_splits), [130], [4097])
    out, expected, slack = run_prefill(gpu, batch, 16, 4, 128, kv_dtype, num_splits=num_splits)
    assert_close(out, expected, f"prefill {kv_dtype} with {num_splits} splits", slack=slack)


@pytest.mark.parametrize(("hq", "hkv"), [(10, 2), (12, 4), (64, 1)], ids=["gqa5", "gqa3", "gqa64"])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_prefill_attention_gqa_groups_that_do_not_divide_the_tile(gpu: Gpu, hq: int, hkv: int, num_splits: int) -> None:
    # 128-row tiles: GQA 5: 25 chunk rows x 5 heads = 125 rows; GQA 3: 42 x 3 = 126; GQA 64: two chunk rows per tile
    batch = make_batch(np.random.default_rng(hq + num_splits), [77, 20], [1000, 20])
    out, expected, slack = run_prefill(gpu, batch, hq, hkv, 128, "int8", num_splits=num_splits)
    assert_close(out, expected, f"prefill hq={hq} hkv={hkv} with {num_splits} splits", slack=slack)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_prefill_attention_head_dim_64_split(gpu: Gpu, kv_dtype: str) -> None:
    batch = make_batch(np.random.default_rng(65), [77], [3000])
    out, expected, slack = run_prefill(gpu, batch, 8, 2, 64, kv_dtype, num_splits=6)
    assert_close(out, expected, f"prefill d=64 {kv_dtype} 6 splits", slack=slack)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_prefill_attention_short_chunk_over_a_long_prefix_qwen3_8b_heads(gpu: Gpu, kv_dtype: str) -> None:
    # the agent-turn shape, scaled down for the float64 reference: 131 new rows after 30,000 cached tokens
    batch = make_batch(np.random.default_rng(8), [131], [30_131])
    assert prefill_splits(gpu, batch, 32, 8, 128, kv_dtype) > 1
    out, expected, slack = run_prefill(gpu, batch, 32, 8, 128, kv_dtype)
    assert_close(out, expected, f"prefill {kv_dtype} C=131 L=30131 (auto splits)", slack=slack)


@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_prefill_attention_agent_turn_shape_scaled_down(gpu: Gpu, kv_dtype: str, num_splits: int | None) -> None:
    # qwen3-8b heads, an odd chunk over a non-page-aligned prefix (531 new rows as in the agent turn, 17 tiles)
    batch = make_batch(np.random.default_rng(531), [531], [531 + 4_700])
    out, expected, slack = run_prefill(gpu, batch, 32, 8, 128, kv_dtype, num_splits=num_splits)
    assert_close(out, expected, f"prefill {kv_dtype} C=531 L=5231 splits={num_splits or 'auto'}", slack=slack)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_prefill_attention_several_sequences_in_one_launch_leaves_decode_rows_alone(gpu: Gpu, num_splits: int) -> None:
    batch = make_batch(np.random.default_rng(5), [70, 3, 200, 20], [70, 500, 1100, 4097])
    out, expected, slack = run_prefill(gpu, batch, 16, 4, 128, "bf16", num_splits=num_splits)
    decode_rows = np.arange(70, 73)  # the 3-row sequence is decode_attention's
    prefill_rows = np.setdiff1d(np.arange(batch.num_rows), decode_rows)
    assert_close(out[prefill_rows], expected[prefill_rows], "prefill multi-sequence", slack=slack[prefill_rows])
    assert (out[decode_rows].view(np.uint16) == 0xFFFF).all(), "prefill_attention wrote a decode sequence's rows"


# -- the executor's op: rope_kv, then decode and prefill in one mixed step -------------------------------


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_attention_op_mixed_step_matches_float64(gpu: Gpu, kv_dtype: str) -> None:
    hq, hkv, d = 16, 4, 128
    rng = np.random.default_rng(99)
    batch = make_batch(rng, query_lens=[1, 150, 4], context_lens=[700, 150, 66])
    t = batch.num_rows
    spec = KVSpec(num_layers=1, num_pages=batch.num_pages, n_kv_heads=hkv, head_dim=d, dtype=KVDtype.parse(kv_dtype))
    kv = KVCache(gpu.streams, spec)
    prefix = [make_pages(rng, batch.num_pages, hkv, d, kv_dtype, batch.slots_before_step()) for _ in range(2)]
    layer = kv.layers[0]
    for buffer, data in ((layer.k, prefix[0].raw), (layer.v, prefix[1].raw), (layer.k_scale, prefix[0].scale), (layer.v_scale, prefix[1].scale)):
        if buffer is not None:
            ring = StagingRing(gpu.streams, 1, data.nbytes)
            ring.publish(gpu.stream, buffer, data, label="prefix")
            ring.free()
    qkv = rng.standard_normal((t, (hq + 2 * hkv) * d)).astype(BF16)
    norms = [(1 + 0.1 * rng.standard_normal(d)).astype(BF16) for _ in range(2)]
    table = plan.rope_table(rope_inv_freq(d), 1.0, 1024)
    params = AttentionParams(
        shape=shape_of(hq, hkv, d),
        rope=SimpleNamespace(buffer=gpu.upload(table)),
        q_norm=SimpleNamespace(buffer=gpu.upload(norms[0]), dtype="bf16"),
        k_norm=SimpleNamespace(buffer=gpu.upload(norms[1]), dtype="bf16"),
    )
    out = gpu.poisoned(t * hq * d * 2)
    read, written = pages_of(batch)
    backend = AttentionBackend(gpu.lib, gpu.streams, gpu.stream, max_tokens=t, max_seqs=3, max_pages_per_seq=batch.block_tables.shape[1])
    inputs = gpu.inputs(batch)
    published = {name: getattr(inputs, name) for name in STEP_INPUT_NAMES}
    backend.plan(PublishedStep(published, tuple(batch.query_lens.tolist()), kv, tuple(read), tuple(written), None))
    backend.forward(gpu.upload(qkv), out, params, 0)

    x = qkv.astype(np.float64).reshape(t, hq + 2 * hkv, d)
    q = neox_rope_ref(rms_normalize_ref(x[:, :hq], norms[0], 1e-6), batch.positions, rope_inv_freq(d), 1.0)
    # Attention is judged on the pages as rope_kv left them (its own accuracy is tested above).
    elem = np.int8 if kv_dtype == "int8" else BF16
    pages = []
    for values, scale in ((layer.k, layer.k_scale), (layer.v, layer.v_scale)):
        raw = gpu.download(values, elem, (batch.num_pages, PAGE, hkv, d))
        pages.append(dequantized(raw, gpu.download(scale, np.float32, (batch.num_pages, PAGE, hkv)) if scale is not None else None))
    expected = paged_attention_ref(q, pages[0], pages[1], batch.block_tables, batch.context_lens, batch.query_start, d**-0.5)
    actual = gpu.download(out, BF16, (t, hq, d))
    prefill_rows = np.arange(batch.query_start[1], batch.query_start[2])  # the 150-row chunk
    decode_rows = np.setdiff1d(np.arange(t), prefill_rows)
    assert_close(actual[decode_rows], expected[decode_rows], f"attention op {kv_dtype}, decode rows")
    assert_close(actual[prefill_rows], expected[prefill_rows], f"attention op {kv_dtype}, prefill rows")
