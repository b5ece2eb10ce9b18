"""Per-op cost of Stream.declare on logical streams, verifier off vs on.

Off, an enqueue still notes the op in the crash-context ring (that is kept in production); on, it is also
checked for happens-before. The op mix is a decode step's shape: two streams, each op reading two
resources and writing one, an event wait every 8 ops.

    python tools/bench_verifier_overhead.py [--ops 200000]
"""

from __future__ import annotations

import argparse
import time

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.ordering import Span


def ns_per_op(verify: bool, ops: int) -> float:
    streams = StreamSet(verify=verify)
    compute, copy = streams.create("compute"), streams.create("copy")
    weights, kv = ("weights", 0), ("kv", 0)
    started = time.perf_counter_ns()
    for i in range(ops):
        if i % 8 == 0:
            copy.declare("publish", reads=(Span("staging", 0, 256),), writes=("block_table",), lane=0)
            compute.wait(copy.record())
        compute.declare("layer op", reads=(weights, kv), writes=(("act", i % 4),), lane=0)
    return (time.perf_counter_ns() - started) / (ops + ops // 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000)
    ops = parser.parse_args().ops
    ns_per_op(True, 1000)  # warm-up
    off, on = min(ns_per_op(False, ops) for _ in range(3)), min(ns_per_op(True, ops) for _ in range(3))
    print(f"Stream.declare, {ops} ops, logical streams (record/wait cost folded in):")
    print(f"  verifier off: {off:7.0f} ns/op")
    print(f"  verifier on : {on:7.0f} ns/op")


if __name__ == "__main__":
    main()
