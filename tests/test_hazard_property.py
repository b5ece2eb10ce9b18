"""The verifier's verdict equals a brute-force happens-before graph on random programs.

A program is the issue order of ops over a few logical streams, each op issued by one of two host threads:
kernels with random read/write sets (whole buffers or byte ranges of them), event records, waits, event and
stream synchronisations, and host reads/writes. The oracle never uses clocks: it builds the happens-before graph from its four edge kinds
(program order, host issue, record -> wait, sync -> host) and tests reachability by walking predecessors.
The verifier must raise at exactly the first op where the oracle sees two overlapping accesses, one a
write, with no path between them, and never on a race-free program.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_rt.cuda.streams import Event, StreamSet
from ninfer_rt.ordering import OrderingViolation, Span

KEYS = ("a", "b")
HOST_THREADS = 2
BUFFER_BYTES = 8


@dataclass(frozen=True)
class Access:
    key: str
    start: int
    end: int
    write: bool

    def conflicts(self, other: Access) -> bool:
        overlap = self.start < other.end and other.start < self.end
        return self.key == other.key and overlap and (self.write or other.write)

    def resource(self) -> object:
        whole = (self.start, self.end) == (0, BUFFER_BYTES)
        return self.key if whole else Span(self.key, self.start, self.end)


@dataclass(frozen=True)
class Op:
    kind: str  # launch | record | wait | sync_event | sync_stream | host_access
    host: int  # the host thread that issues it
    stream: int = 0
    event: int = 0  # index among the program's records so far (wait, sync_event)
    accesses: tuple[Access, ...] = ()


# --- program generation ---------------------------------------------------------------------------------

ranges = st.one_of(
    st.just((0, BUFFER_BYTES)),
    st.tuples(st.integers(0, BUFFER_BYTES - 1), st.integers(1, BUFFER_BYTES)).filter(lambda r: r[0] < r[1]),
)
accesses = st.builds(lambda key, r, write: Access(key, r[0], r[1], write), st.sampled_from(KEYS), ranges, st.booleans())


@st.composite
def programs(draw: st.DrawFn) -> tuple[int, list[Op]]:
    n_streams = draw(st.integers(2, 4))
    stream = st.integers(0, n_streams - 1)
    access_sets = st.lists(accesses, min_size=1, max_size=3).map(tuple)
    ops: list[Op] = []
    records = 0
    for _ in range(draw(st.integers(1, 30))):
        # ordering ops are weighted up so programs often stay race-free long enough to get interesting
        kinds = ["launch", "launch", "record", "record", "sync_stream", "host_access"]
        kinds += ["wait", "wait", "wait", "sync_event"] if records else []
        kind = draw(st.sampled_from(kinds))
        host = draw(st.integers(0, HOST_THREADS - 1))
        if kind == "launch":
            ops.append(Op("launch", host, draw(stream), accesses=draw(access_sets)))
        elif kind == "record":
            ops.append(Op("record", host, draw(stream)))
            records += 1
        elif kind == "wait":
            ops.append(Op("wait", host, draw(stream), event=draw(st.integers(0, records - 1))))
        elif kind == "sync_event":
            ops.append(Op("sync_event", host, event=draw(st.integers(0, records - 1))))
        elif kind == "sync_stream":
            ops.append(Op("sync_stream", host, draw(stream)))
        else:
            ops.append(Op("host_access", host, accesses=draw(access_sets)))
    return n_streams, ops


# --- the oracle: an explicit graph, reachability by search ----------------------------------------------


@dataclass
class Graph:
    timelines: list[int] = field(default_factory=list)
    preds: list[set[int]] = field(default_factory=list)

    def add(self, timeline: int, preds: set[int]) -> int:
        self.timelines.append(timeline)
        self.preds.append(preds)
        return len(self.preds) - 1

    def on(self, timeline: int) -> set[int]:
        return {n for n, t in enumerate(self.timelines) if t == timeline}

    def reaches(self, source: int, target: int) -> bool:
        seen, todo = set(), [target]
        while todo:
            node = todo.pop()
            if node == source:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(self.preds[node])
        return False


def first_race(ops: list[Op]) -> int | None:
    """Index of the first op that has an access racing an earlier one, by graph reachability."""
    graph = Graph()
    record_nodes: list[int] = []
    accessed: list[tuple[int, Access]] = []
    for index, op in enumerate(ops):
        host = -1 - op.host  # host timelines are negative, streams are 0..n-1
        if op.kind in ("launch", "record", "wait"):
            # program order on the stream, and the issue edge from everything the issuing thread did so far
            preds = graph.on(op.stream) | graph.on(host)
            if op.kind == "wait":
                preds.add(record_nodes[op.event])
            node = graph.add(op.stream, preds)
            if op.kind == "record":
                record_nodes.append(node)
        else:
            preds = graph.on(host)
            if op.kind == "sync_event":
                preds.add(record_nodes[op.event])
            elif op.kind == "sync_stream":
                preds |= graph.on(op.stream)
            node = graph.add(host, preds)
        for access in op.accesses:
            for earlier, other in accessed:
                if access.conflicts(other) and not graph.reaches(earlier, node):
                    return index
        accessed.extend((node, a) for a in op.accesses)
    return None


# --- the system under test -------------------------------------------------------------------------------


def first_violation(n_streams: int, ops: list[Op]) -> int | None:
    """Index of the op at which the verifier raises, running the program on logical streams, each op on
    its own host thread (one at a time, in program order)."""
    streams = StreamSet(verify=True)
    lanes = [streams.create(f"s{i}") for i in range(n_streams)]
    events: list[Event] = []
    threads = [ThreadPoolExecutor(max_workers=1) for _ in range(HOST_THREADS)]
    try:
        for index, op in enumerate(ops):
            try:
                threads[op.host].submit(issue(op, f"op{index}", streams, lanes, events)).result()
            except OrderingViolation:
                return index
        return None
    finally:
        for thread in threads:
            thread.shutdown()


def issue(op: Op, label: str, streams: StreamSet, lanes: list, events: list[Event]) -> Callable[[], None]:
    reads = [a.resource() for a in op.accesses if not a.write]
    writes = [a.resource() for a in op.accesses if a.write]
    if op.kind == "launch":
        return lambda: lanes[op.stream].declare(label, reads, writes)
    if op.kind == "record":
        return lambda: events.append(lanes[op.stream].record())
    if op.kind == "wait":
        return lambda: lanes[op.stream].wait(events[op.event])
    if op.kind == "sync_event":
        return lambda: events[op.event].synchronize()
    if op.kind == "sync_stream":
        return lambda: lanes[op.stream].synchronize()
    return lambda: streams.host_access(label, reads, writes)


@settings(max_examples=600, deadline=None)
@given(programs())
def test_hazard_verdict_equals_bruteforce_happens_before(program: tuple[int, list[Op]]) -> None:
    n_streams, ops = program
    assert first_violation(n_streams, ops) == first_race(ops)
