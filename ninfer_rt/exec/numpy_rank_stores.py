"""The engine's KV pages and state slots as every simulated rank's own, sized for its heads.

The engine keeps one KVCache and one StateSlotPool, with the same page and slot ids for every rank (one
scheduler, one prefix cache, one snapshot store). Under tensor parallelism their layouts are rank-major:
the cache holds N x L layers of a rank's KV heads, rank r's being layers [r L, (r + 1) L); a state slot holds
N x L linear-attention layers of a rank's heads, rank r's the r-th run of L. Whole-page and whole-slot work
(copy-on-write of a tail page, zeroing, snapshot writes and restores) thus covers every rank at once, as it
would run on every GPU, while a rank's ops touch and declare only its part: `Span(("kv", page), r, r + 1)`
of a page (the bare page key the engine declares overlaps them all) and rank r's byte range of a slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ninfer_rt.kv.cache import KVCache, KVLayer, KVSpec, page_resource
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.tensor_parallel import TensorParallelPlan
from ninfer_rt.ordering import Span


def rank_major_kv_spec(spec: KVSpec, plan: TensorParallelPlan) -> KVSpec:
    """The engine's KV geometry for `spec`'s model split by `plan`."""
    return replace(spec, num_layers=spec.num_layers * plan.ranks, n_kv_heads=plan.attention.groups_per_rank)


def rank_major_state_spec(spec: StateSpec, plan: TensorParallelPlan) -> StateSpec:
    """The engine's state-slot geometry for `spec`'s model split by `plan`."""
    return replace(
        spec,
        num_layers=spec.num_layers * plan.ranks,
        key_heads=plan.linear.groups_per_rank,
        value_heads=plan.linear.members_per_rank,
    )


@dataclass(frozen=True)
class RankKV:
    """Rank r's KV cache: a KVCache to the numpy executor's ops."""

    cache: KVCache
    rank: int
    ranks: int

    @property
    def spec(self) -> KVSpec:
        return replace(self.cache.spec, num_layers=self.cache.spec.num_layers // self.ranks)

    @property
    def layers(self) -> list[KVLayer]:
        per_rank = self.cache.spec.num_layers // self.ranks
        return self.cache.layers[self.rank * per_rank : (self.rank + 1) * per_rank]

    def page_resource(self, page: int) -> Span:
        return Span(page_resource(page), self.rank, self.rank + 1)


@dataclass(frozen=True)
class RankStates:
    """Rank r's state slots: a StateSlotPool to the numpy executor's linear-attention op."""

    pool: StateSlotPool
    rank: int
    ranks: int

    @property
    def _layers(self) -> int:
        return self.pool.spec.num_layers // self.ranks

    def resource(self, slot: int) -> Span:
        start = self.pool.offset(slot) + self.rank * self._layers * self.pool.spec.layer_bytes
        return Span(self.pool.buffer.resource, start, start + self._layers * self.pool.spec.layer_bytes)

    def conv_window(self, slot: int, layer: int) -> np.ndarray:
        return self.pool.conv_window(slot, self.rank * self._layers + layer)

    def recurrent(self, slot: int, layer: int) -> np.ndarray:
        return self.pool.recurrent(slot, self.rank * self._layers + layer)
