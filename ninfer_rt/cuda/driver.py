"""CUDA driver basics: error checking, the device and its primary context.

Every driver/NVRTC call in ninfer_rt goes through `check`, so a failure always names the call and carries
the driver's own error string. Sticky errors (the context is dead after them) are marked so that the engine
stops launching and dumps its crash context instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc


class CudaError(RuntimeError):
    """A driver or NVRTC call failed; `code` is the CUresult / nvrtcResult."""

    def __init__(self, call: str, code: object, message: str) -> None:
        super().__init__(f"{call} failed: {getattr(code, 'name', code)}: {message}")
        self.call = call
        self.code = code

    @property
    def sticky(self) -> bool:
        """True for errors after which the context is unusable (the process must restart)."""
        return self.code in _STICKY


_STICKY = {
    cu.CUresult.CUDA_ERROR_LAUNCH_FAILED,
    cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
    cu.CUresult.CUDA_ERROR_ILLEGAL_INSTRUCTION,
    cu.CUresult.CUDA_ERROR_MISALIGNED_ADDRESS,
    cu.CUresult.CUDA_ERROR_HARDWARE_STACK_ERROR,
    cu.CUresult.CUDA_ERROR_INVALID_PC,
    cu.CUresult.CUDA_ERROR_ASSERT,
    cu.CUresult.CUDA_ERROR_ECC_UNCORRECTABLE,
}


def _error_string(code: object) -> str:
    if isinstance(code, nvrtc.nvrtcResult):
        _, text = nvrtc.nvrtcGetErrorString(code)
    else:
        err, text = cu.cuGetErrorString(code)
        if err != cu.CUresult.CUDA_SUCCESS or text is None:
            return "unknown error"
    return text.decode() if isinstance(text, bytes) else str(text)


def check(result: tuple, call: str) -> object:
    """Unpack a cuda.bindings result tuple `(status, *values)`; raise CudaError unless it succeeded."""
    status, *values = result
    if status not in (cu.CUresult.CUDA_SUCCESS, nvrtc.nvrtcResult.NVRTC_SUCCESS):
        raise CudaError(call, status, _error_string(status))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# Archs with an "a" variant whose feature set (wgmma, setmaxnreg, ...) kernels may use.
_ARCH_SPECIFIC = {(9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1)}


def arch_string(major: int, minor: int) -> str:
    """Compute capability -> NVRTC arch: sm_90a on Hopper, sm_120a on Blackwell workstation, sm_80..."""
    suffix = "a" if (major, minor) in _ARCH_SPECIFIC else ""
    return f"sm_{major}{minor}{suffix}"


@dataclass(frozen=True)
class Device:
    ordinal: int
    handle: object
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    total_memory: int
    max_shared_memory_per_block_optin: int

    @property
    def arch(self) -> str:
        return arch_string(*self.compute_capability)

    def free_memory(self) -> int:
        free, _total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)


# The one module-level device state in the package, by the driver's design: a device's primary context is
# process-global (cuDevicePrimaryCtxRetain hands every caller the same context), so ninfer_rt retains it once
# per device and keeps it for the life of the process; a release while any executor's buffers live would
# destroy them with it.
_init_lock = threading.Lock()
_contexts: dict[int, tuple[Device, object]] = {}


def device_count() -> int:
    """Number of visible CUDA devices; 0 when there is no driver or no GPU (never raises)."""
    try:
        (status,) = cu.cuInit(0)
        if status != cu.CUresult.CUDA_SUCCESS:
            return 0
        status, count = cu.cuDeviceGetCount()
        return int(count) if status == cu.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


def open_device(ordinal: int = 0) -> Device:
    """Initialise the driver, retain the device's primary context and make it current on this thread."""
    with _init_lock:
        if ordinal not in _contexts:
            check(cu.cuInit(0), "cuInit")
            handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
            ctx = check(cu.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
            _contexts[ordinal] = (_describe(ordinal, handle), ctx)
        device, ctx = _contexts[ordinal]
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return device


def _describe(ordinal: int, handle: object) -> Device:
    attr = cu.CUdevice_attribute

    def get(a: object) -> int:
        return int(check(cu.cuDeviceGetAttribute(a, handle), "cuDeviceGetAttribute"))

    name = check(cu.cuDeviceGetName(256, handle), "cuDeviceGetName")
    name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
    return Device(
        ordinal=ordinal,
        handle=handle,
        name=name,
        compute_capability=(
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        total_memory=int(check(cu.cuDeviceTotalMem(handle), "cuDeviceTotalMem")),
        max_shared_memory_per_block_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
    )
