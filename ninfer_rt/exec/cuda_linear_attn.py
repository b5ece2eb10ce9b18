"""LinearAttentionBackend: the CUDA executor's Gated DeltaNet op and its device scratch.

A layer's linear attention is the causal conv + SiLU (gdn_conv.cu: from each sequence's window, the
targets' windows written), the gated delta rule (gdn_delta_rule.cu: the recurrent kernel for sequences of
at most 8 rows, the chunked one above, both over the whole step; the q/k norm and the gating fused in)
and the gated output norm, over the projection rows [q | k | v | z | b | a] (cuda/linear_attn_ops.py).

The state slots belong to the engine (kv/states.py's StateSlotPool, passed to each forward); `plan` runs
once per step and keeps the step's published tables (query_start, state_slots, state_targets) and the host
copies of its slots, from which the slot spans every launch declares are built once per pool. Scratch (the
conv output bf16 [max_tokens, C] and the delta rule's f32 output [max_tokens, Hv dv], per geometry) is made
at the geometry's first step, outside any capture, and kept: a captured step replays over the same
addresses, and allocating while `capturing()` raises instead.

NINFER_GDN_CHUNKED picks the chunked form of sequences above 8 rows: `split` (gdn_chunked_split.cu's three
passes, the default: 168 us against 542 at 531 rows, 2.02 ms against 7.7 at 8,192 on the H200's 27B layer) or
`fused` (gdn_delta_rule.cu's one kernel walking the chunks). The split form's workspace
(gdn_split_plan.SplitWorkspace: ~48 KiB a row and 3.5 MiB a chunk at the 27B shape) and the layer scratch are
reserved for the widest step before the KV cache is sized (`reserve`); a step wider than that (a backend used
without reserving) grows them after the compute stream drains; prefill steps are eager, so growing never meets
a capture. The launches of a step depend only on its
query lengths and target width, never on the state values, so decode and verify steps can be captured;
a replay declares the slot spans of its own step (`slot_spans`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ninfer_rt.cuda import gdn_split_plan, linear_attn_ops
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.linear_attn_ops import DeltaRuleArgs, GdnHeads, GdnStep, SplitWorkspace, StateLayer
from ninfer_rt.cuda.memory import Buffer, DeviceBuffer
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.exec.layer_backend import CaptureGuard, PublishedStep
from ninfer_rt.kv.states import CONV_DTYPE, STATE_DTYPE, StateSlotPool
from ninfer_rt.model.executor import LinearAttentionParams, LinearAttentionShape
from ninfer_rt.ordering.verifier import Resource

STATE_INPUT_NAMES = ("query_start", "state_slots", "state_targets")
MAX_STATE_TARGETS = linear_attn_ops.RECURRENT_MAX_ROWS  # a verify pass keeps the state after each of its rows
CHUNKED_FORM_ENV = "NINFER_GDN_CHUNKED"
CHUNKED_FORMS = ("fused", "split")


def chunked_form_from_env() -> str:
    form = os.environ.get(CHUNKED_FORM_ENV, "split")
    if form not in CHUNKED_FORMS:
        raise ValueError(f"{CHUNKED_FORM_ENV}={form!r}: expected one of {', '.join(CHUNKED_FORMS)}")
    return form


def gdn_heads(shape: LinearAttentionShape) -> GdnHeads:
    if shape.conv_kernel != linear_attn_ops.CONV_KERNEL:
        raise ValueError(f"the CUDA conv kernel is instantiated for kernel {linear_attn_ops.CONV_KERNEL}, not {shape.conv_kernel}")
    return GdnHeads(shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim, shape.norm_eps)


@dataclass(frozen=True)
class _Scratch:
    conv: DeviceBuffer  # bf16 [max_tokens, C]
    mixed: DeviceBuffer  # f32 [max_tokens, Hv dv]


@dataclass(frozen=True)
class _HostStep:
    query_lens: tuple[int, ...]
    slots: np.ndarray  # int32 [B]
    targets: np.ndarray  # int32 [B, S]
    inputs: tuple[Buffer, Buffer, Buffer]  # query_start, state_slots, state_targets (published)
    lane: object


class LinearAttentionBackend(CaptureGuard):
    """The Gated DeltaNet layers of one executor's steps on its compute stream (exec/layer_backend.LayerBackend)."""

    def __init__(
        self, library: KernelLibrary, streams: StreamSet, stream: Stream, *, max_tokens: int, chunked_form: str | None = None
    ) -> None:
        self.library = library
        self.streams = streams
        self.stream = stream
        self.max_tokens = max_tokens
        self.chunked_form = chunked_form or chunked_form_from_env()
        if self.chunked_form not in CHUNKED_FORMS:
            raise ValueError(f"chunked form {self.chunked_form!r}: expected one of {', '.join(CHUNKED_FORMS)}")
        self._scratch: dict[GdnHeads, _Scratch] = {}
        self._split: dict[GdnHeads, tuple[gdn_split_plan.SplitWorkspace, SplitWorkspace]] = {}
        self._host: _HostStep | None = None
        self._steps: dict[int, GdnStep] = {}  # this step's, by the id of the pool it runs over

    def reserve(self, shape: LinearAttentionShape, max_seqs: int) -> None:
        """Allocate the scratch and (split form) the workspace of the widest step now, so that the KV cache
        is sized around them and no step allocates them later."""
        heads = gdn_heads(shape)
        self._scratch_for(heads)
        if self.chunked_form == "split":
            chunks = gdn_split_plan.max_step_chunks(self.max_tokens, max_seqs, MAX_STATE_TARGETS)
            self._workspace_covering(heads, gdn_split_plan.SplitWorkspace(
                self.max_tokens, chunks, heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim))

    def plan(self, step: PublishedStep) -> None:
        self._steps = {}
        if step.state_slots.size == 0:
            self._host = None  # a model without linear attention, or a step that runs none
            return
        inputs = tuple(step.inputs[name] for name in STATE_INPUT_NAMES)
        self._host = _HostStep(step.query_lens, step.state_slots.copy(), step.state_targets.copy(), inputs, step.lane)

    def forward(self, projected: Buffer, out: Buffer, params: LinearAttentionParams, states: StateSlotPool, layer: int) -> None:
        """out [T, Hv dv] bf16 (out_proj's input) = the layer over the step's rows of `projected`
        [T, q | k | v | z | b | a], each sequence from its slot's state of linear layer `layer`, the
        states after the rows its targets ask for written there."""
        if self._host is None:
            raise RuntimeError("linear_attention: the step has no state slots (StepBatch.state_slots is empty)")
        heads = gdn_heads(params.shape)
        _check_pool(states, params.shape)
        lib, stream, step, scratch = self.library, self.stream, self._step_over(states), self._scratch_for(heads)
        spec = states.spec
        layer_states = StateLayer(states.buffer, spec.layer_offset(layer), spec.slot_bytes, spec.conv_bytes)
        linear_attn_ops.conv_silu(lib, stream, step, heads, projected, params.conv_weight.buffer, scratch.conv, layer_states)
        gating = DeltaRuleArgs(scratch.conv, projected, params.a_log.buffer, params.dt_bias.buffer, scratch.mixed)
        if self.chunked_form == "split" and step.chunked:
            split, columns = self._split_workspace(heads, step), linear_attn_ops.SPLIT_CARRY_COLUMNS
        else:
            split, columns = None, linear_attn_ops.chunk_columns(heads.key_dim, heads.value_dim, lib.device.max_shared_memory_per_block_optin)
        linear_attn_ops.delta_rule(lib, stream, step, heads, gating, layer_states, columns, split)
        linear_attn_ops.gated_norm(
            lib, stream, heads, scratch.mixed, projected, params.norm.buffer, out, step.num_rows, lane=step.lane
        )

    def slot_spans(self, states: StateSlotPool) -> tuple[tuple[Resource, ...], tuple[Resource, ...]]:
        """(read, written) slot spans of the planned step over `states`: what a replay of a captured step
        declares for its own slots (none for a step without state slots)."""
        if self._host is None:
            return (), ()
        step = self._step_over(states)
        return tuple(step.slots_read), tuple(step.slots_written)

    def _step_over(self, states: StateSlotPool) -> GdnStep:
        """The step's launch arguments over `states`, with its slots' spans (made once per step and pool)."""
        key = id(states)
        if key not in self._steps:
            host = self._host
            highest = max(int(host.slots.max()), int(host.targets.max()))
            if highest >= states.total:
                raise ValueError(f"linear_attention: state slot {highest} outside the pool's {states.total} slots")
            written = sorted({int(t) for t in host.targets.reshape(-1) if t >= 0})
            self._steps[key] = GdnStep(
                *host.inputs, host.query_lens, int(host.targets.shape[1]),
                slots_read=tuple(states.resource(int(s)) for s in sorted(set(host.slots.tolist()))),
                slots_written=tuple(states.resource(t) for t in written), lane=host.lane,
            )
        return self._steps[key]

    def _scratch_for(self, heads: GdnHeads) -> _Scratch:
        if heads not in self._scratch:
            if self._capturing:
                raise RuntimeError("linear attention: scratch would be allocated inside a captured step; run the step eagerly first")
            name = f"[{heads.value_heads}x{heads.value_dim}]"
            self._scratch[heads] = _Scratch(
                DeviceBuffer(self.streams, self.max_tokens * heads.conv_channels * 2, f"gdn.conv{name}"),
                DeviceBuffer(self.streams, self.max_tokens * heads.value_size * 4, f"gdn.mixed{name}"),
            )
        return self._scratch[heads]

    def _split_workspace(self, heads: GdnHeads, step: GdnStep) -> SplitWorkspace:
        """The split form's arrays for `step`, grown to the step's rows and chunks if they are short."""
        chunks = gdn_split_plan.chunk_bases(step.query_lens, step.num_targets)[-1]
        needed = gdn_split_plan.SplitWorkspace(step.num_rows, chunks, heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim)
        return self._workspace_covering(heads, needed)

    def _workspace_covering(self, heads: GdnHeads, needed: gdn_split_plan.SplitWorkspace) -> SplitWorkspace:
        held = self._split.get(heads)
        if held is not None and held[0].covers(needed):
            return held[1]
        if self._capturing:
            raise RuntimeError("linear attention: the split workspace would be allocated inside a captured step; run the step eagerly first")
        if held is not None:
            self.stream.record().synchronize()  # the old arrays' last readers are on this stream
            for buffer in held[1].buffers:
                buffer.free()
        shape = gdn_split_plan.SplitWorkspace(
            max(needed.rows, held[0].rows if held else 0), max(needed.chunks, held[0].chunks if held else 0),
            heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim,
        )
        name = f"[{heads.value_heads}x{heads.value_dim}]"
        arrays = SplitWorkspace(*(DeviceBuffer(self.streams, size, f"gdn.split.{key}{name}") for key, size in shape.sizes().items()))
        self._split[heads] = (shape, arrays)
        return arrays


def _check_pool(states: StateSlotPool, shape: LinearAttentionShape) -> None:
    """The kernels read bf16 windows and f32 states of the layer's geometry."""
    spec = states.spec
    if (np.dtype(spec.conv_dtype), np.dtype(spec.state_dtype)) != (CONV_DTYPE, STATE_DTYPE):
        raise ValueError(f"the CUDA kernels read bf16 conv windows and f32 states, not {spec.conv_dtype} / {spec.state_dtype}")
    ours = (shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim, shape.conv_kernel)
    theirs = (spec.key_heads, spec.value_heads, spec.key_head_dim, spec.value_head_dim, spec.conv_kernel)
    if ours != theirs:
        raise ValueError(f"state slots of geometry {theirs} for a layer of {ours}")
