"""Snapshots: immutable saved Gated DeltaNet states keyed to the prefix cache's page hash chain.

The attention layers' KV can be matched page by page, but a linear-attention state exists only at the
positions where it was saved. A snapshot is the full state (every linear layer's conv window and recurrent
state, one `StateSlotPool` slot's bytes) after the first `position` tokens of a prefix, plus optionally
the main model's last hidden row (the MTP bridge's `h[position - 1]`).

Key (`SnapshotKey`): the chain hash of the last full page before `position` (`parent`, None for the first
page) and the tokens from that page's end up to `position` (`partial`, empty when `position` is a multiple
of the page size). The hash names the whole prefix up to the page; the partial tokens are compared, like a
prefix-cache tail, so a hit is always exact. Correctness rests on tokens only; pages are memory policy:
- `covering_page` is the page holding token `position - 1`: a full page (aligned), or the sequence's
  private tail page (not aligned). When the prefix cache forgets that page (evicted), the snapshot goes too
  (`PrefixCache.on_forget`): without the KV up to `position` a resume could not use it anyway. A page the
  cache never indexes (its tokens were already cached in another page: a prefix recomputed because its
  snapshot was evicted, two lanes computing the same prompt) hands its snapshots over to the page that
  is, when its sequence ends (`pages_dropped`).
- resuming at a non-aligned position needs the KV of the partial tokens: that is the prefix cache's tail
  hit, which the new sequence copies into a private page (kv/cow.py: the COW transaction and its fence);
  `deepest_at_or_before` only returns snapshots at or before the matched length, so that KV is present.

Where snapshots are taken (`snapshot_points`, a pure function the engine calls for each computed span):
at the end of a request's input (the next turn's prompt starts with it), at the end of its generation
(so the next turn does not recompute the assistant reply), at branch points (an admission's match point
past its deepest snapshot: two conversations diverge there), and every `interval` tokens of a long cold
prefill (a later prompt sharing only part of it resumes close to its divergence). The engine cuts prefill
chunks at these points: a state exists only at the end of a computed span.

Eviction: a fixed budget of records (`capacity`; bytes are converted with `records_for_budget`), and
with their covering page (above). Which record a new write takes: a superseded snapshot first, least
recently used first, then any, least recently used first. A snapshot is superseded when the sequence that
restored or wrote it writes a deeper one (`write(..., supersedes=)`): the deeper one's prefix contains it,
so only a request that diverges before the deeper position (a branch off a periodic snapshot) still needs
it. The engine (engine/state_ledger.py) keeps a turn's end of input current beside its end of
generation (`write(..., alternative=)`): the next turn resumes from the latter when the client sends the
reply back unchanged, from the former when it re-renders it differently, and restoring one of the two
supersedes the other (that conversation has shown which of them it takes). Each conversation's two
resume points thus outlive the stale snapshots of every conversation: with N conversations taking turns
and a budget of 2N records, every next turn resumes (tests/test_snapshot_retention.py), where plain LRU,
with 2-3 writes a turn, evicted each conversation's resume points before its next turn. Restoring a
snapshot makes it current again (the restorer supersedes it once it writes past it). Among superseded
snapshots the passed-over alternatives are the oldest, so with 3N records the input end before the last
one survives too: the resume point of a prompt that re-tokenizes the previous prompt's last token
differently (a byte-level BPE merge across the boundary with the reply).

Ordering (rules 4 and 5): `write` (slot -> record) and `restore` (record -> slot) are copies on the given
stream with declared accesses (the slot's span, the record's span). The write records a fence; every
restore first makes its stream wait on it (`_await_write`), so a restore on another stream or lane never
reads a half-written state. Records are handed out like KV pages (a `PagePool`): a restore holds a
reference for its copy and releases it behind a fence recorded after the copy, so an evicted snapshot's
record is reused by a new write only after every queued restore of it (the new write's stream waits).
Written-ness: a snapshot exists only once its write is enqueued, and `write` refuses a slot that holds no
state (StateSlotPool's written-ness), so a restore can never copy a state nobody computed; restoring an
evicted snapshot, or a hidden row it does not hold, raises before anything is enqueued.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.streams import Event, Stream, StreamSet
from ninfer_rt.kv.pages import PagePool
from ninfer_rt.kv.prefix import PrefixCache
from ninfer_rt.kv.states import StateSlotPool, UnwrittenStateError
from ninfer_rt.ordering import Span


class StaleSnapshotError(RuntimeError):
    """A snapshot handle was used after its record was evicted (look it up again)."""


@dataclass(frozen=True)
class SnapshotKey:
    position: int
    parent: int | None  # chain hash of the last full page before `position` (None: none)
    partial: tuple[int, ...]  # tokens after that page, up to `position`

    @classmethod
    def of(cls, hashes: Sequence[int], tokens: Sequence[int], position: int, page_size: int) -> SnapshotKey:
        """The key of the state after `tokens[:position]`, from the chain hashes of its full pages."""
        full = position // page_size
        if len(hashes) < full or len(tokens) < position:
            raise ValueError(f"a snapshot at {position} needs {full} page hashes and {position} tokens")
        return cls(position, hashes[full - 1] if full else None, tuple(tokens[full * page_size : position]))


@dataclass(eq=False)
class Snapshot:
    key: SnapshotKey
    record: int
    covering_page: int | None
    has_hidden: bool
    write_fence: Event  # recorded behind the write's copies
    ident: int = field(default_factory=itertools.count().__next__)
    alive: bool = True
    superseded: bool = False  # a deeper snapshot of the same sequence exists: evicted first
    alternative: Snapshot | None = None  # the same turn's other resume point (end of input / of generation)

    @property
    def position(self) -> int:
        return self.key.position


@dataclass(frozen=True)
class SnapshotStats:
    count: int
    capacity: int
    bytes: int
    restores: int
    evictions: int


def records_for_budget(budget_bytes: int, record_bytes: int) -> int:
    return max(0, budget_bytes // record_bytes)


class SnapshotStore:
    """Up to `capacity` snapshots of `slots`' states, in one device buffer of records."""

    def __init__(self, streams: StreamSet, slots: StateSlotPool, capacity: int, page_size: int, hidden_bytes: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"a snapshot store needs room for at least one snapshot, got {capacity}")
        self.slots = slots
        self.page_size = page_size
        self.capacity = capacity
        self.state_bytes = slots.spec.slot_bytes
        self.hidden_bytes = hidden_bytes
        self.record_bytes = self.state_bytes + hidden_bytes
        self.buffer = DeviceBuffer(streams, capacity * self.record_bytes, "state snapshots")
        self._records = PagePool(capacity)
        self._lru: OrderedDict[int, Snapshot] = OrderedDict()  # least recently used first
        self._by_parent: dict[int | None, list[Snapshot]] = {}
        self._by_page: dict[int, set[Snapshot]] = {}
        self.restores = 0
        self.evictions = 0

    # -- lookup ----------------------------------------------------------------------------------------

    def deepest_at_or_before(self, hashes: Sequence[int], tokens: Sequence[int], match_length: int) -> Snapshot | None:
        """The snapshot at the largest position <= `match_length` whose prefix is `tokens`' prefix.

        `hashes` are the chain hashes of the prompt's matched full pages (PrefixMatch.hashes), `tokens`
        the prompt; `match_length` the tokens whose KV the match supplies (full pages and tail)."""
        for depth in range(min(len(hashes), match_length // self.page_size), -1, -1):
            parent = hashes[depth - 1] if depth else None
            start = depth * self.page_size
            fitting = [
                snap for snap in self._by_parent.get(parent, ())
                if snap.position <= match_length and tuple(tokens[start : snap.position]) == snap.key.partial
            ]
            if fitting:
                return max(fitting, key=lambda snap: snap.position)
        return None

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, key: SnapshotKey) -> Snapshot | None:
        return next((s for s in self._by_parent.get(key.parent, ()) if s.key == key), None)

    # -- device ops ------------------------------------------------------------------------------------

    def write(
        self,
        key: SnapshotKey,
        slot: int,
        stream: Stream,
        *,
        covering_page: int | None,
        hidden: tuple[Buffer, int] | None = None,
        lane: object = None,
        supersedes: Snapshot | None = None,
        alternative: Snapshot | None = None,
    ) -> Snapshot:
        """Save the state in `slot` (and the hidden row at (buffer, offset)) as the snapshot `key`, on
        `stream`, which must already be ordered after the kernel that wrote the slot. An existing snapshot
        of the same key is returned as it is (states of one prefix are equal). `supersedes`: the snapshot
        this sequence last restored or wrote, a prefix of this one, now evicted before the others.
        `alternative`: the end of input this end of generation extends, kept current beside it until a
        restore of either one supersedes the other."""
        if supersedes is not None and supersedes.position < key.position:
            supersedes.superseded = True
        existing = self.find(key)
        if existing is None:
            existing = self._write_record(key, slot, stream, covering_page, hidden, lane)
        else:
            self._touch(existing)
        if alternative is not None and alternative.alive and alternative is not existing:
            _pair(existing, alternative)
        return existing

    def _write_record(
        self, key: SnapshotKey, slot: int, stream: Stream, covering_page: int | None, hidden: tuple[Buffer, int] | None, lane: object
    ) -> Snapshot:
        self.slots.require_written(slot, f"snapshot at position {key.position}")
        if hidden is not None and not self.hidden_bytes:
            raise ValueError("this snapshot store keeps no hidden row (hidden_bytes=0)")
        if not self._records.can_allocate(1):
            self._evict(self._victims()[0])
        [record] = self._records.allocate(1, stream)  # waits on the fences of the record's last readers
        label = f"snapshot write @{key.position} (slot {slot} -> record {record})"
        stream.copy(self.buffer, self.slots.buffer, self.state_bytes, self._offset(record), self.slots.offset(slot), label=label, lane=lane)
        if hidden is not None:
            source, offset = hidden
            stream.copy(self.buffer, source, self.hidden_bytes, self._offset(record) + self.state_bytes, offset, label=f"{label}: hidden row", lane=lane)
        snap = Snapshot(key, record, covering_page, hidden is not None, stream.record())
        self._insert(snap)
        return snap

    def restore(
        self, snap: Snapshot, slot: int, stream: Stream, *, hidden: tuple[Buffer, int] | None = None, lane: object = None
    ) -> None:
        """Copy the snapshot into the (owned) `slot` on `stream`; the slot then holds the state at
        `snap.position`. Two lanes may restore one snapshot, each into its own slot."""
        self._require_restorable(snap, hidden is not None)
        self._records.share([snap.record], stream)  # a reference for the copy: the record outlives it
        self._await_write(snap, stream)
        label = f"snapshot restore @{snap.position} (record {snap.record} -> slot {slot})"
        stream.copy(self.slots.buffer, self.buffer, self.state_bytes, self.slots.offset(slot), self._offset(snap.record), label=label, lane=lane)
        if hidden is not None:
            target, offset = hidden
            stream.copy(target, self.buffer, self.hidden_bytes, offset, self._offset(snap.record) + self.state_bytes, label=f"{label}: hidden row", lane=lane)
        self._records.release([snap.record], stream.record())
        self.slots.mark_written(slot)
        self.restores += 1
        snap.superseded = False
        if snap.alternative is not None:  # this conversation took `snap`: the other resume point is stale
            snap.alternative.superseded = True
        self._touch(snap)

    def resource(self, snap: Snapshot) -> Span:
        start = self._offset(snap.record)
        return Span(self.buffer.resource, start, start + self.record_bytes)

    # -- eviction --------------------------------------------------------------------------------------

    def page_forgotten(self, page: int) -> None:
        """The prefix cache evicted `page`: snapshots it covers go with it (PrefixCache.on_forget)."""
        for snap in list(self._by_page.get(page, ())):
            self._evict(snap)

    def pages_dropped(self, pages: Iterable[int], prefix: PrefixCache) -> None:
        """`pages` left their sequence unindexed (the prefix cache already held the same tokens in another
        page, or nothing keeps them): each snapshot they cover moves to the page that now holds its K/V,
        or goes (without that K/V no resume reaches it, and no page eviction would ever free it)."""
        for page in pages:
            for snap in self._by_page.pop(page, set()):
                snap.covering_page = prefix.page_holding(snap.key.parent, snap.key.partial)
                if snap.covering_page is None:
                    self._evict(snap)
                else:
                    self._by_page.setdefault(snap.covering_page, set()).add(snap)

    def evict(self, n: int) -> int:
        """Drop up to `n` snapshots in eviction order (memory pressure); returns how many."""
        victims = self._victims()[:n]
        for snap in victims:
            self._evict(snap)
        return len(victims)

    def stats(self) -> SnapshotStats:
        return SnapshotStats(len(self._lru), self.capacity, len(self._lru) * self.record_bytes, self.restores, self.evictions)

    def covering_pages(self) -> set[int]:
        """The pages the live snapshots end in: each snapshot goes when the prefix cache forgets its page."""
        return set(self._by_page)

    def records_in_use(self) -> int:
        """Records held: one per live snapshot once no restore is being enqueued (the idle check)."""
        return self._records.stats().in_use

    def free(self) -> None:
        self.buffer.free()

    # -- internals -------------------------------------------------------------------------------------

    def _await_write(self, snap: Snapshot, stream: Stream) -> None:
        stream.wait(snap.write_fence)

    def _require_restorable(self, snap: Snapshot, with_hidden: bool) -> None:
        if not snap.alive:
            raise StaleSnapshotError(f"snapshot at position {snap.position} was evicted; look the prefix up again")
        if with_hidden and not snap.has_hidden:
            raise UnwrittenStateError(f"snapshot at position {snap.position} holds no hidden row")

    def _offset(self, record: int) -> int:
        return record * self.record_bytes

    def _insert(self, snap: Snapshot) -> None:
        self._lru[snap.ident] = snap
        self._by_parent.setdefault(snap.key.parent, []).append(snap)
        if snap.covering_page is not None:
            self._by_page.setdefault(snap.covering_page, set()).add(snap)

    def _victims(self) -> list[Snapshot]:
        """Every snapshot in eviction order: superseded ones first, each group least recently used first."""
        return sorted(self._lru.values(), key=lambda snap: not snap.superseded)  # stable: LRU within a group

    def _touch(self, snap: Snapshot) -> None:
        self._lru.move_to_end(snap.ident)

    def _evict(self, snap: Snapshot) -> None:
        """Forget the snapshot; its record is free once its write (and every restore) has run."""
        del self._lru[snap.ident]
        siblings = self._by_parent[snap.key.parent]
        siblings.remove(snap)
        if not siblings:
            del self._by_parent[snap.key.parent]
        if snap.covering_page is not None:
            covered = self._by_page[snap.covering_page]
            covered.discard(snap)
            if not covered:
                del self._by_page[snap.covering_page]
        snap.alive = False
        _unpair(snap)
        self._records.release([snap.record], snap.write_fence)
        self.evictions += 1


def _pair(a: Snapshot, b: Snapshot) -> None:
    _unpair(a)
    _unpair(b)
    a.alternative, b.alternative = b, a


def _unpair(snap: Snapshot) -> None:
    if snap.alternative is not None:
        snap.alternative.alternative = None
        snap.alternative = None


def snapshot_points(
    start: int,
    end: int,
    *,
    input_end: int,
    interval: int,
    branch_points: Iterable[int] = (),
    generation_end: int | None = None,
) -> list[int]:
    """Positions in (start, end] where the state should be saved, for a span of tokens [start, end) that
    is about to be computed: `input_end` (the prompt's length), `generation_end` (the processed length at
    finish, when known), the `branch_points`, and multiples of `interval` (0: never) up to the input's end
    when the prompt is longer than `interval` (a cold prefill of it crosses several; a warm turn's short
    recompute rarely one). The engine ends a chunk at each point and writes a snapshot there."""
    if not 0 <= start <= end:
        raise ValueError(f"span [{start}, {end}) is not a span of positions")
    points = {input_end, *branch_points}
    if generation_end is not None:
        points.add(generation_end)
    if interval > 0 and input_end > interval:
        points.update(range(interval * (start // interval + 1), min(end, input_end) + 1, interval))
    return sorted(p for p in points if start < p <= end)
