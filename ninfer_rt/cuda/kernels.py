"""Loaded kernels and typed launches.

A `KernelSpec` names a kernel (family + function) and its signature; `KernelLibrary` compiles (or loads
from the cache) each family once per device, loads the cubin and hands out `Kernel`s. `Kernel.launch`
checks every argument against the signature *before* anything is enqueued, so a float passed for a
pointer is a TypeError naming the kernel and the argument, not a corrupted launch.
"""

from __future__ import annotations

import ctypes
import enum
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from numbers import Integral, Real

from cuda.bindings import driver as cu

from ninfer_rt.cuda.compiler import KernelCompileError, cache_dir, compile_family, compile_many
from ninfer_rt.cuda.driver import Device, check
from ninfer_rt.cuda.memory import Buffer
from ninfer_rt.cuda.streams import require_stream
from ninfer_rt.ordering.verifier import Resource


class Arg(enum.Enum):
    """Kernel argument kinds: the C type each maps to, and its value range."""

    PTR = (ctypes.c_void_p, 0, 2**64 - 1)
    I32 = (ctypes.c_int, -(2**31), 2**31 - 1)
    U32 = (ctypes.c_uint, 0, 2**32 - 1)
    I64 = (ctypes.c_longlong, -(2**63), 2**63 - 1)
    F32 = (ctypes.c_float, None, None)

    @property
    def ctype(self) -> type:
        return self.value[0]


@dataclass(frozen=True)
class KernelSpec:
    family: str  # kernels_src/<family>.cu
    name: str  # the extern "C" __global__ function
    signature: tuple[Arg, ...]


Dim3 = tuple[int, int, int]


@dataclass
class Kernel:
    spec: KernelSpec
    function: object  # CUfunction
    max_dynamic_smem: int = 48 * 1024  # the driver's limit until raised with cuFuncSetAttribute

    def launch(
        self,
        stream: object,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        *args: object,
        smem: int = 0,
        label: str | None = None,
        reads: Iterable[Resource] = (),
        writes: Iterable[Resource] = (),
        lane: object = None,
    ) -> None:
        stream = require_stream(stream)
        params = self.pack(args)
        if not 0 <= smem <= self.max_dynamic_smem:
            raise ValueError(f"{self.spec.name}: {smem} bytes of dynamic shared memory, limit {self.max_dynamic_smem}")
        stream.launch(
            self.function,
            _dim3(grid, f"{self.spec.name} grid"),
            _dim3(block, f"{self.spec.name} block"),
            params,
            smem,
            label=label or self.spec.name,
            reads=reads,
            writes=writes,
            lane=lane,
        )

    def pack(self, args: tuple[object, ...]) -> tuple[tuple[object, ...], tuple[type, ...]]:
        """Arguments -> cuda.bindings' kernelParams form: (values, ctypes types)."""
        signature = self.spec.signature
        if len(args) != len(signature):
            raise TypeError(f"kernel {self.spec.name} takes {len(signature)} arguments, got {len(args)}")
        values = tuple(_convert(self.spec.name, i, kind, value) for i, (kind, value) in enumerate(zip(signature, args)))
        return values, tuple(kind.ctype for kind in signature)


def _convert(kernel: str, index: int, kind: Arg, value: object) -> object:
    where = f"kernel {kernel}, argument {index} ({kind.name})"
    if kind is Arg.PTR and isinstance(value, Buffer):
        if not value.ptr:
            raise TypeError(f"{where}: buffer {value.name!r} has no device address (freed, or logical)")
        return value.ptr
    if kind is Arg.F32:
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{where}: expected a real number, got {type(value).__name__}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, Integral):
        expected = "a Buffer or an integer address" if kind is Arg.PTR else "an integer"
        raise TypeError(f"{where}: expected {expected}, got {type(value).__name__}")
    _, low, high = kind.value
    if not low <= int(value) <= high:
        raise ValueError(f"{where}: {value} is out of range [{low}, {high}]")
    return int(value)


def _dim3(dims: int | tuple[int, ...], what: str) -> Dim3:
    shape = tuple(dims) if isinstance(dims, tuple) else (dims,)
    if not 1 <= len(shape) <= 3 or any(isinstance(d, bool) or not isinstance(d, Integral) or d < 1 for d in shape):
        raise ValueError(f"{what}: expected 1 to 3 positive integers, got {dims!r}")
    return tuple(int(d) for d in shape) + (1,) * (3 - len(shape))


@dataclass
class KernelLibrary:
    """The kernels of one device: each family compiled for the device's arch and loaded once."""

    device: Device
    arch: str | None = None  # None: the device's own (sm_90a on Hopper)
    _modules: dict[str, object] = field(default_factory=dict, init=False)
    _kernels: dict[KernelSpec, Kernel] = field(default_factory=dict, init=False)

    @property
    def target_arch(self) -> str:
        """The arch the kernels are compiled for."""
        return self.arch or self.device.arch

    def kernel(self, spec: KernelSpec) -> Kernel:
        if spec not in self._kernels:
            name = spec.name.encode()
            function = check(cu.cuModuleGetFunction(self._module(spec.family), name), f"cuModuleGetFunction({spec.name})")
            self._kernels[spec] = Kernel(spec, function)
        return self._kernels[spec]

    def raise_dynamic_smem(self, spec: KernelSpec, nbytes: int) -> Kernel:
        """Let `spec` launch with up to `nbytes` of dynamic shared memory (beyond the 48 KiB default)."""
        kernel = self.kernel(spec)
        if nbytes > self.device.max_shared_memory_per_block_optin:
            raise ValueError(f"{spec.name}: {nbytes} bytes of shared memory exceed the device's {self.device.max_shared_memory_per_block_optin}")
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuFuncSetAttribute(kernel.function, attribute, nbytes), f"cuFuncSetAttribute({spec.name})")
        kernel.max_dynamic_smem = nbytes
        return kernel

    def preload(self, names: list[str]) -> None:
        """Compile (in parallel) and load `names` now, so no request pays for NVRTC; a cold cache's compile
        time goes to stderr, a warm start says nothing."""
        arch = self.target_arch
        missing = [name for name in names if name not in self._modules]
        started = time.perf_counter()
        outcomes = compile_many([(name, arch) for name in missing])
        errors = [o for o in outcomes if isinstance(o, KernelCompileError)]
        if errors:
            raise errors[0]
        for compiled in outcomes:
            self._modules[compiled.family] = check(cu.cuModuleLoadData(compiled.cubin), f"cuModuleLoadData({compiled.family})")
        fresh = [o.family for o in outcomes if not o.cached]
        if fresh:
            print(f"ninfer-rt: compiled {len(fresh)} kernel families for {arch} in {time.perf_counter() - started:.1f} s "
                  f"(cached in {cache_dir()} for the next start)", file=sys.stderr)

    def _module(self, family: str) -> object:
        if family not in self._modules:
            compiled = compile_family(family, self.target_arch)
            self._modules[family] = check(cu.cuModuleLoadData(compiled.cubin), f"cuModuleLoadData({family})")
        return self._modules[family]

    def close(self) -> None:
        for module in self._modules.values():
            check(cu.cuModuleUnload(module), "cuModuleUnload")
        self._modules.clear()
        self._kernels.clear()


def kernel_with_smem(lib: KernelLibrary, spec: KernelSpec, nbytes: int) -> Kernel:
    """`spec`'s kernel allowed `nbytes` of dynamic shared memory (raised past the 48 KiB default once)."""
    kernel = lib.kernel(spec)
    return kernel if kernel.max_dynamic_smem >= nbytes else lib.raise_dynamic_smem(spec, nbytes)
