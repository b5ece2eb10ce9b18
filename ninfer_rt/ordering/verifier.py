"""Happens-before verifier: vector clocks over streams and host threads.

Every device op (launch, copy, memset), every host access to a pinned or staged buffer and every page
hand-over declares the resources it reads and writes. Each timeline (a stream, or a host thread) carries a
vector clock; an op's epoch is (timeline, its counter). `record` snapshots a stream's clock into an event;
`wait` and host synchronisation merge it. An access conflicts with an earlier one on the same resource when
at least one writes and the earlier epoch is not covered by the current clock: that is a race the GPU is
free to run either way, so it raises `OrderingViolation` the first time it is *issued*, not when it bites.

Per resource we keep the last write and the reads since it, one per timeline (FastTrack's observation:
later reads on a timeline subsume earlier ones on that timeline).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

Resource = Hashable


class OrderingViolation(RuntimeError):
    """Two accesses to one resource, at least one a write, with no happens-before between them."""


@dataclass(frozen=True)
class OpRef:
    """Enough about an op to name it in a violation or a crash dump."""

    timeline: str
    seq: int
    label: str
    lane: object = None

    def __str__(self) -> str:
        lane = "" if self.lane is None else f", lane {self.lane}"
        return f"'{self.label}' (#{self.seq} on {self.timeline}{lane})"


@dataclass
class Timeline:
    """A sequence of ops that are ordered among themselves: one stream, or one host thread."""

    name: str
    index: int
    clock: dict[int, int] = field(default_factory=dict)

    def tick(self) -> int:
        self.clock[self.index] = self.clock.get(self.index, 0) + 1
        return self.clock[self.index]

    def merge(self, other: dict[int, int]) -> None:
        mine = self.clock
        for idx, count in other.items():
            if mine.get(idx, 0) < count:
                mine[idx] = count

    def covers(self, timeline_index: int, count: int) -> bool:
        return self.clock.get(timeline_index, 0) >= count


@dataclass
class _Access:
    timeline_index: int
    count: int
    op: OpRef


@dataclass
class _ResourceState:
    last_write: _Access | None = None
    reads: dict[int, _Access] = field(default_factory=dict)


class Verifier:
    """Checks declared accesses against happens-before. One per StreamSet; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timelines: list[Timeline] = []
        self._host_timelines: dict[int, Timeline] = {}
        self._resources: dict[Resource, _ResourceState] = {}
        self.ops_checked = 0

    def timeline(self, name: str) -> Timeline:
        with self._lock:
            tl = Timeline(name, len(self._timelines))
            self._timelines.append(tl)
            return tl

    def host(self) -> Timeline:
        """The calling host thread's timeline (made on first use)."""
        ident = threading.get_ident()
        tl = self._host_timelines.get(ident)
        if tl is None:
            tl = self.timeline(f"host:{threading.current_thread().name}")
            self._host_timelines[ident] = tl
        return tl

    def op(
        self,
        tl: Timeline,
        label: str,
        reads: Iterable[Resource] = (),
        writes: Iterable[Resource] = (),
        lane: object = None,
    ) -> OpRef:
        """Declare one op issued on `tl` by the calling host thread; raises OrderingViolation on the first
        unordered conflict. Issuing is itself an edge: whatever the host did before enqueuing an op
        happens before the op (a kernel enqueued after a host write to pinned memory sees the write)."""
        host = self.host()
        with self._lock:
            if tl is not host:
                tl.merge(host.clock)
            count = tl.tick()
            ref = OpRef(tl.name, count, label, lane)
            me = _Access(tl.index, count, ref)
            written = set(writes)
            for res in reads:
                if res not in written:
                    self._read(tl, res, me)
            for res in written:
                self._write(tl, res, me)
            self.ops_checked += 1
            return ref

    def snapshot(self, tl: Timeline) -> dict[int, int]:
        with self._lock:
            return dict(tl.clock)

    def merge(self, tl: Timeline, clock: dict[int, int]) -> None:
        with self._lock:
            tl.merge(clock)

    def forget(self, resources: Iterable[Resource]) -> None:
        """Drop history of resources whose storage no longer exists (freed buffers)."""
        with self._lock:
            for res in resources:
                self._resources.pop(res, None)

    def _state(self, res: Resource) -> _ResourceState:
        st = self._resources.get(res)
        if st is None:
            st = self._resources[res] = _ResourceState()
        return st

    def _read(self, tl: Timeline, res: Resource, me: _Access) -> None:
        st = self._state(res)
        w = st.last_write
        if w is not None and not tl.covers(w.timeline_index, w.count):
            raise _violation(res, w.op, "write", me.op, "read")
        st.reads[tl.index] = me

    def _write(self, tl: Timeline, res: Resource, me: _Access) -> None:
        st = self._state(res)
        w = st.last_write
        if w is not None and not tl.covers(w.timeline_index, w.count):
            raise _violation(res, w.op, "write", me.op, "write")
        for r in st.reads.values():
            if not tl.covers(r.timeline_index, r.count):
                raise _violation(res, r.op, "read", me.op, "write")
        st.last_write = me
        st.reads = {}


def _violation(res: Resource, earlier: OpRef, earlier_kind: str, later: OpRef, later_kind: str) -> OrderingViolation:
    return OrderingViolation(
        f"unordered access to {res!r}: {later_kind} by {later} has no happens-before with "
        f"the earlier {earlier_kind} by {earlier}; the later op's stream must wait on an event recorded "
        f"after the earlier op (or the host must synchronize on it)"
    )
