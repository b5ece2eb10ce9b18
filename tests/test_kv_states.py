"""StateSpec sizes, the StateSlotPool's fenced hand-over and accounting, and the StateRing's accept."""

from __future__ import annotations

import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv.states import OutOfStateSlots, StateSlotPool, StateSpec, UnwrittenStateError
from ninfer_rt.kv.states_verify import RingStateError, StateRing
from tests.state_helpers import TINY_SPEC, expected_state, read_state, run_pass, same_state, start_empty

MIB = 1 << 20


def qwen3_5_27b_state() -> StateSpec:
    """The 27B class's linear-attention numbers as its config.json states them."""
    config = {"linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "linear_layers": 48}
    return StateSpec(config["linear_layers"], config["linear_num_key_heads"], config["linear_num_value_heads"],
                     config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"])


def test_27b_slot_is_144_mib_of_recurrent_state_and_2_8_mib_of_conv_windows() -> None:
    spec = qwen3_5_27b_state()
    assert spec.num_layers * spec.recurrent_bytes == 48 * 48 * 128 * 128 * 4 == 144 * MIB
    assert spec.conv_channels == 2 * 16 * 128 + 48 * 128 == 10240
    assert spec.num_layers * spec.conv_window_bytes / MIB == pytest.approx(2.8125)
    assert spec.slot_bytes == 48 * (10240 * 3 * 2 + 3 * MIB)  # both parts already 256-byte aligned


def test_layers_of_a_slot_are_aligned_and_disjoint() -> None:
    spec = StateSpec(3, 1, 3, 5, 7, conv_kernel=4)
    assert spec.conv_bytes % 256 == 0 and spec.layer_bytes % 256 == 0
    assert spec.conv_bytes >= spec.conv_window_bytes and spec.layer_bytes >= spec.conv_bytes + spec.recurrent_bytes
    assert [spec.layer_offset(i) for i in range(3)] == [0, spec.layer_bytes, 2 * spec.layer_bytes]


def test_pool_accounting_free_in_use_fenced() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    pool = StateSlotPool(streams, TINY_SPEC, 3)
    a, b = pool.acquire(compute), pool.acquire(compute)
    assert pool.stats() == type(pool.stats())(total=3, in_use=2, free=1, fenced=0)
    pool.release(a, compute.record())
    assert (pool.stats().in_use, pool.stats().free, pool.stats().fenced) == (1, 1, 1)
    pool.release(b, compute.record())
    assert pool.stats().in_use == 0 and pool.stats().balanced
    pool.acquire(compute)
    assert pool.stats().fenced == 1 and pool.stats().balanced


def test_pool_refuses_more_slots_than_it_has() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    pool = StateSlotPool(streams, TINY_SPEC, 1)
    pool.acquire(compute)
    assert not pool.can_acquire()
    with pytest.raises(OutOfStateSlots):
        pool.acquire(compute)


def test_a_released_slot_is_reused_only_after_its_fence() -> None:
    """Stream A reads the slot and releases it; stream B acquires it and writes: ordered by the fence."""
    streams = StreamSet(verify=True)
    a, b = streams.create("a"), streams.create("b")
    pool = StateSlotPool(streams, TINY_SPEC, 1)
    slot = pool.acquire(a)
    a.declare("decode reads state", reads=[pool.resource(slot)])
    pool.release(slot, a.record())
    pool.zero(pool.acquire(b), b)  # would raise OrderingViolation without the wait


def test_acquired_slot_is_unwritten_until_zeroed() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    pool = StateSlotPool(streams, TINY_SPEC, 1)
    slot = pool.acquire(compute)
    with pytest.raises(UnwrittenStateError, match="never zeroed, restored or written"):
        pool.require_written(slot, "snapshot")
    pool.zero(slot, compute)
    pool.require_written(slot, "snapshot")
    assert (pool.recurrent(slot, 1) == 0).all() and (pool.conv_window(slot, 0) == 0).all()


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_accept_makes_the_live_state_equal_plain_decoding_of_the_accepted_tokens(accepted: int) -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    ring = StateRing(StateSlotPool(streams, TINY_SPEC, 4), 4, compute)
    start_empty(ring, compute)
    run_pass(ring, compute, [3, 4])
    before = list(ring.slots)
    run_pass(ring, compute, [5, 6, 7, 8], saved=4)
    live = ring.accept(accepted, compute)
    assert sorted(ring.slots) == sorted(before), "accept swaps an index, it allocates nothing"
    assert same_state(read_state(ring.pool, live), expected_state(TINY_SPEC, [3, 4, 5, 6, 7, 8][: 3 + accepted]))
    run_pass(ring, compute, [9])  # decoding continues from the accepted state
    assert same_state(read_state(ring.pool, ring.live_slot), expected_state(TINY_SPEC, [3, 4, 5, 6, 7, 8][: 3 + accepted] + [9]))


def test_ring_refuses_passes_and_accepts_out_of_turn() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    ring = StateRing(StateSlotPool(streams, TINY_SPEC, 2), 2, compute)
    with pytest.raises(UnwrittenStateError):
        ring.begin(compute)  # the live slot holds no state yet
    start_empty(ring, compute)
    with pytest.raises(RingStateError, match="without a verify pass"):
        ring.accept(0, compute)
    run_pass(ring, compute, [1, 2], saved=2)
    with pytest.raises(RingStateError):
        ring.live_slot  # noqa: B018 - undecided until the accept
    with pytest.raises(RingStateError, match="not accepted yet"):
        ring.begin(compute)
    ring.accept(1, compute)
    ring.release(compute.record())
    assert ring.pool.stats().in_use == 0
