"""NVRTC: a kernel family (`kernels_src/<family>.cu`) -> a cubin for one arch, cached on disk.

The cache key is the sha256 of everything that decides the cubin: the source, the local headers it
includes (recursively), the NVRTC options (arch, defines, include dirs) and the NVRTC version, so the
second start of the engine compiles nothing. Cache files carry a checksum of their payload; a file that
fails it is recompiled and overwritten, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cuda.bindings import nvrtc
from tqdm import tqdm

from ninfer_rt.cuda.driver import arch_string, check, device_count, open_device

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
# A family opts into extra NVRTC options (e.g. --use_fast_math) with a line of its own source.
_OPTIONS_DIRECTIVE = re.compile(r"^//\s*nvrtc-options:(.*)$", re.MULTILINE)
_ARCH = re.compile(r"^sm_(\d+)([af]?)$")
_CACHE_MAGIC = b"NINFER-CUBIN-1\n"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a family; the message carries NVRTC's log (`<family>.cu(<line>): error ...`)."""

    def __init__(self, family: str, arch: str, log: str) -> None:
        super().__init__(f"kernel family {family!r} failed to compile for {arch}:\n{log}")
        self.family = family
        self.arch = arch
        self.log = log


class UnknownFamilyError(ValueError):
    """No `<family>.cu` in the kernels directory."""


class ArchError(ValueError):
    """An arch NVRTC cannot target, or `native` without a GPU."""


@dataclass(frozen=True)
class CompiledFamily:
    family: str
    arch: str
    cubin: bytes
    seconds: float
    cached: bool


def kernels_dir() -> Path:
    """$NINFER_KERNELS_DIR; else the sources a wheel ships inside the package (setup.py copies them in);
    else `kernels_src/` at the repository root, which an editable install and a source checkout compile,
    so that `ninfer-rt kernels watch` sees the files being edited."""
    override = os.environ.get("NINFER_KERNELS_DIR")
    if override:
        return Path(override)
    shipped = resources.files("ninfer_rt") / "kernels_src"
    if shipped.is_dir():
        return Path(str(shipped))
    return Path(__file__).resolve().parents[2] / "kernels_src"


def cache_dir() -> Path:
    override = os.environ.get("NINFER_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "ninfer-rt" / "kernels"


def families() -> list[str]:
    """Every kernel family in the kernels directory, sorted."""
    return sorted(path.stem for path in kernels_dir().glob("*.cu"))


def nvrtc_version() -> tuple[int, int]:
    return check(nvrtc.nvrtcVersion(), "nvrtcVersion")


def resolve_arch(arch: str) -> str:
    """`native` -> the current device's arch; otherwise validate `sm_XY[a|f]` against NVRTC's list."""
    if arch == "native":
        if device_count() == 0:
            raise ArchError("--arch native needs a CUDA GPU and none is visible; name one, e.g. sm_90a")
        return open_device().arch
    match = _ARCH.match(arch)
    supported = check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    if match is None or int(match.group(1)) not in supported or not _variant_exists(int(match.group(1)), match.group(2)):
        known = ", ".join(f"sm_{n}" for n in supported)
        raise ArchError(f"unknown arch {arch!r}: NVRTC {'.'.join(map(str, nvrtc_version()))} targets {known} (sm_XYa where arch-specific, sm_XYf from sm_100)")
    return arch


def _variant_exists(number: int, suffix: str) -> bool:
    """sm_XYa exists only where the driver knows an arch-specific feature set; sm_XYf from Blackwell on."""
    if suffix == "a":
        return arch_string(number // 10, number % 10) == f"sm_{number}a"
    return suffix == "" or number >= 100


def compile_family(
    family: str, arch: str = "native", defines: Mapping[str, object] | None = None, cache: Path | None = None
) -> CompiledFamily:
    """Compile `family` for `arch` (or load it from the cache). `defines` become -D options."""
    arch = resolve_arch(arch)
    source_path = kernels_dir() / f"{family}.cu"
    if not source_path.is_file():
        raise UnknownFamilyError(f"unknown kernel family {family!r} (known: {', '.join(families()) or 'none'} in {kernels_dir()})")
    started = time.perf_counter()
    source = source_path.read_text()
    headers = _local_headers(source, kernels_dir())
    options = _options(source, arch, defines or {})
    entry = (cache or cache_dir()) / f"{family}-{arch}-{_cache_key(source, headers, options)[:32]}.cubin"
    cubin = _read_cache_entry(entry)
    cached = cubin is not None
    if cubin is None:
        cubin = _nvrtc_compile(source_path.name, source, headers, options, family, arch)
        _write_cache_entry(entry, cubin)
    return CompiledFamily(family, arch, cubin, time.perf_counter() - started, cached)


def family_ptx(family: str, arch: str = "sm_90a") -> str:
    """The PTX of `family` for `arch`'s virtual architecture (uncached): for reading what the kernels
    compile to, e.g. the test that every entry waits for the previous kernel (common.cuh)."""
    virtual = resolve_arch(arch).replace("sm_", "compute_")
    source = (kernels_dir() / f"{family}.cu").read_text()
    options = _options(source, virtual, {})
    return _nvrtc_compile(f"{family}.cu", source, _local_headers(source, kernels_dir()), options, family, virtual, ptx=True).decode()


def compile_log(family: str, arch: str = "sm_90a") -> str:
    """NVRTC's log of compiling `family` for `arch` with ptxas's resource report (registers, spills, its
    performance notes), uncached: for tests and kernel development."""
    arch = resolve_arch(arch)
    source = (kernels_dir() / f"{family}.cu").read_text()
    options = [*_options(source, arch, {}), "--ptxas-options=-v"]
    with _compiled_program(f"{family}.cu", source, _local_headers(source, kernels_dir()), options, family, arch) as program:
        return _program_log(program)


def _header_args(headers: Mapping[str, str]) -> tuple[int, list[bytes], list[bytes]]:
    """nvrtcCreateProgram's header arguments: the count, the contents, the names."""
    return len(headers), [h.encode() for h in headers.values()], [n.encode() for n in headers]


def _local_headers(source: str, directory: Path) -> dict[str, str]:
    """`#include "x.cuh"` files found in `directory`, recursively: handed to NVRTC in memory and hashed,
    so what is compiled is exactly what the cache key covers."""
    found: dict[str, str] = {}
    pending = _LOCAL_INCLUDE.findall(source)
    while pending:
        name = pending.pop()
        path = directory / name
        if name in found or not path.is_file():
            continue  # a missing header is left for NVRTC to report with its line
        found[name] = path.read_text()
        pending.extend(_LOCAL_INCLUDE.findall(found[name]))
    return dict(sorted(found.items()))


def _options(source: str, arch: str, defines: Mapping[str, object]) -> list[str]:
    requested = [opt for line in _OPTIONS_DIRECTIVE.findall(source) for opt in line.split()]
    return [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "-default-device",
        "-lineinfo",  # source lines in compute-sanitizer reports; no effect on the generated code
        *(f"-I{path}" for path in cuda_include_dirs()),
        *(f"-D{name}={value}" for name, value in sorted(defines.items())),
        *requested,
    ]


def cuda_include_dirs() -> list[str]:
    """Where cuda_fp16.h / cuda_bf16.h live: the nvidia-cuda-runtime wheel (found by cuda.pathfinder),
    else any nvidia wheel's include dir, else a CUDA toolkit."""
    found = _pathfinder_include_dir()
    if found:
        return [found]
    candidates = [Path(p) / "nvidia" for p in sys.path if p]
    wheel_dirs = [inc for root in candidates if root.is_dir() for inc in sorted(root.glob("*/include"))]
    toolkit = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    for directory in [*wheel_dirs, *toolkit, Path("/usr/local/cuda/include")]:
        if (directory / "cuda_bf16.h").is_file():
            return [str(directory)]
    raise FileNotFoundError("cuda_bf16.h not found: install the nvidia-cuda-runtime wheel or set CUDA_HOME")


def _pathfinder_include_dir() -> str | None:
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        return find_nvidia_header_directory("cudart")
    except (ImportError, RuntimeError):  # older cuda-pathfinder: no header lookup, or none for cudart
        return None


def _cache_key(source: str, headers: Mapping[str, str], options: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (source, *(f"{name}\0{text}" for name, text in headers.items()), *options, str(nvrtc_version())):
        digest.update(part.encode())
        digest.update(b"\0\0")  # separator: ("ab", "c") and ("a", "bc") must not collide
    return digest.hexdigest()


def _read_cache_entry(path: Path) -> bytes | None:
    """The cached cubin, or None when absent or corrupt (header or checksum mismatch)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    header_size = len(_CACHE_MAGIC) + 32
    if not data.startswith(_CACHE_MAGIC) or len(data) <= header_size:
        return None
    checksum, cubin = data[len(_CACHE_MAGIC) : header_size], data[header_size:]
    return cubin if hashlib.sha256(cubin).digest() == checksum else None


def _write_cache_entry(path: Path, cubin: bytes) -> None:
    """Write-then-rename, so a concurrent reader sees the old entry or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(_CACHE_MAGIC + hashlib.sha256(cubin).digest() + cubin)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _nvrtc_compile(
    name: str, source: str, headers: Mapping[str, str], options: list[str], family: str, arch: str, ptx: bool = False
) -> bytes:
    with _compiled_program(name, source, headers, options, family, arch) as program:
        get_size, get = (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
        output = b" " * check(get_size(program), get_size.__name__)
        check(get(program, output), get.__name__)
        return output.rstrip(b"\0") if ptx else output


@contextmanager
def _compiled_program(
    name: str, source: str, headers: Mapping[str, str], options: list[str], family: str, arch: str
) -> Iterator[object]:
    """An NVRTC program compiled with `options` (KernelCompileError with its log if it does not), destroyed on exit."""
    program = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), *_header_args(headers)), "nvrtcCreateProgram")
    try:
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(family, arch, _program_log(program))
        yield program
    finally:
        check(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")


def _program_log(program: object) -> str:
    size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
    log = b" " * size
    check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
    return log.rstrip(b"\0").decode(errors="replace").strip()


Outcome = CompiledFamily | KernelCompileError


def compile_many(jobs: list[tuple[str, str]]) -> list[Outcome]:
    """Compile (family, arch) jobs in parallel (NVRTC releases the GIL); outcomes in `jobs` order, an NVRTC
    error in place of its cubin. A progress bar on a terminal."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1)))
    try:
        futures = {pool.submit(_compile_one, name, arch): i for i, (name, arch) in enumerate(jobs)}
        progress = tqdm(as_completed(futures), total=len(futures), desc="compiling kernels", unit="cubin",
                        disable=not sys.stderr.isatty(), leave=False)
        outcomes = {futures[future]: future.result() for future in progress}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [outcomes[i] for i in range(len(jobs))]


def _compile_one(name: str, arch: str) -> Outcome:
    try:
        return compile_family(name, arch)
    except KernelCompileError as err:
        return err
    except UnknownFamilyError as err:  # the file vanished (an editor's save-by-rename): report it as a failure
        return KernelCompileError(name, arch, str(err))
