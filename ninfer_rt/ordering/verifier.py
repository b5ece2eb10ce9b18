"""Happens-before verifier: vector clocks over streams and host threads.

Every device op (launch, copy, memset), every host access to a pinned or staged buffer and every page
hand-over declares the resources it reads and writes. Each timeline (a stream, or a host thread) carries a
vector clock; an op's epoch is (timeline, its counter). `record` snapshots a stream's clock into an event;
`wait` and host synchronisation merge it. An access conflicts with an earlier one on the same resource when
at least one writes and the earlier epoch is not covered by the current clock: that is a race the GPU is
free to run either way, so it raises `OrderingViolation` the first time it is *issued*, not when it bites.

Happens-before is built from four kinds of edges, and nothing else:
  - program order on each timeline (a stream runs its ops in issue order; so does a host thread);
  - the issue edge: what a host thread did before it enqueued an op (or a record, or a wait) happens
    before that op (a kernel enqueued after a host write to pinned memory sees the write);
  - record -> wait: work after `B.wait(e)` happens after everything before `e = A.record()`;
  - synchronisation: after `e.synchronize()` / `A.synchronize()` returns, the host is after all of it.
Enqueueing an op is *not* an edge from the op to the host: the op has not run yet.

Resources are hashable keys (a buffer's key, ("kv", page_id), (buffer, slot), ...) or byte ranges of a key,
`Span(key, start, end)`. A bare key means all of its bytes, so it overlaps every span of that key.

Per resource we keep the last write and the reads since it, one per timeline (FastTrack's observation:
later reads on a timeline subsume earlier ones, and an ordered write subsumes everything before it). For
byte ranges the key's bytes are split into segments with identical histories, each carrying that state;
a write re-joins the segments it covers, so a key accessed in a few fixed ranges stays a few segments.
The verdict is exact: it equals the transitive closure of the edges above (tests/test_hazard_property.py
checks it against a brute-force graph).
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

# A whole-key access covers [0, WHOLE); no buffer is this large, so spans and whole keys compare uniformly.
WHOLE = 1 << 62


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of the resource `key`: conflicts only with overlapping spans and the whole key
    (an empty span, start == end, conflicts with nothing)."""

    key: Hashable
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end <= WHOLE:
            raise ValueError(f"Span of {self.key!r}: need 0 <= start <= end, got [{self.start}, {self.end})")

    def as_json(self) -> dict:
        return {"key": repr(self.key), "start": self.start, "end": self.end}


Resource = Hashable  # a key, or a Span of one


class OrderingViolation(RuntimeError):
    """Two accesses to one resource, at least one a write, with no happens-before between them."""

    def __init__(self, resource: str, earlier: OpRef, earlier_kind: str, later: OpRef, later_kind: str) -> None:
        super().__init__(
            f"unordered access to {resource}: {later_kind} by {later} has no happens-before with the earlier "
            f"{earlier_kind} by {earlier}; the later op's stream must wait on an event recorded after the "
            "earlier op (or the host must synchronize on it)"
        )
        self.resource = resource
        self.earlier = earlier
        self.later = later


class OpRef(NamedTuple):  # a tuple, not a dataclass: one is made per declared op, on the enqueue path
    """Enough about an op to name it in a violation or a crash dump."""

    timeline: str
    seq: int
    label: str
    lane: object = None

    def __str__(self) -> str:
        lane = "" if self.lane is None else f", lane/request {self.lane}"
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



class _Access(NamedTuple):
    timeline_index: int
    count: int
    op: OpRef


@dataclass
class _State:
    """History of a run of bytes: the last write and, per timeline, the last read since it."""

    last_write: _Access | None = None
    reads: dict[int, _Access] = field(default_factory=dict)

    def copy(self) -> _State:
        return _State(self.last_write, dict(self.reads))


class _Segments:
    """One key's bytes as sorted segments [starts[i], starts[i+1]) (the last one runs to WHOLE)."""

    def __init__(self) -> None:
        self.starts: list[int] = [0]
        self.states: list[_State] = [_State()]

    def split(self, start: int, end: int) -> None:
        """Make `start` and `end` segment bounds (each half keeps the history of the segment split)."""
        self._split(start)
        if end < WHOLE:
            self._split(end)

    def indices(self, start: int, end: int) -> range:
        """The segments that tile [start, end); its ends must already be bounds (see `split`)."""
        starts = self.starts
        if len(starts) == 1:
            return range(0, 1 if start < end else 0)
        return range(bisect_left(starts, start), bisect_left(starts, end) if end < WHOLE else len(starts))

    def bounds(self, i: int) -> tuple[int, int]:
        return self.starts[i], self.starts[i + 1] if i + 1 < len(self.starts) else WHOLE

    def rejoin_written(self, span: range, written: _Access) -> None:
        """After a write, its bytes share one history again."""
        self.starts[span.start + 1 : span.stop] = []
        self.states[span.start : span.stop] = [_State(written)]

    def _split(self, at: int) -> None:
        i = bisect_right(self.starts, at) - 1
        if self.starts[i] != at:
            self.starts.insert(i + 1, at)
            self.states.insert(i + 1, self.states[i].copy())


class Verifier:
    """Checks declared accesses against happens-before. One per StreamSet; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timelines: list[Timeline] = []
        self._host_timelines: dict[int, Timeline] = {}
        self._resources: dict[Hashable, _Segments] = {}
        self.ops_checked = 0

    def timeline(self, name: str) -> Timeline:
        with self._lock:
            return self._new_timeline(name)

    def host(self) -> Timeline:
        """The calling host thread's timeline (made on first use)."""
        with self._lock:
            return self._host()

    def op(
        self,
        tl: Timeline,
        label: str,
        reads: Iterable[Resource] = (),
        writes: Iterable[Resource] = (),
        lane: object = None,
    ) -> OpRef:
        """Declare one op issued on `tl` by the calling host thread. Raises OrderingViolation on the first
        unordered conflict, leaving the history as it was (the op is not recorded)."""
        with self._lock:
            self._issue(tl)
            seq = tl.clock.get(tl.index, 0) + 1
            ref = OpRef(tl.name, seq, label, lane)
            me = _Access(tl.index, seq, ref)
            read_places = [self._place(res) for res in reads]
            write_places = [self._place(res) for res in writes]
            # every split before any indices are taken, so indices stay valid until the first write applies
            for _res, segments, start, end in read_places + write_places:
                if (start, end) != (0, WHOLE):
                    segments.split(start, end)
            clock = tl.clock
            for res, segments, start, end in read_places:
                if len(segments.starts) == 1 and start < end:  # never accessed in part (KV pages, most buffers)
                    _check_segment(clock, res, segments, 0, me, is_write=False)
                else:
                    _check(clock, res, segments, segments.indices(start, end), me, is_write=False)
            for res, segments, start, end in write_places:
                _check(clock, res, segments, segments.indices(start, end), me, is_write=True)
            tl.tick()
            for _res, segments, start, end in read_places:
                if len(segments.starts) == 1 and start < end:
                    segments.states[0].reads[tl.index] = me
                    continue
                for i in segments.indices(start, end):
                    segments.states[i].reads[tl.index] = me
            for _res, segments, start, end in write_places:
                if (start, end) != (0, WHOLE):
                    segments.split(start, end)  # again: an earlier write of this op may have re-joined
                segments.rejoin_written(segments.indices(start, end), me)
            self.ops_checked += 1
            return ref

    def record(self, tl: Timeline) -> dict[int, int]:
        """The clock an event recorded now on stream `tl` carries (the issuing host's past included)."""
        with self._lock:
            self._issue(tl)
            return dict(tl.clock)

    def wait(self, tl: Timeline, event_clock: dict[int, int]) -> None:
        """Stream `tl` waits on an event: its later ops are after everything the event covers."""
        with self._lock:
            self._issue(tl)
            tl.merge(event_clock)

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
                self._resources.pop(res.key if isinstance(res, Span) else res, None)

    def _new_timeline(self, name: str) -> Timeline:
        tl = Timeline(name, len(self._timelines))
        self._timelines.append(tl)
        return tl

    def _host(self) -> Timeline:
        ident = threading.get_ident()
        tl = self._host_timelines.get(ident)
        if tl is None:
            tl = self._host_timelines[ident] = self._new_timeline(f"host:{threading.current_thread().name}")
        return tl

    def _issue(self, tl: Timeline) -> None:
        """The issue edge: the calling host thread's past happens before what it enqueues on `tl`."""
        host = self._host()
        if tl is not host:
            tl.merge(host.clock)

    def _place(self, res: Resource) -> tuple[Resource, _Segments, int, int]:
        """The resource's key history and the bytes it covers."""
        if isinstance(res, Span):
            key, start, end = res.key, res.start, res.end
        else:
            key, start, end = res, 0, WHOLE
        segments = self._resources.get(key)
        if segments is None:
            segments = self._resources[key] = _Segments()
        return res, segments, start, end


def _check(clock: dict[int, int], res: Resource, segments: _Segments, indices: range, me: _Access, is_write: bool) -> None:
    """Raise unless every conflicting earlier access in these segments is covered by `clock`."""
    for i in indices:
        _check_segment(clock, res, segments, i, me, is_write)


def _check_segment(clock: dict[int, int], res: Resource, segments: _Segments, i: int, me: _Access, is_write: bool) -> None:
    state = segments.states[i]
    w = state.last_write
    if w is not None and clock.get(w.timeline_index, 0) < w.count:
        raise OrderingViolation(_describe(res, segments, i), w.op, "write", me.op, "write" if is_write else "read")
    if is_write:
        for r in state.reads.values():
            if clock.get(r.timeline_index, 0) < r.count:
                raise OrderingViolation(_describe(res, segments, i), r.op, "read", me.op, "write")


def _describe(res: Resource, segments: _Segments, segment: int) -> str:
    if not isinstance(res, Span) and len(segments.starts) == 1:
        return repr(res)
    key = res.key if isinstance(res, Span) else res
    start, end = segments.bounds(segment)
    end_text = "end" if end == WHOLE else str(end)
    return f"{key!r} bytes [{start}, {end_text})"
