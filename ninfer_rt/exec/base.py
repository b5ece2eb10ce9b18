"""What a forward step needs, independent of where it runs.

`StepBatch` is the host-side description of one step: any mix of prefill chunks and decode tokens over
the paged KV (DESIGN.md, "Data layouts"). `Executor` is the interface `model/layers.py` is written against;
`exec/numpy_exec.py` (reference, CPU) and `exec/cuda_exec.py` (GPU) implement it. Tensors are opaque to
layers.py: numpy arrays on one, device buffers on the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.kv.cache import KVCache

Tensor = Any


@dataclass
class StepBatch:
    """One step for B sequences and T new tokens in total (rows of every activation tensor)."""

    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]: absolute position of each new token
    query_start: np.ndarray  # int32 [B+1]: sequence b owns rows query_start[b]:query_start[b+1]
    context_lens: np.ndarray  # int32 [B]: tokens in sequence b's KV after this step's writes
    block_tables: np.ndarray  # int32 [B, max_pages]: page ids in order, -1 where unused
    slot_mapping: np.ndarray  # int32 [T]: page * page_size + offset receiving each new token's K/V
    logit_rows: np.ndarray  # int32 [N]: rows whose logits the sampler needs
    lanes: tuple = ()  # per-sequence request ids, for op labels and crash dumps

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    def pages_read(self) -> set[int]:
        """Every page a step's attention may read (declared to the ordering verifier)."""
        return {int(p) for p in self.block_tables.reshape(-1) if p >= 0}

    def pages_written(self, page_size: int) -> set[int]:
        return {int(s) // page_size for s in self.slot_mapping}


class Executor(Protocol):
    """The ops model/layers.py composes. Each enqueues on `compute` and declares its accesses."""

    streams: StreamSet
    compute: Stream

    def begin_step(self, batch: StepBatch, kv: KVCache) -> None:
        """Publish the step's inputs (ids, positions, block tables, slots) in the compute stream's order."""

    def embed(self, table: Tensor) -> Tensor: ...

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(normed, new_residual): new_residual = x + residual (or x), normed = rmsnorm(new_residual)."""

    def linear(self, x: Tensor, weight: Tensor) -> Tensor: ...

    def attention(self, qkv: Tensor, layer: Any, layer_index: int, kv: KVCache) -> Tensor:
        """q/k RMSNorm (if the layer has it), RoPE, K/V write into pages, paged causal attention."""

    def silu_mul(self, gate_up: Tensor) -> Tensor: ...

    def logits(self, hidden: Tensor, lm_head: Tensor) -> np.ndarray:
        """float32 [N, vocab] on the host for the step's logit_rows."""
