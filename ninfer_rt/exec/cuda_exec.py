"""CUDA Executor: the model's ops as kernels on one compute stream (the GPU side of model/executor.py).

Tensors are `DeviceTensor`s (exec/cuda_tensors.py). Weights are uploaded once through pinned staging (qkv
and gate_up fused by layers.py's prepare). Activations come from a pool of buffers sized for `max_tokens`
rows. Everything runs on the one `compute` stream, so a buffer reused by a later op is always ordered
after the last op that read it.

Per op: linear is the decode GEMV for <= 8 rows and a GEMM above (exec/cuda_linear.py: cuBLASLt, and for
int4/int8 weights NINFER_QUANT_GEMM's form, dequantize + cuBLASLt or the fused GEMM; a projection of
quantized then bf16 rows is one GEMV launch, or GEMMs into column ranges of one output); a GEMV into gate_up is
deferred and fused with the SwiGLU that consumes it (one pass over the weights, no gate_up round trip);
attention is the AttentionBackend's (cuda_attention.py: rope_kv, then the decode or prefill kernel per
sequence), which owns attention's device state and plans each step once in begin_step; linear attention
(the hybrid's Gated DeltaNet) is the LinearAttentionBackend's (cuda_linear_attn.py) over the engine's state
slots. Zero-centred norm gains are prepared as f32 1 + w, PARAMETER weights (conv taps, A_log, dt_bias,
the gated norm's gain) as f32 (exec/cuda_weights.py).

Step inputs (rule 3) are published by `begin_step` (exec/cuda_step_inputs.py): one staging slot and one
copy on the compute stream, at offsets that depend only on the step's shape, so a captured step
(exec/cuda_graphs.py) replays after a fresh publish into the same addresses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from ninfer_rt.cuda import linear_ops, ops, sampling_ops
from ninfer_rt.cuda.blas import Blas
from ninfer_rt.cuda.compiler import families
from ninfer_rt.cuda.graphs import Graph, capture
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.linear_ops import Epilogue, RowLayout
from ninfer_rt.cuda.memory import DeviceBuffer, DeviceView, PinnedBuffer
from ninfer_rt.cuda.quant_ops import QuantizedDeviceWeight
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_attention import AttentionBackend
from ninfer_rt.exec.cuda_graphs import GraphedForward, GraphedMTPSteps
from ninfer_rt.exec.cuda_linear import LinearOps, quant_gemm_from_env
from ninfer_rt.exec.cuda_linear_attn import LinearAttentionBackend
from ninfer_rt.exec.cuda_step_inputs import StepInputs, StepLimits, check_step
from ninfer_rt.exec.cuda_tensors import ActivationPool, DeviceTensor, StepShape, step_shape
from ninfer_rt.exec.cuda_weights import BF16, W, DeviceWeights, Weight
from ninfer_rt.exec.layer_backend import LayerBackend, PublishedStep
from ninfer_rt.kv.cache import KVCache, KVDtype, page_resource
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import (
    AttentionParams,
    AttentionShape,
    LinearAttentionParams,
    LinearAttentionShape,
    SampleTokens,
    StepBatch,
    WeightRole,
)
from ninfer_rt.model.layers import PreparedModel
from ninfer_rt.model.mtp import PreparedMTP
from ninfer_rt.quantize.format import Linear
from ninfer_rt.ordering.verifier import Resource

_HOST_DTYPE = {"bf16": BF16, "f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}


@dataclass(eq=False)
class DeferredSwiglu:
    """linear(x, gate_up) for a decode-width x, not yet run: silu_mul fuses it into one GEMV."""

    x: DeviceTensor
    gate_up: DeviceTensor | QuantizedDeviceWeight


class CudaExecutor:
    """The Executor of model/executor.py on one GPU."""

    def __init__(
        self,
        streams: StreamSet,
        *,
        max_tokens: int,
        max_seqs: int,
        max_pages_per_seq: int,
        max_positions: int,
        max_logit_rows: int | None = None,
        library: KernelLibrary | None = None,
        quant_gemm: str | None = None,
    ) -> None:
        """quant_gemm: the quantized prefill GEMM's form (exec/cuda_linear.py; None: $NINFER_QUANT_GEMM)."""
        if streams.device is None:
            raise ValueError("CudaExecutor needs a device StreamSet; use NumpyExecutor on a logical one")
        self.streams = streams
        self.compute = streams.create("compute")
        self.library = library or KernelLibrary(streams.device)
        self.library.preload(families())  # compile at start-up, not inside the first request
        self.blas = Blas(streams)
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.max_positions = max_positions
        self.max_logit_rows = max_logit_rows or max_tokens
        self._pool = ActivationPool(streams)
        self._limits = StepLimits(max_tokens, max_seqs, max_pages_per_seq, max_positions, self.max_logit_rows)
        self._step_inputs = StepInputs(streams, self._limits)
        self._inputs: dict[str, DeviceView] = {}  # this step's arrays, views of the step-input buffer
        self._host_out: PinnedBuffer | None = None
        self._feed = DeviceBuffer(streams, 4 * self.max_logit_rows, "step.feed")
        self._fed_rows = 0
        self._reads = [PinnedRead(PinnedBuffer(streams, 4 * self.max_logit_rows, f"read_later.{i}")) for i in range(2)]
        self._batch: StepBatch | None = None
        self._prepublished: StepBatch | None = None
        self.shape: StepShape | None = None
        self._lane: object = None
        self._pages_read: tuple[Resource, ...] = ()
        self._pages_written: tuple[Resource, ...] = ()
        self.weights = DeviceWeights(streams, self.compute, self.library)
        self.linear_ops = LinearOps(self.library, self.compute, self.blas, self.weights, quant_gemm or quant_gemm_from_env())
        self.attention_backend = AttentionBackend(
            self.library, streams, self.compute, max_tokens=max_tokens, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq
        )
        self.linear_attention_backend = LinearAttentionBackend(self.library, streams, self.compute, max_tokens=max_tokens)
        self._backends: tuple[LayerBackend, ...] = (self.attention_backend, self.linear_attention_backend)

    # -- preparation -------------------------------------------------------------------------------------

    def prepare_weight(self, name: str, parts: Sequence[Linear], role: WeightRole) -> Weight:
        return self.weights.prepare(name, parts, role)

    def rewrite_weight(self, weight: DeviceTensor, parts: Sequence[np.ndarray]) -> None:
        self.weights.rewrite(weight, parts)

    def empty_weight(self, name: str, rows: int, cols: int, dtype: str = "bf16", *, role: WeightRole) -> DeviceTensor:
        """An unpooled device tensor that lives as long as the model (benchmarks fill it on the device)."""
        return self.weights.empty(name, rows, cols, dtype, role=role)

    def adopt_weight(self, weight: W, role: WeightRole) -> W:
        """Keep a weight's role for the ops (exec/cuda_weights.py DeviceWeights.adopt)."""
        return self.weights.adopt(weight, role)

    def upload(self, buffer: DeviceBuffer, array: np.ndarray, *, label: str) -> None:
        """Host array -> device buffer through pinned staging, in chunks, ordered on the compute stream."""
        self.weights.upload(buffer, array, label=label)

    def prepare_rope(self, inv_freq: np.ndarray, attention_scaling: float) -> DeviceTensor:
        """cos/sin table f32 [max_positions, 2, D/2], as rope_kv.cu reads it (row p: cos, then sin)."""
        return self.weights.rope(inv_freq, attention_scaling, self.max_positions)

    def reserve_step_buffers(self, shape: AttentionShape, kv_dtype: KVDtype, linear: LinearAttentionShape | None = None) -> None:
        """int8 KV's widening buffers, where long prefill steps widen (AttentionBackend.reserve), the
        weights' scratch at the size of the largest dequantized weight, and a hybrid's linear-attention
        scratch and workspace (LinearAttentionBackend.reserve)."""
        self.attention_backend.reserve(shape, kv_dtype)
        self.weights.reserve_scratch()
        if linear is not None:
            self.linear_attention_backend.reserve(linear, self.max_seqs)

    # -- capabilities ------------------------------------------------------------------------------------

    def graphed_forward(self, model: PreparedModel, kv: KVCache, states: StateSlotPool | None = None) -> GraphedForward:
        return GraphedForward(self, model, kv, states)

    def graphed_mtp_steps(self, model: PreparedModel, mtp: PreparedMTP, kv: KVCache) -> GraphedMTPSteps:
        return GraphedMTPSteps(self, model, mtp, kv)

    def device_sampler(self) -> SampleTokens:
        return self.sample_tokens

    # -- step --------------------------------------------------------------------------------------------

    def publish(self, batch: StepBatch, kv: KVCache) -> None:
        """Copy the step's inputs into their fixed device buffers, in the compute stream's order (rule 3)."""
        check_step(batch, self._limits, self.weights.vocab, self._fed_rows)
        self._inputs = self._step_inputs.publish(self.compute, batch, tuple(batch.lanes) or None)

    @contextmanager
    def prepublished(self, batch: StepBatch, kv: KVCache) -> Iterator[None]:
        """Publish `batch` now; forward passes over it inside the block skip their own publish (a capture
        must not contain the staging copy, and a replay is preceded by an ordinary one)."""
        self.publish(batch, kv)
        self._prepublished = batch
        try:
            yield
        finally:
            self._prepublished = None

    def begin_step(self, batch: StepBatch, kv: KVCache) -> None:
        if self._prepublished is not batch:
            self.publish(batch, kv)
        self._batch = batch
        self.shape = step_shape(batch)
        self._lane = tuple(batch.lanes) or None
        # The page lists only feed the verifier: at 114k tokens building them costs ~1.4 ms of host time per
        # step on the 2-core CI box, a tenth of a decode step, so they are skipped when it is off.
        verifying = self.streams.verifier is not None
        self._pages_read = tuple(page_resource(p) for p in sorted(batch.pages_read())) if verifying else ()
        self._pages_written = (
            tuple(page_resource(p) for p in sorted(batch.pages_written(kv.spec.page_size))) if verifying else ()
        )
        step = PublishedStep(
            self._inputs, self.shape.query_lens, kv, self._pages_read, self._pages_written, self._lane,
            batch.state_slots, batch.state_targets,
        )
        for backend in self._backends:
            backend.plan(step)

    def capture(self, enqueue: Callable[[], object], states: StateSlotPool | None = None) -> Graph:
        """A graph of what `enqueue` puts on the compute stream, every backend told it is capturing (run the
        step eagerly first: nothing may be allocated while capturing). The spans of `states`' slots, like
        KV pages, are declared by each replay for its own step (`step_accesses`)."""
        per_step = () if states is None else (states.buffer.resource,)
        with ExitStack() as stack:
            for backend in self._backends:
                stack.enter_context(backend.capturing())
            return capture(self.compute, enqueue, per_step)

    @property
    def step_pages(self) -> tuple[tuple[Resource, ...], tuple[Resource, ...]]:
        """(read, written) KV pages of the current step."""
        return self._pages_read, self._pages_written

    def step_accesses(self, states: StateSlotPool | None = None) -> tuple[tuple[Resource, ...], tuple[Resource, ...]]:
        """(read, written) resources of the current step that a graph replay declares besides its capture:
        its KV pages and, over `states`, the spans of the slots it reads (live) and writes (targets)."""
        if states is None:
            return self.step_pages
        slots_read, slots_written = self.linear_attention_backend.slot_spans(states)
        return self._pages_read + slots_read, self._pages_written + slots_written

    def embed(self, table: DeviceTensor) -> DeviceTensor:
        rows = self._batch.num_tokens
        out = self._tensor(rows, table.cols)
        linear_ops.gather_rows(
            self.library, self.compute, table.buffer, table.rows, out.buffer, rows, table.cols,
            ids=self._inputs["token_ids"], feed=self._feed, label="embed", lane=self._lane,
        )
        return out

    def rmsnorm(
        self, x: DeviceTensor, weight: DeviceTensor, eps: float, residual: DeviceTensor | None = None
    ) -> tuple[DeviceTensor, DeviceTensor]:
        x = self._ready(x)
        out = self._tensor(x.rows, x.cols)
        ops.rmsnorm(
            self.library, self.compute, x.buffer, weight.buffer, out.buffer, x.rows, x.cols, eps,
            residual.buffer if residual is not None else None, gain_f32=weight.dtype == "f32", lane=self._lane,
        )
        return out, (x if residual is None else residual)

    def linear(self, x: DeviceTensor, weight: Weight) -> DeviceTensor | DeferredSwiglu:
        x = self._ready(x)
        if self.weights.role(weight) is WeightRole.GATE_UP and x.rows <= linear_ops.GEMV_MAX_ROWS:
            return DeferredSwiglu(x, weight)
        return self._matmul(x, weight, "bf16")

    def concat(self, parts: Sequence[DeviceTensor]) -> DeviceTensor:
        parts = [self._ready(p) for p in parts]
        out = self._tensor(parts[0].rows, sum(p.cols for p in parts))
        column = 0
        for part in parts:
            linear_ops.gather_rows(
                self.library, self.compute, part.buffer, part.rows, out.buffer, part.rows, part.cols,
                out_layout=RowLayout(out.cols, column), label="concat", lane=self._lane,
            )
            column += part.cols
        return out

    def silu_mul(self, gate_up: DeviceTensor | DeferredSwiglu) -> DeviceTensor:
        if isinstance(gate_up, DeferredSwiglu):
            x, w = gate_up.x, gate_up.gate_up
            out = self._tensor(x.rows, w.rows // 2)
            self.linear_ops.gemv(x, w, out, Epilogue.SWIGLU, "gate_up+swiglu", self._lane)
            return out
        out = self._tensor(gate_up.rows, gate_up.cols // 2)
        ops.silu_mul(self.library, self.compute, gate_up.buffer, out.buffer, gate_up.rows, out.cols, lane=self._lane)
        return out

    def attention(self, qkv: DeviceTensor, params: AttentionParams, kv: KVCache, kv_layer: int) -> DeviceTensor:
        qkv = self._ready(qkv)
        out = self._tensor(qkv.rows, params.shape.q_size)
        self.attention_backend.forward(qkv.buffer, out.buffer, params, kv_layer)
        return out

    def linear_attention(
        self, projected: DeviceTensor, params: LinearAttentionParams, states: StateSlotPool, layer: int
    ) -> DeviceTensor:
        projected = self._ready(projected)
        out = self._tensor(projected.rows, params.shape.value_size)
        self.linear_attention_backend.forward(projected.buffer, out.buffer, params, states, layer)
        return out

    def select_rows(self, x: DeviceTensor) -> DeviceTensor:
        x = self._ready(x)
        picked = self._tensor(self.shape.logit_rows, x.cols)
        linear_ops.gather_rows(
            self.library, self.compute, x.buffer, x.rows, picked.buffer, picked.rows, x.cols,
            ids=self._inputs["logit_rows"], label="logit rows", lane=self._lane,
        )
        return picked

    def logits(self, hidden: DeviceTensor, lm_head: DeviceTensor) -> DeviceTensor:
        if self.shape.logit_rows == 0:  # a prefill chunk that samples nothing
            return DeviceTensor(self._ready(hidden).buffer, 0, lm_head.rows, "f32")
        return self._matmul(self.select_rows(hidden), lm_head, "f32", capacity=self.max_logit_rows)

    def argmax(self, logits: DeviceTensor) -> DeviceTensor:
        """Greedy token per logits row, int32 [rows] (sampling.cu): 4 bytes per row to the host."""
        out = self._tensor(logits.rows, 1, "i32", capacity=self.max_logit_rows)
        self.sampler.argmax(self.library, logits.buffer, out.buffer, logits.rows, logits.cols, lane=self._lane)
        return out

    def sample_tokens(self, logits: DeviceTensor, params: np.ndarray) -> DeviceTensor:
        """The token each logits row draws, int32 [rows] (sampling.cu; greedy rows take the argmax): `params`
        is engine.sampling.pack_device_params' int32 [rows, 8], published on the compute stream. Eager, never
        captured: which passes run depends on the rows' parameters."""
        out = self._tensor(logits.rows, 1, "i32", capacity=self.max_logit_rows)
        self.sampler.sample(self.library, logits.buffer, out.buffer, logits.rows, logits.cols, params, lane=self._lane)
        return out

    @functools.cached_property
    def sampler(self) -> sampling_ops.DeviceSampler:
        """Token selection's scratch and parameter staging on the compute stream (made at first use)."""
        return sampling_ops.DeviceSampler(self.streams, self.compute, self.max_logit_rows)

    def to_host(self, x: DeviceTensor) -> np.ndarray:
        """Copy to pinned memory, wait on the compute stream's event, read (declared) on the host."""
        x = self._ready(x)
        if x.rows == 0:
            return np.zeros((0, x.cols), np.int32 if x.dtype == "i32" else np.float32)
        if self._host_out is None or self._host_out.nbytes < x.nbytes:
            if self._host_out is not None:
                self._host_out.free()
            self._host_out = PinnedBuffer(self.streams, max(x.nbytes, 1 << 20), "to_host")
        self.compute.copy(self._host_out, x.buffer, x.nbytes, label="to_host", lane=self._lane)
        self.compute.record().synchronize()
        values = self._host_out.read(_HOST_DTYPE[x.dtype], (x.rows, x.cols), label="to_host: read", lane=self._lane)
        return values if x.dtype == "i32" else values.astype(np.float32)

    def read_later(self, x: DeviceTensor) -> PinnedRead:
        """Two pinned slots in turn; a slot is reused only after its result was taken."""
        slot = self._reads[0] if self._reads[0].taken else self._reads[1]
        if not slot.taken:
            raise RuntimeError("read_later: two reads are already pending; take a result first")
        x = self._ready(x)
        if x.dtype != "i32" or x.nbytes > slot.buffer.nbytes:
            raise ValueError(f"read_later reads int32 ids of at most {slot.buffer.nbytes // 4} rows")
        self.compute.copy(slot.buffer, x.buffer, x.nbytes, label="read_later", lane=self._lane)
        slot.start(self.compute.record(), (x.rows, x.cols), self._lane)
        self._reads.reverse()  # the other slot next, if it is free
        return slot

    def feed(self, ids: DeviceTensor | np.ndarray) -> None:
        rows = ids.size if isinstance(ids, np.ndarray) else ids.rows
        if rows > self.max_logit_rows:
            raise ValueError(f"feed: {rows} ids exceed the executor's {self.max_logit_rows} logit rows")
        if isinstance(ids, np.ndarray):
            host = np.ascontiguousarray(ids, np.int32).reshape(-1)
            self._step_inputs.staging.publish(self.compute, self._feed, host, label="feed host ids", lane=self._lane)
        else:
            self.compute.copy(self._feed, ids.buffer, 4 * rows, label="feed sampled ids", lane=self._lane)
        self._fed_rows = rows

    # -- internals ---------------------------------------------------------------------------------------

    def _matmul(
        self, x: DeviceTensor, weight: Weight, out_dtype: str, capacity: int | None = None
    ) -> DeviceTensor:
        """x @ weight^T in a pooled tensor (exec/cuda_linear.py picks the kernel)."""
        out = self._tensor(x.rows, weight.rows, out_dtype, capacity)
        self.linear_ops.matmul(x, weight, out, self._lane)
        return out

    def _ready(self, x: DeviceTensor | DeferredSwiglu) -> DeviceTensor:
        """A deferred gate_up consumed by anything but silu_mul is computed as the plain product."""
        return self._matmul(x.x, x.gate_up, "bf16") if isinstance(x, DeferredSwiglu) else x

    def _tensor(self, rows: int, cols: int, dtype: str = "bf16", capacity: int | None = None) -> DeviceTensor:
        capacity = capacity or self.max_tokens
        if rows > capacity:
            raise ValueError(f"{rows} rows exceed the executor's capacity of {capacity} (max_tokens/max_logit_rows)")
        return DeviceTensor(self._pool.take(cols, dtype, capacity), rows, cols, dtype, (self._pool, capacity))


class PinnedRead:
    """A read_later slot: the copy's event and shape until its result is taken."""

    def __init__(self, buffer: PinnedBuffer) -> None:
        self.buffer = buffer
        self.taken = True
        self._event: object = None
        self._shape: tuple[int, int] = (0, 0)
        self._lane: object = None

    def start(self, event: object, shape: tuple[int, int], lane: object) -> None:
        self.taken, self._event, self._shape, self._lane = False, event, shape, lane

    def result(self) -> np.ndarray:
        if self.taken:
            raise RuntimeError("read_later: this result was already taken")
        self._event.synchronize()
        self.taken = True
        return self.buffer.read(np.dtype(np.int32), self._shape, label="read_later: read", lane=self._lane)
