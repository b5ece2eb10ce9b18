"""The state cache's hazards, injected into the real StateSlotPool / SnapshotStore / StateRing code.

Each scenario runs once with the bug injected (the verifier must raise OrderingViolation) and once as
written (clean). Then a property test drives the whole lifecycle with two lanes on two streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.kv.pages import PagePool
from ninfer_rt.kv.prefix import PrefixCache
from ninfer_rt.kv.snapshots import Snapshot, SnapshotKey, SnapshotStore, StaleSnapshotError, snapshot_points
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.kv.states_verify import StateRing
from ninfer_rt.ordering import OrderingViolation
from tests.state_helpers import TINY_SPEC, expected_state, read_state, run_pass, same_state, start_empty

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


# --- the whole lifecycle, two lanes on two streams: no leaks, exact states, a clean verifier -----------

PROMPTS = (
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6],  # the next turn of the first
    [3, 1, 4, 1, 5, 9, 2, 6, 1, 1, 2, 3],  # a branch of the first after two pages
    [2, 7, 1, 8, 2, 8, 1, 8, 2, 8],
)
INTERVAL = 8  # periodic snapshots of "long" cold prefills, at toy scale
DRAFTS = 3


@dataclass
class Running:
    stream: Stream
    prompt: list[int]
    ring: StateRing
    pages: list[int]
    hashes: list[int]
    tokens: list[int]  # processed: the ring's live state is the state after exactly these


class Lifecycle:
    """Drives the real pool, store, page pool and prefix cache the way the engine will."""

    def __init__(self) -> None:
        self.streams = StreamSet(verify=True)
        self.lanes = [self.streams.create("lane-a"), self.streams.create("lane-b")]
        self.pool = StateSlotPool(self.streams, TINY_SPEC, 2 * (DRAFTS + 1))
        self.store = SnapshotStore(self.streams, self.pool, 3, PAGE)
        self.pages = PagePool(24)
        self.prefix = PrefixCache(self.pages, PAGE)
        self.prefix.on_forget(self.store.page_forgotten)
        self.running: list[Running | None] = [None, None]
        self.old_snapshots: list[Snapshot] = []

    def admit(self, lane: int, choice: int) -> None:
        prompt, speculative = PROMPTS[choice % len(PROMPTS)], choice >= len(PROMPTS)
        depth = DRAFTS + 1 if speculative else 1
        if self.running[lane] is not None or not self.pool.can_acquire(depth):
            return
        stream = self.lanes[lane]
        match = self.prefix.match(prompt[:-1])
        self.pages.share(match.pages, stream)
        ring = StateRing(self.pool, depth, stream, lane=lane)
        snap = self.store.deepest_at_or_before(match.hashes, prompt, len(match.pages) * PAGE)
        if snap is None:
            start_empty(ring, stream)
        else:
            self.store.restore(snap, ring.live_slot, stream, lane=lane)
            self.old_snapshots.append(snap)
        seq = Running(stream, prompt, ring, list(match.pages), list(match.hashes), prompt[: snap.position if snap else 0])
        assert same_state(read_state(self.pool, ring.live_slot), expected_state(TINY_SPEC, seq.tokens))
        self.running[lane] = seq

    def extend(self, lane: int, n: int) -> None:
        """Prefill the next tokens up to the next snapshot point (then save it), or decode one token."""
        seq = self.running[lane]
        if seq is None:
            return
        start = len(seq.tokens)
        if start < len(seq.prompt):
            end = min(len(seq.prompt), start + 1 + 2 * n)
            end = (snapshot_points(start, end, input_end=len(seq.prompt), interval=INTERVAL) or [end])[0]
            new = seq.prompt[start:end]
        else:
            new = [1 + sum(seq.tokens) % 19]
        self._compute(seq, new, saved=1)
        if len(seq.tokens) in snapshot_points(start, len(seq.tokens), input_end=len(seq.prompt), interval=INTERVAL):
            self.snapshot(lane)

    def speculate(self, lane: int, accepted: int) -> None:
        seq = self.running[lane]
        if seq is None or seq.ring.depth == 1 or len(seq.tokens) < len(seq.prompt):
            return
        drafts = [1 + (sum(seq.tokens) + i) % 19 for i in range(DRAFTS + 1)]
        self._grow(seq, len(drafts))
        run_pass(seq.ring, seq.stream, drafts, saved=len(drafts), label="verify")
        seq.ring.accept(accepted % len(drafts), seq.stream)
        self._commit(seq, drafts[: 1 + accepted % len(drafts)])

    def branch(self, lane: int, _arg: int) -> None:
        """A branch point: save the state where the sequence stands."""
        self.snapshot(lane)

    def snapshot(self, lane: int) -> None:
        seq = self.running[lane]
        if seq is None or not seq.tokens:
            return
        position = len(seq.tokens)
        key = SnapshotKey.of(seq.hashes, seq.tokens, position, PAGE)
        self.store.write(key, seq.ring.live_slot, seq.stream, covering_page=seq.pages[(position - 1) // PAGE], lane=lane)

    def retire(self, lane: int, how: int) -> None:
        """0: finish (end-of-generation snapshot, tail catalogued), 1: preemption (tail catalogued), 2: abort."""
        seq = self.running[lane]
        if seq is None:
            return
        if how % 3 == 0:
            self.snapshot(lane)
        stored = len(seq.tokens) % PAGE
        if how % 3 < 2 and stored and len(seq.pages) > len(seq.hashes):
            self.prefix.insert_tail(seq.hashes[-1] if seq.hashes else None, seq.tokens[-stored:], seq.pages[len(seq.hashes)])
        fence = seq.stream.record()
        self.pages.release(reversed(seq.pages), fence)
        seq.ring.release(fence)
        self.running[lane] = None

    def evict(self, _lane: int, n: int) -> None:
        self.pages.evict(1 + n % 3)
        if n % 2:
            self.store.evict(1)

    def restore_stale(self, lane: int, index: int) -> None:
        dead = [snap for snap in self.old_snapshots if not snap.alive]
        seq = self.running[lane]
        if dead and seq is not None and seq.ring.depth == 1:
            with pytest.raises(StaleSnapshotError):
                self.store.restore(dead[index % len(dead)], seq.ring.live_slot, seq.stream)

    def idle(self) -> None:
        for lane in (0, 1):
            self.retire(lane, 0)
        slots = self.pool.stats()
        assert slots.in_use == 0 and slots.balanced, slots
        assert self.store.records_in_use() == len(self.store) <= self.store.capacity
        pages = self.pages.stats()
        assert pages.in_use == 0 and pages.balanced and pages.cached == len(self.prefix), pages

    def _compute(self, seq: Running, new: list[int], saved: int) -> None:
        self._grow(seq, len(new))
        run_pass(seq.ring, seq.stream, new, saved=saved)
        self._commit(seq, new)

    def _grow(self, seq: Running, n: int) -> None:
        needed = -(-(len(seq.tokens) + n) // PAGE) - len(seq.pages)
        if needed > 0:
            seq.pages += self.pages.allocate(needed, seq.stream)

    def _commit(self, seq: Running, tokens: list[int]) -> None:
        seq.tokens += tokens
        for index in range(len(seq.hashes), len(seq.tokens) // PAGE):
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.append(self.prefix.insert_full(parent, seq.tokens[index * PAGE : (index + 1) * PAGE], seq.pages[index]))
        assert same_state(read_state(self.pool, seq.ring.live_slot), expected_state(TINY_SPEC, seq.tokens))


OPS = ("admit", "admit", "extend", "extend", "extend", "speculate", "speculate", "branch", "retire", "evict", "restore_stale")
programs = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1), st.integers(0, 2 * len(PROMPTS) - 1)), max_size=50)


@settings(max_examples=150, deadline=None)
@given(programs)
def test_hazard_state_lifecycle_never_leaks_never_restores_garbage_and_stays_ordered(program: list[tuple[str, int, int]]) -> None:
    world = Lifecycle()
    for op, lane, arg in program:
        getattr(world, op)(lane, arg)
    world.idle()
