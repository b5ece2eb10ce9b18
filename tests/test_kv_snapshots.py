"""SnapshotStore: keys on the hash chain, deepest lookup, LRU and page-tied eviction, restores, policy."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.kv.pages import PagePool
from ninfer_rt.kv.prefix import PrefixCache, chain_hash
from ninfer_rt.kv.snapshots import SnapshotKey, SnapshotStore, StaleSnapshotError, records_for_budget, snapshot_points
from ninfer_rt.kv.states import StateSlotPool, UnwrittenStateError
from ninfer_rt.kv.states_verify import StateRing
from tests.state_helpers import TINY_SPEC, expected_state, read_state, run_pass, same_state, start_empty

PAGE = 4
TOKENS = [7, 1, 4, 2, 9, 9, 3, 5, 8, 6, 2, 1]


def hashes(tokens: list[int], pages: int) -> list[int]:
    chain: list[int] = []
    for i in range(pages):
        chain.append(chain_hash(chain[-1] if chain else None, tokens[i * PAGE : (i + 1) * PAGE]))
    return chain


class Setup:
    def __init__(self, capacity: int = 4, hidden_bytes: int = 0) -> None:
        self.streams = StreamSet(verify=True)
        self.compute = self.streams.create("compute")
        self.pool = StateSlotPool(self.streams, TINY_SPEC, 6)
        self.store = SnapshotStore(self.streams, self.pool, capacity, PAGE, hidden_bytes)

    def snapshot(self, position: int, tokens: list[int] = TOKENS, covering_page: int | None = None, **kw: object):
        ring = StateRing(self.pool, 1, self.compute)
        start_empty(ring, self.compute)
        run_pass(ring, self.compute, tokens[:position])
        key = SnapshotKey.of(hashes(tokens, position // PAGE), tokens, position, PAGE)
        snap = self.store.write(key, ring.live_slot, self.compute, covering_page=covering_page, **kw)
        ring.release(self.compute.record())
        return snap

    def restored(self, snap, stream: Stream | None = None) -> StateRing:
        stream = stream or self.compute
        ring = StateRing(self.pool, 1, stream)
        self.store.restore(snap, ring.live_slot, stream)
        return ring


def test_deepest_snapshot_at_or_before_the_match() -> None:
    s = Setup()
    for position in (4, 6, 8):
        s.snapshot(position)
    chain = hashes(TOKENS, 3)
    assert s.store.deepest_at_or_before(chain, TOKENS, 12).position == 8
    assert s.store.deepest_at_or_before(chain, TOKENS, 7).position == 6  # inside page 2: the partial one
    assert s.store.deepest_at_or_before(chain[:1], TOKENS, 5).position == 4
    assert s.store.deepest_at_or_before([], TOKENS, 3) is None


def test_partial_tokens_must_match_the_prompt() -> None:
    s = Setup()
    s.snapshot(6)
    other = TOKENS[:5] + [0] + TOKENS[6:]  # differs inside the partial tokens of the snapshot at 6
    assert s.store.deepest_at_or_before(hashes(other, 1), other, 12) is None
    assert s.store.deepest_at_or_before(hashes(TOKENS, 1), TOKENS, 12).position == 6


def test_restore_gives_the_state_of_the_prefix_and_decoding_continues_exactly() -> None:
    s = Setup()
    snap = s.snapshot(6)
    ring = s.restored(snap)
    run_pass(ring, s.compute, TOKENS[6:9])
    assert same_state(read_state(s.pool, ring.live_slot), expected_state(TINY_SPEC, TOKENS[:9]))


def test_two_lanes_restore_one_snapshot_into_their_own_slots() -> None:
    s = Setup()
    snap = s.snapshot(5)
    lane_b = s.streams.create("lane-b")
    a, b = s.restored(snap), s.restored(snap, lane_b)
    run_pass(a, s.compute, [1, 1])
    run_pass(b, lane_b, [2])
    assert same_state(read_state(s.pool, a.live_slot), expected_state(TINY_SPEC, TOKENS[:5] + [1, 1]))
    assert same_state(read_state(s.pool, b.live_slot), expected_state(TINY_SPEC, TOKENS[:5] + [2]))


def test_least_recently_used_snapshot_is_evicted_first() -> None:
    s = Setup(capacity=2)
    first, second = s.snapshot(2), s.snapshot(3)
    s.restored(first)  # first is now the most recently used
    s.snapshot(4)
    assert first.alive and not second.alive and len(s.store) == 2
    with pytest.raises(StaleSnapshotError):
        s.restored(second)


def test_restoring_one_of_a_turns_two_resume_points_makes_the_other_go_first() -> None:
    s = Setup(capacity=3)
    other = s.snapshot(2)  # another conversation's, the least recently used: plain LRU would evict it
    input_end = s.snapshot(6)
    generation_end = s.snapshot(9, alternative=input_end)
    s.restored(input_end)  # the client re-rendered the reply: the end of generation is passed over
    assert generation_end.superseded and not input_end.superseded
    s.snapshot(3)
    assert not generation_end.alive and input_end.alive and other.alive
    assert input_end.alternative is None  # an evicted alternative unpairs


def test_restoring_the_end_of_generation_supersedes_the_end_of_input() -> None:
    s = Setup(capacity=3)
    input_end = s.snapshot(6)
    generation_end = s.snapshot(9, alternative=input_end)
    s.restored(generation_end)
    assert input_end.superseded and not generation_end.superseded


def test_snapshot_goes_with_the_page_that_covers_it() -> None:
    s = Setup()
    pages = PagePool(2)
    prefix = PrefixCache(pages, PAGE)
    prefix.on_forget(s.store.page_forgotten)
    [page] = pages.allocate(1, s.compute)
    prefix.insert_full(None, TOKENS[:PAGE], page)
    pages.release([page], s.compute.record())
    snap, kept = s.snapshot(4, covering_page=page), s.snapshot(3, covering_page=None)
    pages.evict(1)
    assert not snap.alive and kept.alive and len(s.store) == 1
    assert s.store.records_in_use() == 1


def test_a_snapshot_of_an_unwritten_slot_is_refused() -> None:
    s = Setup()
    slot = s.pool.acquire(s.compute)
    with pytest.raises(UnwrittenStateError):
        s.store.write(SnapshotKey(0, None, ()), slot, s.compute, covering_page=None)
    assert len(s.store) == 0


def test_hidden_row_round_trip_and_its_absence_is_an_error() -> None:
    s = Setup(hidden_bytes=16)
    row, out = DeviceBuffer(s.streams, 16, "last hidden"), DeviceBuffer(s.streams, 16, "bridge hidden")
    row.view(np.float32)[:] = [1.5, -2.0, 3.25, 0.0]
    snap = s.snapshot(3, hidden=(row, 0))
    ring = StateRing(s.pool, 1, s.compute)
    s.store.restore(snap, ring.live_slot, s.compute, hidden=(out, 0))
    assert out.view(np.float32).tolist() == [1.5, -2.0, 3.25, 0.0]
    with pytest.raises(UnwrittenStateError, match="no hidden row"):
        s.store.restore(s.snapshot(2), ring.live_slot, s.compute, hidden=(out, 0))


def test_writing_an_existing_key_returns_the_snapshot_it_has() -> None:
    s = Setup()
    assert s.snapshot(5) is s.snapshot(5) and len(s.store) == 1


def test_budget_in_bytes_becomes_a_record_count() -> None:
    assert records_for_budget(10 * 1024, 1024) == 10 and records_for_budget(1023, 1024) == 0


def test_snapshot_points_of_a_cold_prefill_a_turn_and_a_branch() -> None:
    # 114,281-token cold prompt in 16k chunks of the span [0, 114281): every 16,384 and the input's end
    points = snapshot_points(0, 114281, input_end=114281, interval=16384)
    assert points == [16384 * i for i in range(1, 7)] + [114281]
    # a warm turn recomputing [114200, 114350) of a 114,350-token prompt, diverging at 114,230
    assert snapshot_points(114200, 114350, input_end=114350, interval=16384, branch_points=[114230]) == [114230, 114350]
    # generation: the processed length at finish
    assert snapshot_points(114350, 114900, input_end=114350, interval=16384, generation_end=114900) == [114900]
    # a prompt no longer than the interval gets no periodic points; a chunk short of every point, none
    assert snapshot_points(0, 64, input_end=64, interval=64) == [64] and snapshot_points(0, 40, input_end=100, interval=64) == []
    assert snapshot_points(0, 100, input_end=100, interval=64) == [64, 100]
