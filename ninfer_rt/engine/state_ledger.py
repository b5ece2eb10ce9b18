"""The state side of the ledger: one StateRing (kv/states_verify.py) per running request of a hybrid model,
and the snapshots (kv/snapshots.py) that let a later request resume a prefix without recomputing it.

A hybrid's linear-attention layers carry each sequence's recurrent state in a state slot; with `--spec mtp`
a sequence owns a ring of 1 + draft_tokens slots (per-position verify states, docs/state-cache.md), else
one. The KV ledger (kv_ledger.py) drives this one at the same moments it drives the pages:

- `resume_point(match, tokens)`: the deepest snapshot at or before the KV match; the KV ledger cuts the
  match there (a state exists only where it was saved).
- `admit(request, start, snapshot, match_end)`: a ring for the request, holding the state at `start`: the
  snapshot restored into the live slot, or the empty prefix's zeros when start is 0 (declared ops on the
  compute stream). A match that reaches past `start` is a branch point: the state there is saved on the
  way, so the next request sharing that prefix resumes from it.
- `chunk_limit(request, start, size)`: a prefill chunk ends at the next snapshot point (snapshot_points:
  the end of the input, branch points, every `interval` tokens of a long prompt), since a state exists
  only at the end of a computed span.
- `begin(request, saved, rows)` before a step's forward: (the slot the pass reads, the slots receiving the
  states after its last `saved` rows). A prefill chunk or a plain decode saves 1, in place; a verify pass
  of 1 + k rows saves 1 + k. `StateRows.end()` once the forward is enqueued advances the known position.
- `accept(request, accepted)` after verification: the state after the pass's first row plus `accepted`
  drafts becomes the live one (an index swap, declared on the compute stream).
- `saved(request, seq)` after a step's tokens are committed: writes a snapshot when the state's position
  is a snapshot point; `release(request, fence, seq)` writes the end-of-generation snapshot first (when
  the state is exactly the committed tokens'), then returns the ring behind the pages' fence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_rt.cuda.streams import Event, Stream
from ninfer_rt.engine.request import Request
from ninfer_rt.kv.prefix import PrefixCache, PrefixMatch
from ninfer_rt.kv.sequence import SequenceKV
from ninfer_rt.kv.snapshots import Snapshot, SnapshotKey, SnapshotStore, snapshot_points
from ninfer_rt.kv.states import SlotStats, StateSlotPool
from ninfer_rt.kv.states_verify import StateRing


@dataclass
class _Tracked:
    """A running request's ring and the position its live state is at (tokens it covers)."""

    ring: StateRing
    position: int
    input_end: int
    branch_points: set[int] = field(default_factory=set)
    pass_start: int = 0  # position before the pending verify pass
    last_snapshot: Snapshot | None = None  # restored or written: a prefix of the state, superseded by the next write


@dataclass(frozen=True)
class StateRows:
    """One sequence's state arguments of a step (StepBatch.state_slots / state_targets entries)."""

    slot: int  # holds the state before the step
    targets: list[int]  # receive the states after the last len(targets) rows
    tracked: _Tracked
    rows: int

    def end(self) -> None:
        """The forward that reads `slot` and writes `targets` is enqueued: the targets hold states."""
        self.tracked.ring.end(self.targets)
        if len(self.targets) == 1:
            self.tracked.position += self.rows
        else:  # a verify pass: the position is known once its accept chose a state
            self.tracked.pass_start = self.tracked.position


@dataclass
class SnapshotCounters:
    resumed_tokens: int = 0  # prompt tokens whose compute a restored snapshot skipped
    writes: int = 0


class StateLedger:
    def __init__(
        self, pool: StateSlotPool, ring_depth: int, compute: Stream,
        snapshots: SnapshotStore | None = None, interval: int = 0,
    ) -> None:
        if ring_depth < 1:
            raise ValueError(f"a state ring needs at least the live slot, got depth {ring_depth}")
        self.pool = pool
        self.ring_depth = ring_depth
        self.compute = compute
        self.snapshots = snapshots  # None: prefix caching off, nothing is saved or resumed
        self.interval = interval
        self.counters = SnapshotCounters()
        self.tracked: dict[str, _Tracked] = {}

    # -- admission -------------------------------------------------------------------------------------

    def can_admit(self) -> bool:
        return self.pool.can_acquire(self.ring_depth)

    def resume_point(self, match: PrefixMatch, tokens: list[int]) -> Snapshot | None:
        if self.snapshots is None:
            return None
        return self.snapshots.deepest_at_or_before(match.hashes, tokens, match.num_tokens)

    def admit(self, request: Request, start: int, snapshot: Snapshot | None = None, match_end: int = 0) -> None:
        if (snapshot.position if snapshot is not None else 0) != start:
            raise ValueError(f"{request.request_id}: no state is known at position {start}")
        lane = request.request_id
        ring = StateRing(self.pool, self.ring_depth, self.compute, lane=lane)
        if snapshot is None:
            self.pool.zero(ring.live_slot, self.compute, lane=lane)
        else:
            self.snapshots.restore(snapshot, ring.live_slot, self.compute, lane=lane)
            self.counters.resumed_tokens += start
        tracked = _Tracked(ring, start, len(request.prompt_ids), last_snapshot=snapshot)
        if match_end > start:
            tracked.branch_points.add(match_end)
        self.tracked[request.request_id] = tracked

    def chunk_limit(self, request: Request, start: int, size: int) -> int:
        """`size` cut so the chunk [start, start + size) ends at the first snapshot point inside it."""
        tracked = self.tracked[request.request_id]
        if self.snapshots is None or start >= tracked.input_end:
            return size
        points = snapshot_points(
            start, start + size, input_end=tracked.input_end, interval=self.interval, branch_points=tracked.branch_points
        )
        return points[0] - start if points else size

    # -- steps -----------------------------------------------------------------------------------------

    def begin(self, request: Request, saved: int = 1, rows: int = 1) -> StateRows:
        tracked = self.tracked[request.request_id]
        slot = tracked.ring.live_slot
        return StateRows(slot, tracked.ring.begin(self.compute, saved), tracked, rows)

    def accept(self, request: Request, accepted: int) -> None:
        tracked = self.tracked[request.request_id]
        if tracked.ring.awaiting_accept:
            tracked.ring.accept(accepted, self.compute)
            tracked.position = tracked.pass_start + 1 + accepted

    def live_slot(self, request: Request) -> int:
        return self.tracked[request.request_id].ring.live_slot

    def saved(self, request: Request, seq: SequenceKV) -> None:
        """The step's tokens are committed: save the state if it sits at a snapshot point of the input."""
        tracked = self.tracked[request.request_id]
        at = tracked.position
        if at == 0 or at != seq.num_tokens or tracked.ring.awaiting_accept:
            return
        points = snapshot_points(
            at - 1, at, input_end=tracked.input_end, interval=self.interval, branch_points=tracked.branch_points
        )
        if points:
            self._write(tracked, seq, at, request.request_id)

    # -- retirement ------------------------------------------------------------------------------------

    def release(self, request: Request, fence: Event, seq: SequenceKV | None = None, finished: bool = False) -> None:
        """Give the ring back behind `fence`; a finished request's state is saved first (end of generation),
        when it is exactly the state of the committed tokens (not a step ahead of them, nor undecided)."""
        tracked = self.tracked.pop(request.request_id, None)
        if tracked is None:
            return
        if finished and seq is not None and tracked.position == seq.num_tokens and not tracked.ring.awaiting_accept:
            # the end of input stays current beside it: a client that re-renders the reply differently
            # (dropped or edited reasoning) resumes there
            self._write(tracked, seq, tracked.position, request.request_id, supersede=False, alternative=True)
        tracked.ring.release(fence if self.snapshots is None else self.compute.record())

    def pages_dropped(self, pages: list[int], prefix: PrefixCache) -> None:
        """A released sequence's pages the prefix cache does not index: their snapshots move or go."""
        if self.snapshots is not None:
            self.snapshots.pages_dropped(pages, prefix)

    def stats(self) -> SlotStats:
        return self.pool.stats()

    def _write(
        self, tracked: _Tracked, seq: SequenceKV, position: int, lane: str, supersede: bool = True, alternative: bool = False
    ) -> None:
        if self.snapshots is None or position == 0 or not seq.pages:
            return
        key = SnapshotKey.of(seq.hashes, seq.token_ids, position, self.snapshots.page_size)
        covering = seq.pages[(position - 1) // self.snapshots.page_size]
        tracked.last_snapshot = self.snapshots.write(
            key, tracked.ring.live_slot, self.compute, covering_page=covering, lane=lane,
            supersedes=tracked.last_snapshot if supersede else None,
            alternative=tracked.last_snapshot if alternative else None,
        )
        self.counters.writes += 1
