"""Launch wrappers for token selection on the device (kernels_src/sampling.cu): greedy argmax and
top-k / top-p / min-p sampling, each ending in one int32 token per logits row.

Both are multi-block reductions: grid (S, rows), S <= MAX_SLICES blocks per row, and the last block of a
row to finish reduces the others' partials through a scratch buffer (self-cleaning: zeroed once when
allocated, then every pass leaves it zeroed). A scratch belongs to one stream; `DeviceSampler` owns the
scratch, the parameter buffer and its staging ring for one executor's compute stream.

The packed parameter rows (PARAM_WORDS int32 per row) are built by ninfer_rt/engine/sampling.py
(`pack_device_params`); the flag bits below are the kernel's `SampleFlags`.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.cuda.kernels import Arg, KernelLibrary, KernelSpec
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer, StagingRing
from ninfer_rt.cuda.ops import _require_bytes, _require_positive
from ninfer_rt.cuda.streams import Stream, StreamSet, require_stream

THREADS = 256  # kThreads
MAX_SLICES = 64  # kMaxSlices
MIN_SLICE = 2048  # floats per block below which more blocks only add partials
_BINS = 2048
ARGMAX_ROW_BYTES = 16 + MAX_SLICES * 8  # kArgmaxRowBytes
SAMPLE_ROW_BYTES = 64 + MAX_SLICES * 8 + _BINS * 4 + _BINS * 8  # kSampleRowBytes
PARAM_WORDS = 8  # SampleParams: temperature, top_k, top_p, min_p, u (f32 bits where float), flags, 2 unused
FLAGS_WORD = 5
MAX_SAMPLE_VOCAB = 1 << 23  # W <= 2^40 per token: the u64 sums hold 2^23 tokens
MAX_ROWS = 65535  # grid.y

# SampleFlags
GREEDY, TOP_K, TOP_P, MIN_P = 1, 2, 4, 8

ARGMAX = KernelSpec("sampling", "argmax_f32", (Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.PTR))
SAMPLE_BEGIN = KernelSpec("sampling", "sample_begin", (Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.PTR))
SAMPLE_RADIX = KernelSpec("sampling", "sample_radix", (Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.PTR, Arg.I32))
SAMPLE_DRAW = KernelSpec("sampling", "sample_draw", (Arg.PTR, Arg.PTR, Arg.PTR, Arg.I32, Arg.I32, Arg.PTR))
TOP_K_STAGES = (1, 2)  # sample_radix's `stage` for top-k digits 2 and 3 (digit 1 is in sample_begin)
TOP_P_STAGES = (4, 5, 6)


def slicing(vocab: int) -> tuple[int, int]:
    """(blocks per row, floats per block): at most MAX_SLICES blocks, at least MIN_SLICE floats each
    (short rows take fewer blocks), a multiple of 4 so float4 loads stay aligned."""
    blocks = max(1, min(MAX_SLICES, -(-vocab // MIN_SLICE)))
    per_block = -(-vocab // blocks)
    per_block = -(-per_block // 4) * 4
    return -(-vocab // per_block), per_block


def sample_launches(flags: np.ndarray) -> list[tuple[str, int]]:
    """The passes a sample call makes for these rows' flags: ("begin", 0), ("radix", stage)..., ("draw", 0).
    Passes no row needs are skipped (an all-greedy call is sample_begin alone)."""
    flags = np.asarray(flags, np.int32)
    sampled = flags[(flags & GREEDY) == 0]
    launches = [("begin", 0)]
    if (sampled & TOP_K).any():
        launches += [("radix", stage) for stage in TOP_K_STAGES]
    if (sampled & TOP_P).any():
        launches += [("radix", stage) for stage in TOP_P_STAGES]
    if sampled.size:
        launches.append(("draw", 0))
    return launches


def _check(op: str, logits: Buffer, out: Buffer, rows: int, vocab: int, scratch: Buffer, row_bytes: int) -> tuple[int, int]:
    _require_positive(op, rows=rows, vocab=vocab)
    if rows > MAX_ROWS:
        raise ValueError(f"{op}: {rows} rows exceed the grid's {MAX_ROWS}")
    _require_bytes(op, logits=(logits, rows * vocab * 4), out=(out, rows * 4), scratch=(scratch, rows * row_bytes))
    for name, buffer in (("logits", logits), ("scratch", scratch)):
        if buffer.ptr % 16:
            raise ValueError(f"{op}: {name} ({buffer.name}) is not 16-byte aligned")
    return slicing(vocab)


def argmax(
    lib: KernelLibrary, stream: object, logits: Buffer, out: Buffer, rows: int, vocab: int, scratch: Buffer, *,
    label: str = "argmax", lane: object = None,
) -> None:
    """out[r] = argmax(logits[r]) (int32; lowest index among ties, NaN never wins, all-NaN -> 0) for f32
    logits [rows, vocab]. `scratch`: argmax_scratch_bytes(rows), zeroed before its first use."""
    stream = require_stream(stream)
    blocks, per_block = _check("argmax", logits, out, rows, vocab, scratch, ARGMAX_ROW_BYTES)
    lib.kernel(ARGMAX).launch(
        stream, (blocks, rows), THREADS, out, logits, vocab, per_block, scratch,
        label=label, reads=(logits.resource, scratch.resource), writes=(out.resource, scratch.resource), lane=lane,
    )


def sample(
    lib: KernelLibrary, stream: object, logits: Buffer, out: Buffer, rows: int, vocab: int, params: Buffer,
    flags: np.ndarray, scratch: Buffer, *, label: str = "sample", lane: object = None,
) -> None:
    """out[r] = the token row r draws (greedy rows: the argmax), int32, for f32 logits [rows, vocab].
    `params`: int32 [rows, PARAM_WORDS] on the device; `flags`: the host copy of its flags column (which
    passes to launch). `scratch`: sample_scratch_bytes(rows), zeroed before its first use."""
    stream = require_stream(stream)
    blocks, per_block = _check("sample", logits, out, rows, vocab, scratch, SAMPLE_ROW_BYTES)
    _require_bytes("sample", params=(params, rows * PARAM_WORDS * 4))
    flags = np.asarray(flags, np.int32).reshape(-1)
    if flags.shape != (rows,):
        raise ValueError(f"sample: {flags.size} flags for {rows} rows")
    if vocab > MAX_SAMPLE_VOCAB and (flags & GREEDY == 0).any():
        raise ValueError(f"sample: vocab {vocab} exceeds {MAX_SAMPLE_VOCAB} (the fixed-point mass sums)")
    grid = (blocks, rows)
    reads = (logits.resource, params.resource, scratch.resource)
    for kind, stage in sample_launches(flags):
        if kind == "begin":
            lib.kernel(SAMPLE_BEGIN).launch(
                stream, grid, THREADS, out, params, logits, vocab, per_block, scratch,
                label=f"{label}: begin", reads=reads, writes=(out.resource, scratch.resource), lane=lane,
            )
        elif kind == "radix":
            lib.kernel(SAMPLE_RADIX).launch(
                stream, grid, THREADS, params, logits, vocab, per_block, scratch, stage,
                label=f"{label}: radix {stage}", reads=reads, writes=(scratch.resource,), lane=lane,
            )
        else:
            lib.kernel(SAMPLE_DRAW).launch(
                stream, grid, THREADS, out, params, logits, vocab, per_block, scratch,
                label=f"{label}: draw", reads=reads, writes=(out.resource, scratch.resource), lane=lane,
            )


def argmax_scratch_bytes(rows: int) -> int:
    return rows * ARGMAX_ROW_BYTES


def sample_scratch_bytes(rows: int) -> int:
    return rows * SAMPLE_ROW_BYTES


def zeroed_scratch(streams: StreamSet, stream: Stream, nbytes: int, name: str) -> DeviceBuffer:
    """A scratch buffer zeroed in `stream`'s order (the only zeroing it ever needs)."""
    buffer = DeviceBuffer(streams, nbytes, name)
    stream.memset(buffer, 0, label=f"zero {name}")
    return buffer


class DeviceSampler:
    """Scratch, parameter buffer and staging for token selection on one stream. The argmax scratch is
    allocated once for `max_rows` (argmax may be captured in a graph: its address must not change); the
    sampling scratch grows with the rows asked for (sampling is never captured: its passes depend on the
    rows' parameters). Outgrown buffers are kept, not freed: queued kernels may still use them."""

    def __init__(self, streams: StreamSet, stream: Stream, max_rows: int) -> None:
        self.streams = streams
        self.stream = stream
        self.max_rows = max_rows
        self._argmax_scratch: DeviceBuffer | None = None
        self._sample_scratch: DeviceBuffer | None = None
        self._sample_rows = 0
        self._params: DeviceBuffer | None = None
        self._staging: StagingRing | None = None
        self._retired: list[DeviceBuffer] = []

    def argmax(self, lib: KernelLibrary, logits: Buffer, out: Buffer, rows: int, vocab: int, *, lane: object = None) -> None:
        if self._argmax_scratch is None:
            self._argmax_scratch = zeroed_scratch(self.streams, self.stream, argmax_scratch_bytes(self.max_rows), "argmax.scratch")
        argmax(lib, self.stream, logits, out, rows, vocab, self._argmax_scratch, lane=lane)

    def sample(
        self, lib: KernelLibrary, logits: Buffer, out: Buffer, rows: int, vocab: int, params: np.ndarray, *, lane: object = None
    ) -> None:
        """`params`: int32 [rows, PARAM_WORDS] (engine.sampling.pack_device_params), published through a
        staging ring on this stream (rule 3) before the launches that read it."""
        params = np.ascontiguousarray(params, np.int32)
        if params.shape != (rows, PARAM_WORDS):
            raise ValueError(f"sample: params of shape {params.shape}, expected ({rows}, {PARAM_WORDS})")
        if rows > self.max_rows:
            raise ValueError(f"sample: {rows} rows exceed the sampler's {self.max_rows}")
        if self._params is None:
            self._params = DeviceBuffer(self.streams, self.max_rows * PARAM_WORDS * 4, "sample.params")
            self._staging = StagingRing(self.streams, 4, self.max_rows * PARAM_WORDS * 4, name="staging.sample_params")
        if rows > self._sample_rows:
            if self._sample_scratch is not None:
                self._retired.append(self._sample_scratch)
            self._sample_rows = min(self.max_rows, max(rows, 2 * self._sample_rows, 8))
            self._sample_scratch = zeroed_scratch(
                self.streams, self.stream, sample_scratch_bytes(self._sample_rows), f"sample.scratch[{self._sample_rows}]"
            )
        self._staging.publish(self.stream, self._params, params, label="publish sample params", lane=lane)
        sample(lib, self.stream, logits, out, rows, vocab, self._params, params[:, FLAGS_WORD], self._sample_scratch, lane=lane)
