"""The state cache's hazards, injected into the real StateSlotPool / SnapshotStore / StateRing code.

Each scenario runs once with the bug injected (the verifier must raise OrderingViolation) and once as
written (clean). The property test over the whole lifecycle is tests/test_hazard_states_property.py.
"""

from __future__ import annotations

import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv.pages import PagePool
from ninfer_rt.kv.snapshots import SnapshotKey, SnapshotStore
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.kv.states_verify import StateRing
from ninfer_rt.ordering import OrderingViolation
from tests.state_helpers import TINY_SPEC, run_pass, start_empty

PAGE = 4
PROMPT = list(range(1, 11))


def states(streams: StreamSet, snapshots: int = 2) -> tuple[StateSlotPool, SnapshotStore]:
    pool = StateSlotPool(streams, TINY_SPEC, 8)
    return pool, SnapshotStore(streams, pool, snapshots, PAGE)


def key(position: int, tokens: list[int] = PROMPT) -> SnapshotKey:
    return SnapshotKey(position, None, tuple(tokens[:position]))  # positions < PAGE * 1 need no hashes


def skip(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> None:
    monkeypatch.setattr(cls, method, lambda *args: None)


# --- 1. a restore on a stream that does not wait for the snapshot's write ------------------------------


def restore_on_the_copy_stream(streams: StreamSet) -> None:
    """Turn 1 ends: its state is saved on the compute stream. Turn 2's restore runs on the copy stream."""
    compute, copy = streams.create("compute"), streams.create("copy")
    pool, store = states(streams)
    turn1 = StateRing(pool, 1, compute)
    start_empty(turn1, compute)
    run_pass(turn1, compute, PROMPT[:3])
    snap = store.write(key(3), turn1.live_slot, compute, covering_page=None)
    turn2 = StateRing(pool, 1, copy)
    store.restore(snap, turn2.live_slot, copy)


def test_hazard_restore_not_waiting_for_the_snapshot_write_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    skip(monkeypatch, SnapshotStore, "_await_write")
    with pytest.raises(OrderingViolation, match=r"snapshot restore @3.*snapshot write @3"):
        restore_on_the_copy_stream(StreamSet(verify=True))


def test_hazard_restore_after_the_snapshot_write_is_clean() -> None:
    restore_on_the_copy_stream(StreamSet(verify=True))


# --- 2. a snapshot freed, and its record rewritten, while a queued restore reads it --------------------


def evict_while_restoring(streams: StreamSet) -> None:
    """Lane B restores the only record; memory pressure evicts it and lane A writes a new snapshot there."""
    lane_a, lane_b = streams.create("lane-a"), streams.create("lane-b")
    pool, store = states(streams, snapshots=1)
    seq_a = StateRing(pool, 1, lane_a, lane="a")
    start_empty(seq_a, lane_a)
    run_pass(seq_a, lane_a, PROMPT[:2])
    snap = store.write(key(2), seq_a.live_slot, lane_a, covering_page=None, lane="a")
    seq_b = StateRing(pool, 1, lane_b, lane="b")
    store.restore(snap, seq_b.live_slot, lane_b, lane="b")
    run_pass(seq_a, lane_a, PROMPT[2:3])
    store.write(key(3), seq_a.live_slot, lane_a, covering_page=None, lane="a")  # evicts `snap`, reuses its record
    assert not snap.alive and len(store) == 1


def test_hazard_snapshot_record_reused_under_a_queued_restore_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    skip(monkeypatch, PagePool, "_wait_for_fences")
    with pytest.raises(OrderingViolation, match=r"snapshot write @3.*snapshot restore @2"):
        evict_while_restoring(StreamSet(verify=True))


def test_hazard_snapshot_record_reused_after_its_restores_is_clean() -> None:
    evict_while_restoring(StreamSet(verify=True))


# --- 3. lane B restoring a snapshot that lane A's cold prefill is still writing -----------------------


def concurrent_cold_prefill(streams: StreamSet) -> None:
    """Lane A prefills the shared prompt in chunks, saving the state at each chunk end; lane B, admitted
    with the same prompt, resumes from the deepest snapshot. B orders itself after A's chunk (the event
    A records when the chunk's compute is enqueued): only the snapshot's own fence covers its copy."""
    lane_a, lane_b = streams.create("lane-a"), streams.create("lane-b")
    pool, store = states(streams)
    seq_a = StateRing(pool, 1, lane_a, lane="a")
    start_empty(seq_a, lane_a)
    run_pass(seq_a, lane_a, PROMPT[:3], label="lane A prefill chunk")
    chunk_done = lane_a.record()
    store.write(key(3), seq_a.live_slot, lane_a, covering_page=None, lane="a")
    run_pass(seq_a, lane_a, PROMPT[3:], label="lane A prefill chunk")

    seq_b = StateRing(pool, 1, lane_b, lane="b")
    lane_b.wait(chunk_done)
    snap = store.deepest_at_or_before([], PROMPT, 3)
    store.restore(snap, seq_b.live_slot, lane_b, lane="b")
    run_pass(seq_b, lane_b, PROMPT[3:5], label="lane B recompute")


def test_hazard_lane_b_restoring_a_snapshot_lane_a_is_writing_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    skip(monkeypatch, SnapshotStore, "_await_write")
    with pytest.raises(OrderingViolation, match=r"lane/request b.*lane/request a"):
        concurrent_cold_prefill(StreamSet(verify=True))


def test_hazard_lane_b_restoring_after_lane_a_wrote_is_clean() -> None:
    concurrent_cold_prefill(StreamSet(verify=True))


# --- 4. a rollback reading a verify slot that the next step already rewrote ----------------------------


def accept_on_the_sampler_stream(streams: StreamSet) -> None:
    """Verify 3 drafts on the compute stream; the sampler stream learns a = 1 and accepts; the next
    verify pass rewrites every slot of the ring (the accepted one in place). Unordered with the accept,
    the pass both reads the live index the accept wrote and rewrites the slot it read; the verifier names
    the first of the two conflicts it checks (the read)."""
    compute, sampler = streams.create("compute"), streams.create("sampler")
    pool, _ = states(streams)
    ring = StateRing(pool, 4, compute)
    start_empty(ring, compute)
    run_pass(ring, compute, [5, 6, 7, 8], saved=4, label="verify step 1")
    sampler.wait(compute.record())
    ring.accept(1, sampler)
    run_pass(ring, compute, [9, 10, 11, 12], saved=4, label="verify step 2")


def test_hazard_rollback_slot_rewritten_by_the_next_step_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    skip(monkeypatch, StateRing, "_await_accept")
    with pytest.raises(OrderingViolation, match=r"verify step 2.*state accept 1"):
        accept_on_the_sampler_stream(StreamSet(verify=True))


def test_hazard_rollback_before_the_next_step_is_clean() -> None:
    accept_on_the_sampler_stream(StreamSet(verify=True))
