"""The CUDA executor's step inputs (rule 3): a step's nine int32 arrays (the hybrid's state slots and
targets among them), checked, packed into one staging slot and copied by one copy on the compute stream
into one device buffer, at offsets that depend only on the arrays' lengths (so on the step's shape).
That is what lets a captured step (exec/cuda_graphs.py) replay after a fresh publish into the same
addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer, DeviceView, StagingRing
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.exec.cuda_linear_attn import MAX_STATE_TARGETS
from ninfer_rt.model.executor import StepBatch

STEP_INPUTS = (
    "token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping", "logit_rows", "state_slots",
    "state_targets",
)
MAX_INPUT_LAYOUTS = 1024


@dataclass(frozen=True)
class StepLimits:
    """What the executor was sized for: a step beyond any of it is refused before anything is published."""

    max_tokens: int
    max_seqs: int
    max_pages_per_seq: int
    max_positions: int
    max_logit_rows: int

    def capacity(self, name: str) -> int:
        """int32s of the step input `name` at most."""
        return {
            "query_start": self.max_seqs + 1,
            "context_lens": self.max_seqs,
            "block_tables": self.max_seqs * self.max_pages_per_seq,
            "logit_rows": self.max_logit_rows,
            "state_slots": self.max_seqs,
            "state_targets": self.max_seqs * MAX_STATE_TARGETS,
        }.get(name, self.max_tokens)

    def input_bytes(self) -> int:
        return 4 * sum(-(-self.capacity(name) // 4) * 4 for name in STEP_INPUTS)


@dataclass(frozen=True)
class InputLayout:
    """Where a step's input arrays (in STEP_INPUTS order) sit in the one step-input buffer, in int32s."""

    offsets: tuple[int, ...]
    size: int
    views: dict[str, DeviceView]


class StepInputs:
    """The one step-input buffer and its staging ring (which also stages the host ids a step is fed)."""

    def __init__(self, streams: StreamSet, limits: StepLimits) -> None:
        self.limits = limits
        self.buffer = DeviceBuffer(streams, limits.input_bytes(), "step.inputs")
        self.staging = StagingRing(streams, 3, limits.input_bytes(), name="step_inputs")
        self._layouts: dict[tuple[int, ...], InputLayout] = {}

    def publish(self, stream: Stream, batch: StepBatch, lane: object) -> dict[str, DeviceView]:
        """Copy the step's arrays into the buffer on `stream`; returns their views."""
        tables = np.full((batch.num_seqs, self.limits.max_pages_per_seq), -1, np.int32)
        tables[:, : batch.block_tables.shape[1]] = batch.block_tables
        arrays = {name: getattr(batch, name) for name in STEP_INPUTS} | {"block_tables": tables}
        lengths = tuple(int(np.size(arrays[name])) for name in STEP_INPUTS)
        layout = self._layouts.get(lengths)
        if layout is None:
            if len(self._layouts) >= MAX_INPUT_LAYOUTS:  # prefill lengths vary: stay bounded (offsets
                self._layouts.clear()  # are a function of the lengths, so a rebuilt layout is the same)
            layout = self._layouts[lengths] = input_layout(self.buffer, dict(zip(STEP_INPUTS, lengths)))
        packed = np.zeros(layout.size, np.int32)  # alignment gaps stay 0
        for name, offset, length in zip(STEP_INPUTS, layout.offsets, lengths):
            packed[offset : offset + length] = np.ravel(arrays[name])
        self.staging.publish(stream, self.buffer, packed, label="publish step inputs", lane=lane)
        return layout.views


def check_step(batch: StepBatch, limits: StepLimits, vocab: int, fed_rows: int) -> None:
    """Limits and token ids, before anything is published: a kernel never sees an id out of range (ids in
    [-fed_rows, 0) name rows of the device-side feed)."""
    counts = {
        "tokens": (batch.num_tokens, limits.max_tokens),
        "sequences": (batch.num_seqs, limits.max_seqs),
        "pages per sequence": (batch.block_tables.shape[1], limits.max_pages_per_seq),
        "logit rows": (len(batch.logit_rows), limits.max_logit_rows),
        "state targets per sequence": (batch.state_targets.shape[1] if batch.state_slots.size else 0, MAX_STATE_TARGETS),
    }
    for what, (value, limit) in counts.items():
        if value > limit:
            raise ValueError(f"step has {value} {what}, the executor was sized for {limit}")
    ids = batch.token_ids
    if vocab and ids.size and (ids.min() < -fed_rows or ids.max() >= vocab):
        raise ValueError(f"token id out of range [0, {vocab}) (or [-{fed_rows}, 0): fed rows): {int(ids.min())}..{int(ids.max())}")
    if batch.positions.size and (batch.positions.min() < 0 or batch.positions.max() >= limits.max_positions):
        raise ValueError(
            f"positions {int(batch.positions.min())}..{int(batch.positions.max())} outside the RoPE table [0, {limits.max_positions})"
        )
    if len(batch.logit_rows) and (batch.logit_rows.min() < 0 or batch.logit_rows.max() >= batch.num_tokens):
        raise ValueError("logit_rows must index the step's rows")
    if batch.state_slots.size:
        check_state_targets(batch)


def check_state_targets(batch: StepBatch) -> None:
    """Slots [B] and targets [B, S] (-1 pads at the front), and no target asking for the state after a row
    count below zero: a kernel then never reads or writes a slot the step did not name."""
    slots, targets = batch.state_slots, batch.state_targets
    if slots.shape != (batch.num_seqs,) or targets.ndim != 2 or targets.shape[0] != batch.num_seqs:
        raise ValueError(f"state_slots {slots.shape} / state_targets {targets.shape} for {batch.num_seqs} sequences")
    if slots.min() < 0 or targets.min() < -1:
        raise ValueError("state slots must be >= 0 and state targets >= -1 (padding)")
    lengths, width = np.diff(batch.query_start), targets.shape[1]
    for seq, length in enumerate(lengths):
        wanted = [int(length) - width + 1 + t for t in range(width) if targets[seq, t] >= 0]
        if wanted and wanted[0] < 0:
            raise ValueError(f"sequence {seq} has {int(length)} rows; its state targets ask for the state after {wanted[0]}")


def input_layout(buffer: DeviceBuffer, lengths: dict[str, int]) -> InputLayout:
    """Consecutive regions of `lengths` int32s in `buffer`, each 16-byte aligned (an empty one still gets
    4 bytes: a kernel argument needs an address)."""
    offsets, views, end = [], {}, 0
    for name, length in lengths.items():
        offsets.append(end)
        views[name] = DeviceView(buffer, 4 * end, 4 * max(length, 1), f"step.{name}")
        end += -(-max(length, 1) // 4) * 4
    return InputLayout(tuple(offsets), end, views)
