"""In-process collectives between simulated ranks: all-reduce and all-gather as device ops.

A collective is NCCL's rendezvous, modelled for the ordering verifier: rank r first `contribute`s its
operand into its own buffer on a stream of its own; the collective, on a stream of its own, waits on every
rank's compute stream, reads every rank's operand buffer and writes every rank's result buffer; each rank's
compute stream then waits on the collective before it `take`s its result. An operand written on a stream
the collective did not wait on, or a result read on a stream that did not wait on the collective, is an
unordered access the verifier reports (tests/test_tensor_parallel_ordering.py injects both).

Sums run in rank order, each rank receiving the same array, so the result is deterministic and identical
on every rank, as replicated activations must be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import Stream, StreamSet

Combine = Callable[[list[np.ndarray]], np.ndarray]


class RankBuffer:
    """One rank's operand or result buffer; it only grows, as a captured graph's would stay fixed."""

    def __init__(self, streams: StreamSet, name: str) -> None:
        self._streams = streams
        self._name = name
        self.buffer = DeviceBuffer(streams, 8, name)
        self.shape: tuple[int, ...] = ()
        self.dtype = np.dtype(np.float32)

    def fit(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.buffer.nbytes < nbytes:
            self.buffer.free()
            self.buffer = DeviceBuffer(self._streams, nbytes, self._name)
        self.shape, self.dtype = shape, np.dtype(dtype)

    def array(self) -> np.ndarray:
        return self.buffer.view(self.dtype, self.shape)


class Collectives:
    """All-reduce and all-gather over the compute streams of `ranks` simulated ranks."""

    def __init__(self, streams: StreamSet, rank_streams: Sequence[Stream]) -> None:
        self.stream = streams.create("collective")
        self.rank_streams = tuple(rank_streams)
        self.operands = [RankBuffer(streams, f"tp.operand[{r}]") for r in range(len(rank_streams))]
        self.results = [RankBuffer(streams, f"tp.result[{r}]") for r in range(len(rank_streams))]

    def all_reduce(self, parts: Sequence[np.ndarray], label: str, lane: object = None) -> list[np.ndarray]:
        """Each rank's copy of the sum of `parts` (rank order)."""
        return self._run(parts, label, _sum_in_rank_order, parts[0].shape, lane)

    def all_gather(self, parts: Sequence[np.ndarray], label: str, lane: object = None) -> list[np.ndarray]:
        """Each rank's copy of `parts` side by side along the last axis (rank order)."""
        shape = (*parts[0].shape[:-1], sum(part.shape[-1] for part in parts))
        return self._run(parts, label, lambda arrays: np.concatenate(arrays, axis=-1), shape, lane)

    def contribute(self, rank: int, part: np.ndarray, stream: Stream, lane: object = None) -> None:
        """Write rank r's operand on `stream` (the rank's compute stream in every correct use)."""
        operand = self.operands[rank]
        operand.fit(part.shape, part.dtype)

        def store() -> None:
            operand.array()[...] = part

        stream.host_op(store, label=f"tp operand[{rank}]", writes=(operand.buffer.resource,), lane=lane)

    def combine(self, label: str, combine: Combine, shape: tuple[int, ...], lane: object = None) -> None:
        """The collective itself: after every rank's compute stream, every operand in, every result (of
        `shape`) out."""
        for stream in self.rank_streams:
            self.stream.wait(stream.record())
        for result in self.results:
            result.fit(shape, self.operands[0].dtype)

        def run() -> None:
            combined = combine([operand.array() for operand in self.operands])
            for result in self.results:
                result.array()[...] = combined

        self.stream.host_op(run, label=label, lane=lane, reads=tuple(o.buffer.resource for o in self.operands),
                            writes=tuple(r.buffer.resource for r in self.results))
        done = self.stream.record()
        for stream in self.rank_streams:
            stream.wait(done)

    def take(self, rank: int, stream: Stream, lane: object = None) -> np.ndarray:
        """Rank r's result, read on `stream` (a copy: the buffer is the next collective's)."""
        result = self.results[rank]
        return stream.host_op(lambda: result.array().copy(), label=f"tp result[{rank}]",
                              reads=(result.buffer.resource,), lane=lane)

    def _run(self, parts: Sequence[np.ndarray], label: str, combine: Combine, shape: tuple[int, ...],
             lane: object) -> list[np.ndarray]:
        for rank, (part, stream) in enumerate(zip(parts, self.rank_streams, strict=True)):
            self.contribute(rank, part, stream, lane)
        self.combine(label, combine, shape, lane)
        return [self.take(rank, stream, lane) for rank, stream in enumerate(self.rank_streams)]


def _sum_in_rank_order(arrays: list[np.ndarray]) -> np.ndarray:
    total = arrays[0].copy()
    for array in arrays[1:]:
        total += array
    return total
