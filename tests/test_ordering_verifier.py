"""The happens-before verifier's rules, one behaviour per test (the random-program check is in
test_hazard_property.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.ordering import OrderingViolation, Span, verify_by_default


def two_streams() -> tuple[StreamSet, object, object]:
    streams = StreamSet(verify=True)
    return streams, streams.create("a"), streams.create("b")


def test_the_verifier_is_on_in_every_test() -> None:
    assert verify_by_default()
    assert StreamSet().verifier is not None


@pytest.mark.parametrize("value", ["0", "", "off", "false", "no"])
def test_the_environment_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NINFER_VERIFY_ORDERING", value)
    assert StreamSet().verifier is None


def test_with_the_verifier_off_a_race_goes_unreported() -> None:
    streams = StreamSet(verify=False)
    a, b = streams.create("a"), streams.create("b")
    a.declare("produce", writes=("x",))
    b.declare("consume", reads=("x",))


def test_concurrent_reads_on_two_streams_are_not_a_race() -> None:
    _, a, b = two_streams()
    a.declare("read on a", reads=("x",))
    b.declare("read on b", reads=("x",))


def test_two_unordered_writes_are_a_race() -> None:
    _, a, b = two_streams()
    a.declare("first write", writes=("x",))
    with pytest.raises(OrderingViolation, match="write by 'second write'.*earlier write by 'first write'"):
        b.declare("second write", writes=("x",))


def test_a_write_after_an_unordered_read_is_a_race() -> None:
    _, a, b = two_streams()
    a.declare("reader", reads=("x",))
    with pytest.raises(OrderingViolation, match="earlier read by 'reader'"):
        b.declare("writer", writes=("x",))


def test_ops_on_one_stream_are_ordered_by_program_order() -> None:
    _, a, _ = two_streams()
    a.declare("write", writes=("x",))
    a.declare("read", reads=("x",))
    a.declare("write again", writes=("x",))


def test_happens_before_is_transitive_through_a_chain_of_event_waits() -> None:
    streams = StreamSet(verify=True)
    a, b, c = streams.create("a"), streams.create("b"), streams.create("c")
    a.declare("produce", writes=("x",))
    b.wait(a.record())
    c.wait(b.record())
    c.declare("consume", reads=("x",))


def test_an_event_recorded_before_the_write_does_not_order_it() -> None:
    _, a, b = two_streams()
    too_early = a.record()
    a.declare("produce", writes=("x",))
    b.wait(too_early)
    with pytest.raises(OrderingViolation):
        b.declare("consume", reads=("x",))


def test_the_host_may_read_device_results_only_after_synchronizing_the_producer() -> None:
    streams, a, _ = two_streams()
    a.declare("logits to pinned", writes=("pinned",))
    with pytest.raises(OrderingViolation):
        streams.host_access("sample", reads=("pinned",))
    a.synchronize()
    streams.host_access("sample", reads=("pinned",))


def test_enqueueing_an_op_does_not_order_the_host_after_it() -> None:
    streams, a, b = two_streams()
    a.declare("copy out of staging", reads=("staging",))
    b.declare("unrelated", writes=("y",))
    with pytest.raises(OrderingViolation):
        streams.host_access("rewrite staging", writes=("staging",))


def test_a_violating_op_leaves_no_trace_in_the_history() -> None:
    _, a, b = two_streams()
    a.declare("produce", writes=("x",))
    with pytest.raises(OrderingViolation):
        b.declare("racy consume", reads=("y",), writes=("x",))
    a.declare("write y", writes=("y",))  # the rejected op's read of y was not recorded


def test_disjoint_byte_ranges_of_one_buffer_do_not_conflict() -> None:
    _, a, b = two_streams()
    a.declare("write slot 0", writes=(Span("ring", 0, 64),))
    b.declare("write slot 1", writes=(Span("ring", 64, 128),))


def test_overlapping_byte_ranges_conflict_and_the_message_names_the_bytes() -> None:
    _, a, b = two_streams()
    a.declare("write 0..100", writes=(Span("ring", 0, 100),))
    with pytest.raises(OrderingViolation, match=r"'ring' bytes \[64, 100\)"):
        b.declare("read 64..128", reads=(Span("ring", 64, 128),))


def test_a_whole_buffer_access_conflicts_with_any_byte_range_of_it() -> None:
    _, a, b = two_streams()
    a.declare("write a tail", writes=(Span("page", 4000, 4096),))
    with pytest.raises(OrderingViolation):
        b.declare("read the page", reads=("page",))


def test_a_freed_buffers_history_is_forgotten() -> None:
    streams, a, b = two_streams()
    a.declare("last use", writes=("x",))
    streams.verifier.forget(["x"])
    b.declare("new owner", writes=("x",))


def issued_by(thread: ThreadPoolExecutor, fn: object) -> object:
    return thread.submit(fn).result()


def test_a_wait_carries_the_issuing_threads_past_to_ops_another_thread_enqueues_after_it() -> None:
    streams, a, b = two_streams()
    producer, consumer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    event = a.record()
    issued_by(producer, lambda: streams.host_access("stage", writes=("staging",)))
    issued_by(producer, lambda: b.wait(event))
    issued_by(consumer, lambda: b.declare("upload", reads=("staging",)))


def test_an_event_carries_the_recording_threads_past_to_a_thread_that_synchronizes_on_it() -> None:
    streams, a, _ = two_streams()
    producer, consumer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    issued_by(producer, lambda: streams.host_access("fill", writes=("pinned",)))
    event = issued_by(producer, a.record)
    issued_by(consumer, event.synchronize)
    issued_by(consumer, lambda: streams.host_access("read", reads=("pinned",)))


def test_host_threads_are_unordered_without_a_synchronization() -> None:
    streams, _, _ = two_streams()
    producer, consumer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    issued_by(producer, lambda: streams.host_access("fill", writes=("pinned",)))
    with pytest.raises(OrderingViolation):
        issued_by(consumer, lambda: streams.host_access("read", reads=("pinned",)))


def test_declarations_given_as_generators_are_checked_not_consumed_by_the_crash_ring() -> None:
    _, a, b = two_streams()
    a.declare("produce", writes=(r for r in ["x"]))
    with pytest.raises(OrderingViolation):
        b.declare("consume", reads=(r for r in ["x"]))
