"""The state side of the ledger: one StateRing (kv/states_verify.py) per running request of a hybrid model.

A hybrid's linear-attention layers carry each sequence's recurrent state in a state slot; with `--spec mtp`
a sequence owns a ring of 1 + draft_tokens slots (per-position verify states, docs/state-cache.md), else
one. The KV ledger (kv_ledger.py) drives this one at the same moments it drives the pages:

- `admit(request, start)`: a ring for the request. The state at `start` must be known: 0, the empty
  prefix, whose state is zeroed now by a declared memset on the compute stream. (A snapshot restore
  would supply a state at start > 0: SnapshotStore.deepest_at_or_before, then SnapshotStore.restore into
  `live_slot(request)`; until that is wired the KV ledger matches no prefix for a hybrid.)
- `begin(request, saved)` before a step's forward: (the slot the pass reads, the slots receiving the
  states after its last `saved` rows). A prefill chunk or a plain decode saves 1, in place in the live
  slot, so a chunked prefill carries its state from chunk to chunk; a verify pass of 1 + k rows saves
  1 + k. `StateRows.end()` once the forward is enqueued (its targets now hold states).
- `accept(request, accepted)` after verification: the state after the pass's first row plus `accepted`
  drafts becomes the live one (an index swap, declared on the compute stream); a no-op without a
  pending verify pass.
- `release(request, fence)`: finish, abort and preemption; the fence is the one the pages go back
  behind (recorded on the compute stream after the last step that read or wrote the slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.cuda.streams import Event, Stream
from ninfer_rt.engine.request import Request
from ninfer_rt.kv.states import SlotStats, StateSlotPool
from ninfer_rt.kv.states_verify import StateRing


@dataclass(frozen=True)
class StateRows:
    """One sequence's state arguments of a step (StepBatch.state_slots / state_targets entries)."""

    slot: int  # holds the state before the step
    targets: list[int]  # receive the states after the last len(targets) rows
    ring: StateRing

    def end(self) -> None:
        """The forward that reads `slot` and writes `targets` is enqueued: the targets hold states."""
        self.ring.end(self.targets)


class StateLedger:
    def __init__(self, pool: StateSlotPool, ring_depth: int, compute: Stream) -> None:
        if ring_depth < 1:
            raise ValueError(f"a state ring needs at least the live slot, got depth {ring_depth}")
        self.pool = pool
        self.ring_depth = ring_depth
        self.compute = compute
        self.rings: dict[str, StateRing] = {}

    def can_admit(self) -> bool:
        return self.pool.can_acquire(self.ring_depth)

    def admit(self, request: Request, start: int) -> None:
        if start != 0:
            raise ValueError(f"{request.request_id}: no state is known at position {start} (only at 0)")
        ring = StateRing(self.pool, self.ring_depth, self.compute, lane=request.request_id)
        self.pool.zero(ring.live_slot, self.compute, lane=request.request_id)
        self.rings[request.request_id] = ring

    def begin(self, request: Request, saved: int = 1) -> StateRows:
        ring = self.rings[request.request_id]
        slot = ring.live_slot
        return StateRows(slot, ring.begin(self.compute, saved), ring)

    def accept(self, request: Request, accepted: int) -> None:
        ring = self.rings[request.request_id]
        if ring.awaiting_accept:
            ring.accept(accepted, self.compute)

    def live_slot(self, request: Request) -> int:
        return self.rings[request.request_id].live_slot

    def release(self, request: Request, fence: Event) -> None:
        ring = self.rings.pop(request.request_id, None)
        if ring is not None:
            ring.release(fence)

    def stats(self) -> SlotStats:
        return self.pool.stats()
