"""A collective between simulated ranks is a device op the ordering verifier checks: it reads every rank's
operand and writes every rank's result, so an operand written on a stream the collective did not wait on,
or a result read on a stream that did not wait on it, is reported; correct use sums in rank order."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.numpy_collectives import Collectives
from ninfer_rt.ordering import OrderingViolation

RANKS = 3


def collectives() -> tuple[StreamSet, Collectives]:
    streams = StreamSet(verify=True)
    return streams, Collectives(streams, [streams.create(f"compute.rank{r}") for r in range(RANKS)])


def partials() -> list[np.ndarray]:
    return [np.random.default_rng(r).standard_normal((2, 5)) for r in range(RANKS)]


def test_all_reduce_gives_every_rank_the_rank_order_sum() -> None:
    _, tp = collectives()
    parts = partials()
    results = tp.all_reduce(parts, "all_reduce")
    expected = (parts[0] + parts[1]) + parts[2]
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_all_gather_concatenates_in_rank_order() -> None:
    _, tp = collectives()
    parts = partials()
    for result in tp.all_gather(parts, "all_gather"):
        np.testing.assert_array_equal(result, np.concatenate(parts, axis=-1))


def test_an_operand_written_on_a_stream_the_collective_did_not_wait_on_is_a_violation() -> None:
    streams, tp = collectives()
    side = streams.create("copy.rank1")  # rank 1 writes its partial here, and its compute stream never waits
    for rank, part in enumerate(partials()):
        tp.contribute(rank, part, side if rank == 1 else tp.rank_streams[rank])
    with pytest.raises(OrderingViolation, match=r"tp\.operand\[1\]"):
        tp.combine("all_reduce", sum, (2, 5))


def test_a_result_read_on_a_stream_that_did_not_wait_on_the_collective_is_a_violation() -> None:
    streams, tp = collectives()
    for rank, part in enumerate(partials()):
        tp.contribute(rank, part, tp.rank_streams[rank])
    tp.combine("all_reduce", sum, (2, 5))
    with pytest.raises(OrderingViolation, match=r"tp\.result\[0\]"):
        tp.take(0, streams.create("copy.rank0"))
