"""Graphed steps on the CUDA executor: the main forward's decode and verify steps (`GraphedForward`) and
the MTP steps of speculative decoding (`GraphedMTPSteps`, model/mtp.py MTPSteps), replayed from CUDA
graphs (cuda/graphs.py). Decode-width steps (<= 8 rows) replay a graph per key; wider ones (prefill, the
catch-up of a prefill chunk) run eagerly; replays are bit-identical to eager runs: same kernels, same
buffers, same launch parameters.

An MTP graph's key is the step shape, the phase and the lm_head scored (the full one or
`--lm-head-draft`'s rows, whose buffer is rewritten in place on a vocabulary refresh, so its address never
changes).

A graph reads and writes only fixed addresses, so the hidden state handed between MTP steps lives in two
buffers of GraphedMTPSteps: `hidden_in` receives the verify forward's hidden rows (one device copy before
the catch-up replay: the verify graph's output address depends on its own shape), and `state` the rows the
next draft step reads, written by the last op of every catch-up and draft graph. The argmax of the
logits is captured too, so a greedy draft costs one replay and a 4-byte read per row.

A hybrid's graphs carry its state slots as step inputs: the slot and target tables are published before
each replay like the block tables, so one graph serves any slots, and each replay declares the slot spans
of its own step (the live slots read, the targets written) beside its pages.

Capture: inputs are published outside the graph, and an eager run first loads the kernels and fills the
activation pool. The MTP's eager run does not write `state` (the draft step it warms up reads it), and
every eager run writes the same K/V the replay that follows rewrites. A hybrid's eager run writes no
state: its targets are all padding (-1), since a decode step updates its live slot in place and a second
update by the replay would advance the state twice; the launches do not depend on the target values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from ninfer_rt.cuda.graphs import Graph
from ninfer_rt.cuda.linear_ops import GEMV_MAX_ROWS
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.exec.cuda_tensors import DeviceTensor, StepShape, step_shape
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import ForwardOutput, PreparedModel, forward
from ninfer_rt.model.mtp import MTPOutput, PreparedMTP, mtp_forward, scored

if TYPE_CHECKING:  # the executor builds these objects over itself (CudaExecutor.graphed_forward)
    from ninfer_rt.exec.cuda_exec import CudaExecutor

Phase = Literal["catch-up", "draft"]


class GraphedForward:
    """`layers.forward` with decode-width steps (<= 8 rows in total) replayed from CUDA graphs, one per
    StepShape (batch, verify widths, state targets); wider steps (prefill) run eagerly. `states`: a
    hybrid's state slots (None for a dense model)."""

    def __init__(self, executor: CudaExecutor, model: PreparedModel, kv: KVCache, states: StateSlotPool | None = None) -> None:
        self.executor = executor
        self.model = model
        self.kv = kv
        self.states = states
        self.graphs: dict[StepShape, Graph] = {}

    def __call__(self, batch: StepBatch) -> ForwardOutput:
        shape = step_shape(batch)
        if sum(shape.query_lens) > GEMV_MAX_ROWS:
            return forward(self.executor, self.model, batch, self.kv, self.states)
        graph = self.graphs.get(shape)
        if graph is None:
            graph = self.graphs[shape] = self._capture(batch)
        with self.executor.prepublished(batch, self.kv):  # outside the graph, on the stream it replays on
            self.executor.begin_step(batch, self.kv)  # host bookkeeping only
        step_reads, step_writes = self.executor.step_accesses(self.states)
        return graph.replay(step_reads, step_writes, lane=tuple(batch.lanes) or None)

    def _capture(self, batch: StepBatch) -> Graph:
        # The eager run loads every kernel and fills the pool; its outputs are dropped before capturing so
        # the capture finds every buffer it needs free (no allocation while capturing). It writes this
        # step's K/V, which the replay that follows rewrites with the same values, and no state.
        forward(self.executor, self.model, writing_no_state(batch), self.kv, self.states)
        with self.executor.prepublished(batch, self.kv):  # the capture reads the inputs, never copies them
            return self.executor.capture(lambda: forward(self.executor, self.model, batch, self.kv, self.states), self.states)

    def destroy(self) -> None:
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()


@dataclass(frozen=True)
class MTPGraphKey:
    shape: StepShape
    phase: Phase  # a catch-up reads `hidden_in` and keeps its logit rows; a draft step reads `state`
    lm_head: str  # the scored head's buffer name: "w.lm_head" ("w.embed" if tied) or "w.mtp.lm_head_draft"


class GraphedMTPSteps:
    def __init__(self, executor: CudaExecutor, model: PreparedModel, mtp: PreparedMTP, kv: KVCache) -> None:
        self.executor = executor
        self.model = model
        self.mtp = mtp
        self.kv = kv
        self.graphs: dict[MTPGraphKey, Graph] = {}
        hidden = model.config.hidden_size
        self.hidden_in = DeviceBuffer(executor.streams, GEMV_MAX_ROWS * hidden * 2, "mtp.hidden_in")
        self.state = DeviceBuffer(executor.streams, executor.max_seqs * hidden * 2, "mtp.state")  # a row per request
        self._state_rows = 0

    def catch_up(self, batch: StepBatch, hidden: DeviceTensor, lm_head: DeviceTensor) -> MTPOutput:
        if _wide(batch):
            return self._eager(batch, hidden, lm_head, "catch-up")
        self.executor.compute.copy(self.hidden_in, hidden.buffer, hidden.nbytes, label="mtp: verify hidden rows")
        source = DeviceTensor(self.hidden_in, hidden.rows, hidden.cols)
        return self._replay(MTPGraphKey(step_shape(batch), "catch-up", lm_head.buffer.name), batch, source, lm_head)

    def draft(self, batch: StepBatch, lm_head: DeviceTensor) -> MTPOutput:
        if not self._state_rows:
            raise RuntimeError("draft steps follow a catch-up with logit rows")
        source = DeviceTensor(self.state, self._state_rows, self.model.config.hidden_size)
        if _wide(batch):
            return self._eager(batch, source, lm_head, "draft")
        return self._replay(MTPGraphKey(step_shape(batch), "draft", lm_head.buffer.name), batch, source, lm_head)

    def destroy(self) -> None:
        """Graphs and buffers, once the compute stream is idle (a benchmark moving to another KV cache)."""
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()
        self.hidden_in.free()
        self.state.free()

    # -- internals ---------------------------------------------------------------------------------------

    def _eager(self, batch: StepBatch, hidden: DeviceTensor, lm_head: DeviceTensor, phase: Phase) -> MTPOutput:
        out, carried = self._forward(batch, hidden, lm_head, phase)
        self._carry(carried)
        self._state_rows = len(batch.logit_rows)
        return out

    def _replay(self, key: MTPGraphKey, batch: StepBatch, hidden: DeviceTensor, lm_head: DeviceTensor) -> MTPOutput:
        with self.executor.prepublished(batch, self.kv):  # outside the graph, on the stream it replays on
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(lambda: self._forward(batch, hidden, lm_head, key.phase))
            self.executor.begin_step(batch, self.kv)  # host bookkeeping only
        pages_read, pages_written = self.executor.step_pages
        out = graph.replay(pages_read, pages_written, lane=tuple(batch.lanes) or None)
        self._state_rows = len(batch.logit_rows)
        return out

    def _capture(self, forward: Callable[[], tuple[MTPOutput, DeviceTensor | None]]) -> Graph:
        forward()  # eager: kernels loaded, pool filled; its outputs are dropped before capturing

        def enqueue() -> MTPOutput:
            out, carried = forward()
            self._carry(carried)
            return out

        return self.executor.capture(enqueue)

    def _forward(
        self, batch: StepBatch, hidden: DeviceTensor, lm_head: DeviceTensor, phase: Phase
    ) -> tuple[MTPOutput, DeviceTensor | None]:
        """The step's scored logits, and the rows the next draft step reads (None without logit rows)."""
        out = mtp_forward(self.executor, self.model, self.mtp, batch, hidden, self.kv, lm_head)
        logits = scored(self.executor, out.logits, batch)
        if not len(batch.logit_rows):
            return logits, None
        return logits, self.executor.select_rows(out.hidden) if phase == "catch-up" else out.hidden

    def _carry(self, rows: DeviceTensor | None) -> None:
        if rows is not None:
            self.executor.compute.copy(self.state, rows.buffer, rows.nbytes, label="mtp: carry hidden rows")


def writing_no_state(batch: StepBatch) -> StepBatch:
    """`batch` with every state target padding: the same launches, reading the live slots, writing none."""
    if not batch.state_slots.size:
        return batch
    return replace(batch, state_targets=np.full_like(batch.state_targets, -1))


def _wide(batch: StepBatch) -> bool:
    return batch.num_tokens > GEMV_MAX_ROWS
