"""What the CUDA executor's backends share: one backend per kind of layer owns that kind's device state
(attention: scratch, workspaces, widening buffers; Gated DeltaNet: its conv and delta-rule scratch over the
state slots the engine owns). The executor publishes a step, every backend plans it once (`plan`), then each layer of the kind
calls its backend's forward. Buffers are allocated by a reservation or by a plan outside any capture, and
kept for the executor's life, so a captured step replays over the same addresses."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ninfer_rt.cuda.memory import DeviceView
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.ordering.verifier import Resource


@dataclass(frozen=True)
class PublishedStep:
    """A step as the executor published it (rule 3): its int32 arrays in their fixed device buffers, each
    sequence's new rows, the KV it runs over and the pages it reads and writes (empty when the
    verifier is off), its lanes, and the host copies of its linear-attention state slots and targets
    (StepBatch's; empty for models without linear attention), whose spans the launches declare."""

    inputs: Mapping[str, DeviceView]
    query_lens: tuple[int, ...]
    kv: KVCache
    pages_read: tuple[Resource, ...]
    pages_written: tuple[Resource, ...]
    lane: object
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    state_targets: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int32))


class LayerBackend(Protocol):
    def plan(self, step: PublishedStep) -> None:
        """Decide the step's launches (kernels, split counts, buffers) once, before its first layer."""

    def capturing(self) -> AbstractContextManager[None]:
        """While open, the step is being captured into a graph: allocating then is an error."""


class CaptureGuard:
    """The capturing() half of a LayerBackend: `_capturing` is true while a step is being captured, and the
    backend's allocations refuse then."""

    _capturing = False

    @contextmanager
    def capturing(self) -> Iterator[None]:
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
