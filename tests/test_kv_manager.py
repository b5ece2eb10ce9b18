"""KVManager: a request's KV from prefix match through growth, tail copy-on-write, finish and next turn."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.kv.cache import KVCache, KVSpec, page_resource
from ninfer_rt.kv.capacity import ContextTooLong
from ninfer_rt.kv.manager import KVManager
from ninfer_rt.kv.sequence import SequenceKV

PAGE = 64


class World:
    """A logical StreamSet with the verifier on, a small KV cache and its manager."""

    def __init__(self, num_pages: int = 32, max_context: int = 100_000) -> None:
        self.streams = StreamSet(verify=True)
        self.compute = self.streams.create("compute")
        self.copy = self.streams.create("copy")
        self.cache = KVCache(self.streams, KVSpec(num_layers=2, num_pages=num_pages, n_kv_heads=1, head_dim=8))
        self.kv = KVManager(self.streams, self.cache, max_context)

    def run(self, prompt: list[int], lane: object = None) -> SequenceKV:
        """Admit and prefill `prompt` in one step (completing a tail copy first), as the engine would."""
        match = self.kv.match(prompt)
        seq = self.kv.admit(prompt, match, self.compute, self.copy, lane=lane)
        self.kv.complete_copy(seq, self.compute)
        self.prefill(seq, prompt[seq.num_tokens :])
        return seq

    def prefill(self, seq: SequenceKV, tokens: list[int]) -> None:
        self.kv.grow(seq, len(tokens), self.compute)
        slots = seq.slot_mapping(len(tokens))
        self.write_kv(self.compute, seq, slots, tokens)
        self.kv.commit(seq, tokens)

    def write_kv(self, stream: Stream, seq: SequenceKV, slots: np.ndarray, tokens: list[int]) -> None:
        """Attention's K/V write: each token's K/V is its token id, so copies can be checked by value."""
        values = np.repeat(np.asarray(tokens, np.float32), 8).reshape(-1, 1, 8)
        stream.host_op(
            lambda: [self.cache.write_tokens(layer, slots, values, values) for layer in range(2)],
            label="attention",
            reads=[page_resource(p) for p in seq.pages],
            writes=[page_resource(p) for p in set(slots // PAGE)],
        )

    def finish(self, seq: SequenceKV) -> None:
        self.kv.finish(seq, self.compute.record())

    def balanced(self) -> bool:
        return self.kv.stats().balanced


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_two_sequences_sharing_a_system_prompt_share_its_pages() -> None:
    world = World()
    system = tokens(1000, 2 * PAGE)
    first = world.run(system + tokens(0, 10))
    second = world.run(system + tokens(500, 10))
    assert second.pages[:2] == first.pages[:2] and second.cached_tokens == 2 * PAGE
    assert all(world.kv.pool.refcount(p) == 2 for p in first.pages[:2])


def test_freeing_one_sharer_frees_nothing_the_other_uses() -> None:
    world = World()
    system = tokens(1000, 2 * PAGE)
    first = world.run(system + tokens(0, 10))
    second = world.run(system + tokens(500, 10))
    world.finish(first)
    assert all(world.kv.pool.refcount(p) == 1 for p in second.pages)
    assert world.balanced()


def test_a_finished_conversation_stays_cached_and_the_next_turn_reactivates_it() -> None:
    world = World()
    turn_one = tokens(0, 3 * PAGE)
    first = world.run(turn_one)
    full_pages = first.pages[:2]
    world.finish(first)
    assert all(world.kv.pool.is_cached(p) for p in full_pages)
    second = world.run(turn_one + tokens(5000, 20))
    assert second.pages[:2] == full_pages and not any(world.kv.pool.is_cached(p) for p in full_pages)


def test_a_prefix_of_length_41_mod_64_copies_the_tail_in_two_steps() -> None:
    world = World()
    turn_one = tokens(0, 2 * PAGE + 41)
    first = world.run(turn_one)
    tail_page = first.pages[2]
    world.finish(first)

    match = world.kv.match(turn_one + tokens(7000, 5))
    assert match.num_tokens == 2 * PAGE + 41
    second = world.kv.admit(turn_one + tokens(7000, 5), match, world.compute, world.copy)  # step i
    assert second.pending_copy is not None and len(second.pages) == 2
    assert world.kv.crash_summary()["open_transactions"][0]["source"] == tail_page

    world.kv.complete_copy(second, world.compute)  # step i+1
    private = second.pages[2]
    assert private != tail_page and second.num_tokens == 2 * PAGE + 41
    k, _ = world.cache.read_tokens(1, [private], 41)
    np.testing.assert_array_equal(k[:, 0, 0], turn_one[2 * PAGE :])
    world.prefill(second, tokens(7000, 5))  # writes into the private copy, not the cached tail
    assert world.kv.pool.is_cached(tail_page) and world.kv.crash_summary()["open_transactions"] == []


def test_finishing_before_the_copy_completes_releases_the_copy_page() -> None:
    world = World()
    turn_one = tokens(0, PAGE + 41)
    world.finish(world.run(turn_one))
    prompt = turn_one + [1, 2]
    second = world.kv.admit(prompt, world.kv.match(prompt), world.compute, world.copy)
    world.finish(second)
    stats = world.kv.stats()
    assert stats.in_use == 0 and stats.balanced


def test_admission_refuses_what_does_not_fit_instead_of_failing_mid_step() -> None:
    world = World(num_pages=4)
    world.run(tokens(0, 3 * PAGE))
    match = world.kv.match(tokens(9000, 2 * PAGE))
    assert not world.kv.can_admit(match, prefill_tokens=2 * PAGE)
    assert world.kv.can_admit(match, prefill_tokens=PAGE)


def test_eviction_under_pressure_reuses_cached_pages_and_keeps_the_invariant() -> None:
    world = World(num_pages=4)
    world.finish(world.run(tokens(0, 3 * PAGE)))
    world.finish(world.run(tokens(9000, 3 * PAGE)))
    stats = world.kv.stats()
    assert stats.evictions >= 2 and stats.balanced


def test_a_prompt_longer_than_the_context_limit_is_refused_with_both_numbers() -> None:
    world = World(max_context=1000)
    with pytest.raises(ContextTooLong) as error:
        world.kv.match(tokens(0, 900), max_new_tokens=200)
    assert (error.value.needed, error.value.limit) == (1100, 1000)


def test_the_context_limit_is_also_the_whole_pool() -> None:
    assert World(num_pages=4).kv.context_limit == 4 * PAGE


def test_block_table_row_lists_pages_in_order_padded_with_minus_one() -> None:
    world = World()
    seq = world.run(tokens(0, PAGE + 1))
    np.testing.assert_array_equal(seq.block_table_row(4), [*seq.pages, -1, -1])


def test_slot_mapping_continues_after_the_stored_tokens() -> None:
    world = World()
    seq = world.run(tokens(0, PAGE - 1))
    world.kv.grow(seq, 2, world.compute)
    np.testing.assert_array_equal(seq.slot_mapping(2), [seq.pages[0] * PAGE + PAGE - 1, seq.pages[1] * PAGE])


def test_a_sequences_slots_and_block_table_follow_every_change_of_its_pages() -> None:
    # page_array() is rebuilt only when `pages` changed: appends, truncation, replacement, reassignment.
    seq = SequenceKV(page_size=4, pages=[3, 1, 2])
    assert seq.slots(np.array([0, 5, 11])).tolist() == [12, 5, 11]
    seq.pages.append(9)
    assert seq.block_table_row(6).tolist() == [3, 1, 2, 9, -1, -1]
    del seq.pages[1:]
    seq.pages.extend([7, 8])
    assert seq.slots(np.array([4, 9])).tolist() == [28, 33]
    seq.pages = [5]
    assert seq.block_table_row(2).tolist() == [5, -1]
