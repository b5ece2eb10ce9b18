"""The seed's bug: a block-membership publish on a stream the compute stream does not wait on.

In the original server the publish ran on the legacy default stream, unordered with the non-blocking
compute stream, and took 53 real requests to crash a GPU. ninfer-rt has no default stream, so the nearest
expressible mistake is a publish on some other stream without an event wait; the verifier must reject it
on its first occurrence, on logical streams, without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.memory import DeviceBuffer, StagingRing
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.ordering import OrderingViolation

MEMBERSHIP = np.array([3, 1, 4, 1, 5], dtype=np.int32)


def publish_membership(streams: StreamSet, on: Stream) -> DeviceBuffer:
    membership = DeviceBuffer(streams, MEMBERSHIP.nbytes, "block_membership")
    StagingRing(streams, slots=2, slot_bytes=64).publish(on, membership, MEMBERSHIP, label="publish membership", lane=7)
    return membership


def attention_reading(compute: Stream, membership: DeviceBuffer) -> np.ndarray:
    return compute.host_op(
        lambda: membership.view(np.int32, MEMBERSHIP.shape).copy(),
        label="decode attention",
        reads=(membership.resource,),
        lane=7,
    )


def test_hazard_default_stream_publish_without_event_wait_is_a_violation() -> None:
    streams = StreamSet(verify=True)
    publisher, compute = streams.create("publish"), streams.create("compute")
    membership = publish_membership(streams, publisher)

    with pytest.raises(OrderingViolation) as caught:
        attention_reading(compute, membership)

    assert caught.value.earlier.label == "publish membership"
    assert caught.value.later.label == "decode attention"


def test_hazard_default_stream_publish_with_event_wait_is_clean() -> None:
    streams = StreamSet(verify=True)
    publisher, compute = streams.create("publish"), streams.create("compute")
    membership = publish_membership(streams, publisher)

    compute.wait(publisher.record())

    assert attention_reading(compute, membership).tolist() == MEMBERSHIP.tolist()


def test_hazard_publish_on_the_consuming_stream_itself_is_clean() -> None:
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    membership = publish_membership(streams, compute)

    assert attention_reading(compute, membership).tolist() == MEMBERSHIP.tolist()


def test_hazard_violation_names_both_ops_with_stream_seq_label_lane_and_the_resource() -> None:
    streams = StreamSet(verify=True)
    publisher, compute = streams.create("publish"), streams.create("compute")
    membership = publish_membership(streams, publisher)

    with pytest.raises(OrderingViolation) as caught:
        attention_reading(compute, membership)

    message = str(caught.value)
    assert "'publish membership' (#1 on stream:publish, lane/request 7)" in message
    assert "'decode attention' (#1 on stream:compute, lane/request 7)" in message
    assert "'block_membership'" in message
