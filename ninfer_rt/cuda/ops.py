"""One launch wrapper per kernel: shapes checked, launch shape chosen, accesses declared.

Each wrapper takes the library, the stream, buffers and sizes, checks that every buffer is large enough,
and enqueues through `Kernel.launch`, declaring what the kernel reads and writes for the ordering verifier.
The math each kernel computes is documented at the top of its `kernels_src/<family>.cu`.
"""

from __future__ import annotations

from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec
from ninfer_rt.cuda.memory import Buffer
from ninfer_rt.cuda.streams import require_stream

BF16_BYTES = 2
# Grid-stride kernels need no more blocks than this to fill any current GPU; more only adds scheduling.
_MAX_GRID_STRIDE_BLOCKS = 4096
_GRID_STRIDE_THREADS = 256

RMSNORM = KernelSpec("rmsnorm", "rmsnorm_bf16", (Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.F32))
RMSNORM_RESIDUAL = KernelSpec("rmsnorm", "rmsnorm_residual_bf16", (Arg.PTR, Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.F32))
RMSNORM_F32W = KernelSpec("rmsnorm", "rmsnorm_bf16_f32w", RMSNORM.signature)
RMSNORM_RESIDUAL_F32W = KernelSpec("rmsnorm", "rmsnorm_residual_bf16_f32w", RMSNORM_RESIDUAL.signature)
SILU_MUL = KernelSpec("activation", "silu_mul_bf16", (Arg.PTR, Arg.PTR, Arg.I32, Arg.I32))


def rmsnorm(
    lib: KernelLibrary,
    stream: object,
    x: Buffer,
    w: Buffer,
    out: Buffer,
    rows: int,
    hidden: int,
    eps: float,
    residual: Buffer | None = None,
    *,
    gain_f32: bool = False,
    lane: object = None,
) -> None:
    """out = rmsnorm(x) * w over `rows` rows of `hidden` bf16 values; w is bf16, or f32 with `gain_f32` (the
    hybrid's zero-centred 1 + w). With `residual`, first residual = x + residual in place, and normalise
    that (the fused add of a decoder layer)."""
    stream = require_stream(stream)
    _require_positive("rmsnorm", rows=rows, hidden=hidden)
    row_major = rows * hidden * BF16_BYTES
    _require_bytes("rmsnorm", x=(x, row_major), w=(w, hidden * (4 if gain_f32 else BF16_BYTES)), out=(out, row_major))
    # One thread per 16-byte vector (or per element when rows can't be vectorised), in whole warps.
    per_thread = 8 if hidden % 8 == 0 else 1
    threads = min(1024, _round_up(-(-hidden // per_thread), 32))
    if residual is None:
        lib.kernel(RMSNORM_F32W if gain_f32 else RMSNORM).launch(
            stream, rows, threads, out, x, w, hidden, eps,
            label="rmsnorm", reads=(x.resource, w.resource), writes=(out.resource,), lane=lane,
        )
        return
    _require_bytes("rmsnorm", residual=(residual, row_major))
    lib.kernel(RMSNORM_RESIDUAL_F32W if gain_f32 else RMSNORM_RESIDUAL).launch(
        stream, rows, threads, out, residual, x, w, hidden, eps,
        label="rmsnorm+residual", reads=(x.resource, w.resource, residual.resource),
        writes=(out.resource, residual.resource), lane=lane,
    )


def silu_mul(
    lib: KernelLibrary, stream: object, gate_up: Buffer, out: Buffer, rows: int, inter: int, *, lane: object = None
) -> None:
    """out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:] for `rows` rows (SwiGLU)."""
    stream = require_stream(stream)
    _require_positive("silu_mul", rows=rows, inter=inter)
    _require_bytes("silu_mul", gate_up=(gate_up, rows * 2 * inter * BF16_BYTES), out=(out, rows * inter * BF16_BYTES))
    items = rows * (inter // 8 if inter % 8 == 0 else inter)
    blocks = min(_MAX_GRID_STRIDE_BLOCKS, -(-items // _GRID_STRIDE_THREADS))
    lib.kernel(SILU_MUL).launch(
        stream, blocks, _GRID_STRIDE_THREADS, out, gate_up, rows, inter,
        label="silu_mul", reads=(gate_up.resource,), writes=(out.resource,), lane=lane,
    )


class StepRows:
    """What a step's launch arguments derive from their `query_lens` (new rows per sequence)."""

    query_lens: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_rows(self) -> int:
        return sum(self.query_lens)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _require_positive(op: str, **sizes: int) -> None:
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{op}: {name} must be a positive integer, got {size!r}")


def _require_bytes(op: str, **buffers: tuple[Buffer, int]) -> None:
    for name, (buffer, needed) in buffers.items():
        if not isinstance(buffer, Buffer):
            raise TypeError(f"{op}: {name} must be a Buffer, got {type(buffer).__name__}")
        if buffer.nbytes < needed:
            raise ValueError(f"{op}: {name} ({buffer.name}) holds {buffer.nbytes} bytes, needs {needed}")
