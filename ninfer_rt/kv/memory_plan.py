"""`--kv-capacity auto` for every per-sequence store at once: KV pages, Gated DeltaNet state slots and the
state-snapshot budget, out of the device memory the weights left.

Order of claims on what is free (after a safety margin for activations, cuBLAS workspaces and graphs):
1. state slots: max_concurrency x ring depth (1 + draft tokens with MTP), fixed: without them a hybrid
   sequence cannot run at all;
2. snapshots: `--state-snapshot-budget` (bytes or a count), or by default DEFAULT_SNAPSHOTS_PER_LANE per
   lane, shrunk to at most a SNAPSHOT_SHARE of what the slots left so they never crowd out the KV;
3. KV pages: everything else (pages beyond the running lanes' needs keep retained conversations cached).
   Enough for max_context tokens per lane is the goal; less is still a valid plan (the context limit is
   then what the pages hold), but not less than one page per lane.
A plan that cannot give each lane a page, or that an explicit budget overfills, is refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.kv.cache import KVSpec
from ninfer_rt.kv.capacity import bytes_per_page
from ninfer_rt.kv.snapshots import records_for_budget
from ninfer_rt.kv.states import StateSpec

GIB = 1 << 30
DEFAULT_SNAPSHOTS_PER_LANE = 8
SNAPSHOT_SHARE = 0.25
CPU_TOKENS_PER_SNAPSHOT = 2048
CPU_SNAPSHOT_BYTES = 512 << 20


def safety_margin(total_memory: int) -> int:
    """Device bytes no store claims: activations, cuBLAS workspaces and graphs are allocated after them."""
    return max(3 * GIB, total_memory // 20)


class MemoryPlanError(ValueError):
    """The stores do not fit the device (one line, naming what does not fit)."""


@dataclass(frozen=True)
class SnapshotBudget:
    """--state-snapshot-budget: a byte budget ('4GiB', '512MiB') or a snapshot count ('12')."""

    bytes: int | None = None
    count: int | None = None

    @classmethod
    def parse(cls, text: str) -> SnapshotBudget:
        units = {"gib": GIB, "mib": 1 << 20, "gb": 10**9, "mb": 10**6}
        lowered = text.strip().lower()
        for unit, scale in units.items():
            if lowered.endswith(unit):
                return cls(bytes=int(float(lowered[: -len(unit)]) * scale))
        if lowered.isdigit():
            return cls(count=int(lowered))
        raise ValueError(f"--state-snapshot-budget must be a size such as 4GiB or a snapshot count, got {text!r}")

    def records(self, record_bytes: int) -> int:
        return self.count if self.count is not None else records_for_budget(self.bytes, record_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    margin: int
    kv_pages: int
    page_bytes: int
    page_size: int
    lanes: int
    max_context: int
    state_slots: int
    slot_bytes: int
    snapshots: int
    snapshot_bytes: int  # one record: a slot's bytes (the engine's snapshots keep no hidden row)
    headroom: int  # free bytes no store claims (beyond the margin)

    @property
    def tokens_per_lane(self) -> int:
        return self.kv_pages * self.page_size // self.lanes

    @property
    def max_context_fits(self) -> bool:
        """Every lane can hold a max_context-token sequence at once."""
        return self.tokens_per_lane >= self.max_context

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB"

        fit = "fits" if self.max_context_fits else f"does not fit: {self.tokens_per_lane:,} tokens a lane"
        return (
            f"memory: weights {gib(self.weights_bytes)}; KV {self.kv_pages} pages ({gib(self.kv_pages * self.page_bytes)}; "
            f"{self.max_context:,} tokens x {self.lanes} lanes {fit}); state slots {self.state_slots} "
            f"({gib(self.state_slots * self.slot_bytes)}); snapshots {self.snapshots} "
            f"({gib(self.snapshots * self.snapshot_bytes)}); margin {gib(self.margin)}, headroom {gib(self.headroom)}"
        )


def plan_memory(
    free_bytes: int,
    margin: int,
    weights_bytes: int,
    page: KVSpec,
    lanes: int,
    max_context: int,
    state: StateSpec | None = None,
    ring_depth: int = 1,
    budget: SnapshotBudget | None = None,
) -> MemoryPlan:
    """The split of `free_bytes` (what is free after the weights) between the three stores."""
    page_bytes = bytes_per_page(page)
    available = free_bytes - margin
    slots = lanes * ring_depth if state is not None else 0
    slot_bytes = state.slot_bytes if state is not None else 0
    left = available - slots * slot_bytes
    if left < lanes * page_bytes:
        raise MemoryPlanError(
            f"--max-concurrency {lanes}: {slots} state slots ({slots * slot_bytes / GIB:.2f} GiB) and a KV page "
            f"per lane do not fit: the weights take {weights_bytes / GIB:.2f} GiB, {free_bytes / GIB:.2f} GiB is "
            f"left, less a {margin / GIB:.2f} GiB margin for activations"
        )
    record = slot_bytes
    snapshots = _snapshots(left - lanes * page_bytes, record, lanes, budget) if state is not None else 0
    left -= snapshots * record
    pages = left // page_bytes
    return MemoryPlan(
        weights_bytes, margin, int(pages), page_bytes, page.page_size, lanes, max_context, slots, slot_bytes,
        snapshots, record, int(left - pages * page_bytes),
    )


def cpu_snapshots(kv_pages: int, page_size: int, lanes: int, record_bytes: int) -> int:
    """The default snapshot count on the CPU, where memory does not bound it: one per
    CPU_TOKENS_PER_SNAPSHOT tokens the KV pool can keep cached (a snapshot lives no longer than the page
    it ends in), so the resume points of every conversation the pool retains fit, within
    CPU_SNAPSHOT_BYTES and never fewer than the GPU's default."""
    by_pool = kv_pages * page_size // CPU_TOKENS_PER_SNAPSHOT
    return max(DEFAULT_SNAPSHOTS_PER_LANE * lanes, min(by_pool, CPU_SNAPSHOT_BYTES // record_bytes))


def _snapshots(spare: int, record: int, lanes: int, budget: SnapshotBudget | None) -> int:
    if budget is not None:
        wanted = budget.records(record)
        if wanted * record > spare:
            raise MemoryPlanError(
                f"--state-snapshot-budget asks for {wanted} snapshots ({wanted * record / GIB:.2f} GiB); "
                f"{spare / GIB:.2f} GiB is left after the state slots and a KV page per lane"
            )
        return wanted
    return int(min(DEFAULT_SNAPSHOTS_PER_LANE * lanes, spare * SNAPSHOT_SHARE // record))
