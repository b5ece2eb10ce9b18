"""Snapshot write and restore on the GPU: device-to-device copies on two streams, bytes exact, verifier on."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.memory import PinnedBuffer, StagingRing
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv.snapshots import SnapshotKey, SnapshotStore
from ninfer_rt.kv.states import StateSlotPool, StateSpec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", [StateSpec(2, 1, 2, 4, 4), StateSpec(48, 16, 48, 128, 128)], ids=["tiny", "27b"])
def test_snapshot_round_trip_between_lanes_is_byte_exact(spec: StateSpec) -> None:
    streams = StreamSet(open_device(), verify=True)
    lane_a, lane_b = streams.create("lane-a"), streams.create("lane-b")
    pool = StateSlotPool(streams, spec, 2)
    store = SnapshotStore(streams, pool, 1, page_size=64)
    source, target = pool.acquire(lane_a), pool.acquire(lane_b)
    state = np.random.default_rng(0).integers(0, 256, spec.slot_bytes, dtype=np.uint8)
    ring = StagingRing(streams, 1, spec.slot_bytes)
    ring.publish(lane_a, pool.buffer, state, pool.offset(source), label="state upload")
    pool.mark_written(source)
    snap = store.write(SnapshotKey(64, 1, ()), source, lane_a, covering_page=None)
    store.restore(snap, target, lane_b)
    host = PinnedBuffer(streams, spec.slot_bytes, "readback")
    lane_b.copy(host, pool.buffer, spec.slot_bytes, 0, pool.offset(target), label="state readback")
    lane_b.synchronize()
    assert np.array_equal(host.read(np.dtype(np.uint8), (spec.slot_bytes,), label="read state"), state)
    for buffer in (host, pool.buffer, store.buffer):
        buffer.free()
    ring.free()
    streams.destroy()
