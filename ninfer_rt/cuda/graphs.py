"""CUDA graphs: capture a step's launches once, replay them as one launch.

Decode is launch bound in Python (~5 us per launch, ~400 launches a step for a 36-layer model), so each
decode step shape (batch size and verify width, see `exec/cuda_tensors.StepShape`) is captured once and replayed.

Capture: cuStreamBeginCapture(THREAD_LOCAL) on the (non-default) compute stream, the ops enqueued as in
an eager step, cuStreamEndCapture, cuGraphInstantiate. Nothing may allocate or load modules while
capturing, so a shape is always run eagerly once first (it fills the activation pool and loads every
kernel); the capture then reuses exactly those buffers. Python's cyclic garbage collector is paused while
capturing: a finalizer it runs may free device memory. Replay: the step's inputs are published into
their fixed device buffers by an ordinary copy on the same stream (outside the graph), then
cuGraphLaunch on that stream.

Ordering: ops enqueued while capturing do not run, so their declarations are recorded instead of being
sent to the verifier; a replay is declared as one op reading and writing the union of them. What a
step names through its published tables is the exception: a replay touches the KV pages of *its* step's
block table and the state slots of *its* step's slot table, so the recorded page resources and the spans
of the buffers given as `per_step` (a hybrid's state slot pool) are dropped, and the replayed step's own
pages and slot spans declared instead.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from cuda.bindings import driver as cu

from ninfer_rt.cuda.driver import check
from ninfer_rt.cuda.streams import Stream, require_stream
from ninfer_rt.ordering.verifier import Resource, Span


def _is_page(resource: Resource) -> bool:
    return isinstance(resource, tuple) and len(resource) == 2 and resource[0] == "kv"


@dataclass
class CapturedAccesses:
    """The declarations made while capturing: replayed as one op."""

    per_step: frozenset[Resource] = frozenset()  # keys whose spans each replay declares for itself
    labels: list[str] = field(default_factory=list)
    reads: set[Resource] = field(default_factory=set)
    writes: set[Resource] = field(default_factory=set)

    def note(self, label: str, reads: Iterable[Resource], writes: Iterable[Resource]) -> None:
        self.labels.append(label)
        self.reads.update(r for r in reads if not self._replay_declares(r))
        self.writes.update(w for w in writes if not self._replay_declares(w))

    def _replay_declares(self, resource: Resource) -> bool:
        return _is_page(resource) or (isinstance(resource, Span) and resource.key in self.per_step)


@contextmanager
def _recording(stream: Stream, into: CapturedAccesses) -> Iterator[None]:
    """Route `stream`'s declarations into `into` instead of the verifier: captured ops do not run now.
    (An instance attribute shadows Stream.declare for the duration; every enqueue path calls declare.)"""
    stream.declare = lambda label, reads=(), writes=(), lane=None: into.note(label, tuple(reads), tuple(writes))
    try:
        yield
    finally:
        del stream.declare


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector held off for the span. A collection may run at any allocation, and what it
    finalizes (a cuBLASLt handle left in a cycle by an earlier executor, say) can free device memory, which
    synchronizes: inside a capture that invalidates the capture, and the error surfaces at a later, innocent
    launch (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Graph:
    """One instantiated capture, replayable on the stream it was captured on."""

    def __init__(self, stream: Stream, graph: object, executable: object, accesses: CapturedAccesses, outputs: Any) -> None:
        self.stream = stream
        self._graph = graph
        self._exec = executable
        self.accesses = accesses
        self.outputs = outputs  # held: their buffers are the graph's fixed output addresses
        # The captured part of every replay's declaration, built once: a decode step's capture touches
        # hundreds of buffers, and set algebra over them per replay cost tens of microseconds of host time.
        self._writes = tuple(accesses.writes)
        self._reads = tuple(accesses.reads - accesses.writes)
        self._label = f"graph replay ({len(accesses.labels)} ops)"

    def replay(self, step_reads: Iterable[Resource] = (), step_writes: Iterable[Resource] = (), lane: object = None) -> Any:
        """Launch the graph after everything already enqueued on its stream; returns the capture's outputs.
        `step_reads` / `step_writes`: the replayed step's KV pages and per-step spans (never among the
        captured resources, see note())."""
        written = frozenset(step_writes)
        reads = self._reads + tuple(resource for resource in step_reads if resource not in written)
        self.stream.declare(self._label, reads, self._writes + tuple(written), lane)
        check(cu.cuGraphLaunch(self._exec, self.stream.handle), "cuGraphLaunch")
        return self.outputs

    def destroy(self) -> None:
        check(cu.cuGraphExecDestroy(self._exec), "cuGraphExecDestroy")
        check(cu.cuGraphDestroy(self._graph), "cuGraphDestroy")


def capture(stream: object, enqueue: Callable[[], Any], per_step: Iterable[Resource] = ()) -> Graph:
    """Capture everything `enqueue` puts on `stream` into a graph; `enqueue` must not allocate, load
    modules, record events or synchronize (run it eagerly once before capturing). Spans of the `per_step`
    keys are left to each replay to declare, as KV pages are."""
    stream = require_stream(stream)
    if stream.handle is None:
        raise TypeError(f"cannot capture on logical stream {stream.name!r}")
    accesses = CapturedAccesses(frozenset(per_step))
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    with _collector_paused():
        check(cu.cuStreamBeginCapture(stream.handle, mode), "cuStreamBeginCapture")
        try:
            with _recording(stream, accesses):
                outputs = enqueue()
        except BaseException:
            # End the capture so the stream is usable again; the partial graph is discarded.
            graph = cu.cuStreamEndCapture(stream.handle)[1]
            if graph is not None:
                cu.cuGraphDestroy(graph)
            raise
        graph = check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
    executable = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    return Graph(stream, graph, executable, accesses, outputs)
