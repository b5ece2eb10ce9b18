"""`ninfer-rt kernels ...`: compile the kernel families ahead of time (fills the cubin cache)."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

import click
from tqdm import tqdm

from ninfer_rt.cuda.compiler import (
    ArchError,
    CompiledFamily,
    KernelCompileError,
    compile_family,
    families,
    resolve_arch,
)


class BadArgument(click.ClickException):
    """An unknown family or arch: one line naming it, exit status 2 (click's usage-error status)."""

    exit_code = 2


@click.group()
def kernels() -> None:
    """Kernel families in kernels_src/ (compiled with NVRTC, cached on disk)."""


@kernels.command("compile")
@click.option("--arch", default="native", show_default=True, help="sm_120a, sm_90a, sm_80, ... or native (this GPU).")
@click.argument("names", metavar="[FAMILY]...", nargs=-1)
def compile_command(arch: str, names: tuple[str, ...]) -> None:
    """Compile every kernel family (or the named ones) for ARCH and print a table."""
    known = families()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise BadArgument(f"unknown kernel family {unknown[0]!r} (known: {', '.join(known)})")
    try:
        arch = resolve_arch(arch)
    except ArchError as err:
        raise BadArgument(str(err)) from err
    try:
        results = _compile_all(list(names or known), arch)
    except KernelCompileError as err:
        raise click.ClickException(str(err)) from err
    click.echo(_table(results))


def _compile_all(names: list[str], arch: str) -> list[CompiledFamily]:
    """Compile in parallel (NVRTC releases the GIL), in `names` order; the first error cancels the rest."""
    pool = ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1))
    try:
        futures = {pool.submit(compile_family, name, arch): name for name in names}
        progress = tqdm(as_completed(futures), total=len(futures), desc=f"compiling for {arch}", unit="family",
                        disable=not sys.stderr.isatty(), leave=False)
        results = {futures[future]: future.result() for future in progress}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [results[name] for name in names]


def _table(results: list[CompiledFamily]) -> str:
    rows = [("family", "arch", "cubin bytes", "seconds", "status")]
    rows += [(r.family, r.arch, str(len(r.cubin)), f"{r.seconds:.2f}", "cached" if r.cached else "compiled") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
