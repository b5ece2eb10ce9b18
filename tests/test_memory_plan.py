"""--kv-capacity auto splits a device between KV pages, Gated DeltaNet state slots and snapshots: the seed's
flags (--max-context 262144 --max-concurrency 2 --kv-dtype int8 --spec mtp --draft-tokens 3) at the 27B
hybrid shape with int4 g128 weights, on simulated 32 GiB (RTX 5090) and 96 GiB (RTX 6000 Pro) devices,
through the engine's own path (engine/stores.py: the options the engine builds from its flags, the plan,
the line it prints)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.cuda.driver import Device
from ninfer_rt.engine.build import EngineConfig, store_options
from ninfer_rt.engine.stores import StoreSizes, device_plan, state_spec, store_sizes
from ninfer_rt.kv.memory_plan import GIB, MemoryPlan, MemoryPlanError, SnapshotBudget
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.quantize_checkpoint.footprint import WeightFormat, weight_bytes

FIXTURES = Path(__file__).parent / "fixtures"
SEED_FLAGS = dict(max_context=262_144, max_concurrency=2, kv_dtype="int8", spec="mtp", draft_tokens=3, kv_capacity="auto")
CUDA_CONTEXT = 1 * GIB  # what the driver and the activation pool take before the weights (simulated)


@dataclass(frozen=True)
class SimulatedDevice(Device):
    """A device of `total_memory` bytes on which `in_use` bytes are taken: the memory query is the only
    part of the device the plan reads."""

    in_use: int = 0

    def free_memory(self) -> int:
        return self.total_memory - self.in_use


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(json.loads((FIXTURES / "qwen3_6_27b_config.json").read_text()))


def device(cfg: ModelConfig, gib: int) -> SimulatedDevice:
    weights = weight_bytes(cfg, WeightFormat(bits=4, group_size=128))
    return SimulatedDevice(0, None, f"simulated {gib} GiB", (12, 0), 170, gib * GIB, 101376, CUDA_CONTEXT + weights)


def sizes_on(cfg: ModelConfig, gib: int, capsys: pytest.CaptureFixture[str], **flags: object) -> tuple[StoreSizes, str]:
    """What the engine sizes on the device, and the line it prints."""
    config = EngineConfig(**{**SEED_FLAGS, **flags})  # type: ignore[arg-type]
    dev = device(cfg, gib)
    sizes = store_sizes(store_options(cfg, config, config.max_context), state_spec(cfg, dev, np.dtype(np.float32)), dev)
    [line] = capsys.readouterr().err.strip().splitlines()
    return sizes, line


def plan_on(cfg: ModelConfig, gib: int, **flags: object) -> MemoryPlan:
    config = EngineConfig(**{**SEED_FLAGS, **flags})  # type: ignore[arg-type]
    dev = device(cfg, gib)
    return device_plan(store_options(cfg, config, config.max_context), state_spec(cfg, dev, np.dtype(np.float32)), dev)


def test_the_27b_weights_in_bf16_and_int4(cfg: ModelConfig) -> None:
    # bf16: ~27.3 G parameters, 54.6 GB; int4 g128 projections (0.516 B a weight) + the bf16 embedding and
    # lm_head (248320 x 5120 each, 5.1 GB together) + what stays as stored: 17.9 GB
    assert 50.5 * GIB < weight_bytes(cfg) < 51.5 * GIB
    assert 16.3 * GIB < weight_bytes(cfg, WeightFormat(bits=4, group_size=128)) < 17.0 * GIB


def test_96_gib_prints_a_split_that_holds_the_full_context_for_both_lanes(cfg: ModelConfig, capsys: pytest.CaptureFixture[str]) -> None:
    sizes, line = sizes_on(cfg, 96, capsys)
    print(line)
    plan = plan_on(cfg, 96)
    assert plan.max_context_fits and sizes == StoreSizes(plan.kv_pages, plan.snapshots)
    assert plan.state_slots == 2 * 4 and plan.snapshots == 16  # a ring of 1 + 3 per lane; 8 snapshots a lane
    assert plan.snapshot_bytes == plan.slot_bytes  # the records the engine's SnapshotStore allocates
    used = plan.kv_pages * plan.page_bytes + plan.state_slots * plan.slot_bytes + plan.snapshots * plan.snapshot_bytes
    assert used + plan.margin + plan.headroom + plan.weights_bytes == 96 * GIB
    assert line == f"ninfer-rt: {plan.describe()}"
    assert f"KV {plan.kv_pages} pages" in line and "262,144 tokens x 2 lanes fits" in line
    assert "state slots 8 (1.15 GiB); snapshots 16 (2.29 GiB)" in line


def test_32_gib_prints_a_split_with_slots_and_snapshots_and_the_context_left(cfg: ModelConfig, capsys: pytest.CaptureFixture[str]) -> None:
    sizes, line = sizes_on(cfg, 32, capsys)
    print(line)
    plan = plan_on(cfg, 32)
    assert not plan.max_context_fits and 60_000 < plan.tokens_per_lane < 262_144
    assert sizes.kv_pages == plan.kv_pages and plan.state_slots == 8 and sizes.snapshots == plan.snapshots > 0
    assert f"does not fit: {plan.tokens_per_lane:,} tokens a lane" in line


def test_a_device_too_small_for_the_state_slots_is_refused_in_one_line(cfg: ModelConfig, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(MemoryPlanError) as err:
        sizes_on(cfg, 20, capsys)
    message = str(err.value)
    print(message)
    assert "\n" not in message and message.startswith("--max-concurrency 2: 8 state slots")
    assert capsys.readouterr().err == ""  # no split is printed for a plan that does not exist


def test_an_explicit_snapshot_budget_overrides_the_default_and_is_checked(cfg: ModelConfig) -> None:
    assert plan_on(cfg, 96, state_snapshot_budget="4").snapshots == 4
    assert plan_on(cfg, 96, state_snapshot_budget="3GiB").snapshots == 3 * GIB // plan_on(cfg, 96).snapshot_bytes
    with pytest.raises(MemoryPlanError, match="--state-snapshot-budget"):
        plan_on(cfg, 32, state_snapshot_budget="20GiB")


def test_without_prefix_caching_no_snapshot_is_planned(cfg: ModelConfig) -> None:
    plan = plan_on(cfg, 96, prefix_caching=False)
    assert plan.snapshots == 0 and plan.state_slots == 8


@pytest.mark.parametrize("text", ["", "lots", "-3", "4 GiBs"])
def test_a_bad_snapshot_budget_names_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--state-snapshot-budget"):
        SnapshotBudget.parse(text)
