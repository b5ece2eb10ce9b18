"""Tensor parallelism on the CPU: N numpy executors, one per simulated rank, behind one Executor.

The model runs unchanged (model/layers.py, model/mtp.py): every tensor it holds is `Ranked`, one array per
rank. Weights arrive split by the plan (model/tensor_parallel.py's `shard_weights`) and each rank prepares
its part; activations are replicated between the layers' halves and split inside them. An op runs on every
rank; after a row-parallel projection (o_proj, down_proj, out_proj) and the vocabulary-sharded embedding
the ranks' partial sums are all-reduced, and the vocabulary-sharded logits are all-gathered
(exec/numpy_collectives.py). Attention and the Gated DeltaNet run on each rank with its heads only, over its
share of the engine's KV pages and state slots (exec/numpy_rank_stores.py).

Every rank enqueues on its own logical compute stream. The engine sees `compute`, one stream for all of
them: each op forks from it (every rank waits on an event of `compute`) and joins back into it (`compute`
waits on every rank), so whatever the engine enqueues on `compute` (publishes, page copies, snapshot
copies, release fences) is ordered with every rank's work, exactly as with one executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.numpy_collectives import Collectives
from ninfer_rt.exec.numpy_exec import HostSteps, NumpyExecutor, ReadyRead
from ninfer_rt.exec.numpy_rank_stores import RankKV, RankStates
from ninfer_rt.kv.cache import KVCache, KVDtype
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import AttentionParams, AttentionShape, LinearAttentionParams, StepBatch, WeightRole
from ninfer_rt.model.layers import PreparedModel
from ninfer_rt.model.mtp import PreparedMTP
from ninfer_rt.model.tensor_parallel import Shards, Split, TensorParallelPlan

T = TypeVar("T")


@dataclass(frozen=True)
class Ranked:
    """A tensor as one array per rank. `split` (weights only) says how the parts' results combine; None:
    every rank holds the whole (an activation, a norm gain, a replicated matrix)."""

    parts: tuple[np.ndarray, ...]
    split: Split | None = None


class TensorParallelExecutor(HostSteps):
    """The Executor protocol (model/executor.py) over `plan.ranks` NumpyExecutors."""

    def __init__(self, streams: StreamSet, plan: TensorParallelPlan, dtype: type = np.float32) -> None:
        self.streams = streams
        self.compute = streams.create("compute")
        self.dtype = np.dtype(dtype)
        self.plan = plan
        self.ranks = [NumpyExecutor(streams, dtype, compute_name=f"compute.rank{r}") for r in range(plan.ranks)]
        self.collectives = Collectives(streams, [rank.compute for rank in self.ranks])
        self._lane: object = None

    # -- preparation -------------------------------------------------------------------------------------

    def prepare_weight(self, name: str, parts: Sequence[object], role: WeightRole) -> Ranked:
        split = _common_split(name, parts)
        return Ranked(tuple(rank.prepare_weight(name, _rank_parts(parts, r), role) for r, rank in enumerate(self.ranks)), split)

    def rewrite_weight(self, weight: Ranked, parts: Sequence[object]) -> None:
        for r, rank in enumerate(self.ranks):
            rank.rewrite_weight(weight.parts[r], _rank_parts(parts, r))

    def prepare_rope(self, inv_freq: np.ndarray, attention_scaling: float) -> Ranked:
        return Ranked(tuple(rank.prepare_rope(inv_freq, attention_scaling) for rank in self.ranks))

    # -- step --------------------------------------------------------------------------------------------

    def begin_step(self, batch: StepBatch, kv: KVCache) -> None:
        self._lane = tuple(batch.lanes) or None
        self._each(lambda r, rank: rank.begin_step(batch, self._rank_kv(kv, r)))

    def embed(self, table: Ranked) -> Ranked:
        if table.split is not Split.VOCAB:
            return self._ranked(lambda r, rank: rank.embed(table.parts[r]))
        shards = self._each(lambda r, rank: rank.embed_vocab_shard(table.parts[r], self.plan.vocab_rows(r).start))
        return self._combined(self.collectives.all_reduce, shards, "all_reduce embed")

    def rmsnorm(self, x: Ranked, weight: Ranked, eps: float, residual: Ranked | None = None) -> tuple[Ranked, Ranked]:
        pairs = self._each(lambda r, rank: rank.rmsnorm(x.parts[r], weight.parts[r], eps, None if residual is None else residual.parts[r]))
        return Ranked(tuple(normed for normed, _ in pairs)), Ranked(tuple(summed for _, summed in pairs))

    def linear(self, x: Ranked, weight: Ranked) -> Ranked:
        outputs = self._each(lambda r, rank: rank.linear(x.parts[r], weight.parts[r]))
        if weight.split is Split.ROWS:  # partial sums of a row-parallel projection
            return self._combined(self.collectives.all_reduce, outputs, "all_reduce")
        return Ranked(tuple(outputs))

    def concat(self, parts: Sequence[Ranked]) -> Ranked:
        return self._ranked(lambda r, rank: rank.concat([part.parts[r] for part in parts]))

    def silu_mul(self, gate_up: Ranked) -> Ranked:
        return self._ranked(lambda r, rank: rank.silu_mul(gate_up.parts[r]))

    def attention(self, qkv: Ranked, params: AttentionParams, kv: KVCache, kv_layer: int) -> Ranked:
        return self._ranked(lambda r, rank: rank.attention(qkv.parts[r], self._rank_attention(params, r), self._rank_kv(kv, r), kv_layer))

    def linear_attention(self, projected: Ranked, params: LinearAttentionParams, states: StateSlotPool, layer: int) -> Ranked:
        return self._ranked(
            lambda r, rank: rank.linear_attention(
                projected.parts[r], self._rank_linear(params, r), RankStates(states, r, len(self.ranks)), layer
            )
        )

    def select_rows(self, x: Ranked) -> Ranked:
        return self._ranked(lambda r, rank: rank.select_rows(x.parts[r]))

    def logits(self, hidden: Ranked, lm_head: Ranked) -> Ranked:
        scores = self._each(lambda r, rank: rank.logits(hidden.parts[r], lm_head.parts[r]))
        if lm_head.split is Split.VOCAB:  # each rank scored its vocabulary run
            return self._combined(self.collectives.all_gather, scores, "all_gather logits")
        return Ranked(tuple(scores))

    def argmax(self, logits: Ranked) -> Ranked:
        return self._ranked(lambda r, rank: rank.argmax(logits.parts[r]))

    def to_host(self, x: Ranked) -> np.ndarray:
        """Rank 0's copy: every rank holds the same replicated result."""
        self.compute.synchronize()
        return self.ranks[0].to_host(x.parts[0])

    def read_later(self, x: Ranked) -> ReadyRead:
        return ReadyRead(self.to_host(x))

    def feed(self, ids: Ranked | np.ndarray) -> None:
        self._each(lambda r, rank: rank.feed(ids.parts[r] if isinstance(ids, Ranked) else ids))

    # -- internals ---------------------------------------------------------------------------------------

    def _each(self, op: Callable[[int, NumpyExecutor], T]) -> list[T]:
        """`op` on every rank, forked from `compute` and joined back into it."""
        self._fork()
        results = [op(r, rank) for r, rank in enumerate(self.ranks)]
        self._join()
        return results

    def _ranked(self, op: Callable[[int, NumpyExecutor], np.ndarray]) -> Ranked:
        return Ranked(tuple(self._each(op)))

    def _combined(self, collective: Callable[..., list[np.ndarray]], parts: list[np.ndarray], label: str) -> Ranked:
        self._fork()
        results = collective(parts, label, self._lane)
        self._join()
        return Ranked(tuple(results))

    def _fork(self) -> None:
        forked = self.compute.record()
        for rank in self.ranks:
            rank.compute.wait(forked)

    def _join(self) -> None:
        for rank in self.ranks:
            self.compute.wait(rank.compute.record())

    def _rank_kv(self, kv: KVCache, rank: int) -> RankKV:
        return RankKV(kv, rank, len(self.ranks))

    def _rank_attention(self, params: AttentionParams, r: int) -> AttentionParams:
        return replace(
            params,
            shape=self.plan.attention_shape(params.shape),
            rope=params.rope.parts[r],
            q_norm=None if params.q_norm is None else params.q_norm.parts[r],
            k_norm=None if params.k_norm is None else params.k_norm.parts[r],
        )

    def _rank_linear(self, params: LinearAttentionParams, r: int) -> LinearAttentionParams:
        return replace(
            params,
            shape=self.plan.linear_shape(params.shape),
            conv_weight=params.conv_weight.parts[r],
            a_log=params.a_log.parts[r],
            dt_bias=params.dt_bias.parts[r],
            norm=params.norm.parts[r],
        )


def _rank_parts(parts: Sequence[object], rank: int) -> list[np.ndarray]:
    return [part.parts[rank] if isinstance(part, Shards) else part for part in parts]


def _common_split(name: str, parts: Sequence[object]) -> Split | None:
    """How the prepared weight's results combine: its parts' common split (None: replicated)."""
    splits = {part.split if isinstance(part, Shards) else None for part in parts}
    if len(splits) != 1:
        raise ValueError(f"{name}: parts split differently ({sorted(str(s) for s in splits)}) cannot be fused")
    return splits.pop()
