"""The per-sequence stores an engine allocates, and how big: KV pages, a hybrid's Gated DeltaNet state slots,
and its state snapshots.

On a GPU, `--kv-capacity auto` plans them together from the memory the weights left (kv/memory_plan.py:
slots first, then the snapshot budget, the KV pages take the rest) and prints the split; a given page
count or `--state-snapshot-budget` overrides its part. On the CPU memory is not the limit: the KV gets its
default page count and the snapshots a count sized to what that pool retains (memory_plan.cpu_snapshots).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ninfer_rt.cuda.driver import Device
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.engine.state_ledger import StateLedger
from ninfer_rt.kv.cache import KVSpec
from ninfer_rt.kv.capacity import resolve_kv_capacity
from ninfer_rt.kv.memory_plan import MemoryPlan, SnapshotBudget, cpu_snapshots, plan_memory, safety_margin
from ninfer_rt.kv.snapshots import SnapshotStore
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.config import ModelConfig


@dataclass(frozen=True)
class StoreOptions:
    """The EngineConfig fields that size the stores."""

    kv_capacity: str
    kv_page: KVSpec  # one page's geometry (num_pages ignored)
    max_concurrency: int
    max_context: int
    ring_depth: int  # state slots per running sequence
    prefix_caching: bool
    snapshot_budget: str | None
    snapshot_interval: int


@dataclass(frozen=True)
class StoreSizes:
    kv_pages: int
    snapshots: int


def state_spec(cfg: ModelConfig, device: Device | None, cpu_dtype: np.dtype) -> StateSpec | None:
    """A hybrid's per-sequence state (the executor's precision on the CPU); None for a dense model."""
    if not cfg.is_hybrid:
        return None
    return StateSpec.for_model(cfg) if device is not None else StateSpec.for_model(cfg, cpu_dtype, cpu_dtype)


def store_sizes(options: StoreOptions, state: StateSpec | None, device: Device | None) -> StoreSizes:
    """The stores' sizes; on a device, from its memory plan, whose split is printed (one line, stderr)."""
    if device is None:
        pages = resolve_kv_capacity(options.kv_capacity, options.kv_page, None)
        budget = snapshot_budget(options, state)
        if budget is None:
            return StoreSizes(pages, cpu_snapshots(pages, options.kv_page.page_size, options.max_concurrency, state.slot_bytes))
        return StoreSizes(pages, budget.records(state.slot_bytes) if state is not None else 0)
    plan = device_plan(options, state, device)
    print(f"ninfer-rt: {plan.describe()}", file=sys.stderr)
    pages = plan.kv_pages if options.kv_capacity == "auto" else resolve_kv_capacity(options.kv_capacity, options.kv_page, None)
    return StoreSizes(pages, plan.snapshots)


def device_plan(options: StoreOptions, state: StateSpec | None, device: Device) -> MemoryPlan:
    """The split of what `device` has free (everything in use counts as the weights'); MemoryPlanError
    (one line) when the stores cannot fit."""
    margin = safety_margin(device.total_memory)
    free = device.free_memory()
    return plan_memory(free, margin, device.total_memory - free, options.kv_page, options.max_concurrency,
                       options.max_context, state, options.ring_depth, budget=snapshot_budget(options, state))


def snapshot_budget(options: StoreOptions, state: StateSpec | None) -> SnapshotBudget | None:
    """--state-snapshot-budget; none at all without prefix caching or linear layers; None: the default."""
    if not options.prefix_caching or state is None:
        return SnapshotBudget(count=0)
    return SnapshotBudget.parse(options.snapshot_budget) if options.snapshot_budget else None


def make_state_ledger(
    streams: StreamSet, compute: Stream, state: StateSpec | None, options: StoreOptions, snapshots: int
) -> StateLedger | None:
    """A hybrid's state slots (a ring per running sequence) and snapshot store; None for a dense model."""
    if state is None:
        return None
    pool = StateSlotPool(streams, state, options.max_concurrency * options.ring_depth)
    store = SnapshotStore(streams, pool, snapshots, options.kv_page.page_size) if snapshots else None
    return StateLedger(pool, options.ring_depth, compute, store, options.snapshot_interval)
