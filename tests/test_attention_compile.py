"""Attention families on the CPU: NVRTC compiles them for every target arch with every kernel the wrappers
launch, and the wrappers' host-side math, checks, launch shapes and declared accesses are right."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from attention_refs import PAGE, make_batch, make_pages, neox_rope_ref, paged_attention_ref
from ninfer_rt.cuda import attention_ops
from ninfer_rt.cuda import attention_plan as plan
from ninfer_rt.cuda import attention_prefill_plan as prefill_plan
from ninfer_rt.cuda.attention_buffers import STEP_INPUT_NAMES, AttentionStep, DecodeWorkspace, PagedKV, StepInputs, WidenedKV
from ninfer_rt.cuda.attention_plan import KVVariant
from ninfer_rt.cuda.compiler import compile_family
from ninfer_rt.cuda.memory import DeviceBuffer, DeviceView
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_attention import AttentionBackend
from ninfer_rt.exec.layer_backend import PublishedStep
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec, page_resource
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import AttentionParams, AttentionShape
from ninfer_rt.model.rope import rope_attention_scaling, rope_inv_freq

TARGET_ARCHS = ("sm_80", "sm_90a", "sm_120a")
H200_SMS = 132
RESIDENT = 3  # decode blocks per SM on an H200 (146 registers, 16 KiB of shared memory)


def kernel_names() -> dict[str, set[str]]:
    """Every kernel name the wrappers can launch, by family."""
    names: dict[str, set[str]] = {
        "rope_kv": set(), "decode_attention": {"decode_attention_combine"}, "prefill_attention": set(),
        "kv_widen": {prefill_plan.WIDEN_INT8_KV.name},
    }
    names["prefill_attention"] |= {prefill_plan.prefill_combine_spec(d, prefill_plan.mma_sync_tile_rows(d)).name for d in prefill_plan.PREFILL_HEAD_DIMS}
    names["prefill_attention"] |= {prefill_plan.prefill_combine_spec(d, prefill_plan.PREFILL_TILE_ROWS).name for d in prefill_plan.PREFILL_SM90_HEAD_DIMS}
    for kind in plan.CACHE_VARIANTS:
        names["rope_kv"] |= {plan.rope_kv_spec(d, kind).name for d in plan.ROPE_HEAD_DIMS}
        names["prefill_attention"] |= {prefill_plan.prefill_spec(d, kind).name for d in prefill_plan.PREFILL_HEAD_DIMS}
        names["decode_attention"] |= {plan.decode_spec(d, kind).name for d in plan.DECODE_HEAD_DIMS}
    return names


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attention_cubins")


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("family", ["rope_kv", "decode_attention", "prefill_attention", "kv_widen"])
def test_family_compiles_with_every_kernel_the_wrappers_launch(family: str, arch: str, cache_dir: Path) -> None:
    cubin = compile_family(family, arch, cache=cache_dir).cubin
    missing = sorted(name for name in kernel_names()[family] if name.encode() + b"\0" not in cubin)
    assert not missing, f"{family} for {arch} lacks {missing}"


# -- host-side math -------------------------------------------------------------------------------------


def test_num_splits_fills_one_wave_of_an_h200_at_batch_one_for_a_114k_context() -> None:
    splits = plan.decode_num_splits(1, 8, H200_SMS, RESIDENT, 114_812)
    assert H200_SMS * RESIDENT - 8 < splits * 8 <= H200_SMS * RESIDENT
    assert -(-114_812 // PAGE) / splits >= plan.MIN_PAGES_PER_SPLIT


@pytest.mark.parametrize("context", [1, 63, 65, 256, 1000])
def test_num_splits_never_cuts_short_contexts_below_two_pages_per_split(context: int) -> None:
    splits = plan.decode_num_splits(1, 8, H200_SMS, RESIDENT, context)
    assert splits == max(1, -(-context // PAGE) // plan.MIN_PAGES_PER_SPLIT)


@pytest.mark.parametrize("num_seqs", [1, 2, 7, 64, 512])
@pytest.mark.parametrize("n_kv_heads", [1, 4, 8])
def test_num_splits_without_a_context_never_spills_into_a_second_wave(num_seqs: int, n_kv_heads: int) -> None:
    splits = plan.decode_num_splits(num_seqs, n_kv_heads, H200_SMS, RESIDENT)
    assert 1 <= splits <= plan.MAX_SPLITS
    blocks, wave = splits * num_seqs * n_kv_heads, H200_SMS * RESIDENT
    assert blocks <= wave or splits == 1
    assert blocks > wave - num_seqs * n_kv_heads or splits == plan.MAX_SPLITS


def test_decode_takes_up_to_eight_rows_per_sequence_in_row_groups_of_eight() -> None:
    assert plan.decode_max_queries(32, 8) == 8
    assert plan.decode_max_queries(64, 8) == 8  # group 8 x 8 rows = 64 rows, 8 row groups
    assert plan.decode_max_queries(64, 4) == 4  # group 16
    assert [plan.decode_row_groups(r) for r in (1, 8, 9, 32, 33, 64)] == [1, 1, 2, 4, 5, 8]
    with pytest.raises(ValueError, match="1..64 rows"):
        plan.decode_row_groups(65)


def test_row_groups_share_the_wave_with_the_splits() -> None:
    assert plan.decode_num_splits(1, 8, H200_SMS, RESIDENT, row_groups=2) == H200_SMS * RESIDENT // 16


@pytest.fixture
def yarn_config(tiny_qwen3: Path) -> ModelConfig:
    raw = json.loads((tiny_qwen3 / "config.json").read_text())
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    return ModelConfig.from_dict({**raw, "max_position_embeddings": 16384, "rope_scaling": scaling})


def test_rope_table_holds_scaled_cos_then_sin_per_position(yarn_config: ModelConfig) -> None:
    inv_freq, scaling = rope_inv_freq(yarn_config), rope_attention_scaling(yarn_config)
    assert scaling != 1.0
    table = plan.rope_table(inv_freq, scaling, 5000)
    assert table.shape == (5000, 2, yarn_config.head_dim // 2) and table.dtype == np.float32
    angles = 4999 * inv_freq
    np.testing.assert_allclose(table[4999, 0], np.cos(angles) * scaling, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(table[4999, 1], np.sin(angles) * scaling, rtol=1e-6, atol=1e-7)


def test_rotating_with_the_rope_table_is_neox_rope(yarn_config: ModelConfig) -> None:
    """What rope_kv.cu does with a table row equals the reference rotation (i pairs with i + D/2)."""
    inv_freq, scaling = rope_inv_freq(yarn_config), rope_attention_scaling(yarn_config)
    d = yarn_config.head_dim
    table = plan.rope_table(inv_freq, scaling, 300).astype(np.float64)
    positions = np.array([0, 1, 17, 299])
    x = np.random.default_rng(0).standard_normal((4, 3, d))
    cos, sin = table[positions, 0][:, None, :], table[positions, 1][:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    kernel_math = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    np.testing.assert_allclose(kernel_math, neox_rope_ref(x, positions, inv_freq, scaling), rtol=1e-5, atol=1e-6)


def test_paged_reference_equals_dense_causal_attention_on_contiguous_keys() -> None:
    """The GPU tests' reference itself: through shuffled pages it is plain causal attention."""
    rng = np.random.default_rng(1)
    batch = make_batch(rng, [3], [130])
    k, v = (make_pages(rng, batch.num_pages, 2, 16, "bf16", batch.all_slots()) for _ in range(2))
    q = rng.standard_normal((3, 4, 16))
    out = paged_attention_ref(q, k.values, v.values, batch.block_tables, batch.context_lens, batch.query_start, 0.25)
    pages = batch.block_tables[0, :3]
    keys, values = k.values[pages].reshape(-1, 2, 16)[:130], v.values[pages].reshape(-1, 2, 16)[:130]
    for j in range(3):
        for h in range(4):
            scores = keys[: 128 + j, h // 2] @ q[j, h] * 0.25
            probs = np.exp(scores - scores.max())
            np.testing.assert_allclose(out[j, h], probs @ values[: 128 + j, h // 2] / probs.sum(), rtol=1e-12)


# -- launches: shapes, kernel choice and declared accesses (a recording library, no GPU) -----------------


@dataclass
class Launch:
    name: str
    grid: tuple[int, ...]
    args: tuple[object, ...]
    reads: tuple[object, ...]
    writes: tuple[object, ...]
    smem: int = 0
    block: int = 0


@dataclass
class RecordingLibrary:
    device: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(sm_count=H200_SMS, arch="sm_90a"))
    arch: str | None = None  # KernelLibrary's: None compiles for the device's arch

    @property
    def target_arch(self) -> str:
        return self.arch or self.device.arch
    launches: list[Launch] = field(default_factory=list)

    raised: dict[str, int] = field(default_factory=dict)  # raise_dynamic_smem calls: kernel name -> bytes

    def kernel(self, spec: object) -> SimpleNamespace:
        def launch(
            stream: object, grid: tuple[int, ...], block: int, *args: object, smem: int = 0, label: str, reads: tuple = (),
            writes: tuple = (), lane: object = None,
        ) -> None:
            assert smem <= max(48 * 1024, self.raised.get(spec.name, 0)), f"{spec.name}: {smem} bytes of shared memory not raised"
            self.launches.append(Launch(spec.name, grid, args, tuple(reads), tuple(writes), smem, block))

        return SimpleNamespace(launch=launch, max_dynamic_smem=max(48 * 1024, self.raised.get(spec.name, 0)))

    def raise_dynamic_smem(self, spec: object, nbytes: int) -> SimpleNamespace:
        self.raised[spec.name] = nbytes
        return self.kernel(spec)


def logical_step(
    query_lens: list[int], context_lens: list[int], kv_dtype: str = "bf16", heads: tuple[int, int, int] = (16, 4, 128)
) -> SimpleNamespace:
    streams = StreamSet(verify=False)
    hq, hkv, d = heads
    batch = make_batch(np.random.default_rng(0), query_lens, context_lens)
    kv = KVCache(streams, KVSpec(num_layers=1, num_pages=batch.num_pages, n_kv_heads=hkv, head_dim=d, dtype=KVDtype.parse(kv_dtype)))
    max_tokens = 512

    def buf(nbytes: int, name: str) -> DeviceBuffer:
        return DeviceBuffer(streams, nbytes, name)

    inputs = StepInputs(
        positions=buf(4 * max_tokens, "positions"), query_start=buf(4 * 9, "query_start"), context_lens=buf(4 * 8, "context_lens"),
        block_tables=buf(4 * 8 * batch.block_tables.shape[1], "block_tables"), slot_mapping=buf(4 * max_tokens, "slot_mapping"),
    )
    shape = AttentionShape(num_heads=hq, num_kv_heads=hkv, head_dim=d, norm_eps=1e-6)
    norm = SimpleNamespace(buffer=buf(2 * d, "norm"), dtype="bf16")
    params = AttentionParams(shape, SimpleNamespace(buffer=buf(4 * 1024 * d, "rope")), norm, norm)
    read = tuple(page_resource(p) for p in np.unique(batch.block_tables[batch.block_tables >= 0]))
    written = tuple(page_resource(p) for p in np.unique(batch.slot_mapping // PAGE))
    return SimpleNamespace(
        streams=streams, stream=streams.create("compute"), kv=kv, inputs=inputs, params=params, batch=batch,
        qkv=buf(max_tokens * (hq + 2 * hkv) * d * 2, "qkv"), out=buf(max_tokens * hq * d * 2, "out"), read=read, written=written,
    )


@pytest.fixture(autouse=True)
def h200_occupancy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_ops, "resident_blocks", lambda kernel, dynamic_smem=0, threads=128: RESIDENT)


HEADS = AttentionShape(num_heads=16, num_kv_heads=4, head_dim=128, norm_eps=1e-6)  # logical_step's


def backend_for(lib: RecordingLibrary, step: SimpleNamespace) -> AttentionBackend:
    """An executor's backend: 512 rows, 8 sequences, the step's block-table width."""
    return AttentionBackend(lib, step.streams, step.stream, max_tokens=512, max_seqs=8, max_pages_per_seq=step.batch.block_tables.shape[1])


def run_attention_op(
    lib: RecordingLibrary, step: SimpleNamespace, backend: AttentionBackend | None = None, query_lens: list[int] | None = None
) -> AttentionBackend:
    """One layer of one step through the backend, as the executor runs it (plan, then forward)."""
    backend = backend or backend_for(lib, step)
    lens = tuple(query_lens if query_lens is not None else step.batch.query_lens.tolist())
    inputs = {name: getattr(step.inputs, name) for name in STEP_INPUT_NAMES}
    backend.plan(PublishedStep(inputs, lens, step.kv, step.read, step.written, None))
    backend.forward(step.qkv, step.out, step.params, 0)
    return backend


def attention_step(step: SimpleNamespace, query_lens: list[int]) -> AttentionStep:
    return AttentionStep(step.inputs, tuple(query_lens), step.batch.block_tables.shape[1], step.read, step.written)


def test_decode_step_is_rope_then_split_then_combine_with_a_context_free_grid() -> None:
    lib, step = RecordingLibrary(), logical_step([1, 2], [5000, 70])
    run_attention_op(lib, step)
    names = [launch.name for launch in lib.launches]
    assert names == ["rope_kv_d128_bf16", "decode_attention_d128_bf16", "decode_attention_combine"]
    rope, split, combine = lib.launches
    splits = plan.decode_num_splits(2, 4, H200_SMS, RESIDENT)
    assert rope.grid == (5, 3) and split.grid == (splits, 4, 2) and combine.grid == (2 * 8, 16)
    assert set(step.written) <= set(rope.writes) and set(step.read) <= set(split.reads)
    assert step.out.resource in combine.writes and not any(r[0] == "kv" for r in combine.reads)


@pytest.mark.parametrize(("query_lens", "context_lens", "prefill_splits"), [
    ([1, 2], [5000, 70], None),  # decode only: the combine stores every row
    ([4, 300, 1], [900, 300, 64], True),  # the split prefill's combine stores its rows
    ([250, 250], [250, 250], False),  # one split (a short context): the prefill kernel stores
])
def test_gated_attention_reads_strided_qkv_rows_turns_a_quarter_of_each_head_and_gates_the_output_as_stored(
    query_lens: list[int], context_lens: list[int], prefill_splits: bool | None
) -> None:
    lib, step = RecordingLibrary(), logical_step(query_lens, context_lens)
    gain = SimpleNamespace(buffer=step.params.q_norm.buffer, dtype="f32")  # zero-centred 1 + w, prepared in f32
    step.params = replace(step.params, q_norm=gain, k_norm=gain, rotary_dim=32, output_gate=True)
    stride = (16 + 2 * 4) * 128 + 16 * 128
    step.qkv = DeviceBuffer(step.streams, 512 * stride * 2, "gated qkv")
    run_attention_op(lib, step)
    assert lib.launches[0].args[-3:] == (stride, 32, 1)  # rope_kv
    names = [launch.name for launch in lib.launches]
    assert not any("gate" in name for name in names), "the output gate has no launch of its own"
    assert ("prefill_attention_combine_d128" in names) is bool(prefill_splits)
    gated = (step.qkv.ptr + 2 * (16 + 8) * 128, stride)  # the gates follow q, k and v in each row
    for launch in lib.launches[1:]:
        if step.out.resource in launch.writes:  # a launch that stores the output applies the gate
            assert launch.args[-2:] == gated and step.qkv.resource in launch.reads, launch.name
        elif launch.name.startswith("prefill_attention"):  # the split prefill's partials are ungated
            assert launch.args[-2:] == (0, 0) and step.qkv.resource not in launch.reads


def test_partial_rope_refuses_dims_the_lanes_cannot_pair() -> None:
    with pytest.raises(ValueError, match="rotary_dim 80"):
        plan.check_rotary_dim(128, 80)
    plan.check_rotary_dim(256, 64)
    plan.check_rotary_dim(64, 16)


def test_mixed_step_adds_one_prefill_launch_and_verify_rows_take_more_row_groups() -> None:
    lib, step = RecordingLibrary(), logical_step([4, 300, 1], [900, 300, 64])
    run_attention_op(lib, step)
    names = [launch.name for launch in lib.launches]
    assert names == [
        "rope_kv_d128_bf16", "decode_attention_d128_bf16", "decode_attention_combine", "prefill_attention_sm90_d128_bf16",
        "prefill_attention_combine_d128",
    ]
    # 4 verify rows x GQA group 4 = 16 rows per kv head: two row groups of 8 per split
    splits = plan.decode_num_splits(3, 4, H200_SMS, RESIDENT, row_groups=2)
    assert lib.launches[1].grid == (splits * 2, 4, 3)
    prefill, combine = lib.launches[-2:]
    # GQA 4: 32 chunk rows x 4 q heads per 128-row tile, ceil(300 / 32) = 10 tiles per kv head; the context
    # bound is the block table's width (16 pages), so at most 4 splits of 4 pages
    blocks = 10 * 4 * 3
    capacity = prefill_plan.prefill_workspace_rows(H200_SMS, 128) // 128
    splits = prefill_plan.prefill_num_splits(blocks, H200_SMS, RESIDENT, 16 * PAGE, capacity)
    assert splits > 1
    assert prefill.grid == (10 * splits, 4, 3) and set(step.read) <= set(prefill.reads)
    assert (prefill.block, prefill.smem) == (256, prefill_plan.prefill_sm90_smem(128, KVVariant.BF16)) == (256, 99_328)
    assert step.out.resource not in prefill.writes and len(prefill.writes) == 2
    assert combine.grid == (10 * 128 // 16, 4, 3) and set(prefill.writes) <= set(combine.reads) and combine.writes == (step.out.resource,)
    assert not any(r[0] == "kv" for r in combine.reads)


def test_a_long_int8_chunk_is_widened_once_and_the_prefill_reads_only_the_widened_pages() -> None:
    lib, step = RecordingLibrary(), logical_step([4, 400, 1], [900, 400, 64], kv_dtype="int8")
    run_attention_op(lib, step)
    names = [launch.name for launch in lib.launches]
    assert names[3:] == ["widen_int8_kv", "prefill_attention_sm90_d128_widened", "prefill_attention_combine_d128"]
    widen, prefill = lib.launches[3:5]
    # one block per page of the longest context the block table allows, one row per sequence
    assert (widen.grid, widen.block) == ((step.batch.block_tables.shape[1], 3), 256)
    assert set(step.read) <= set(widen.reads) and not any(r[0] == "kv" for r in prefill.reads)
    assert set(widen.writes) <= set(prefill.reads) and len(widen.writes) == 3
    assert (prefill.block, prefill.smem) == (256, prefill_plan.prefill_sm90_smem(128, KVVariant.WIDENED)) == (256, 99_328)


def test_a_short_int8_chunk_runs_the_int8_kernel_without_widening() -> None:
    lib, step = RecordingLibrary(), logical_step([prefill_plan.PREFILL_WIDEN_MIN_QUERIES - 1], [900], kv_dtype="int8")
    run_attention_op(lib, step)
    prefill = lib.launches[1]
    assert [launch.name for launch in lib.launches][:2] == ["rope_kv_d128_int8", "prefill_attention_sm90_d128_int8"]
    assert (prefill.block, prefill.smem) == (384, prefill_plan.prefill_sm90_smem(128, KVVariant.INT8)) == (384, 218_688)
    assert set(step.read) <= set(prefill.reads)


def test_int8_pages_past_the_widening_budget_run_the_int8_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # a budget of 10 pages: the chunk's bound (the block table's width, 17 pages) does not fit
    monkeypatch.setattr(prefill_plan, "PREFILL_WIDEN_BUDGET", 10 * prefill_plan.widened_page_bytes(4, 128))
    lib, step = RecordingLibrary(), logical_step([400], [900], kv_dtype="int8")
    assert step.batch.block_tables.shape[1] > 10
    run_attention_op(lib, step)
    assert [launch.name for launch in lib.launches][:2] == ["rope_kv_d128_int8", "prefill_attention_sm90_d128_int8"]


def test_one_set_of_widening_buffers_serves_every_batch_size() -> None:
    # the executor's block table is a view of num_seqs rows: 1, then 3, then 1 again; the widened tables are
    # sized for the executor's most sequences (8) up front
    lib, wide = RecordingLibrary(), logical_step([4, 400, 1], [900, 400, 64], kv_dtype="int8")
    row = 4 * wide.batch.block_tables.shape[1]
    backend = backend_for(lib, wide)
    for rows, query_lens in ((1, [400]), (3, [4, 400, 1]), (1, [400])):
        view = DeviceView(wide.inputs.block_tables, 0, rows * row, "step.block_tables")
        run_attention_op(lib, SimpleNamespace(**{**vars(wide), "inputs": replace(wide.inputs, block_tables=view)}), backend, query_lens)
    widens = [launch for launch in lib.launches if launch.name == "widen_int8_kv"]
    assert len(widens) == 3 and len({launch.args[0] for launch in widens}) == 1  # one K buffer
    assert len({launch.args[2] for launch in widens}) == 1 and widens[0].args[2].nbytes == 8 * row


def test_a_widening_that_does_not_fit_its_buffers_is_refused() -> None:
    lib, step = RecordingLibrary(), logical_step([400], [900], kv_dtype="int8")
    kv = step.kv.layers[0]
    small = WidenedKV.allocate(step.streams, 4, 128, 10, 4 * 8 * step.batch.block_tables.shape[1])
    with pytest.raises(ValueError, match="exceed the widening buffers"):
        attention_ops.widen_int8_kv(
            lib, step.stream, attention_step(step, [400]), HEADS, PagedKV(kv.k, kv.v, kv.k_scale, kv.v_scale), small, 900
        )
    assert lib.launches == []


def test_widening_buffers_reserved_up_front_are_the_ones_a_step_uses() -> None:
    # CudaExecutor.reserve_step_buffers reserves them at start-up, before the KV cache is sized
    lib, step = RecordingLibrary(), logical_step([4, 400, 1], [900, 400, 64], kv_dtype="int8")
    backend = backend_for(lib, step)
    backend.reserve(HEADS, KVDtype.INT8)
    reserved = backend.widened_kv(HEADS)
    run_attention_op(lib, step, backend)
    (widen,) = (launch for launch in lib.launches if launch.name == "widen_int8_kv")
    assert widen.args[:4] == (reserved.k, reserved.v, reserved.tables, reserved.capacity)
    assert reserved.capacity == prefill_plan.PREFILL_WIDEN_SEQUENCES * step.batch.block_tables.shape[1]


def test_widening_where_it_does_not_apply_is_refused_before_any_launch() -> None:
    lib, step = RecordingLibrary(), logical_step([400], [900])
    kv, widened = step.kv.layers[0], WidenedKV.allocate(step.streams, 4, 128, 40, 4 * 8 * step.batch.block_tables.shape[1])
    with pytest.raises(ValueError, match="widening needs int8 KV"):
        attention_ops.widen_int8_kv(lib, step.stream, attention_step(step, [400]), HEADS, PagedKV(kv.k, kv.v), widened, 900)
    with pytest.raises(ValueError, match="no wgmma kernel for widened pages at head_dim 128 on sm_80"):
        prefill_plan.prefill_kernel("sm_80", 128, KVVariant.WIDENED)
    assert lib.launches == []


def test_prefill_only_step_launches_no_decode_kernels() -> None:
    lib, step = RecordingLibrary(), logical_step([100], [100])
    run_attention_op(lib, step)
    # a 100-token context (a 3-page block table) is too short to split; sm_90a, bf16 KV, head_dim 128: wgmma
    assert [launch.name for launch in lib.launches] == ["rope_kv_d128_bf16", "prefill_attention_sm90_d128_bf16"]
    prefill = lib.launches[1]
    assert prefill.grid == (4, 4, 1) and prefill.writes == (step.out.resource,)
    assert (prefill.block, prefill.smem) == (256, prefill_plan.prefill_sm90_smem(128, KVVariant.BF16)) == (256, 99_328)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_120a"])
def test_prefill_runs_the_mma_sync_kernel_on_every_other_arch(arch: str) -> None:
    lib, step = RecordingLibrary(device=SimpleNamespace(sm_count=H200_SMS, arch=arch)), logical_step([100], [100])
    run_attention_op(lib, step)
    prefill = lib.launches[1]
    assert (prefill.name, prefill.block) == ("prefill_attention_d128_bf16", 128)
    assert prefill.smem == prefill_plan.prefill_smem_bytes(128, KVVariant.BF16) == 69_632


def test_the_wgmma_prefill_kernel_is_chosen_only_where_it_applies() -> None:
    def name(arch: str, d: int, kv: KVVariant, wgmma: bool | None = None) -> str:
        return prefill_plan.prefill_kernel(arch, d, kv, wgmma).spec.name

    bf16, int8, widened = KVVariant.BF16, KVVariant.INT8, KVVariant.WIDENED
    assert name("sm_90a", 128, bf16) == "prefill_attention_sm90_d128_bf16"
    assert name("sm_90a", 128, bf16, wgmma=False) == "prefill_attention_d128_bf16"
    assert name("sm_90a", 128, int8) == "prefill_attention_sm90_d128_int8"
    assert name("sm_90a", 128, int8, wgmma=False) == "prefill_attention_d128_int8"
    assert name("sm_90a", 128, widened) == "prefill_attention_sm90_d128_widened"
    assert name("sm_90a", 64, bf16) == "prefill_attention_d64_bf16"
    assert name("sm_90", 128, bf16) == "prefill_attention_d128_bf16"  # wgmma needs the arch-specific target
    assert name("sm_90a", 256, bf16) == "prefill_attention_sm90_d256_bf16"
    assert name("sm_90a", 256, widened) == "prefill_attention_sm90_d256_widened"
    assert name("sm_90a", 256, int8) == "prefill_attention_d256_int8"  # no int8 wgmma kernel at 256: mma.sync
    with pytest.raises(ValueError, match="no wgmma kernel"):
        prefill_plan.prefill_kernel("sm_120a", 128, bf16, wgmma=True)
    with pytest.raises(ValueError, match="no wgmma kernel"):
        prefill_plan.prefill_kernel("sm_120a", 128, widened)
    with pytest.raises(ValueError, match="no wgmma kernel for int8 pages at head_dim 256"):
        prefill_plan.prefill_kernel("sm_90a", 256, int8, wgmma=True)


def test_int8_kv_is_widened_only_on_sm_90a_for_chunks_of_256_rows_or_more() -> None:
    widens, int8 = prefill_plan.prefill_widens, KVVariant.INT8
    assert widens("sm_90a", 128, int8, 256) and not widens("sm_90a", 128, int8, 255)
    assert not widens("sm_90a", 128, KVVariant.BF16, 531) and not widens("sm_90a", 64, int8, 531)
    assert not widens("sm_120a", 128, int8, 531) and not widens("sm_90a", 128, int8, 531, wgmma=False)


def test_prefill_splits_the_keys_of_a_short_chunk_over_a_long_context_but_not_a_long_chunk() -> None:
    # qwen3-8b: 32 q heads, 8 kv heads -> 32 chunk rows per 128-row tile; 2 blocks per SM on an H200 (255
    # registers, 69.5 KiB of shared memory; registers decide)
    capacity = prefill_plan.prefill_workspace_rows(H200_SMS, 128) // 128
    blocks = prefill_plan.prefill_grid_blocks(531, 1, 32, 8, 128)
    assert blocks == 17 * 8
    splits = prefill_plan.prefill_num_splits(blocks, H200_SMS, 2, 114_812, capacity)
    assert 4 <= splits and blocks * splits <= capacity
    waves = blocks * splits / (H200_SMS * 2)
    assert waves / np.ceil(waves) > 0.85
    # the workspace: capacity blocks of 128 rows (138 MB at head_dim 128 on an H200)
    assert prefill_plan.prefill_workspace_bytes(capacity * 128, 128) == (capacity * 128 * 128 * 4, capacity * 128 * 2 * 4)
    long_chunk = prefill_plan.prefill_grid_blocks(4096, 1, 32, 8, 128)
    assert prefill_plan.prefill_num_splits(long_chunk, H200_SMS, RESIDENT, 32768, capacity) == 1
    # a short context keeps 4 pages per split
    assert prefill_plan.prefill_num_splits(blocks, H200_SMS, RESIDENT, 531, capacity) <= 2
    assert prefill_plan.prefill_tile_queries(40, 8, 128) == 25  # GQA 5: 125 of 128 rows used
    with pytest.raises(ValueError, match="exceeds"):
        prefill_plan.prefill_tile_queries(256, 1, 128)


def test_the_scratch_of_a_shape_is_allocated_once_and_reused() -> None:
    lib, step = RecordingLibrary(), logical_step([1], [100])
    backend = run_attention_op(lib, step)
    run_attention_op(lib, step, backend)
    q_args = {launch.args[0] for launch in lib.launches if launch.name.startswith("rope_kv")}
    assert len(q_args) == 1


def test_a_captured_step_that_would_allocate_is_refused() -> None:
    lib, step = RecordingLibrary(), logical_step([1], [100])
    backend = backend_for(lib, step)
    with backend.capturing(), pytest.raises(RuntimeError, match="inside a captured step"):
        run_attention_op(lib, step, backend)
    run_attention_op(lib, step, backend)  # eagerly first: the capture then finds every buffer
    with backend.capturing():
        run_attention_op(lib, step, backend)
    assert len({launch.args[0] for launch in lib.launches if launch.name.startswith("rope_kv")}) == 1


def test_wrappers_refuse_bad_geometry_before_launching() -> None:
    lib, step = RecordingLibrary(), logical_step([1], [100])
    layer = step.kv.layers[0]
    kv = PagedKV(layer.k, layer.v)
    one_split = prefill_plan.PrefillPlan(prefill_plan.prefill_kernel("sm_90a", 128, KVVariant.BF16), 4, 1, 2 * PAGE)
    prefill_step = attention_step(step, [100])
    for heads, match in (((12, 8, 128), "multiple"), ((16, 4, 96), "head_dim 96")):
        with pytest.raises(ValueError, match=match):
            shape = AttentionShape(*heads, norm_eps=1e-6)
            attention_ops.prefill_attention(lib, step.stream, prefill_step, shape, step.qkv, step.out, kv, one_split)
    with pytest.raises(ValueError, match="a kernel for bf16 pages given widened pages"):
        widened = WidenedKV.allocate(step.streams, 4, 128, 4, 64)
        attention_ops.prefill_attention(lib, step.stream, prefill_step, HEADS, step.qkv, step.out, widened, one_split)
    with pytest.raises(ValueError, match="need a workspace"):
        attention_ops.prefill_attention(
            lib, step.stream, prefill_step, HEADS, step.qkv, step.out, kv, replace(one_split, num_splits=2)
        )
    workspace, decode_step = DecodeWorkspace(step.out, step.out), attention_step(step, [1])
    with pytest.raises(ValueError, match="num_splits"):
        attention_ops.decode_attention(lib, step.stream, decode_step, HEADS, step.qkv, step.out, kv, plan.DecodePlan(0, 1), workspace)
    with pytest.raises(ValueError, match="int8 KV needs"):
        PagedKV(layer.k, layer.v, layer.k, None)
    with pytest.raises(ValueError, match="holds"):  # partial buffers too small for 200 splits
        attention_ops.decode_attention(lib, step.stream, decode_step, HEADS, step.qkv, step.out, kv, plan.DecodePlan(200, 1), workspace)
    assert lib.launches == []


@pytest.mark.parametrize(("context", "split"), [(300, False), (4000, True)])
def test_a_prefill_step_splits_the_keys_only_where_the_block_table_is_long(context: int, split: bool) -> None:
    prefill = "prefill_attention_sm90_d128_bf16"  # RecordingLibrary's H200
    lib, step = RecordingLibrary(), logical_step([300], [context])
    run_attention_op(lib, step)
    combine = ["prefill_attention_combine_d128"] if split else []
    assert [launch.name for launch in lib.launches] == ["rope_kv_d128_bf16", prefill, *combine]
