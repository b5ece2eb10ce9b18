"""`ninfer-rt kernels list/test/bench/watch` on a machine without a GPU: list, compile-only test and watch."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ninfer_rt.kernel_dev import loop
from ninfer_rt.cli import kernels as cli_kernels
from ninfer_rt.cli import main
from ninfer_rt.cuda import attention_plan, attention_prefill_plan, linear_ops, ops, quant_layout_ops, quant_ops, sampling_ops
from ninfer_rt.cuda.compiler import compile_family, families
from ninfer_rt.cuda.driver import device_count
from ninfer_rt.kernel_dev.benches import BENCHES
from ninfer_rt.kernel_dev.loop import TARGET_ARCHS, entry_points

# These check what a machine without a GPU does (compile only); with a GPU the same commands test and bench.
without_gpu = pytest.mark.skipif(device_count() > 0, reason="checks the behaviour without a GPU")

GOOD = """// tiny: y = 2x, instantiated per type by a macro, as the real families do
#include "tiny.cuh"
__device__ __noinline__ float twice(float v) { return scale2(v); }
#define TINY(T) extern "C" __global__ void tiny_##T(T* y, const T* x) { y[threadIdx.x] = (T)twice((float)x[threadIdx.x]); }
TINY(float)
TINY(int)
"""
HEADER = "#pragma once\n__forceinline__ float scale2(float v) { return 2.0f * v; }\n"
BROKEN_LINE = "__device__ __noinline__ float twice(float v) { return scale2(v) + ; }"


@pytest.fixture(autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # One cache for the module: `list` compiles every family once, later tests hit the cache.
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-dev-cache"))


@pytest.fixture
def tiny_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A kernels directory holding only the `tiny` family (tiny.cu including tiny.cuh)."""
    directory = tmp_path / "kernels_src"
    directory.mkdir()
    (directory / "tiny.cu").write_text(GOOD)
    (directory / "tiny.cuh").write_text(HEADER)
    monkeypatch.setenv("NINFER_KERNELS_DIR", str(directory))
    yield directory


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["kernels", *args])


def family_blocks(output: str) -> dict[str, str]:
    """`kernels list` output -> family name -> its block (the header line and its indented fields)."""
    blocks: dict[str, str] = {}
    for line in output.splitlines():
        if line and not line.startswith(" "):
            current = line.split()[0]
            blocks[current] = ""
        blocks[current] += line + "\n"
    return blocks


def prefill_kernels() -> list[attention_prefill_plan.PrefillKernel]:
    """Every prefill kernel the plan picks: the mma.sync ones (sm_80) and sm_90a's, for every page variant."""
    return [
        attention_prefill_plan.prefill_kernel(arch, d, kv)
        for arch in ("sm_80", "sm_90a") for d in attention_prefill_plan.PREFILL_HEAD_DIMS for kv in attention_plan.KVVariant
        if kv is not attention_plan.KVVariant.WIDENED or attention_prefill_plan.prefill_wgmma_applies(arch, d, kv)
    ]


def kernels_loaded_by_the_launch_wrappers() -> dict[str, set[str]]:
    """family -> every kernel name the ops modules ask KernelLibrary for."""
    specs = [
        ops.RMSNORM, ops.RMSNORM_RESIDUAL, ops.SILU_MUL, linear_ops.GATHER_ROWS, attention_plan.DECODE_COMBINE,
        sampling_ops.ARGMAX, sampling_ops.SAMPLE_BEGIN, sampling_ops.SAMPLE_RADIX, sampling_ops.SAMPLE_DRAW,
        *(linear_ops.gemv_spec(e, rows) for e in linear_ops.Epilogue for rows in linear_ops.GEMV_BUCKETS),
        *(quant_ops.gemv_spec(bits, rows, 128, w) for bits in (4, 8) for rows in linear_ops.GEMV_BUCKETS for w in quant_ops.WARPS),
        *(quant_ops.dequantize_spec(bits) for bits in (4, 8)),
        *(quant_layout_ops.octets_from_rows_spec(bits) for bits in (4, 8)),
        *(attention_plan.rope_kv_spec(d, kv) for d in attention_plan.ROPE_HEAD_DIMS for kv in attention_plan.CACHE_VARIANTS),
        *(attention_prefill_plan.prefill_spec(d, kv) for d in attention_prefill_plan.PREFILL_HEAD_DIMS for kv in attention_plan.CACHE_VARIANTS),
        *(spec for kernel in prefill_kernels() for spec in (kernel.spec, kernel.combine)), attention_prefill_plan.WIDEN_INT8_KV,
        *(attention_plan.decode_spec(d, kv) for d in attention_plan.DECODE_HEAD_DIMS for kv in attention_plan.CACHE_VARIANTS),
    ]
    loaded: dict[str, set[str]] = {}
    for spec in specs:
        loaded.setdefault(spec.family, set()).add(spec.name)
    return loaded


# -- list -------------------------------------------------------------------------------------------------------


def test_list_shows_every_family_with_its_file_archs_and_every_kernel_the_wrappers_launch() -> None:
    result = run("list")
    assert result.exit_code == 0, result.output
    blocks = family_blocks(result.output)
    assert sorted(blocks) == families()
    for family, names in kernels_loaded_by_the_launch_wrappers().items():
        block = blocks[family]
        assert f"kernels_src/{family}.cu" in block
        assert "archs        " + " ".join(TARGET_ARCHS) in block
        assert names <= set(block.split()), f"{family}: missing {names - set(block.split())}"


def test_list_names_each_family_s_reference_tests_and_includes() -> None:
    blocks = family_blocks(run("list").output)
    assert "tests/test_kernels_gpu.py -k 'rmsnorm'" in blocks["rmsnorm"]
    assert "includes attention_common.cuh, common.cuh" in blocks["decode_attention"]


# The fault drill's kernel exists to fault (serve --debug-fault-after): there is nothing of it to time.
UNTIMED = {"fault_drill"}


def test_every_family_has_a_benchmark() -> None:
    assert set(families()) - UNTIMED <= set(BENCHES)


def test_entry_points_are_the_macro_generated_global_functions_not_device_functions(tiny_dir: Path) -> None:
    assert entry_points(compile_family("tiny", "sm_90a").cubin) == ["tiny_float", "tiny_int"]


# -- test (compile only without a GPU) ----------------------------------------------------------------------------


@without_gpu
def test_test_without_a_gpu_compiles_for_every_target_arch_says_so_and_exits_0() -> None:
    result = run("test", "rmsnorm")
    assert result.exit_code == 0, result.output
    compiled = [line.split()[:2] for line in result.output.splitlines() if line.startswith("rmsnorm ")]
    assert compiled == [["rmsnorm", arch] for arch in TARGET_ARCHS]
    assert "no CUDA GPU visible: compiled only" in result.output


def test_test_of_a_broken_family_exits_1_showing_the_source_line(tiny_dir: Path) -> None:
    (tiny_dir / "tiny.cu").write_text(GOOD.replace(GOOD.splitlines()[2], BROKEN_LINE))
    result = run("test", "tiny", "--arch", "sm_90a")
    assert result.exit_code == 1
    assert "tiny.cu(3): error" in result.output and f"    3 | {BROKEN_LINE}" in result.output


@pytest.mark.parametrize("command", ["test", "bench", "watch"])
def test_unknown_family_is_a_usage_error(command: str) -> None:
    result = run(command, "nonexistent")
    assert result.exit_code == 2 and "unknown kernel family 'nonexistent'" in result.output


@without_gpu
def test_bench_without_a_gpu_says_it_needs_one() -> None:
    result = run("bench", "rmsnorm")
    assert result.exit_code == 1 and "needs a CUDA GPU" in result.output


# -- watch ----------------------------------------------------------------------------------------------------


def watch_with_edits(monkeypatch: pytest.MonkeyPatch, edits: list[tuple[Path, str]]) -> None:
    """Make the watcher's idle poll perform the next edit (a fake clock: no real waiting, no races)."""
    pending = iter(edits)

    def next_edit(_seconds: float) -> None:
        path, text = next(pending)
        path.write_text(text)

    monkeypatch.setattr(cli_kernels, "watch", functools.partial(loop.watch, sleep=next_edit))


def cycles(output: str) -> list[str]:
    """The watch output split per compile cycle."""
    return output.split("tiny: compiling")[1:]


@without_gpu
def test_watch_shows_a_broken_edit_with_its_line_and_recovers_on_the_next_good_edit(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tiny_dir / "tiny.cu"
    watch_with_edits(monkeypatch, [(source, GOOD.replace(GOOD.splitlines()[2], BROKEN_LINE)), (source, GOOD + "// fixed\n")])
    result = run("watch", "tiny", "--arch", "sm_90a", "--iterations", "3")
    assert result.exit_code == 0, result.output
    assert "compile only: no GPU of that arch here" in result.output
    good, broken, recovered = cycles(result.output)
    assert "tiny    sm_90a" in good and "error" not in good
    assert "tiny.cu(3): error" in broken and f"    3 | {BROKEN_LINE}" in broken
    assert "tiny    sm_90a" in recovered and "compiled" in recovered and "error" not in recovered


@without_gpu
def test_watch_recompiles_when_an_included_header_changes(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    header = tiny_dir / "tiny.cuh"
    watch_with_edits(monkeypatch, [(header, HEADER.replace("2.0f * v", "2.0f * w"))])
    result = run("watch", "tiny", "--arch", "sm_90a", "--iterations", "2")
    assert result.exit_code == 0, result.output
    _, broken = cycles(result.output)
    assert "tiny.cuh(2): error" in broken and "    2 | __forceinline__ float scale2(float v) { return 2.0f * w; }" in broken


def test_watch_waits_while_nothing_changes() -> None:
    polls: list[float] = []
    runs: list[int] = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 3:
            raise KeyboardInterrupt  # the user stops it

    with pytest.raises(KeyboardInterrupt):
        loop.watch("rmsnorm", lambda: runs.append(1), poll_seconds=0.25, sleep=sleep)
    assert runs == [1] and polls == [0.25, 0.25, 0.25]
