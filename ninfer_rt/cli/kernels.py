"""`ninfer-rt kernels ...`: the kernel developer's commands.

compile (fill the cubin cache; `--out DIR` also writes the plain cubins for cuobjdump), list (families,
files, entry points, archs), test (compile, then the family's reference tests on this GPU), bench (timed
on model shapes against the measured roofline) and watch (compile, test and bench again on every save).
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import click

from ninfer_rt.cuda.benchmark import LAUNCHES, REPEATS, BenchSession, Measurement, Roofline
from ninfer_rt.cuda.compiler import (
    ArchError,
    CompiledFamily,
    KernelCompileError,
    Outcome,
    compile_many,
    families,
    kernels_dir,
    resolve_arch,
)
from ninfer_rt.cuda.driver import device_count, open_device
from ninfer_rt.kernel_dev.loop import (
    POLL_SECONDS,
    TARGET_ARCHS,
    describe_compile_error,
    entry_points,
    family_files,
    reference_tests,
    run_bench_child,
    run_tests,
    watch,
)
from ninfer_rt.kernel_dev.benches import BENCHES
from ninfer_rt.model.shapes import SHAPES

DEFAULT_SHAPE = "qwen3-8b"


class BadArgument(click.ClickException):
    """An unknown family or arch: one line naming it, exit status 2 (click's usage-error status)."""

    exit_code = 2


@click.group()
def kernels() -> None:
    """Kernel families in kernels_src/ (compiled with NVRTC, cached on disk)."""


@kernels.command("compile")
@click.option("--arch", default="native", show_default=True, help="sm_120a, sm_90a, sm_80, ... or native (this GPU).")
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Also write each cubin to DIR/<family>-<arch>.cubin, for cuobjdump -sass or nvdisasm.",
)
@click.argument("names", metavar="[FAMILY]...", nargs=-1)
def compile_command(arch: str, out_dir: Path | None, names: tuple[str, ...]) -> None:
    """Compile every kernel family (or the named ones) for ARCH and print a table."""
    names, arch = _known(names), _one_arch(arch)
    if out_dir is not None:
        _make_out_dir(out_dir)  # before compiling: a bad --out fails at once
    outcomes = compile_many([(name, arch) for name in names])
    errors = [o for o in outcomes if isinstance(o, KernelCompileError)]
    if errors:
        raise click.ClickException(str(errors[0]))
    click.echo(_compile_table(outcomes))
    if out_dir is not None:
        _write_cubins(outcomes, out_dir)


def _out_error(out_dir: Path, error: OSError) -> BadArgument:
    return BadArgument(f"--out {out_dir}: {error.strerror or error}")


def _make_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _out_error(out_dir, error) from error


def _write_cubins(outcomes: list[CompiledFamily], out_dir: Path) -> None:
    """The plain cubins (the cache's entries carry a checksum header the CUDA tools do not read)."""
    try:
        for outcome in outcomes:
            path = out_dir / f"{outcome.family}-{outcome.arch}.cubin"
            partial = path.with_name(path.name + ".partial")
            partial.write_bytes(outcome.cubin)
            partial.replace(path)  # a reader sees the old file or the whole new one
            click.echo(f"wrote {path}")
    except OSError as error:
        raise _out_error(out_dir, error) from error


@kernels.command("list")
def list_command() -> None:
    """Every kernel family: its file and includes, the archs it is built for, its entry points, tests and bench."""
    names = families()
    archs = _archs("native")
    # Entry points come from the cubins (macro-generated names; an arch-specific family has none elsewhere).
    outcomes = compile_many([(name, arch) for name in names for arch in archs])
    for i, name in enumerate(names):
        click.echo(_describe_family(name, archs, outcomes[i * len(archs):(i + 1) * len(archs)]))


@kernels.command("test")
@click.option("--arch", default="native", show_default=True, help="native: this GPU's arch (without a GPU: " + ", ".join(TARGET_ARCHS) + ").")
@click.argument("names", metavar="[FAMILY]...", nargs=-1)
def test_command(arch: str, names: tuple[str, ...]) -> None:
    """Compile FAMILY (default: all), then run its reference tests on this GPU. Without a GPU: compile only."""
    names = _known(names)
    archs = _archs(arch)
    if not _compile_and_report(names, archs):
        raise click.ClickException("compilation failed")
    if not _can_run(archs):
        return
    failed = [name for name in names if run_tests(name, click.echo) != 0]
    if failed:
        raise click.ClickException(f"reference tests failed: {', '.join(failed)}")


@kernels.command("bench")
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default=DEFAULT_SHAPE, show_default=True)
@click.option("--launches", default=LAUNCHES, show_default=True, help="launches per captured graph")
@click.option("--repeats", default=REPEATS, show_default=True, help="timed graph replays (the median is reported)")
@click.argument("names", metavar="[FAMILY]...", nargs=-1)
def bench_command(shape: str, launches: int, repeats: int, names: tuple[str, ...]) -> None:
    """Time FAMILY's entry points (default: all) on SHAPE's decode/prefill shapes with CUDA events."""
    names = _known(names)
    if device_count() == 0:
        raise click.ClickException("kernels bench needs a CUDA GPU and none is visible")
    session = BenchSession.open(open_device(), launches, repeats)
    roofline = session.roofline()
    gemm = f"{roofline.flops_per_s / 1e12:.0f} TFLOP/s" if roofline.flops_per_s else "unavailable (no cuBLASLt)"
    click.echo(f"{session.device.name} ({session.device.arch}), shape {shape}: copy bandwidth {roofline.bytes_per_s / 1e12:.2f} TB/s, "
               f"bf16 GEMM {gemm}; median of {repeats} replays of {launches}-launch graphs")
    for name in names:
        bench = BENCHES.get(name)
        if bench is None:
            click.echo(f"\n{name}: no benchmark registered (add one to ninfer_rt/kernel_dev/benches.py BENCHES)")
            continue
        click.echo(f"\n{name}\n" + _bench_table(bench(session, SHAPES[shape]), roofline))
    session.close()


@kernels.command("watch")
@click.option("--arch", default="native", show_default=True, help="native: this GPU's arch (without a GPU: " + ", ".join(TARGET_ARCHS) + ").")
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default=DEFAULT_SHAPE, show_default=True)
@click.option("--iterations", type=click.IntRange(min=1), default=None, help="stop after N compile cycles (default: run until Ctrl-C)")
@click.option("--interval", type=float, default=POLL_SECONDS, show_default=True, help="seconds between checks of the files")
@click.argument("family")
def watch_command(arch: str, shape: str, iterations: int | None, interval: float, family: str) -> None:
    """Recompile FAMILY on every save of its .cu file or its includes, then test and bench it (GPU only).
    Compile errors are shown with their source line; the watch goes on."""
    (name,) = _known((family,))
    archs = _archs(arch)
    run = _can_run(archs, quiet=True)
    files = ", ".join(path.name for path in family_files(name))
    click.echo(f"watching {files}: compile for {', '.join(archs)}" + (", then test and bench" if run else "; compile only: no GPU of that arch here"))

    def cycle() -> None:
        click.echo(f"\n[{time.strftime('%H:%M:%S')}] {name}: compiling")
        if _compile_and_report([name], archs) and run:
            run_tests(name, click.echo)
            run_bench_child(name, shape)

    try:
        watch(name, cycle, iterations, interval)
    except KeyboardInterrupt:
        click.echo("stopped")


# -- helpers -------------------------------------------------------------------------------------------------


def _known(names: tuple[str, ...]) -> list[str]:
    """The named families (all when none is named); an unknown name is a usage error."""
    known = families()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise BadArgument(f"unknown kernel family {unknown[0]!r} (known: {', '.join(known)})")
    return list(names or known)


def _one_arch(arch: str) -> str:
    try:
        return resolve_arch(arch)
    except ArchError as err:
        raise BadArgument(str(err)) from err


def _archs(arch: str) -> list[str]:
    """`native` is this GPU's arch, or every CI target where there is no GPU (what CI would check)."""
    if arch == "native" and device_count() == 0:
        return list(TARGET_ARCHS)
    return [_one_arch(arch)]


def _can_run(archs: list[str], quiet: bool = False) -> bool:
    """Whether cubins for `archs` can run here: a GPU is visible and it is of that arch."""
    if device_count() == 0:
        if not quiet:
            click.echo("no CUDA GPU visible: compiled only; the reference tests need a GPU")
        return False
    native = open_device().arch
    if archs != [native]:
        if not quiet:
            click.echo(f"compiled only: this GPU runs {native}, not {', '.join(archs)}")
        return False
    return True


def _compile_and_report(names: list[str], archs: list[str]) -> bool:
    """Compile every (family, arch); print the table, or each error with its source lines. True if all compiled."""
    outcomes = compile_many([(name, arch) for name in names for arch in archs])
    errors = [o for o in outcomes if isinstance(o, KernelCompileError)]
    for error in errors:
        click.echo(describe_compile_error(error))
    if not errors:
        click.echo(_compile_table(outcomes))
    return not errors


def _compile_table(results: list[Outcome]) -> str:
    rows = [("family", "arch", "cubin bytes", "seconds", "status")]
    rows += [(r.family, r.arch, str(len(r.cubin)), f"{r.seconds:.2f}", "cached" if r.cached else "compiled") for r in results]
    return _columns(rows)


def _describe_family(name: str, archs: list[str], outcomes: list[Outcome]) -> str:
    source, *headers = family_files(name)
    includes = f" (includes {', '.join(h.name for h in headers)})" if headers else ""
    entries = _entries(name, archs, outcomes)
    fields = {
        "archs": " ".join(archs),
        "entry points": entries,
        "tests": reference_tests(name).describe(),
        "bench": "yes" if name in BENCHES else "none registered",
    }
    lines = [f"{name}  {source.relative_to(kernels_dir().parent)}{includes}"]
    for label, value in fields.items():
        lines.append(textwrap.fill(value, width=110, initial_indent=f"  {label:<13}", subsequent_indent=" " * 15))
    return "\n".join(lines)


def _entries(name: str, archs: list[str], outcomes: list[Outcome]) -> str:
    """The family's entry points over `archs`; those some archs lack are marked with the archs that have them."""
    failed = [o for o in outcomes if isinstance(o, KernelCompileError)]
    if failed:
        return f"(does not compile for {failed[0].arch}: run `ninfer-rt kernels test {name}`)"
    per_arch = {arch: entry_points(o.cubin) for arch, o in zip(archs, outcomes)}
    ordered = list(dict.fromkeys(e for entries in per_arch.values() for e in entries))
    if not ordered:
        return f"(none for {', '.join(archs)})"
    return " ".join(
        e if all(e in found for found in per_arch.values()) else f"{e} ({'/'.join(a for a, f in per_arch.items() if e in f)} only)"
        for e in ordered
    )


def _bench_table(results: list[Measurement], roofline: Roofline) -> str:
    rows = [("kernel", "case", "us", "GB/s", "TFLOP/s", "of roofline")]
    for m in results:
        tflops = f"{m.flops / m.seconds / 1e12:.1f}" if m.flops else "-"
        rows.append((m.kernel, m.case, f"{m.seconds * 1e6:.2f}", f"{m.bytes / m.seconds / 1e9:.0f}", tflops, f"{m.roofline_fraction(roofline):.0%}"))
    return _columns(rows)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
