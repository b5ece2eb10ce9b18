"""One step on the executor: scheduled chunks -> StepBatch -> forward -> sampled tokens.

Executor-agnostic: it speaks model.executor.StepBatch and model.layers.forward, so the numpy executor and the
CUDA executor run the same code. `run` returns a list of tokens per sampling request; here that list
holds one token, and the speculative runner (spec.py) returns the accepted drafts plus the bonus token
through the same shape.

A hybrid model's steps also carry each sequence's state slots (engine/state_ledger.py): the runner asks
the ledger's states for them as it lays out a sequence's rows (`StateRing.begin`) and tells it once the
forward is enqueued (`StateRing.end`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ninfer_rt.engine.kv_ledger import KVLedger
from ninfer_rt.engine.request import Request
from ninfer_rt.engine.sampling import PendingSamples, Sample, start_sampling
from ninfer_rt.engine.scheduler import ScheduledChunk
from ninfer_rt.engine.state_ledger import StateRows
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.kv.sequence import SequenceKV
from ninfer_rt.model.executor import Executor, StepBatch, StepForward
from ninfer_rt.model.layers import ForwardOutput, PreparedModel, forward

@dataclass(frozen=True)
class SampledTokens:
    request: Request
    samples: list[Sample]
    drafted: int = 0  # drafts verified this step (speculative decoding): len(samples) - 1 were accepted


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows in a step: `token_ids` at positions start, start + 1, ...; logits are wanted
    for the rows at `logit_offsets` (relative to the sequence's first row)."""

    seq: SequenceKV
    start: int
    token_ids: Sequence[int]
    logit_offsets: Sequence[int]
    lane: str
    state: StateRows | None = None  # a hybrid's linear-attention state slots for these rows


def state_arrays(parts: Sequence[SeqRows]) -> dict[str, np.ndarray]:
    """StepBatch.state_slots / state_targets ([B], [B, S], -1 pads at the front); none for a step whose
    rows touch no linear-attention state (a dense model's, or an MTP step's)."""
    if all(part.state is None for part in parts):
        return {}
    width = max(len(part.state.targets) for part in parts)
    targets = np.full((len(parts), width), -1, np.int32)
    for row, part in enumerate(parts):
        targets[row, width - len(part.state.targets) :] = part.state.targets
    return {"state_slots": np.array([part.state.slot for part in parts], np.int32), "state_targets": targets}


def step_batch(parts: Sequence[SeqRows]) -> StepBatch:
    sizes = [len(part.token_ids) for part in parts]
    query_start = np.cumsum([0, *sizes]).astype(np.int32)
    positions = [np.arange(part.start, part.start + size) for part, size in zip(parts, sizes)]
    width = max(len(part.seq.pages) for part in parts)
    return StepBatch(
        token_ids=np.concatenate([np.asarray(part.token_ids, np.int64) for part in parts]).astype(np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        query_start=query_start,
        context_lens=np.array([part.start + size for part, size in zip(parts, sizes)], np.int32),
        block_tables=np.stack([part.seq.block_table_row(width) for part in parts]),
        slot_mapping=np.concatenate([part.seq.slots(pos) for part, pos in zip(parts, positions)]),
        logit_rows=np.array(
            [query_start[i] + offset for i, part in enumerate(parts) for offset in part.logit_offsets], np.int32
        ),
        lanes=tuple(part.lane for part in parts),
        **state_arrays(parts),
    )


class ModelRunner:
    def __init__(
        self,
        executor: Executor,
        model: PreparedModel,
        kv: KVCache,
        ledger: KVLedger,
        step_forward: StepForward | None = None,
    ) -> None:
        self.executor = executor
        self.model = model
        self.kv = kv
        self.ledger = ledger
        self.states = ledger.states  # None: no linear-attention layers
        states = None if self.states is None else self.states.pool
        # The CUDA executor replays steps from graphs keyed by step shape; the default is the plain forward.
        self.forward = step_forward or (lambda batch: forward(executor, model, batch, kv, states))

    def run(self, chunks: Sequence[ScheduledChunk]) -> list[SampledTokens]:
        output = self.launch(chunks)
        sampling = [chunk.request for chunk in chunks if chunk.samples]
        samples = self.sample(output, sampling, feed=False).result()
        return [SampledTokens(request, [s]) for request, s in zip(sampling, samples)]

    def launch(self, chunks: Sequence[ScheduledChunk]) -> ForwardOutput:
        """Enqueue the step's forward; its logit rows are the sampling chunks', in order."""
        parts = [self.chunk_rows(chunk) for chunk in chunks]
        return self.run_forward(parts, step_batch(parts))

    def run_forward(self, parts: Sequence[SeqRows], batch: StepBatch) -> ForwardOutput:
        """Enqueue the forward of `batch` (laid out from `parts`); their state targets now hold states."""
        out = self.forward(batch)
        for part in parts:
            if part.state is not None:
                part.state.end()
        return out

    def sample(self, output: ForwardOutput, requests: Sequence[Request], feed: bool) -> PendingSamples:
        """One token per logit row, request i from row i: on the device where the executor can (4 bytes
        per row back, read later), else from host copies of the rows. `feed`: see start_sampling."""
        return start_sampling(self.executor, output.logits, requests, feed)

    def chunk_rows(self, chunk: ScheduledChunk) -> SeqRows:
        request, start, size = chunk.request, chunk.request.num_computed, chunk.num_tokens
        return SeqRows(
            self.ledger.sequence(request),
            start,
            request.token_slice(start, start + size),
            [size - 1] if chunk.samples else [],
            request.request_id,
            self.state_rows(request, rows=size),
        )

    def state_rows(self, request: Request, saved: int = 1, rows: int = 1) -> StateRows | None:
        """The request's state slots for its `rows` rows of the next forward (none for a dense model)."""
        return None if self.states is None else self.states.begin(request, saved, rows)
