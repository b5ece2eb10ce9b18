"""Gated DeltaNet state slots: the live recurrent state of every running sequence, with fenced release.

What a slot holds (`StateSpec`, docs/ARCHITECTURE.md "Hybrid state slots and snapshots"): for each linear-attention layer, the conv window
(the last `conv_kernel - 1` pre-conv columns of the q, k and v channels, bf16, [channels, kernel - 1]) and
the recurrent state (fp32, [value heads, key head dim, value head dim]). At the 27B shape that is
48 x (60 KiB + 3 MiB) = 146.8 MiB per slot (tests/test_kv_states.py derives it from the config numbers).

Layout: one device buffer for all slots, slot-major, so a slot is one contiguous byte range and copying a
whole state (snapshot write, restore) is a single copy, not one per layer:

    slot s: [layer 0: conv window | pad to 256 B | recurrent state][layer 1: ...] ... [layer L-1: ...]

A kernel for layer l of slot s addresses `s * slot_bytes + l * layer_bytes` (+ `conv_bytes` for the
recurrent part); batched kernels take one base pointer per sequence, or base + slot stride.

Discipline (rule 4, as for KV pages): a slot has one owner. `release(slot, fence)` takes the event recorded
after the last op that touched it; the slot is then *fenced* until the next `acquire`, which makes the new
owner's stream wait on every fence before returning it. The ids and their fences are a `PagePool`, the
same fenced hand-over the KV pages use. Every op on a slot declares `resource(slot)`, the slot's byte span
of the buffer, so the verifier sees copies (whose default declaration is exactly that span), memsets and
kernels alike.

Written-ness: a freshly acquired slot holds whatever its last owner left. It holds a state only once it
was zeroed (a sequence starting at position 0), restored from a snapshot, or written by a kernel
(`mark_written`). Reading an unwritten slot as a state (a snapshot write, a speculative accept) raises
`UnwrittenStateError`: restoring garbage must fail loudly, not corrupt output.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import ml_dtypes
import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import Event, Stream, StreamSet
from ninfer_rt.kv.pages import OutOfPages, PagePool
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.ordering import Span

CONV_DTYPE = np.dtype(ml_dtypes.bfloat16)
STATE_DTYPE = np.dtype(np.float32)
_ALIGN = 256  # the recurrent part of each layer starts 256-byte aligned (vector loads, TMA)


class OutOfStateSlots(RuntimeError):
    """acquire() with no slot free or fenced (the scheduler must check can_acquire first)."""


class UnwrittenStateError(RuntimeError):
    """A slot or snapshot was read as a state before any state was written into it."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence Gated DeltaNet state. Field names follow the HF config's linear_* keys."""

    num_layers: int  # linear-attention layers (layer_types == "linear_attention")
    key_heads: int  # linear_num_key_heads
    value_heads: int  # linear_num_value_heads
    key_head_dim: int  # linear_key_head_dim
    value_head_dim: int  # linear_value_head_dim
    conv_kernel: int = 4  # linear_conv_kernel_dim
    # The GPU keeps windows in bf16 and states in fp32; the numpy executor stores its own precision
    # (float32 or float64), so a resumed computation equals an uninterrupted one to that precision.
    conv_dtype: np.dtype = CONV_DTYPE
    state_dtype: np.dtype = STATE_DTYPE

    @classmethod
    def for_model(cls, cfg: ModelConfig, conv_dtype: np.dtype = CONV_DTYPE, state_dtype: np.dtype = STATE_DTYPE) -> StateSpec:
        """The state of a hybrid model's linear-attention layers (`cfg.linear_attention`)."""
        linear = cfg.linear_attention
        if linear is None:
            raise ValueError(f"{cfg.architecture} has no linear-attention layers, so no recurrent state")
        return cls(
            num_layers=len(cfg.linear_attention_layers),
            key_heads=linear.num_key_heads,
            value_heads=linear.num_value_heads,
            key_head_dim=linear.key_head_dim,
            value_head_dim=linear.value_head_dim,
            conv_kernel=linear.conv_kernel_size,
            conv_dtype=np.dtype(conv_dtype),
            state_dtype=np.dtype(state_dtype),
        )

    def __post_init__(self) -> None:
        if min(self.num_layers, self.key_heads, self.value_heads, self.key_head_dim, self.value_head_dim) < 1:
            raise ValueError(f"every StateSpec dimension must be positive: {self}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be at least 2 (a window of kernel - 1 columns), got {self.conv_kernel}")

    @property
    def conv_channels(self) -> int:
        """q and k (key heads x key dim each) and v (value heads x value dim): what the conv runs over."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_channels, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_head_dim, self.value_head_dim)

    # The byte sizes are read for every layer of every step (slot offsets, the verifier's spans): cached, since
    # recomputing them took a fifth of the CPU engine's decode time on the tiny hybrid.
    @cached_property
    def conv_window_bytes(self) -> int:
        return int(np.prod(self.conv_shape)) * np.dtype(self.conv_dtype).itemsize

    @cached_property
    def recurrent_bytes(self) -> int:
        return int(np.prod(self.recurrent_shape)) * np.dtype(self.state_dtype).itemsize

    @cached_property
    def conv_bytes(self) -> int:
        """Bytes of one layer's conv part, padded so its recurrent state starts aligned."""
        return _aligned(self.conv_window_bytes)

    @cached_property
    def layer_bytes(self) -> int:
        return _aligned(self.conv_bytes + self.recurrent_bytes)

    @cached_property
    def slot_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    def layer_offset(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"linear-attention layer {layer} out of range ({self.num_layers} layers)")
        return layer * self.layer_bytes


@dataclass(frozen=True)
class SlotStats:
    total: int
    in_use: int
    free: int  # never used, or used and handed out again (no fence pending)
    fenced: int  # released; the next owner's stream waits on the release fences

    @property
    def balanced(self) -> bool:
        return self.in_use + self.free + self.fenced == self.total


class StateSlotPool:
    """`num_slots` state slots in one device buffer; acquired by one owner, released behind a fence."""

    def __init__(self, streams: StreamSet, spec: StateSpec, num_slots: int, name: str = "state slots") -> None:
        self.spec = spec
        self.total = num_slots
        self._ids = PagePool(num_slots)
        self.buffer = DeviceBuffer(streams, num_slots * spec.slot_bytes, name)
        self._fenced: set[int] = set()
        self._written: set[int] = set()

    # -- ownership -------------------------------------------------------------------------------------

    def can_acquire(self, n: int = 1) -> bool:
        return self._ids.can_allocate(n)

    def acquire(self, stream: Stream) -> int:
        """A slot owned by the caller, usable on `stream` once this returns (it waited on the fences).
        Its bytes are not a state yet: zero it, restore into it, or have a kernel write it."""
        try:
            [slot] = self._ids.allocate(1, stream)
        except OutOfPages:
            raise OutOfStateSlots(f"all {self.total} state slots are in use") from None
        self._fenced.discard(slot)
        self._written.discard(slot)
        return slot

    def release(self, slot: int, fence: Event) -> None:
        """Give the slot back; `fence` was recorded after the last op that read or wrote it."""
        self._ids.release([slot], fence)
        self._fenced.add(slot)
        self._written.discard(slot)

    def in_use(self, slot: int) -> bool:
        return self._ids.refcount(slot) > 0

    # -- declared accesses -----------------------------------------------------------------------------

    def resource(self, slot: int) -> Span:
        """What every op on the slot declares: its byte range of the pool's buffer."""
        start = slot * self.spec.slot_bytes
        return Span(self.buffer.resource, start, start + self.spec.slot_bytes)

    def offset(self, slot: int) -> int:
        return slot * self.spec.slot_bytes

    def zero(self, slot: int, stream: Stream, *, lane: object = None) -> None:
        """The state of an empty prefix (position 0): zero conv window and zero recurrent state."""
        self._require_owned(slot)
        stream.memset(self.buffer, 0, self.spec.slot_bytes, self.offset(slot), label=f"state zero slot {slot}", lane=lane)
        self._written.add(slot)

    def mark_written(self, slot: int) -> None:
        """A kernel (declaring `resource(slot)` as written) stored a state here."""
        self._require_owned(slot)
        self._written.add(slot)

    def is_written(self, slot: int) -> bool:
        return slot in self._written

    def require_written(self, slot: int, what: str) -> None:
        self._require_owned(slot)
        if slot not in self._written:
            raise UnwrittenStateError(
                f"{what}: state slot {slot} holds no state yet (it was never zeroed, restored or written)"
            )

    # -- host views (logical streams: the numpy executor's kernels) ------------------------------------

    def conv_window(self, slot: int, layer: int) -> np.ndarray:
        """[channels, kernel - 1] view (conv_dtype) of one layer's conv window (host-visible buffers only)."""
        start = self.offset(slot) + self.spec.layer_offset(layer)
        raw = self.buffer.host_bytes()[start : start + self.spec.conv_window_bytes]
        return raw.view(self.spec.conv_dtype).reshape(self.spec.conv_shape)

    def recurrent(self, slot: int, layer: int) -> np.ndarray:
        """[value heads, key dim, value dim] view (state_dtype) of one layer's recurrent state."""
        start = self.offset(slot) + self.spec.layer_offset(layer) + self.spec.conv_bytes
        raw = self.buffer.host_bytes()[start : start + self.spec.recurrent_bytes]
        return raw.view(self.spec.state_dtype).reshape(self.spec.recurrent_shape)

    # -- accounting ------------------------------------------------------------------------------------

    def stats(self) -> SlotStats:
        ids = self._ids.stats()
        return SlotStats(self.total, ids.in_use, ids.free - len(self._fenced), len(self._fenced))

    def free(self) -> None:
        self.buffer.free()

    def _require_owned(self, slot: int) -> None:
        if not self.in_use(slot):
            raise ValueError(f"state slot {slot} is not owned by anyone (acquire it first)")
