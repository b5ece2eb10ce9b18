"""Gated DeltaNet families on the CPU: NVRTC compiles them for every target arch with every kernel the
wrappers launch (the PDL contract is checked for every family by test_pdl_contract.py, the mirrored
constants by test_linear_attn_constants.py), the split passes' shared memory fits the devices, and the
wrappers' launch shapes, kernel choice and declared accesses are right, for the fused and the split chunked
forms (a recording library, no GPU)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_rt.cuda import gdn_split_plan
from ninfer_rt.cuda import linear_attn_ops as ops
from ninfer_rt.cuda.compiler import compile_family
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_step_inputs import check_state_targets
from ninfer_rt.exec.cuda_linear_attn import LinearAttentionBackend
from ninfer_rt.exec.layer_backend import PublishedStep
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.executor import LinearAttentionParams, LinearAttentionShape, StepBatch
from ninfer_rt.ordering import Span
from test_attention_compile import RecordingLibrary

TARGET_ARCHS = ("sm_80", "sm_90a", "sm_120a")
SM120_SMEM = 101_376  # opt-in shared memory per block: sm_120 (RTX 5090)
SM90_SMEM = 232_448  # H100/H200
HEADS_27B = ops.GdnHeads(key_heads=16, value_heads=48, key_dim=128, value_dim=128, norm_eps=1e-6)


def kernel_names() -> dict[str, set[str]]:
    delta = {ops.GATED_NORM.name} | {ops.recurrent_spec(d).name for d in ops.KEY_DIMS}
    delta |= {ops.chunked_spec(d, c).name for d in ops.KEY_DIMS for c in ops.CHUNK_COLUMN_GROUPS}
    split = {spec.name for d in ops.KEY_DIMS for c in (16, 32) for spec in ops.split_specs(d, c)}
    return {"gdn_conv": {ops.CONV_SILU.name}, "gdn_delta_rule": delta, "gdn_chunked_split": split}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gdn_cubins")


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("family", ["gdn_conv", "gdn_delta_rule", "gdn_chunked_split"])
def test_family_compiles_with_every_kernel_the_wrappers_launch(family: str, arch: str, cache_dir: Path) -> None:
    cubin = compile_family(family, arch, cache=cache_dir).cubin
    missing = sorted(name for name in kernel_names()[family] if name.encode() + b"\0" not in cubin)
    assert not missing, f"{family} for {arch} lacks {missing}"


def test_the_chunked_kernel_fits_sm120_with_narrow_column_groups_and_hopper_with_wide_ones() -> None:
    assert ops.chunked_smem_bytes(128, 16) <= SM120_SMEM < ops.chunked_smem_bytes(128, 32) <= SM90_SMEM
    assert ops.chunk_columns(128, 128, SM120_SMEM) == 16
    assert ops.chunk_columns(128, 128, SM90_SMEM) == 32
    with pytest.raises(ValueError, match="no column group"):
        ops.chunk_columns(128, 128, 64 * 1024)


def test_every_split_pass_fits_sm120_and_two_blocks_fit_an_h200_sm() -> None:
    for key_dim in ops.KEY_DIMS:
        for columns in (16, 32):
            assert max(ops.split_smem_bytes(key_dim, columns)) <= SM120_SMEM
            assert 2 * max(ops.split_smem_bytes(key_dim, columns)) <= 228 * 1024 - 2 * 1024  # per SM, less 1 KiB per block


def test_geometry_refuses_what_is_not_instantiated() -> None:
    with pytest.raises(ValueError, match="key head dim 96"):
        ops.GdnHeads(key_heads=2, value_heads=4, key_dim=96, value_dim=128, norm_eps=1e-6)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.GdnHeads(key_heads=2, value_heads=4, key_dim=64, value_dim=48, norm_eps=1e-6)
    assert HEADS_27B.conv_channels == 10240 and HEADS_27B.projection_stride == 10240 + 6144 + 96


# -- launches ---------------------------------------------------------------------------------------------


class Fixture:
    """Buffers of a logical step over the 27B layer shape, slots 0..3 of a four-slot pool."""

    def __init__(self, query_lens: tuple[int, ...], num_targets: int = 1) -> None:
        streams = StreamSet(verify=False)
        self.stream = streams.create("compute")
        rows, seqs = sum(query_lens), len(query_lens)

        def buf(nbytes: int, name: str) -> DeviceBuffer:
            return DeviceBuffer(streams, nbytes, name)

        self.pool = buf(4 * 1024, "slots")
        self.states = ops.StateLayer(self.pool, layer_offset=256, slot_bytes=1024, conv_bytes=256)
        spans = tuple(Span(self.pool.resource, 1024 * s, 1024 * (s + 1)) for s in range(4))
        self.step = ops.GdnStep(
            buf(4 * (seqs + 1), "query_start"), buf(4 * seqs, "state_slots"), buf(4 * seqs * num_targets, "state_targets"),
            query_lens, num_targets, slots_read=spans[:1], slots_written=spans[1:],
        )
        heads = HEADS_27B
        self.x = buf(rows * heads.projection_stride * 2, "x")
        self.conv = buf(rows * heads.conv_channels * 2, "conv")
        self.weight = buf(heads.conv_channels * 4 * 4, "conv weight")
        self.gating = ops.DeltaRuleArgs(self.conv, self.x, buf(48 * 4, "A_log"), buf(48 * 4, "dt_bias"), buf(rows * heads.value_size * 4, "o"))


def test_conv_splits_long_sequences_and_declares_the_slots_it_reads_and_writes() -> None:
    lib, f = RecordingLibrary(), Fixture((1, 130))
    ops.conv_silu(lib, f.stream, f.step, HEADS_27B, f.x, f.weight, f.conv, f.states)
    [launch] = lib.launches
    assert launch.name == "gdn_conv_silu_k4" and launch.grid == (10240 // 128, 3, 2)
    assert launch.args[4] == f.pool.ptr + 256 and launch.args[5] == 1024
    assert set(f.step.slots_read) <= set(launch.reads) and set(f.step.slots_written) <= set(launch.writes)
    assert f.conv.resource in launch.writes and f.x.resource in launch.reads


@pytest.mark.parametrize(
    ("query_lens", "kernels"),
    [((1,), ["gdn_recurrent_d128"]), ((4, 8), ["gdn_recurrent_d128"]), ((531,), ["gdn_chunked_d128_c32"]),
     ((1, 9), ["gdn_recurrent_d128", "gdn_chunked_d128_c32"])],
)
def test_delta_rule_runs_the_recurrent_form_up_to_eight_rows_and_the_chunked_form_above(
    query_lens: tuple[int, ...], kernels: list[str]
) -> None:
    lib, f = RecordingLibrary(), Fixture(query_lens)
    ops.delta_rule(lib, f.stream, f.step, HEADS_27B, f.gating, f.states, columns=32)
    assert [launch.name for launch in lib.launches] == kernels
    for launch in lib.launches:
        columns = ops.RECURRENT_COLUMNS if "recurrent" in launch.name else 32
        assert launch.grid == (128 // columns, 48, len(query_lens))
        assert f.gating.out.resource in launch.writes and set(f.step.slots_written) <= set(launch.writes)
    chunked = [launch for launch in lib.launches if "chunked" in launch.name]
    assert all(launch.smem == ops.chunked_smem_bytes(128, 32) for launch in chunked)


def test_delta_rule_refuses_short_buffers_before_launching() -> None:
    lib, f = RecordingLibrary(), Fixture((3,), num_targets=3)
    short = replace(f.gating, out=Fixture((1,)).gating.out)
    with pytest.raises(ValueError, match="out"):
        ops.delta_rule(lib, f.stream, f.step, HEADS_27B, short, f.states, 32)
    assert not lib.launches


def split_workspace(query_lens: tuple[int, ...], num_targets: int, streams: StreamSet | None = None) -> ops.SplitWorkspace:
    streams = streams or StreamSet(verify=False)
    chunks = gdn_split_plan.chunk_bases(query_lens, num_targets)[-1]
    sizes = gdn_split_plan.SplitWorkspace(sum(query_lens), chunks, 16, 48, 128, 128).sizes()
    return ops.SplitWorkspace(*(DeviceBuffer(streams, n, name) for name, n in sizes.items()))


def test_the_split_form_runs_three_passes_over_the_workspace_in_order() -> None:
    query_lens = (1, 300, 70)
    lib, f, ws = RecordingLibrary(), Fixture(query_lens, num_targets=2), split_workspace(query_lens, 2)
    ops.delta_rule(lib, f.stream, f.step, HEADS_27B, f.gating, f.states, 32, ws)
    names = [launch.name for launch in lib.launches]
    assert names == ["gdn_recurrent_d128", "gdn_split_terms_d128", "gdn_split_carry_d128_c32", "gdn_split_out_d128"]
    terms, carry, out = lib.launches[1:]
    chunks_of_300 = 5 + 1  # the 64-grid and the target count 299
    assert terms.grid == out.grid == (chunks_of_300, 48, 3) and carry.grid == (4, 48, 3)
    assert (terms.smem, carry.smem, out.smem) == ops.split_smem_bytes(128, 32)
    assert all(launch.args[-6:] == ws.buffers for launch in lib.launches[1:])
    norms, w, u, cum, h, kt = (b.resource for b in ws.buffers)
    assert {norms, w, u, cum, kt} <= set(terms.writes) and f.conv.resource in terms.reads
    assert {w, kt, u, cum} <= set(carry.reads) and {u, h} <= set(carry.writes)
    assert set(f.step.slots_read) <= set(carry.reads) and set(f.step.slots_written) <= set(carry.writes)
    assert {f.conv.resource, norms, u, cum, h} <= set(out.reads) and out.writes == (f.gating.out.resource,)
    assert not set(f.step.slots_written) & set(terms.writes + out.writes), "only the carry pass writes states"


def test_a_benchmark_can_launch_one_split_pass_alone() -> None:
    lib, f, ws = RecordingLibrary(), Fixture((300,)), split_workspace((300,), 1)
    ops.delta_rule(lib, f.stream, f.step, HEADS_27B, f.gating, f.states, 32, ws, split_passes=("gdn_split_carry",))
    assert [launch.name for launch in lib.launches] == ["gdn_split_carry_d128_c32"]


def test_the_split_form_refuses_a_workspace_short_of_the_steps_chunks() -> None:
    lib, f = RecordingLibrary(), Fixture((300,), num_targets=2)
    with pytest.raises(ValueError, match="h"):
        ops.delta_rule(lib, f.stream, f.step, HEADS_27B, f.gating, f.states, 32, split_workspace((300,), 1))
    assert not lib.launches


# -- the executor's backend: one layer of a step (plan, then forward) ------------------------------------

SHAPE_27B = LinearAttentionShape(16, 48, 128, 128, 4, 1e-6)


def backend_run(
    query_lens: tuple[int, ...], slots: list[int], targets: list[list[int]], capturing: bool = False, form: str = "fused",
    backend: LinearAttentionBackend | None = None,
) -> tuple:
    streams = backend.streams if backend else StreamSet(verify=False)
    lib = backend.library if backend else RecordingLibrary()
    lib.device.max_shared_memory_per_block_optin = SM90_SMEM
    pool = StateSlotPool(streams, StateSpec(2, 16, 48, 128, 128), num_slots=4)
    backend = backend or LinearAttentionBackend(lib, streams, streams.create("compute"), max_tokens=1024, chunked_form=form)
    rows = sum(query_lens)

    def buf(nbytes: int, name: str) -> SimpleNamespace:
        return SimpleNamespace(buffer=DeviceBuffer(streams, nbytes, name))

    inputs = {name: DeviceBuffer(streams, 256, name) for name in ("query_start", "state_slots", "state_targets")}
    step = PublishedStep(inputs, query_lens, None, (), (), None, np.array(slots, np.int32), np.array(targets, np.int32))
    params = LinearAttentionParams(SHAPE_27B, buf(10240 * 16, "conv"), buf(192, "A_log"), buf(192, "dt_bias"), buf(512, "norm"))
    projected = DeviceBuffer(streams, rows * HEADS_27B.projection_stride * 2, "projected")
    out = DeviceBuffer(streams, rows * 6144 * 2, "out")
    backend.plan(step)
    with backend.capturing() if capturing else nullcontext():
        backend.forward(projected, out, params, pool, layer=1)
    return lib, pool, backend


def test_a_layer_is_conv_then_delta_rule_then_gated_norm_over_the_layers_part_of_the_slots() -> None:
    lib, pool, _ = backend_run((1, 300), slots=[0, 2], targets=[[0], [3]])
    assert [launch.name for launch in lib.launches] == [
        "gdn_conv_silu_k4", "gdn_recurrent_d128", "gdn_chunked_d128_c32", "gdn_gated_norm",
    ]
    conv = lib.launches[0]
    assert conv.args[4] == pool.buffer.ptr + pool.spec.layer_offset(1) and conv.args[5] == pool.spec.slot_bytes
    for launch in lib.launches[:3]:
        assert {pool.resource(0), pool.resource(2)} <= set(launch.reads)
        assert {pool.resource(0), pool.resource(3)} <= set(launch.writes) and pool.resource(2) not in launch.writes


def test_the_split_form_is_the_default_and_its_workspace_grows_with_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NINFER_GDN_CHUNKED", raising=False)
    lib, _, backend = backend_run((1, 100), slots=[0, 2], targets=[[0], [3]], form=None)
    assert [launch.name for launch in lib.launches] == [
        "gdn_conv_silu_k4", "gdn_recurrent_d128", "gdn_split_terms_d128", "gdn_split_carry_d128_c32", "gdn_split_out_d128",
        "gdn_gated_norm",
    ]
    first = lib.launches[2].args[-6:]
    backend_run((1, 100), slots=[0, 2], targets=[[0], [3]], backend=backend)
    assert lib.launches[8].args[-6:] == first, "a step that fits reuses the arrays"
    backend_run((700,), slots=[0], targets=[[3]], backend=backend)
    grown = lib.launches[-3].args[-6:]
    assert grown != first and grown[-2].nbytes == 11 * 48 * 128 * 128 * 4  # the 700-row step's 11 chunk states
    monkeypatch.setenv("NINFER_GDN_CHUNKED", "fast")
    with pytest.raises(ValueError, match="NINFER_GDN_CHUNKED='fast'"):
        backend_run((100,), slots=[0], targets=[[3]], form=None)


def test_a_reserved_backend_runs_its_widest_step_in_the_arrays_it_reserved() -> None:
    streams, lib = StreamSet(verify=False), RecordingLibrary()
    backend = LinearAttentionBackend(lib, streams, streams.create("compute"), max_tokens=1024, chunked_form="split")
    backend.reserve(SHAPE_27B, max_seqs=2)
    backend_run((1, 100), slots=[0, 2], targets=[[0], [3]], backend=backend)
    reserved = lib.launches[2].args[-6:]
    backend_run((1016, 8), slots=[0, 2], targets=[[0, 1, 2, 3], [3, 2, 1, 0]], backend=backend)
    assert lib.launches[8].name == "gdn_split_terms_d128" and lib.launches[8].args[-6:] == reserved


def test_decode_steps_never_touch_the_split_workspace() -> None:
    lib, _, backend = backend_run((1,), slots=[0], targets=[[0]], form="split")
    backend_run((1, 8), slots=[0, 2], targets=[[0], [3]], backend=backend, capturing=True)
    assert not any("split" in launch.name for launch in lib.launches)


def test_scratch_is_never_allocated_inside_a_captured_step() -> None:
    with pytest.raises(RuntimeError, match="captured step"):
        backend_run((1,), slots=[0], targets=[[0]], capturing=True)


def test_targets_outside_the_pool_are_refused_before_launching() -> None:
    with pytest.raises(ValueError, match="outside the pool"):
        backend_run((1,), slots=[0], targets=[[7]])


def test_the_executor_refuses_targets_asking_for_states_before_the_first_row() -> None:
    batch = StepBatch(*(np.zeros(2, np.int32),) * 2, np.array([0, 2], np.int32), np.array([2], np.int32),
                      np.zeros((1, 1), np.int32), np.zeros(2, np.int32), np.zeros(0, np.int32),
                      state_slots=np.array([1], np.int32), state_targets=np.array([[2, 3, 1, 1]], np.int32))
    with pytest.raises(ValueError, match="state after -1"):
        check_state_targets(batch)
    check_state_targets(replace(batch, state_targets=np.array([[-1, 3, 1]], np.int32)))
