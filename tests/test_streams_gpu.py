"""Cross-stream ordering and the staging ring on a real GPU (`pytest -m gpu`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from gpu_session import GpuSession
from kernel_refs import rmsnorm_ref, silu_mul_ref

from ninfer_rt.cuda import ops
from ninfer_rt.cuda.memory import DeviceBuffer, StagingRing, StagingSlot
from ninfer_rt.cuda.streams import Stream
from ninfer_rt.ordering import OrderingViolation

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
EPS = 1e-6
BF16_RTOL = 2.0**-6  # one bf16 rounding is within 2^-8 relative; see test_kernels_gpu.py
# Busy work: one rmsnorm over [BUSY_ROWS, BUSY_HIDDEN] moves 1 GiB (~250 us on an H200), far longer than
# the host needs to enqueue a launch, so a few of them keep a stream busy while the host runs ahead.
BUSY_ROWS, BUSY_HIDDEN = 32768, 8192
BUSY_FILL = 0x3F  # bf16 0x3F3F ~ 0.75: finite input without uploading a gigabyte


@pytest.fixture
def session() -> Iterator[GpuSession]:
    session = GpuSession.open()
    yield session
    session.close()


class BusyWork:
    """Launches that only keep a stream busy (they read and write buffers no one else touches)."""

    def __init__(self, session: GpuSession, stream: Stream) -> None:
        self.session = session
        self.x = session.empty(stream, BUSY_ROWS * BUSY_HIDDEN * BF16.itemsize, "busy_x")
        self.w = session.empty(stream, BUSY_HIDDEN * BF16.itemsize, "busy_w")
        self.out = session.empty(stream, self.x.nbytes, "busy_out")
        stream.memset(self.x, BUSY_FILL, label="fill busy_x")
        stream.memset(self.w, BUSY_FILL, label="fill busy_w")

    def enqueue(self, stream: Stream, launches: int) -> None:
        for _ in range(launches):
            ops.rmsnorm(self.session.lib, stream, self.x, self.w, self.out, BUSY_ROWS, BUSY_HIDDEN, EPS)


@dataclass
class ProducerConsumer:
    producer: Stream
    consumer: Stream
    x: np.ndarray
    w: np.ndarray
    produced: DeviceBuffer  # rmsnorm(x) * w, written on the producer
    consumed: DeviceBuffer  # silu_mul(produced), written on the consumer


def produce_then_consume(session: GpuSession, rows: int, inter: int, wait: bool) -> ProducerConsumer:
    """Producer: ~25 ms of busy work, then rmsnorm into `produced` (poisoned first). Consumer: silu_mul of
    `produced`, after waiting on the producer's event when `wait`. Without the wait the consumer would
    read the poison (or older memory) long before the producer's rmsnorm ran."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, 2 * inter)).astype(BF16)
    w = (rng.standard_normal(2 * inter) * 0.2 + 1.0).astype(BF16)
    producer, consumer = session.stream("producer"), session.stream("consumer")
    busy = BusyWork(session, producer)
    x_dev, w_dev = session.upload(producer, x, "x"), session.upload(producer, w, "w")
    produced = session.empty(producer, x.nbytes, "produced")
    consumed = session.empty(consumer, rows * inter * BF16.itemsize, "consumed")
    consumer.synchronize()  # the consumer's own poison is done before the race under test begins

    busy.enqueue(producer, launches=100)
    ops.rmsnorm(session.lib, producer, x_dev, w_dev, produced, rows, 2 * inter, EPS)
    if wait:
        consumer.wait(producer.record())
    ops.silu_mul(session.lib, consumer, produced, consumed, rows, inter)
    return ProducerConsumer(producer, consumer, x, w, produced, consumed)


def assert_close(got: np.ndarray, ref: np.ndarray) -> None:
    got = got.astype(np.float64).reshape(ref.shape)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements never written"
    assert np.all(np.abs(got - ref) <= BF16_RTOL * np.abs(ref) + 1e-6)


def test_consumer_ordered_by_an_event_sees_the_producers_result(session: GpuSession) -> None:
    rows, inter = 64, 4096
    run = produce_then_consume(session, rows, inter, wait=True)
    consumed = session.download(run.consumer, run.consumed, BF16, rows * inter)
    produced = session.download(run.producer, run.produced, BF16, rows * 2 * inter).reshape(rows, 2 * inter)
    assert_close(produced, rmsnorm_ref(run.x, run.w, EPS))
    assert_close(consumed, silu_mul_ref(produced))  # computed from exactly what the producer stored


def test_consumer_without_the_wait_is_refused_before_launch(session: GpuSession) -> None:
    with pytest.raises(OrderingViolation, match="produced"):
        produce_then_consume(session, rows=8, inter=64, wait=False)


def test_staging_ring_reuses_a_slot_only_after_its_copy_completed(session: GpuSession, monkeypatch: pytest.MonkeyPatch) -> None:
    publishes, elements = 32, 1024
    stream = session.stream("consumer")
    busy = BusyWork(session, stream)
    ring = StagingRing(session.streams, slots=2, slot_bytes=elements * 4)
    dst = session.empty(stream, publishes * elements * 4, "block_tables")
    reused_after_completion: list[bool] = []
    acquire = ring.acquire

    def acquire_checked() -> StagingSlot:
        previous = {id(slot): slot.event for slot in ring.slots}
        slot = acquire()
        event = previous[id(slot)]
        reused_after_completion.append(event is None or event.query())
        return slot

    monkeypatch.setattr(ring, "acquire", acquire_checked)
    for i in range(publishes):
        busy.enqueue(stream, launches=10)  # keeps the copy below in flight while the host moves on
        table = np.arange(elements, dtype=np.int32) + i * elements
        ring.publish(stream, dst, table, dst_offset=i * elements * 4, label=f"publish table {i}")

    assert len(reused_after_completion) == publishes and all(reused_after_completion)
    assert ring.waits > 0, "the publish rate never forced a wait; the test did not exercise reuse"
    expected = np.arange(publishes * elements, dtype=np.int32)
    np.testing.assert_array_equal(session.download(stream, dst, np.int32, publishes * elements), expected)
    ring.free()
