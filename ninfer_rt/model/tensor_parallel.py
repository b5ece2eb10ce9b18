"""Tensor parallelism's sharding plan: which rows and columns of each weight rank r of N holds.

Megatron's split, one all-reduce per mixer and one per MLP:
  - column-parallel (each rank a slice of the output rows, no communication): q/k/v (and the gated
    attention's gate) by head, gate/up by intermediate row, a Gated DeltaNet's input projections by head;
  - row-parallel (each rank a slice of the input columns, partial sums to all-reduce): o_proj, down_proj,
    out_proj;
  - vocab-parallel: the embedding (each rank embeds the ids in its range, zeros elsewhere, all-reduce) and
    the lm_head (each rank scores its range, all-gather);
  - everything else (norm gains, the MTP's fc) is replicated: each rank computes it whole.

Heads split in groups: a query head reads KV head h // (H / KV), a Gated DeltaNet value head reads key head
j // (Hv / Hk). Each rank gets an equal run of the member heads (q heads, value heads) and the group heads
they read; when there are fewer group heads than ranks, a group head is replicated on the ranks that share
it. The conv channels of in_proj_qkv are three sections [q | k | v], each sliced by head: a rank's channels
are its key heads' q rows, its key heads' k rows and its value heads' v rows, not a contiguous run.

`shard_weights` returns the checkpoint's structure with each split array replaced by `Shards` (views where
numpy can keep one); replicated arrays stay as they are. The executor that runs the ranks
(exec/numpy_tensor_parallel.py) prepares rank r's weights from part r of each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.executor import AttentionShape, LinearAttentionShape
from ninfer_rt.model.hybrid_weights import GatedAttentionWeights, LinearAttentionWeights
from ninfer_rt.model.weights import HybridLayerWeights, LayerWeights, ModelWeights, MTPWeights


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks (one line naming the dimension)."""


class Split(Enum):
    """How a weight's per-rank parts combine into the whole layer's result."""

    COLUMNS = "columns"  # output rows split: each rank's output is its slice, nothing to combine
    ROWS = "rows"  # input columns split: the outputs are partial sums, all-reduced
    VOCAB = "vocab"  # vocabulary rows split: embeddings all-reduced, logits all-gathered


@dataclass(frozen=True)
class Shards:
    """A weight as N per-rank arrays, and how their results combine."""

    parts: tuple[np.ndarray, ...]
    split: Split


@dataclass(frozen=True)
class HeadSplit:
    """`members` heads reading `groups` shared heads (member h reads group h // (members / groups)), dealt
    to `ranks` ranks in equal runs."""

    members: int
    groups: int
    ranks: int
    what: str  # for errors: "attention heads", "linear-attention value heads"

    def __post_init__(self) -> None:
        if self.members % self.ranks:
            raise TensorParallelError(f"--tensor-parallel {self.ranks}: {self.members} {self.what} do not split evenly")
        if self.groups % self.ranks and self.ranks % self.groups:
            raise TensorParallelError(
                f"--tensor-parallel {self.ranks}: {self.groups} shared heads of the {self.what} neither split "
                f"evenly nor replicate evenly"
            )

    @property
    def members_per_rank(self) -> int:
        return self.members // self.ranks

    @property
    def groups_per_rank(self) -> int:
        return max(self.groups // self.ranks, 1)

    def member_heads(self, rank: int) -> range:
        return range(rank * self.members_per_rank, (rank + 1) * self.members_per_rank)

    def group_heads(self, rank: int) -> range:
        first = self.member_heads(rank).start // (self.members // self.groups)
        return range(first, first + self.groups_per_rank)


@dataclass(frozen=True)
class TensorParallelPlan:
    """The split of one model over `ranks` ranks (`plan_for` checks that it exists)."""

    config: ModelConfig
    ranks: int
    attention: HeadSplit
    linear: HeadSplit | None  # the Gated DeltaNet's; None for a dense model

    def vocab_rows(self, rank: int) -> range:
        """Rank r's run of vocabulary ids (the first vocab % N ranks hold one more)."""
        bounds = np.linspace(0, self.config.vocab_size, self.ranks + 1).astype(int)
        return range(int(bounds[rank]), int(bounds[rank + 1]))

    def attention_shape(self, shape: AttentionShape) -> AttentionShape:
        """One rank's attention geometry."""
        return replace(shape, num_heads=self.attention.members_per_rank, num_kv_heads=self.attention.groups_per_rank)

    def linear_shape(self, shape: LinearAttentionShape) -> LinearAttentionShape:
        return replace(shape, num_key_heads=self.linear.groups_per_rank, num_value_heads=self.linear.members_per_rank)


def plan_for(cfg: ModelConfig, ranks: int) -> TensorParallelPlan:
    """The split of `cfg` over `ranks` ranks; TensorParallelError names the dimension that does not split."""
    if ranks < 1:
        raise TensorParallelError(f"--tensor-parallel must be at least 1, got {ranks}")
    attention = HeadSplit(cfg.num_attention_heads, cfg.num_key_value_heads, ranks, "attention heads")
    linear = cfg.linear_attention
    if linear is not None:
        linear = HeadSplit(linear.num_value_heads, linear.num_key_heads, ranks, "linear-attention value heads")
    if cfg.intermediate_size % ranks:
        raise TensorParallelError(f"--tensor-parallel {ranks}: intermediate size {cfg.intermediate_size} does not split evenly")
    if cfg.vocab_size < ranks:
        raise TensorParallelError(f"--tensor-parallel {ranks}: more ranks than vocabulary rows")
    return TensorParallelPlan(cfg, ranks, attention, linear)


def heads_rows(heads: range, head_dim: int) -> np.ndarray:
    """Row indices of `heads` in a [heads * head_dim, ...] matrix."""
    return np.arange(heads.start * head_dim, heads.stop * head_dim)


def rows(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """array[index] along the output rows: a view when the rows are one contiguous run."""
    _require_dense(array)
    if np.array_equal(index, np.arange(index[0], index[0] + len(index))):
        return array[index[0] : index[0] + len(index)]
    return array[index]


def columns(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """array[:, index] for a contiguous run of input columns (a view)."""
    _require_dense(array)
    return array[:, index[0] : index[0] + len(index)]


def _require_dense(array: object) -> None:
    if not isinstance(array, np.ndarray):
        raise TensorParallelError("--tensor-parallel: quantized checkpoints are not split yet; use a bf16 checkpoint")


def _by_rank(plan: TensorParallelPlan, split: Split, part: Callable[[int], np.ndarray]) -> Shards:
    return Shards(tuple(part(rank) for rank in range(plan.ranks)), split)


def shard_weights(weights: ModelWeights, plan: TensorParallelPlan) -> ModelWeights:
    """`weights` with every split array as Shards (the norms, the MTP's fc and norms replicated)."""
    embed = _by_rank(plan, Split.VOCAB, lambda r: rows(weights.embed, np.asarray(plan.vocab_rows(r))))
    return replace(
        weights,
        embed=embed,
        layers=[_shard_layer(layer, plan) for layer in weights.layers],
        lm_head=embed if weights.config.tie_word_embeddings else _by_rank(plan, Split.VOCAB, lambda r: rows(weights.lm_head, np.asarray(plan.vocab_rows(r)))),
        mtp=None if weights.mtp is None else _shard_mtp(weights.mtp, plan),
        draft_head=None,
    )


def _shard_mtp(mtp: MTPWeights, plan: TensorParallelPlan) -> MTPWeights:
    return replace(mtp, layer=_shard_layer(mtp.layer, plan))


def _shard_layer(layer: LayerWeights | HybridLayerWeights, plan: TensorParallelPlan) -> LayerWeights | HybridLayerWeights:
    inter = plan.config.intermediate_size // plan.ranks
    mlp = {
        "gate_proj": _by_rank(plan, Split.COLUMNS, lambda r: rows(layer.gate_proj, np.arange(r * inter, (r + 1) * inter))),
        "up_proj": _by_rank(plan, Split.COLUMNS, lambda r: rows(layer.up_proj, np.arange(r * inter, (r + 1) * inter))),
        "down_proj": _by_rank(plan, Split.ROWS, lambda r: columns(layer.down_proj, np.arange(r * inter, (r + 1) * inter))),
    }
    if isinstance(layer, HybridLayerWeights):
        mixer = layer.mixer
        if isinstance(mixer, LinearAttentionWeights):
            return replace(layer, mixer=_shard_linear_attention(mixer, plan), **mlp)
        return replace(layer, mixer=replace(mixer, **_attention_fields(mixer, plan)), **mlp)
    return replace(layer, **_attention_fields(layer, plan), **mlp)


def _attention_fields(weights: LayerWeights | GatedAttentionWeights, plan: TensorParallelPlan) -> dict[str, Shards]:
    """q/k/v by head (a rank's KV heads are those its q heads read), o_proj by the q heads' columns; the
    gated attention's gate rows go with their q heads."""
    split, head_dim = plan.attention, plan.config.head_dim

    def q_heads(array: np.ndarray) -> Shards:
        return _by_rank(plan, Split.COLUMNS, lambda r: rows(array, heads_rows(split.member_heads(r), head_dim)))

    def kv_heads(array: np.ndarray) -> Shards:
        return _by_rank(plan, Split.COLUMNS, lambda r: rows(array, heads_rows(split.group_heads(r), head_dim)))

    fields = {
        "q_proj": q_heads(weights.q_proj),
        "k_proj": kv_heads(weights.k_proj),
        "v_proj": kv_heads(weights.v_proj),
        "o_proj": _by_rank(plan, Split.ROWS, lambda r: columns(weights.o_proj, heads_rows(split.member_heads(r), head_dim))),
    }
    if isinstance(weights, GatedAttentionWeights):
        fields["gate_proj"] = q_heads(weights.gate_proj)
    return fields


def linear_channels(plan: TensorParallelPlan, rank: int) -> np.ndarray:
    """Rank r's conv channels of in_proj_qkv: its key heads' q rows, their k rows, its value heads' v rows."""
    linear, split = plan.config.linear_attention, plan.linear
    key_size = linear.num_key_heads * linear.key_head_dim
    keys = heads_rows(split.group_heads(rank), linear.key_head_dim)
    values = heads_rows(split.member_heads(rank), linear.value_head_dim)
    return np.concatenate([keys, key_size + keys, 2 * key_size + values])


def _shard_linear_attention(weights: LinearAttentionWeights, plan: TensorParallelPlan) -> LinearAttentionWeights:
    split, value_dim = plan.linear, plan.config.linear_attention.value_head_dim

    def by_value_head(array: np.ndarray, width: int = 1) -> Shards:
        return _by_rank(plan, Split.COLUMNS, lambda r: rows(array, heads_rows(split.member_heads(r), width)))

    def channels(array: np.ndarray) -> Shards:
        return _by_rank(plan, Split.COLUMNS, lambda r: rows(array, linear_channels(plan, r)))

    return replace(
        weights,
        in_proj_qkv=channels(weights.in_proj_qkv),
        in_proj_z=by_value_head(weights.in_proj_z, value_dim),
        in_proj_b=by_value_head(weights.in_proj_b),
        in_proj_a=by_value_head(weights.in_proj_a),
        conv_weight=channels(weights.conv_weight),
        A_log=by_value_head(weights.A_log),
        dt_bias=by_value_head(weights.dt_bias),
        out_proj=_by_rank(plan, Split.ROWS, lambda r: columns(weights.out_proj, heads_rows(split.member_heads(r), value_dim))),
    )
