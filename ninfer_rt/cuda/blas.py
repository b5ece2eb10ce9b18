"""bf16 GEMM with fp32 accumulation through cuBLASLt (nvmath-python's low-level bindings).

The one product the model needs: out[M, N] = x[M, K] @ w[N, K]^T, with activations row-major and weights
row-major [out, in] as checkpoints store them. cuBLASLt is column-major, so the row-major problem is posed
as its transpose: out^T[N, M] = w[N, K] @ x^T[K, M], where the row-major w is a column-major [K, N] matrix
used transposed and the row-major x is a column-major [K, M] matrix used as is ("TN", the best supported
layout). Descriptors, layouts and the heuristic's algorithm are built once per problem shape and reused.
`out` may be a column range of a wider matrix (GemmShape.out_stride: its rows' stride, a multiple of 8, and
`out` a 16-byte aligned view of its first column): two products then fill one output side by side.

The library is found the way nvmath-python finds it (cuda.pathfinder: the nvidia-cublas wheel, then a
CUDA toolkit); `BlasUnavailableError` says which and how to fix it. Each stream gets its own workspace,
declared as written by every GEMM on that stream, so two streams can never share one unordered.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.ops import _require_bytes
from ninfer_rt.cuda.streams import Stream, StreamSet, require_stream

WORKSPACE_BYTES = 32 << 20  # what NVIDIA recommends for Hopper; Ampere needs less, Blackwell the same
OUT_DTYPES = ("bf16", "f32")
_ELEMENT_BYTES = {"bf16": 2, "f32": 4}
_STRIDED_OUT_ALIGNMENT = 16  # bytes: what a column range of an output is promised to the heuristic


class BlasUnavailableError(RuntimeError):
    """cuBLASLt (or nvmath-python) cannot be loaded on this machine."""


class BlasError(RuntimeError):
    """A cuBLASLt call failed; names the call and the problem shape."""


@dataclass(frozen=True)
class GemmShape:
    m: int  # rows of x and out (tokens)
    n: int  # rows of w, columns of out (output features)
    k: int  # inner dimension (input features)
    out_dtype: str = "bf16"
    accumulate: bool = False  # out += x @ w^T instead of out = x @ w^T
    out_stride: int | None = None  # elements between out's rows; None: n (a packed [M, N] output)

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"gemm: {name} must be a positive integer, got {value!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"gemm: out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype!r}")
        # cuBLASLt needs 16-byte aligned leading dimensions for its tensor-core kernels on bf16.
        if self.k % 8 or self.n % 8 or self.ldc % 8:
            raise ValueError(
                f"gemm: k ({self.k}), n ({self.n}) and the out stride ({self.ldc}) must be multiples of 8 (16-byte rows)"
            )
        if self.ldc < self.n:
            raise ValueError(f"gemm: out rows {self.ldc} apart cannot hold {self.n} columns")

    @property
    def ldc(self) -> int:
        return self.n if self.out_stride is None else self.out_stride

    @property
    def out_bytes(self) -> int:
        """Bytes from out's first element to its last: the last row ends n columns in."""
        return ((self.m - 1) * self.ldc + self.n) * _ELEMENT_BYTES[self.out_dtype]


def _lt():  # noqa: ANN202 - the nvmath module; imported lazily so CPU-only installs never load it
    try:
        from cuda import pathfinder
        from nvmath.bindings import cublasLt
    except ImportError as err:
        raise BlasUnavailableError(
            f"nvmath-python is not importable ({err}); install it with `pip install nvmath-python`"
        ) from err
    try:
        # nvmath loads libcublasLt through cuda.pathfinder as well; loading it here first turns a
        # missing library into one clear message instead of an error at the first GEMM.
        pathfinder.load_nvidia_dynamic_lib("cublasLt")
    except pathfinder.DynamicLibNotFoundError as err:
        raise BlasUnavailableError(
            "libcublasLt was not found by cuda.pathfinder (searched the nvidia-cublas wheel, then "
            f"CUDA_HOME/CUDA_PATH and the system loader): {err}. Install `ninfer-rt[cuda]` "
            "(the nvidia-cublas wheel for CUDA 13) or point CUDA_HOME at a CUDA 13 toolkit"
        ) from err
    return cublasLt


def _call(fn, what: str, *args: object) -> object:  # noqa: ANN001
    try:
        return fn(*args)
    except Exception as err:  # nvmath raises cuBLASLtError / NotSupportedError: name the call
        raise BlasError(f"{what} failed: {err}") from err


@dataclass
class _Plan:
    """Everything cuBLASLt needs for one shape; the numpy arrays own memory the pointers refer to."""

    desc: int
    layouts: tuple[int, int, int]  # w, x, out (C and D share the out layout)
    heuristic: object  # MatmulHeuristicResult: its first field is the algorithm passed to matmul
    alpha: np.ndarray
    beta: np.ndarray


@dataclass
class Blas:
    """GEMMs of one device, owned by its executor. Plans are cached per shape; workspaces per stream; the
    cuBLASLt handle is this object's, destroyed by `close` or when the Blas is collected."""

    streams: StreamSet
    workspace_bytes: int = WORKSPACE_BYTES
    _plans: dict[GemmShape, _Plan] = field(default_factory=dict, init=False)
    _workspaces: dict[str, DeviceBuffer] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.streams.device is None:
            raise ValueError("Blas needs a device StreamSet (the numpy executor multiplies with numpy)")
        self._lt = _lt()
        self._handle = _call(self._lt.create, "cublasLtCreate")
        self._destroy_handle = weakref.finalize(self, self._lt.destroy, self._handle)

    def gemm(
        self, stream: object, x: Buffer, w: Buffer, out: Buffer, shape: GemmShape, *, label: str = "gemm", lane: object = None
    ) -> None:
        """out[M, N] (=|+=) x[M, K] @ w[N, K]^T, x and w bf16, out bf16 or f32, accumulated in f32."""
        stream = require_stream(stream)
        _require_bytes(label, x=(x, shape.m * shape.k * 2), w=(w, shape.n * shape.k * 2), out=(out, shape.out_bytes))
        if shape.ldc != shape.n and out.ptr % _STRIDED_OUT_ALIGNMENT:
            raise ValueError(f"{label}: a strided out ({out.name}) must be {_STRIDED_OUT_ALIGNMENT}-byte aligned")
        plan = self._plan(shape)
        workspace = self._workspace(stream)
        reads = (x.resource, w.resource, out.resource) if shape.accumulate else (x.resource, w.resource)
        stream.declare(label, reads, (out.resource, workspace.resource), lane)
        _call(
            self._lt.matmul, f"cublasLtMatmul({label}, {shape})",
            self._handle, plan.desc, plan.alpha.ctypes.data, w.ptr, plan.layouts[0], x.ptr, plan.layouts[1],
            plan.beta.ctypes.data, out.ptr, plan.layouts[2], out.ptr, plan.layouts[2], plan.heuristic.ptr,
            workspace.ptr, workspace.nbytes, int(stream.handle),
        )

    def _workspace(self, stream: Stream) -> DeviceBuffer:
        if stream.name not in self._workspaces:
            self._workspaces[stream.name] = DeviceBuffer(self.streams, self.workspace_bytes, f"cublaslt_workspace.{stream.name}")
        return self._workspaces[stream.name]

    def _plan(self, shape: GemmShape) -> _Plan:
        if shape not in self._plans:
            self._plans[shape] = self._make_plan(shape)
        return self._plans[shape]

    def _make_plan(self, shape: GemmShape) -> _Plan:
        from nvmath import CudaDataType
        from nvmath.bindings.cublas import ComputeType, Operation

        lt = self._lt
        bf16, f32 = CudaDataType.CUDA_R_16BF, CudaDataType.CUDA_R_32F
        out_type = bf16 if shape.out_dtype == "bf16" else f32
        desc = _call(lt.matmul_desc_create, "cublasLtMatmulDescCreate", ComputeType.COMPUTE_32F, f32)
        self._set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.TRANSA, np.int32(Operation.T))
        self._set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.TRANSB, np.int32(Operation.N))
        layouts = (
            _call(lt.matrix_layout_create, "cublasLtMatrixLayoutCreate(w)", bf16, shape.k, shape.n, shape.k),
            _call(lt.matrix_layout_create, "cublasLtMatrixLayoutCreate(x)", bf16, shape.k, shape.m, shape.k),
            _call(lt.matrix_layout_create, "cublasLtMatrixLayoutCreate(out)", out_type, shape.n, shape.m, shape.ldc),
        )
        preference = _call(lt.matmul_preference_create, "cublasLtMatmulPreferenceCreate")
        try:
            self._set(
                lt.matmul_preference_set_attribute, preference,
                lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, np.uint64(self.workspace_bytes),
            )
            if shape.ldc != shape.n:  # a column range starts mid-row: no algorithm assuming 256-byte pointers
                aligned = lt.MatmulPreferenceAttribute.MIN_ALIGNMENT_C_BYTES, lt.MatmulPreferenceAttribute.MIN_ALIGNMENT_D_BYTES
                for attribute in aligned:
                    self._set(lt.matmul_preference_set_attribute, preference, attribute, np.uint32(_STRIDED_OUT_ALIGNMENT))
            heuristic = lt.MatmulHeuristicResult(1)
            found = np.zeros(1, np.int32)
            _call(
                lt.matmul_algo_get_heuristic, f"cublasLtMatmulAlgoGetHeuristic({shape})",
                self._handle, desc, *layouts, layouts[2], preference, 1, heuristic.ptr, found.ctypes.data,
            )
        finally:
            lt.matmul_preference_destroy(preference)
        if found[0] < 1:
            raise BlasError(f"cuBLASLt has no algorithm for {shape} (bf16 x bf16 -> {shape.out_dtype}, f32 compute)")
        return _Plan(desc, layouts, heuristic, np.ones(1, np.float32), np.full(1, float(shape.accumulate), np.float32))

    @staticmethod
    def _set(setter, obj: int, attribute: object, value: np.generic) -> None:  # noqa: ANN001
        array = np.asarray([value])
        _call(setter, f"{setter.__name__}({attribute.name})", obj, attribute, array.ctypes.data, array.nbytes)

    def close(self) -> None:
        lt = self._lt
        for plan in self._plans.values():
            for layout in plan.layouts:
                lt.matrix_layout_destroy(layout)
            lt.matmul_desc_destroy(plan.desc)
        self._plans.clear()
        for workspace in self._workspaces.values():
            workspace.free()
        self._workspaces.clear()
        self._destroy_handle()

