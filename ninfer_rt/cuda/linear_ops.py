"""Launch wrappers for the decode GEMV and the row gather (kernels_src/{gemv,embedding}.cu); greedy argmax
and sampling are in sampling_ops.py.

Each wrapper checks shapes, alignment and buffer sizes before anything is enqueued, picks the launch shape
and declares what the kernel reads and writes. The math is documented at the top of each .cu file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec
from ninfer_rt.cuda.memory import Buffer
from ninfer_rt.cuda.ops import _require_bytes, _require_positive
from ninfer_rt.cuda.streams import require_stream

GEMV_MAX_ROWS = 8
GEMV_BUCKETS = (1, 2, 4, 8)  # a width of 3 runs the 4-row kernel with rows=3
_GEMV_ROWS_PER_WARP = 2  # kRowsPerWarp in gemv.cu
_GEMV_WARPS_PER_BLOCK = 4  # kWarpsPerBlock in gemv.cu
_GEMV_SIGNATURE = (Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.I32)
GATHER_ROWS = KernelSpec("embedding", "gather_rows_bf16", (Arg.PTR, Arg.I32, Arg.PTR, Arg.I32, Arg.PTR, Arg.I32, Arg.PTR))


class Epilogue(enum.Enum):
    """What the GEMV does with x @ W^T before storing it (see gemv.cu)."""

    STORE = "gemv_bf16"
    STORE_F32 = "gemv_f32"
    RESIDUAL = "gemv_residual_bf16"  # y = bf16(x @ W^T) + residual
    SWIGLU = "gemv_swiglu_bf16"  # W is the fused [gate; up] matrix, y = silu(gate) * up

    @property
    def out_bytes(self) -> int:
        return 4 if self is Epilogue.STORE_F32 else 2


def gemv_bucket(op: str, rows: int, above: str) -> int:
    """The smallest kernel width in GEMV_BUCKETS that takes `rows`; `above` says what to use for more rows."""
    bucket = next((b for b in GEMV_BUCKETS if rows <= b), None)
    if bucket is None or rows < 1:
        raise ValueError(f"{op}: rows must be in 1..{GEMV_MAX_ROWS}, got {rows}; {above}")
    return bucket


def gemv_spec(epilogue: Epilogue, rows: int) -> KernelSpec:
    bucket = gemv_bucket("gemv", rows, "use the cuBLASLt GEMM above")
    return KernelSpec("gemv", f"{epilogue.value}_b{bucket}", _GEMV_SIGNATURE)


def residual_entry(op: str, epilogue: Epilogue, residual: Buffer | None, nbytes: int) -> dict[str, tuple[Buffer, int]]:
    """The residual's size check for _require_device_bytes: the RESIDUAL epilogue needs one, the others refuse one."""
    if epilogue is Epilogue.RESIDUAL:
        if residual is None:
            raise ValueError(f"{op}: the RESIDUAL epilogue needs a residual buffer")
        return {"residual": (residual, nbytes)}
    if residual is not None:
        raise ValueError(f"{op}: a residual was given to the {epilogue.name} epilogue, which ignores it")
    return {}


def gemv(
    lib: KernelLibrary,
    stream: object,
    x: Buffer,
    w: Buffer,
    y: Buffer,
    rows: int,
    n: int,
    k: int,
    epilogue: Epilogue = Epilogue.STORE,
    residual: Buffer | None = None,
    *,
    label: str = "gemv",
    lane: object = None,
) -> None:
    """y[rows, n] = epilogue(x[rows, k] @ W^T); W is [n, k], or [2n, k] (gate rows, then up rows) for SWIGLU."""
    stream = require_stream(stream)
    _require_positive("gemv", rows=rows, n=n, k=k)
    if k % 8:
        raise ValueError(f"gemv: k={k} is not a multiple of 8; the kernel reads 16-byte (8 x bf16) vectors")
    w_rows = 2 * n if epilogue is Epilogue.SWIGLU else n
    _require_device_bytes(
        "gemv", x=(x, rows * k * 2), w=(w, w_rows * k * 2), y=(y, rows * n * epilogue.out_bytes),
        **residual_entry("gemv", epilogue, residual, rows * n * 2),
    )
    groups = n if epilogue is Epilogue.SWIGLU else -(-n // _GEMV_ROWS_PER_WARP)
    reads = (x.resource, w.resource) + ((residual.resource,) if residual is not None else ())
    lib.kernel(gemv_spec(epilogue, rows)).launch(
        stream, -(-groups // _GEMV_WARPS_PER_BLOCK), 32 * _GEMV_WARPS_PER_BLOCK,
        y, x, w, residual.ptr if residual is not None else 0, rows, n, k,
        label=label, reads=reads, writes=(y.resource,), lane=lane,
    )


@dataclass(frozen=True)
class RowLayout:
    """Where rows live in a bf16 buffer: `stride` elements apart, starting at column `column`."""

    stride: int
    column: int = 0


def gather_rows(
    lib: KernelLibrary,
    stream: object,
    src: Buffer,
    src_rows: int,
    out: Buffer,
    rows: int,
    width: int,
    ids: Buffer | None = None,
    out_layout: RowLayout | None = None,
    *,
    feed: Buffer | None = None,
    label: str = "gather_rows",
    lane: object = None,
) -> None:
    """out row t = src row ids[t] (or row t without ids), `width` bf16 values each. src is [src_rows, width];
    out rows are `out_layout.stride` apart from column `out_layout.column` (default: packed [rows, width]).
    ids are int32 already checked to be < src_rows; a negative id -(j + 1) reads feed[j] instead."""
    stream = require_stream(stream)
    layout = out_layout or RowLayout(width)
    _require_positive("gather_rows", rows=rows, width=width, src_rows=src_rows, stride=layout.stride)
    if layout.column < 0 or layout.column + width > layout.stride:
        raise ValueError(f"gather_rows: columns {layout.column}..{layout.column + width} overflow the out row ({layout.stride})")
    buffers = {"src": (src, src_rows * width * 2), "out": (out, rows * layout.stride * 2)}
    if ids is not None:
        buffers["ids"] = (ids, rows * 4)
    _require_bytes("gather_rows", **buffers)
    reads = tuple(buffer.resource for buffer in (src, ids, feed) if buffer is not None)
    lib.kernel(GATHER_ROWS).launch(
        stream, rows, 128 if width >= 1024 else 32,
        out.ptr + 2 * layout.column, layout.stride, src, width, ids if ids is not None else 0, width,
        feed if feed is not None else 0,
        label=label, reads=reads, writes=(out.resource,), lane=lane,
    )


def _require_device_bytes(op: str, **buffers: tuple[Buffer, int]) -> None:
    """Sizes, then 16-byte alignment (the kernels' vector loads) of every buffer, before any launch."""
    _require_bytes(op, **buffers)
    for name, (buffer, _) in buffers.items():
        if buffer.ptr % 16:
            raise ValueError(f"{op}: {name} ({buffer.name}) is not 16-byte aligned")
