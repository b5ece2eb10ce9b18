"""What a forward step needs, independent of where it runs.

`StepBatch` is the host-side description of one step: any mix of prefill chunks and decode tokens over the
paged KV (docs/ARCHITECTURE.md, "Block tables and step inputs"). `Executor` is the interface `model/layers.py`
is written against; `exec/numpy_exec.py` (reference, CPU) and `exec/cuda_exec.py` (GPU) implement it. Tensors
are opaque to layers.py: numpy arrays on one, device buffers on the other. So is the KV cache: the model hands a
`PagedKV` to the executor's ops without opening it (kv/cache.py's KVCache is the one the engine builds,
and the executors know its layout), which keeps the model below the kv package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.model.kv_dtype import KVDtype

if TYPE_CHECKING:  # the model modules are written against this one
    from ninfer_rt.model.layers import ForwardOutput, PreparedModel
    from ninfer_rt.model.mtp import MTPSteps, PreparedMTP

Tensor = Any
StepForward = Callable[["StepBatch"], "ForwardOutput"]
SampleTokens = Callable[[Tensor, np.ndarray], Tensor]  # (logits, packed params) -> int32 ids [rows, 1]


class PageGeometry(Protocol):
    @property
    def page_size(self) -> int:
        """Tokens per KV page."""


@runtime_checkable
class PagedKV(Protocol):
    """Every layer's K/V pages, as the model sees them: a handle passed through to the executor's ops."""

    @property
    def spec(self) -> PageGeometry:
        """The pages' geometry (kv/cache.py's KVSpec)."""


@dataclass
class StepBatch:
    """One step for B sequences and T new tokens in total (rows of every activation tensor)."""

    token_ids: np.ndarray  # int32 [T]; -(j + 1): row j of the ids last given to Executor.feed
    positions: np.ndarray  # int32 [T]: absolute position of each new token
    query_start: np.ndarray  # int32 [B+1]: sequence b owns rows query_start[b]:query_start[b+1]
    context_lens: np.ndarray  # int32 [B]: tokens in sequence b's KV after this step's writes
    block_tables: np.ndarray  # int32 [B, max_pages]: page ids in order, -1 where unused
    slot_mapping: np.ndarray  # int32 [T]: page * page_size + offset receiving each new token's K/V
    logit_rows: np.ndarray  # int32 [N]: rows whose logits the sampler needs
    lanes: tuple = ()  # per-sequence request ids, for op labels and crash dumps
    # Linear-attention state (hybrid models; empty otherwise): the slot holding sequence b's state before
    # the step, and the slots receiving its state after each of its last S rows (-1 pads; the last one
    # listed is the state after all its rows). S = 1 but for speculative verification (kv/states_verify.py).
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 [B]
    state_targets: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int32))  # int32 [B, S]

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


class WeightRole(Enum):
    """What a prepared weight is to the ops that read it. The model names it when it prepares the weight
    (executors never read it from the weight's name) and executors pick storage and kernels by it; each
    layer kind adds the roles its own ops need."""

    EMBEDDING = "embedding"  # [vocab, hidden] rows gathered by token id (embed); also a tied lm_head
    LINEAR = "linear"  # [out, in] matrix of `linear` whose output any op may read
    GATE_UP = "gate_up"  # [gate | up] rows of a `linear` whose output only silu_mul reads (fusable)
    NORM = "norm"  # [features] RMSNorm gains
    ZERO_CENTRED_NORM = "zero_centred_norm"  # [features] gains w applied as (1 + w), formed in f32 or wider
    PARAMETER = "parameter"  # small per-channel/per-head values read at f32 or wider (conv taps, A_log, dt_bias)


@dataclass(frozen=True)
class AttentionShape:
    """Head geometry of one attention layer; the fused qkv rows are q heads, then k heads, then v heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # of the per-head q/k RMSNorm

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass(frozen=True)
class AttentionParams:
    """What the attention op needs besides activations: geometry, RoPE table and optional q/k norms."""

    shape: AttentionShape
    rope: Tensor  # from Executor.prepare_rope
    q_norm: Tensor | None  # [head_dim] gains, None for architectures without q/k norm
    k_norm: Tensor | None
    rotary_dim: int = 0  # RoPE turns the first rotary_dim dims of each head; 0 = all of them
    # Gated attention: the qkv rows end with a gate per q head, and the output is * sigmoid(gate).
    output_gate: bool = False


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated DeltaNet geometry; the conv runs over the [q | k | v] channels of the input projection."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    norm_eps: float  # of the gated output RMSNorm

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_size + self.value_size

    @property
    def projection_rows(self) -> int:
        """Rows of the fused input projection: [q | k | v | z | b | a]."""
        return self.conv_channels + self.value_size + 2 * self.num_value_heads


@dataclass(frozen=True)
class LinearAttentionParams:
    """What the linear-attention op needs besides activations (weights prepared as WeightRole.PARAMETER)."""

    shape: LinearAttentionShape
    conv_weight: Tensor  # [conv_channels, kernel]
    a_log: Tensor  # [value heads]
    dt_bias: Tensor  # [value heads]
    norm: Tensor  # [value head dim], the gated RMSNorm's plain gain


@runtime_checkable
class RecurrentStates(Protocol):
    """Every linear-attention layer's per-sequence state slots, as the model sees them: a handle passed
    through to the executor's ops (kv/states.py's StateSlotPool is the one the engine builds)."""

    def resource(self, slot: int) -> object:
        """What an op on the slot declares to the ordering verifier."""


class Executor(Protocol):
    """The ops model/layers.py composes. Each enqueues on `compute` and declares its accesses.

    Activations are [rows, features] with one row per token of the current step. Device results reach the
    host only through `to_host`, so everything between `begin_step` and it can be captured as one graph.
    Capabilities an executor may lack (graphed steps, sampling on the device) are methods returning None
    there: the engine asks, it never inspects the executor's class.
    """

    streams: StreamSet
    compute: Stream

    def graphed_forward(self, model: PreparedModel, kv: PagedKV, states: RecurrentStates | None = None) -> StepForward | None:
        """The main forward with decode-width steps replayed from captured graphs, or None where steps
        run op by op (layers.forward). `states`: a hybrid's linear-attention state slots, which every
        step (graphed or not) reads and writes."""

    def graphed_mtp_steps(self, model: PreparedModel, mtp: PreparedMTP, kv: PagedKV) -> MTPSteps | None:
        """MTP catch-up and drafting replayed from captured graphs, or None where they run op by op
        (mtp.EagerMTPSteps)."""

    def device_sampler(self) -> SampleTokens | None:
        """Token selection on the executor (engine/sampling.py's definition over pack_device_params rows,
        only ids coming back), or None where every row is sampled on the host from its logits."""

    def prepare_weight(self, name: str, parts: Sequence[np.ndarray], role: WeightRole) -> Tensor:
        """Convert/upload a weight once: the parts' rows stacked in order (a fused qkv or gate_up matrix,
        or a single matrix/vector). Parts are the checkpoint's arrays, [out, in] for linear weights; a linear
        weight's parts may differ in format (groupwise-quantized parts, then dense ones: a quantized Gated
        DeltaNet's in_proj keeps b and a as stored), and it is still one weight to `linear`: how its parts
        are stored and multiplied is the executor's choice. `name` labels the weight (buffers, op labels);
        `role` is what the ops do with it."""

    def rewrite_weight(self, weight: Tensor, parts: Sequence[np.ndarray]) -> None:
        """Replace a prepared dense weight's values in place (same shape), in the compute stream's order:
        graphs captured over it stay valid and nothing is allocated (the draft head's vocabulary refresh)."""

    def prepare_rope(self, inv_freq: np.ndarray, attention_scaling: float) -> Tensor:
        """NeoX RoPE with these inverse frequencies (pair i rotates dims i and i+D/2); cos/sin are scaled by
        `attention_scaling` (YaRN's mscale) as transformers does."""

    def reserve_step_buffers(
        self, shape: AttentionShape, kv_dtype: KVDtype, linear: LinearAttentionShape | None = None
    ) -> None:
        """Allocate now what the widest steps will need (the attention's buffers for the longest ones, the
        quantized prefill's dequantized matrix, the linear attention's scratch for a hybrid: `linear`)
        before the KV cache takes what memory is left, so no step allocates it later. `kv_dtype` is the KV
        spec's."""

    def begin_step(self, batch: StepBatch, kv: PagedKV) -> None:
        """Publish the step's inputs (ids, positions, block tables, slots) in the compute stream's order."""

    def embed(self, table: Tensor) -> Tensor:
        """Rows of `table` for the step's token ids."""

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(normed, new_residual): new_residual = x + residual (or x), normed = rmsnorm(new_residual)."""

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x @ weight.T"""

    def concat(self, parts: Sequence[Tensor]) -> Tensor:
        """Features of `parts` side by side, row by row."""

    def attention(self, qkv: Tensor, params: AttentionParams, kv: PagedKV, kv_layer: int) -> Tensor:
        """q/k RMSNorm (if given), RoPE, K/V write into pages at the step's slots, then paged attention (GQA)
        over each sequence's block table: a row sees its sequence's keys at positions <= its own position.
        Returns [rows, num_heads * head_dim]."""

    def linear_attention(
        self, projected: Tensor, params: LinearAttentionParams, states: RecurrentStates, layer: int
    ) -> Tensor:
        """The Gated DeltaNet between its projections, for each sequence from the state in its
        batch.state_slots entry (conv window + recurrent state of linear layer `layer`): projected rows
        [q | k | v | z | b | a] -> causal conv + SiLU, L2-normalised q/k, gating, the gated delta rule, the
        gated RMSNorm * silu(z). Writes the states after the sequence's last S rows into its
        batch.state_targets. Returns [rows, value heads * value head dim] (out_proj's input)."""

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up for gate_up = [gate | up] along features."""

    def select_rows(self, x: Tensor) -> Tensor:
        """x[logit_rows]: [N, features] (the MTP draft chain's next hidden input)."""

    def logits(self, hidden: Tensor, lm_head: Tensor) -> Tensor:
        """select_rows(hidden) @ lm_head.T: [N, vocab]."""

    def argmax(self, logits: Tensor) -> Tensor:
        """The greedy token of each logits row (lowest index among ties): int32 [rows, 1], so a greedy
        step brings 4 bytes per row to the host instead of the whole vocabulary."""

    def to_host(self, x: Tensor) -> np.ndarray:
        """Wait for the compute stream and return `x` as a host numpy array (float32, or the reference
        executor's float64; int32 for argmax ids)."""

    def read_later(self, x: Tensor) -> PendingRead:
        """Start copying int32 ids `x` to the host behind the ops enqueued so far; the result is to_host's,
        waiting only for that copy, so later steps can be enqueued first. At most two pending at a time."""

    def feed(self, ids: Tensor | np.ndarray) -> None:
        """The ids later steps embed for their negative token ids: -(j + 1) reads row j of `ids` (int32
        [rows, 1], a device tensor from argmax/sample_tokens, or host ids) as it is when that step's
        embedding runs. The engine feeds each decode step's samples to the next step (engine.py)."""


class PendingRead(Protocol):
    def result(self) -> np.ndarray:
        """Wait for the copy and return the host array."""
