"""Reference executor: the model's ops in numpy, on a logical StreamSet.

Math runs in float32 on upcast weights (float64 on request, for golden tests). K/V are stored in the
KVCache's own dtype (bf16 rounding, int8 with per-(page, slot, head) absmax/127 scales, or f32), so the
numerics of the cache are the GPU's. Every op is a `compute.host_op` that declares the step inputs and KV
pages it touches, and the step inputs are published through a StagingRing and read back from device
buffers: the op sequence the verifier checks is the one the CUDA executor enqueues.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer, StagingRing
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.exec.numpy_gated_attention import apply_partial_neox_rope, gate_output
from ninfer_rt.exec.numpy_state_slots import run_linear_attention
from ninfer_rt.kv.cache import KVCache, KVDtype, KVLayer
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import (
    AttentionParams, AttentionShape, LinearAttentionParams, LinearAttentionShape, StepBatch, WeightRole,
)
from ninfer_rt.model.layers import PreparedModel
from ninfer_rt.model.mtp import PreparedMTP
from ninfer_rt.ordering.verifier import Resource
from ninfer_rt.quantize.format import Linear
from ninfer_rt.quantize.layouts import dense

STEP_INPUTS = ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping", "logit_rows")
STATE_INPUTS = ("state_slots", "state_targets")  # published only for models with linear-attention layers
INT8_MAX = 127.0
T = TypeVar("T")


@dataclass(frozen=True)
class ReadyRead:
    """read_later on the host: the copy is already made."""

    value: np.ndarray

    def result(self) -> np.ndarray:
        return self.value


@dataclass(frozen=True)
class RopeTable:
    inv_freq: np.ndarray  # float64 [rotary_dim // 2]
    attention_scaling: float


class StepInputs:
    """Device copies of the current StepBatch's int32 arrays, published on the compute stream (rule 3)."""

    def __init__(self, streams: StreamSet, staging_slots: int, staging_bytes: int) -> None:
        self._streams = streams
        self._ring = StagingRing(streams, staging_slots, staging_bytes, name="step_inputs")
        self._buffers: dict[str, DeviceBuffer] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def publish(self, stream: Stream, batch: StepBatch, lane: object) -> None:
        for name in STEP_INPUTS + (STATE_INPUTS if batch.state_slots.size else ()):
            data = np.ascontiguousarray(getattr(batch, name), dtype=np.int32)
            self._ring.publish(stream, self._buffer(name, data.nbytes), data, label=f"publish {name}", lane=lane)
            self._shapes[name] = data.shape

    def resources(self, *names: str) -> tuple[Resource, ...]:
        return tuple(self._buffers[name].resource for name in names)

    def read(self, name: str) -> np.ndarray:
        """The published array, read from its device buffer (call only inside a declared op)."""
        return self._buffers[name].view(np.int32, self._shapes[name])

    def _buffer(self, name: str, nbytes: int) -> DeviceBuffer:
        # Buffers only grow, so steady-state steps reuse fixed buffers as a captured graph would.
        current = self._buffers.get(name)
        if current is None or current.nbytes < nbytes:
            if current is not None:
                current.free()
            self._buffers[name] = DeviceBuffer(self._streams, max(nbytes, 4), f"step.{name}")
        return self._buffers[name]


class PagedLayerArrays:
    """One layer's K/V pages as numpy views, with the cache dtype's store/load rules."""

    def __init__(self, layer: KVLayer, kv: KVCache) -> None:
        spec = kv.spec
        shape = (spec.num_pages, *spec.page_shape)
        self.page_size = spec.page_size
        self.values = (layer.k.view(spec.element_dtype, shape), layer.v.view(spec.element_dtype, shape))
        self.scales = None
        if spec.dtype.has_scales:
            scale_shape = shape[:-1]
            self.scales = (layer.k_scale.view(np.float32, scale_shape), layer.v_scale.view(np.float32, scale_shape))

    def store(self, slots: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        pages, offsets = np.divmod(slots, self.page_size)
        for which, data in enumerate((keys, values)):
            if self.scales is None:
                self.values[which][pages, offsets] = data.astype(self.values[which].dtype)
                continue
            quantized, scale = quantize_int8(data)
            self.values[which][pages, offsets] = quantized
            self.scales[which][pages, offsets] = scale

    def load(self, block_table: np.ndarray, length: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions 0..length-1, [length, n_kv, head_dim] in `dtype`."""
        pages = block_table[: -(-length // self.page_size)]
        loaded = []
        for which in range(2):
            data = self.values[which][pages].astype(dtype)
            if self.scales is not None:
                data *= self.scales[which][pages][..., None]
            loaded.append(data.reshape(-1, *data.shape[2:])[:length])
        return loaded[0], loaded[1]


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over the last axis: (values, absmax/127 scales)."""
    scale = (np.abs(x).max(axis=-1) / INT8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    return np.clip(np.rint(x / safe), -INT8_MAX, INT8_MAX).astype(np.int8), scale


def rms_normalize(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


ATTENTION_QUERY_BLOCK = 256  # query rows per block: each block reads only the keys up to its last position


def causal_gqa_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, q_positions: np.ndarray, shape: AttentionShape
) -> np.ndarray:
    """q [n, H, D] at absolute positions q_positions over keys/values [L, KV, D] at positions 0..L-1."""
    n = q.shape[0]
    group = shape.num_heads // shape.num_kv_heads
    # [KV, n, group, D]: per kv head, batched matmuls (BLAS), not einsum's loops
    grouped = q.reshape(n, shape.num_kv_heads, group, shape.head_dim).transpose(1, 0, 2, 3)
    keys_t, values_t = keys.transpose(1, 2, 0), values.transpose(1, 0, 2)  # [KV, D, L], [KV, L, D]
    out = np.empty((shape.num_kv_heads, n, group, shape.head_dim), dtype=np.result_type(q, values))
    for start in range(0, n, ATTENTION_QUERY_BLOCK):
        rows = slice(start, min(start + ATTENTION_QUERY_BLOCK, n))
        positions = q_positions[rows]
        length = min(int(positions.max()) + 1, keys.shape[0])  # keys past the block's last position are masked
        block = grouped[:, rows].reshape(shape.num_kv_heads, -1, shape.head_dim)
        scores = (block @ keys_t[..., :length]).reshape(shape.num_kv_heads, len(positions), group, length)
        scores *= shape.scale
        future = np.where(np.arange(length)[None, :] > positions[:, None], -np.inf, 0.0).astype(scores.dtype)
        scores += future[None, :, None, :]
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        mixed = scores.reshape(shape.num_kv_heads, -1, length) @ values_t[:, :length]
        out[:, rows] = mixed.reshape(shape.num_kv_heads, len(positions), group, shape.head_dim)
    return out.transpose(1, 0, 2, 3).reshape(n, shape.q_size)


class HostSteps:
    """What an executor on host memory lacks: reservations, graphed steps, sampling on the device. Steps run
    op by op and tokens are sampled on the host."""

    def reserve_step_buffers(self, shape: AttentionShape, kv_dtype: KVDtype, linear: LinearAttentionShape | None = None) -> None:
        """Nothing: host memory is allocated as the ops run."""

    def graphed_forward(self, model: PreparedModel, kv: KVCache, states: StateSlotPool | None = None) -> None:
        return None

    def graphed_mtp_steps(self, model: PreparedModel, mtp: PreparedMTP, kv: KVCache) -> None:
        return None

    def device_sampler(self) -> None:
        return None


class NumpyExecutor(HostSteps):
    """The reference Executor (see model/executor.py). Tensors are numpy arrays of `dtype`."""

    def __init__(
        self,
        streams: StreamSet,
        dtype: type = np.float32,
        staging_slots: int = 2 * len(STEP_INPUTS),
        staging_bytes: int = 1 << 20,
        compute_name: str = "compute",
    ) -> None:
        if not streams.logical:
            raise ValueError("NumpyExecutor runs on a logical StreamSet (no device)")
        self.streams = streams
        self.compute = streams.create(compute_name)
        self.dtype = np.dtype(dtype)
        self.inputs = StepInputs(streams, staging_slots, staging_bytes)
        self._feed = DeviceBuffer(streams, 4, "step.feed")  # grows with the fed rows
        self._fed_rows = 0
        self._lane: object = None
        self._pages_read: tuple[Resource, ...] = ()
        self._pages_written: tuple[Resource, ...] = ()
        self._state_slots = np.zeros(0, np.int32)  # the step's, as published (for declared accesses)
        self._state_targets = np.zeros((0, 1), np.int32)

    # -- preparation -------------------------------------------------------------------------------------

    def prepare_weight(self, name: str, parts: Sequence[Linear], role: WeightRole) -> np.ndarray:
        # Quantized weights are dequantized exactly here: the reference computes with the weights the
        # kernels dequantize in registers.
        stacked = self._stacked(parts)
        # 1 + w in the executor's precision (float32 at least), as transformers forms it in float32
        return 1.0 + stacked if role is WeightRole.ZERO_CENTRED_NORM else stacked

    def rewrite_weight(self, weight: np.ndarray, parts: Sequence[Linear]) -> None:
        values = self._stacked(parts)
        if values.shape != weight.shape:
            raise ValueError(f"rewrite_weight: {values.shape} values for a weight of shape {weight.shape}")
        weight[...] = values

    def prepare_rope(self, inv_freq: np.ndarray, attention_scaling: float) -> RopeTable:
        return RopeTable(np.asarray(inv_freq, dtype=np.float64), float(attention_scaling))

    # -- step --------------------------------------------------------------------------------------------

    def begin_step(self, batch: StepBatch, kv: KVCache) -> None:
        self._lane = tuple(batch.lanes) or None
        self._pages_read = tuple(kv.page_resource(p) for p in sorted(batch.pages_read()))
        self._pages_written = tuple(kv.page_resource(p) for p in sorted(batch.pages_written(kv.spec.page_size)))
        self._state_slots = batch.state_slots.copy()
        self._state_targets = batch.state_targets.copy()
        self.inputs.publish(self.compute, batch, self._lane)

    def embed(self, table: np.ndarray) -> np.ndarray:
        return self._embed("embed", lambda ids: table[ids])

    def embed_vocab_shard(self, table: np.ndarray, first_id: int) -> np.ndarray:
        """embed over a vocabulary shard: `table` holds the rows of ids first_id.., other ids embed as
        zeros (tensor parallelism sums the ranks' shards)."""

        def gather(ids: np.ndarray) -> np.ndarray:
            local = ids - first_id
            inside = (local >= 0) & (local < table.shape[0])
            return np.where(inside[:, None], table[np.where(inside, local, 0)], 0).astype(table.dtype)

        return self._embed("embed (vocabulary shard)", gather)

    def _embed(self, label: str, gather: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        def run() -> np.ndarray:
            ids = self.inputs.read("token_ids")
            if ids.size and ids.min() < 0:
                if ids.min() < -self._fed_rows:
                    raise ValueError(f"token id {int(ids.min())} refers past the {self._fed_rows} fed rows")
                fed = self._feed.view(np.int32, (self._fed_rows,))
                ids = np.where(ids < 0, fed[np.maximum(-ids - 1, 0)], ids)
            return gather(ids)

        return self._op(label, run, reads=(*self.inputs.resources("token_ids"), self._feed.resource))

    def rmsnorm(
        self, x: np.ndarray, weight: np.ndarray, eps: float, residual: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        def run() -> tuple[np.ndarray, np.ndarray]:
            summed = x if residual is None else x + residual
            return rms_normalize(summed, weight, eps), summed

        return self._op("rmsnorm", run)

    def linear(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return self._op("linear", lambda: x @ weight.T)

    def concat(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return self._op("concat", lambda: np.concatenate(parts, axis=-1))

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        def run() -> np.ndarray:
            gate, up = np.split(gate_up, 2, axis=-1)
            return gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up  # sigmoid without exp overflow

        return self._op("silu_mul", run)

    def attention(self, qkv: np.ndarray, params: AttentionParams, kv: KVCache, kv_layer: int) -> np.ndarray:
        pages = PagedLayerArrays(kv.layers[kv_layer], kv)
        q, gate = self._op(
            f"qk_norm_rope_kv_write[{kv_layer}]",
            lambda: self._rope_and_store(qkv, params, pages),
            reads=self.inputs.resources("positions", "slot_mapping"),
            writes=self._pages_written,
        )
        attended = self._op(
            f"paged_attention[{kv_layer}]",
            lambda: self._paged_attention(q, params.shape, pages),
            reads=(
                *self.inputs.resources("positions", "query_start", "context_lens", "block_tables"),
                *self._pages_read,
            ),
        )
        return attended if gate is None else self._op(f"output_gate[{kv_layer}]", lambda: gate_output(attended, gate))

    def linear_attention(
        self, projected: np.ndarray, params: LinearAttentionParams, states: StateSlotPool, layer: int
    ) -> np.ndarray:
        def run() -> np.ndarray:
            slots, targets = self.inputs.read("state_slots"), self.inputs.read("state_targets")
            return run_linear_attention(projected, params, states, layer, self.inputs.read("query_start"), slots, targets)

        return self._op(
            f"linear_attention[{layer}]",
            run,
            reads=(
                *self.inputs.resources("query_start", *STATE_INPUTS),
                *(states.resource(int(s)) for s in self._state_slots),
            ),
            writes=tuple(states.resource(int(t)) for t in self._state_targets.reshape(-1) if t >= 0),
        )

    def select_rows(self, x: np.ndarray) -> np.ndarray:
        rows = self.inputs.resources("logit_rows")
        return self._op("select_rows", lambda: x[self.inputs.read("logit_rows")], reads=rows)

    def logits(self, hidden: np.ndarray, lm_head: np.ndarray) -> np.ndarray:
        picked = self.select_rows(hidden)
        return self._op("logits", lambda: picked @ lm_head.T)

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        return self._op("argmax", lambda: np.argmax(logits, axis=1).astype(np.int32)[:, None])

    def to_host(self, x: np.ndarray) -> np.ndarray:
        self.compute.synchronize()
        if np.issubdtype(x.dtype, np.integer):
            return np.array(x)
        return np.array(x, dtype=np.result_type(self.dtype, np.float32))

    def read_later(self, x: np.ndarray) -> ReadyRead:
        return ReadyRead(self.to_host(x))

    def feed(self, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, np.int32).reshape(-1)
        if self._feed.nbytes < data.nbytes:
            self._feed.free()
            self._feed = DeviceBuffer(self.streams, data.nbytes, "step.feed")

        def store() -> None:
            self._feed.view(np.int32, (data.size,))[:] = data

        self._op("feed", store, writes=(self._feed.resource,))
        self._fed_rows = data.size

    # -- internals ---------------------------------------------------------------------------------------

    def _stacked(self, parts: Sequence[Linear]) -> np.ndarray:
        return np.concatenate([dense(part, self.dtype) for part in parts], axis=0)

    def _op(
        self, label: str, fn: Callable[[], T], reads: tuple[Resource, ...] = (), writes: tuple[Resource, ...] = ()
    ) -> T:
        return self.compute.host_op(fn, label=label, reads=reads, writes=writes, lane=self._lane)

    def _rope_and_store(
        self, qkv: np.ndarray, params: AttentionParams, pages: PagedLayerArrays
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Returns q [rows, H, D] after q-norm and RoPE, and the output gate rows (None without a gate);
        K (after k-norm, RoPE) and V go into the pages."""
        shape = params.shape
        rows = qkv.shape[0]
        q, k, v, gate = np.split(qkv, [shape.q_size, shape.q_size + shape.kv_size, shape.q_size + 2 * shape.kv_size], axis=-1)
        q = q.reshape(rows, shape.num_heads, shape.head_dim)
        k = k.reshape(rows, shape.num_kv_heads, shape.head_dim)
        v = v.reshape(rows, shape.num_kv_heads, shape.head_dim)
        if params.q_norm is not None:
            q = rms_normalize(q, params.q_norm, shape.norm_eps)
            k = rms_normalize(k, params.k_norm, shape.norm_eps)
        cos, sin = self._cos_sin(params.rope, self.inputs.read("positions"))
        q, k = apply_partial_neox_rope(q, cos, sin), apply_partial_neox_rope(k, cos, sin)
        pages.store(self.inputs.read("slot_mapping"), k, v)
        return q, (gate if params.output_gate else None)

    def _cos_sin(self, rope: RopeTable, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        angles = positions.astype(np.float64)[:, None] * rope.inv_freq[None, :]
        scaling = rope.attention_scaling
        return (np.cos(angles) * scaling).astype(self.dtype), (np.sin(angles) * scaling).astype(self.dtype)

    def _paged_attention(self, q: np.ndarray, shape: AttentionShape, pages: PagedLayerArrays) -> np.ndarray:
        query_start = self.inputs.read("query_start")
        context_lens = self.inputs.read("context_lens")
        block_tables = self.inputs.read("block_tables")
        positions = self.inputs.read("positions")
        out = np.zeros((q.shape[0], shape.q_size), dtype=self.dtype)
        for seq, length in enumerate(context_lens):
            rows = slice(query_start[seq], query_start[seq + 1])
            if rows.start == rows.stop:
                continue
            keys, values = pages.load(block_tables[seq], int(length), self.dtype)
            out[rows] = causal_gqa_attention(q[rows], keys, values, positions[rows], shape)
        return out
