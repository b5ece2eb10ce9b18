"""One step on the executor: scheduled chunks -> StepBatch -> forward -> sampled tokens.

Executor-agnostic: it speaks exec.base.StepBatch and model.layers.forward, so the numpy executor and the
CUDA executor run the same code. `run` returns a list of tokens per sampling request; today that list
holds one token, and speculative decoding (MTP) will return the accepted drafts plus the bonus token
through the same shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ninfer_rt.engine.kv_ledger import KVLedger
from ninfer_rt.engine.request import Request
from ninfer_rt.engine.sampling import Sample, sample
from ninfer_rt.engine.scheduler import ScheduledChunk
from ninfer_rt.exec.base import Executor, StepBatch
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.model.layers import PreparedModel, forward


@dataclass(frozen=True)
class SampledTokens:
    request: Request
    samples: list[Sample]


class ModelRunner:
    def __init__(self, executor: Executor, model: PreparedModel, kv: KVCache, ledger: KVLedger) -> None:
        self.executor = executor
        self.model = model
        self.kv = kv
        self.ledger = ledger

    def run(self, chunks: Sequence[ScheduledChunk]) -> list[SampledTokens]:
        batch = self.build_batch(chunks)
        output = forward(self.executor, self.model, batch, self.kv)
        logits = self.executor.to_host(output.logits)
        sampling = [chunk.request for chunk in chunks if chunk.samples]
        return [
            SampledTokens(request, [sample(row, request.params, request.generator, request.prompt_ids, request.output_ids)])
            for request, row in zip(sampling, logits)
        ]

    def build_batch(self, chunks: Sequence[ScheduledChunk]) -> StepBatch:
        sequences = [self.ledger.sequence(chunk.request) for chunk in chunks]
        width = max(len(seq.pages) for seq in sequences)
        starts = [chunk.request.num_computed for chunk in chunks]
        sizes = [chunk.num_tokens for chunk in chunks]
        query_start = np.cumsum([0, *sizes]).astype(np.int32)
        return StepBatch(
            token_ids=np.concatenate(
                [chunk.request.all_ids[start : start + size] for chunk, start, size in zip(chunks, starts, sizes)]
            ).astype(np.int32),
            positions=np.concatenate([np.arange(start, start + size) for start, size in zip(starts, sizes)]).astype(np.int32),
            query_start=query_start,
            context_lens=np.array([start + size for start, size in zip(starts, sizes)], np.int32),
            block_tables=np.stack([seq.block_table_row(width) for seq in sequences]),
            slot_mapping=np.concatenate([seq.slot_mapping(size) for seq, size in zip(sequences, sizes)]),
            logit_rows=np.array([query_start[i + 1] - 1 for i, chunk in enumerate(chunks) if chunk.samples], np.int32),
            lanes=tuple(chunk.request.request_id for chunk in chunks),
        )
