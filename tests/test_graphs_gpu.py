"""Decode steps replayed from CUDA graphs are bit-identical to eager steps, allocate nothing in steady
state, and are declared to the verifier as one op with the captured accesses plus the step's pages; a
garbage collection falling due while capturing waits until the capture ends."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as cu

from forward_helpers import SeqStep, random_tokens, step_batch
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.graphs import capture
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_graphs import GraphedForward
from ninfer_rt.kv.cache import page_resource
from ninfer_rt.model.layers import forward
from test_cuda_exec_gpu import GPU_TINY, PAGE_SIZE, PAGES, gpu_tiny, runtime  # noqa: F401 - gpu_tiny is a fixture

pytestmark = pytest.mark.gpu
PROMPT, DECODE = 40, 16


def test_graph_replay_is_bit_identical_to_eager(gpu_tiny: Path) -> None:
    tokens = random_tokens(GPU_TINY["vocab"], PROMPT + DECODE, seed=3)
    steps = [PROMPT] + [1] * DECODE
    eager = runtime(gpu_tiny, device=True).run(tokens, steps)
    graphed_rt = runtime(gpu_tiny, device=True)
    graphed = graphed_rt.run(tokens, steps, GraphedForward(graphed_rt.executor, graphed_rt.model, graphed_rt.kv))
    np.testing.assert_array_equal(graphed, eager)


def test_dependent_launch_changes_no_result(gpu_tiny: Path) -> None:
    # Kernels that start before their predecessor finishes (kernels_src/common.cuh) must still see all of
    # its writes: graphed steps with programmatic dependent launch equal plain eager launches bit for bit.
    tokens = random_tokens(GPU_TINY["vocab"], PROMPT + DECODE, seed=5)
    steps = [PROMPT] + [1] * DECODE
    plain = runtime(gpu_tiny, device=True, dependent_launch=False).run(tokens, steps)
    overlapped_rt = runtime(gpu_tiny, device=True, dependent_launch=True)
    graphed = GraphedForward(overlapped_rt.executor, overlapped_rt.model, overlapped_rt.kv)
    np.testing.assert_array_equal(overlapped_rt.run(tokens, steps, graphed), plain)
    np.testing.assert_array_equal(overlapped_rt.run(tokens, steps), plain)


@pytest.mark.parametrize("widths", [(1, 1, 1), (4,), (2, 2)], ids=["batch3", "verify4", "batch2-verify2"])
def test_batched_and_verify_width_graphs_match_eager(gpu_tiny: Path, widths: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(widths))
    prompts = [rng.integers(0, GPU_TINY["vocab"], PROMPT - 5 * i).tolist() for i in range(len(widths))]
    steps = [[rng.integers(0, GPU_TINY["vocab"], w).tolist() for w in widths] for _ in range(3)]  # capture, 2 replays
    pages = [[2 * i, 2 * i + 1] for i in range(len(widths))]

    def run(graphed: bool) -> np.ndarray:
        rt = runtime(gpu_tiny, device=True)
        step = GraphedForward(rt.executor, rt.model, rt.kv) if graphed else (lambda b: forward(rt.executor, rt.model, b, rt.kv))
        forward(rt.executor, rt.model, step_batch([SeqStep(p, 0, pg) for p, pg in zip(prompts, pages)], PAGE_SIZE), rt.kv)
        cached, logits = [len(p) for p in prompts], []
        for new in steps:
            parts = [SeqStep(t, c, pg) for t, c, pg in zip(new, cached, pages)]
            logits.append(rt.executor.to_host(step(step_batch(parts, PAGE_SIZE)).logits))
            cached = [c + len(t) for c, t in zip(cached, new)]
        return np.concatenate(logits)

    np.testing.assert_array_equal(run(graphed=True), run(graphed=False))


def test_replays_allocate_nothing_and_declare_the_current_pages(gpu_tiny: Path) -> None:
    rt = runtime(gpu_tiny, device=True)
    graphed = GraphedForward(rt.executor, rt.model, rt.kv)
    tokens = random_tokens(GPU_TINY["vocab"], PROMPT + 4, seed=5)
    forward(rt.executor, rt.model, step_batch([SeqStep(tokens[:PROMPT], 0, PAGES)], PAGE_SIZE), rt.kv)
    graphed(step_batch([SeqStep(tokens[PROMPT : PROMPT + 1], PROMPT, PAGES)], PAGE_SIZE))  # captures
    allocated = rt.executor._pool.allocated
    for i in range(1, 4):
        rt.executor.to_host(graphed(step_batch([SeqStep(tokens[PROMPT + i : PROMPT + i + 1], PROMPT + i, PAGES)], PAGE_SIZE)).logits)
    assert rt.executor._pool.allocated == allocated
    (graph,) = graphed.graphs.values()
    assert not any(isinstance(r, tuple) and r[0] == "kv" for r in graph.accesses.reads | graph.accesses.writes)
    assert page_resource(PAGES[0]) in set(rt.executor.step_pages[0])


class _Cycle:
    """Garbage only the cyclic collector frees."""

    def __init__(self) -> None:
        self.itself = self


def test_a_collection_due_while_capturing_finalizes_after_the_capture() -> None:
    # A finalizer the collector runs may synchronize (freeing device memory does): inside a capture that
    # invalidates the graph, and the error surfaces at a later launch. With a collection due at every
    # allocation and such garbage made mid-capture, the capture still succeeds and the finalizer runs after.
    streams = StreamSet(open_device(0))
    stream = streams.create("compute")
    src, dst = DeviceBuffer(streams, 4096, "src"), DeviceBuffer(streams, 4096, "dst")
    statuses: list[object] = []

    def enqueue() -> None:
        stream.copy(dst, src, label="before the garbage")
        weakref.finalize(_Cycle(), lambda: statuses.append(cu.cuCtxSynchronize()[0]))
        _ = [{} for _ in range(1000)]  # allocations: a collection would be due at each
        stream.copy(src, dst, label="after the garbage")

    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph = capture(stream, enqueue)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    graph.replay()
    stream.synchronize()
    assert statuses == [cu.CUresult.CUDA_SUCCESS]
    graph.destroy()
