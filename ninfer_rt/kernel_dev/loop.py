"""The kernel developer's loop: which families exist, what each one exports, its reference tests, and a
watcher that recompiles, tests and benchmarks a family on every save (`ninfer-rt kernels ...`).

Entry points are read from the compiled cubin's symbol table rather than from the source: most families
generate their `extern "C" __global__` kernels with macros (one per head dim, KV kind, row bucket), and the
cubin lists exactly the names `cuModuleGetFunction` can load.

The reference tests live in the repository's tests/ (they are not installed with the package), next to
kernels_src/: a family's GPU tests are selected by file and pytest keyword, and run in a child process so
a kernel that faults cannot take the watcher's CUDA context down with it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ninfer_rt.cuda.compiler import KernelCompileError, _local_headers, kernels_dir

# What CI compiles every family for (tests/test_cli_kernels.py, tests/test_*_compile.py).
TARGET_ARCHS = ("sm_80", "sm_90a", "sm_120a")
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class ReferenceTests:
    """A family's reference tests: files under tests/ and an optional pytest -k expression."""

    files: tuple[str, ...]
    keyword: str | None = None

    def describe(self) -> str:
        return " ".join(f"tests/{name}" for name in self.files) + (f" -k '{self.keyword}'" if self.keyword else "")


# Families whose tests share a file with other families. Any other family's tests are tests/test_<family>_gpu.py.
_SHARED_TEST_FILES = {
    "rmsnorm": ReferenceTests(("test_kernels_gpu.py",), "rmsnorm"),
    "activation": ReferenceTests(("test_kernels_gpu.py",), "silu_mul"),
    "rope_kv": ReferenceTests(("test_attention_kernels_gpu.py",), "rope_kv"),
    "decode_attention": ReferenceTests(("test_attention_kernels_gpu.py",), "decode_attention or attention_op"),
    "prefill_attention": ReferenceTests(("test_attention_kernels_gpu.py",), "prefill_attention or attention_op"),
    # the same tests: on sm_90a they run the wgmma kernel where it applies, and the mma.sync one as `portable`
    "prefill_attention_sm90": ReferenceTests(("test_attention_kernels_gpu.py",), "prefill_attention or attention_op"),
    "prefill_attention_sm90_int8": ReferenceTests(("test_attention_kernels_gpu.py",), "prefill_attention or attention_op"),
    "gemm_quant_sm90": ReferenceTests(("test_gemm_quant_gpu.py",)),
    "gemv": ReferenceTests(("test_gemv_gpu.py",), "gemv or swiglu"),
    "embedding": ReferenceTests(("test_gemv_gpu.py",), "gather_rows"),
}


def reference_tests(family: str) -> ReferenceTests:
    return _SHARED_TEST_FILES.get(family, ReferenceTests((f"test_{family}_gpu.py",)))


def tests_dir() -> Path:
    """tests/ of the checkout that holds the kernels directory."""
    return kernels_dir().parent / "tests"


def missing_tests(family: str) -> list[Path]:
    return [path for path in (tests_dir() / name for name in reference_tests(family).files) if not path.is_file()]


def family_files(family: str) -> list[Path]:
    """The family's .cu file and the local headers it includes (recursively): what decides its cubin."""
    source = kernels_dir() / f"{family}.cu"
    headers = _local_headers(source.read_text(), kernels_dir()) if source.is_file() else {}
    return [source, *(kernels_dir() / name for name in headers)]


# -- entry points --------------------------------------------------------------------------------------------

_SHT_SYMTAB = 2
_STT_FUNC = 2
_STB_GLOBAL = 1
_STO_CUDA_ENTRY = 0x10  # st_other flag NVIDIA's ELF gives __global__ functions


def entry_points(cubin: bytes) -> list[str]:
    """The kernels a cubin exports (global functions flagged as CUDA entries in its ELF64 symbol table)."""
    if cubin[:5] != b"\x7fELF\x02":
        raise ValueError("not an ELF64 cubin")
    section_offset = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count = struct.unpack_from("<HH", cubin, 0x3A)
    # (type, offset, size, link, entsize) of each section header
    sections = [struct.unpack_from("<4xI16xQQI12xQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names = []
    for kind, offset, size, link, symbol_size in sections:
        if kind != _SHT_SYMTAB:
            continue
        strings = sections[link][1]
        for at in range(offset, offset + size, symbol_size):
            name_offset, info, other = struct.unpack_from("<IBB", cubin, at)
            if info & 0xF == _STT_FUNC and info >> 4 == _STB_GLOBAL and other & _STO_CUDA_ENTRY:
                start = strings + name_offset
                names.append(cubin[start : cubin.index(b"\0", start)].decode())
    return sorted(names)


# -- compile errors ------------------------------------------------------------------------------------------

_LOG_LOCATION = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?:error|warning|catastrophic error)", re.MULTILINE)


def annotate_log(log: str, directory: Path | None = None) -> str:
    """NVRTC's log with the offending source line under each `file(line): error` message."""
    directory = directory or kernels_dir()
    out = []
    for line in log.splitlines():
        out.append(line)
        match = _LOG_LOCATION.match(line)
        if match:
            source = _source_line(directory / Path(match["file"]).name, int(match["line"]))
            if source is not None:
                out.append(f"    {match['line']} | {source}")
    return "\n".join(out)


def _source_line(path: Path, number: int) -> str | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return lines[number - 1].rstrip() if 1 <= number <= len(lines) else None


def describe_compile_error(err: KernelCompileError) -> str:
    return f"{err.family}.cu failed to compile for {err.arch}:\n{annotate_log(err.log)}"


# -- reference tests -----------------------------------------------------------------------------------------


def pytest_command(family: str) -> list[str]:
    selection = reference_tests(family)
    keyword = ["-k", selection.keyword] if selection.keyword else []
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", *(str(tests_dir() / f) for f in selection.files), *keyword]


def run_tests(family: str, echo: Callable[[str], None]) -> int:
    """Runs the family's GPU tests in a child pytest; returns its exit status (1 when none can run)."""
    missing = missing_tests(family)
    if missing:
        echo(f"{family}: no reference tests: {', '.join(map(str, missing))} not found (tests/ is in the source checkout, not the installed package)")
        return 1
    if importlib.util.find_spec("pytest") is None:
        echo(f"{family}: pytest is not installed (pip install 'ninfer-rt[dev]')")
        return 1
    command = pytest_command(family)
    echo(f"{family}: {reference_tests(family).describe()}")
    return subprocess.run(command, cwd=tests_dir().parent, check=False).returncode


def run_bench_child(family: str, shape: str) -> int:
    """`ninfer-rt kernels bench` in a child process (a faulting kernel must not kill the watcher)."""
    command = [sys.executable, "-c", "from ninfer_rt.cli import main; main()", "kernels", "bench", family, "--shape", shape]
    return subprocess.run(command, check=False).returncode


# -- watch ---------------------------------------------------------------------------------------------------


def files_digest(family: str) -> str:
    """Content hash of the family's source and includes. Contents, not mtimes: two saves within the
    file system's timestamp granularity must still count as two changes, and the files are small."""
    digest = hashlib.sha256()
    for path in family_files(family):
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
    return digest.hexdigest()


def watch(
    family: str,
    cycle: Callable[[], object],
    iterations: int | None = None,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Runs `cycle` now and after every change to the family's files, `iterations` times (None: forever).
    `cycle` reports its own errors; the watch goes on after a failed compile or test."""
    seen, runs = None, 0
    while iterations is None or runs < iterations:
        current = files_digest(family)
        if current == seen:
            sleep(poll_seconds)
            continue
        seen = current
        cycle()
        runs += 1
