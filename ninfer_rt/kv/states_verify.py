"""StateRing: a running sequence's live Gated DeltaNet state, plus its verify slots for speculation.

Speculative rollback by per-position slots (the decision and its numbers: docs/state-cache.md). A
sequence decoding with k drafts owns a ring of k + 1 slots, one of them live. A verify pass over k + 1
tokens reads the live state and writes the state after its token t into `targets[t]`; the last target is
the live slot itself (the kernel has loaded each state tile before it stores any, and the state before the
pass is never needed again: the pass's first token is always kept). Accepting a drafts keeps the state
after token a: `accept(a)` makes `targets[a]` the live slot by index, copying nothing. Each target is
exactly what a plain decode of those tokens writes (same recurrent form, conv window included), so the
live state after a rollback equals plain decoding bit for bit.

A prefill chunk or a plain decode step keeps only its final state: `begin(stream, saved=1)` targets the
live slot (in place) and needs no accept. A ring of depth 1 is a sequence without speculation.

Ordering: a pass declares `pass_reads()` / `pass_writes(targets)` (the live slot and the live-index
resource; the targets). `accept` is a declared op on the stream that learned `a`: it reads the chosen slot
(ordered after the pass that wrote it) and writes the sequence's live index, the entry the next step's
slot table publishes to the kernels (rule 3). The next `begin` makes its stream wait on the accept, so the
next pass cannot rewrite a slot the accept still reads (tests/test_hazard_states.py injects that bug).
Abort and preemption `release` every slot of the ring behind one fence.
"""

from __future__ import annotations

import itertools

from ninfer_rt.cuda.streams import Event, Stream
from ninfer_rt.kv.states import OutOfStateSlots, StateSlotPool, UnwrittenStateError
from ninfer_rt.ordering import Span

_ring_ids = itertools.count()


class RingStateError(RuntimeError):
    """A pass or an accept out of turn: accept without a pass, a new pass before the accept, ..."""


class StateRing:
    def __init__(self, pool: StateSlotPool, depth: int, stream: Stream, *, lane: object = None) -> None:
        if depth < 1:
            raise ValueError(f"a state ring needs at least the live slot, got depth {depth}")
        if not pool.can_acquire(depth):
            raise OutOfStateSlots(f"a ring of {depth} state slots does not fit: {pool.stats()}")
        self.pool = pool
        self.lane = lane
        self.slots = [pool.acquire(stream) for _ in range(depth)]
        self.index_resource = ("state live index", next(_ring_ids))
        self._live = 0
        self._pending: list[int] | None = None  # targets of a multi-position pass awaiting accept
        self._accept_fence: Event | None = None

    @property
    def depth(self) -> int:
        return len(self.slots)

    @property
    def live_slot(self) -> int:
        """The slot holding the sequence's state (snapshot writes read it, restores write it)."""
        if self._pending is not None:
            raise RingStateError("the state is undecided until the verify pass's accept")
        return self.slots[self._live]

    @property
    def awaiting_accept(self) -> bool:
        return self._pending is not None

    # -- the pass --------------------------------------------------------------------------------------

    def begin(self, stream: Stream, saved: int = 1) -> list[int]:
        """Slots the next pass on `stream` writes: the states after its last `saved` tokens, in order; the
        last one is the live slot. `stream` is ordered after the previous accept before this returns."""
        if self._pending is not None:
            raise RingStateError("the previous verify pass was not accepted yet")
        if not 1 <= saved <= self.depth:
            raise ValueError(f"a pass can save 1..{self.depth} states in this ring, not {saved}")
        self.pool.require_written(self.slots[self._live], "verify pass input")
        if self._accept_fence is not None:
            self._await_accept(stream)
        offset = self._live + 1 + self.depth - saved
        return [self.slots[(offset + t) % self.depth] for t in range(saved)]

    def pass_reads(self) -> list[Span | tuple]:
        return [self.pool.resource(self.slots[self._live]), self.index_resource]

    def pass_writes(self, targets: list[int]) -> list[Span]:
        return [self.pool.resource(slot) for slot in targets]

    def end(self, targets: list[int]) -> None:
        """The pass that `begin` planned was enqueued: its targets now hold states."""
        for slot in targets:
            self.pool.mark_written(slot)
        if len(targets) > 1:
            self._pending = targets

    def accept(self, accepted: int, stream: Stream) -> int:
        """Keep the state after token `accepted` of the pending pass (0 = only its first token); returns
        the new live slot. A declared op on `stream`, which must be ordered after the pass."""
        targets = self._pending
        if targets is None:
            raise RingStateError("accept without a verify pass to choose from")
        if not 0 <= accepted < len(targets):
            raise ValueError(f"accepted {accepted} of a pass that saved {len(targets)} states")
        chosen = targets[accepted]
        if not self.pool.is_written(chosen):
            raise UnwrittenStateError(f"verify slot {chosen} holds no state")
        stream.declare(
            f"state accept {accepted} (live slot {self.slots[self._live]} -> {chosen})",
            reads=[self.pool.resource(chosen)],
            writes=[self.index_resource],
            lane=self.lane,
        )
        self._live = self.slots.index(chosen)
        self._pending = None
        self._accept_fence = stream.record()
        return chosen

    # -- retirement ------------------------------------------------------------------------------------

    def release(self, fence: Event) -> None:
        """Finish, abort or preemption: every slot back to the pool behind `fence` (recorded after the last
        op on any of them, on the stream of the last pass, snapshot write or accept)."""
        for slot in self.slots:
            self.pool.release(slot, fence)
        self.slots = []
        self._pending = None

    def _await_accept(self, stream: Stream) -> None:
        stream.wait(self._accept_fence)
