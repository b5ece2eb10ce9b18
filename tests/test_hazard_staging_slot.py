"""Rule 3: a pinned staging slot must not be rewritten by the host before the copy reading it completed."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.memory import DeviceBuffer, PinnedBuffer, StagingRing
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.ordering import OrderingViolation, Span

BLOCK_TABLE = np.arange(16, dtype=np.int32)


def test_hazard_staging_slot_rewritten_before_its_copy_completed_is_a_violation() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    slot = PinnedBuffer(streams, BLOCK_TABLE.nbytes, "staging[0]")
    table = DeviceBuffer(streams, BLOCK_TABLE.nbytes, "block_table")
    slot.write(BLOCK_TABLE, label="stage step 1", lane=0)
    compute.copy(table, slot, label="upload block table", lane=0)

    with pytest.raises(OrderingViolation) as caught:
        slot.write(BLOCK_TABLE + 1, label="stage step 2", lane=0)

    assert (caught.value.earlier.label, caught.value.later.label) == ("upload block table", "stage step 2")


def test_hazard_staging_slot_rewritten_after_syncing_its_copy_event_is_clean() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    slot = PinnedBuffer(streams, BLOCK_TABLE.nbytes, "staging[0]")
    table = DeviceBuffer(streams, BLOCK_TABLE.nbytes, "block_table")
    slot.write(BLOCK_TABLE, label="stage step 1")
    compute.copy(table, slot, label="upload block table")

    compute.record().synchronize()
    slot.write(BLOCK_TABLE + 1, label="stage step 2")

    assert slot.view(np.int32, BLOCK_TABLE.shape).tolist() == (BLOCK_TABLE + 1).tolist()


def test_hazard_staging_ring_reuses_a_slot_only_after_its_copy_so_wrapping_around_is_clean() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    ring = StagingRing(streams, slots=1, slot_bytes=BLOCK_TABLE.nbytes)
    table = DeviceBuffer(streams, BLOCK_TABLE.nbytes, "block_table")

    for step in range(3):
        ring.publish(compute, table, BLOCK_TABLE + step, label=f"publish step {step}")

    assert table.view(np.int32, BLOCK_TABLE.shape).tolist() == (BLOCK_TABLE + 2).tolist()


def test_hazard_host_may_rewrite_only_the_range_of_a_staging_buffer_no_pending_copy_reads() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    staging = PinnedBuffer(streams, 2 * BLOCK_TABLE.nbytes, "staging")
    table = DeviceBuffer(streams, BLOCK_TABLE.nbytes, "block_table")
    compute.copy(table, staging, BLOCK_TABLE.nbytes, src_offset=0, label="upload from the first half")

    second_half = Span(staging.resource, BLOCK_TABLE.nbytes, 2 * BLOCK_TABLE.nbytes)
    streams.host_access("stage into the second half", writes=(second_half,))

    first_half = Span(staging.resource, 0, BLOCK_TABLE.nbytes)
    with pytest.raises(OrderingViolation):
        streams.host_access("stage into the first half", writes=(first_half,))
