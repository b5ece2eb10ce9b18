"""--kv-capacity auto splits a device between KV pages, Gated DeltaNet state slots and snapshots: the seed's
flags (--max-context 262144 --max-concurrency 2 --kv-dtype int8 --spec mtp --draft-tokens 3) at the 27B
hybrid shape with int4 g128 weights, on simulated 32 GiB (RTX 5090) and 96 GiB (RTX 6000 Pro) devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer_rt.kv.cache import KVDtype, KVSpec
from ninfer_rt.kv.memory_plan import GIB, MemoryPlanError, SnapshotBudget, plan_memory, safety_margin
from ninfer_rt.kv.states import StateSpec
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.quantize_checkpoint.footprint import WeightFormat, weight_bytes

FIXTURES = Path(__file__).parent / "fixtures"
MAX_CONTEXT = 262_144
LANES = 2
RING_DEPTH = 1 + 3  # --spec mtp --draft-tokens 3
CUDA_CONTEXT = 1 * GIB  # what the driver and the activation pool take before the weights (simulated)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(json.loads((FIXTURES / "qwen3_6_27b_config.json").read_text()))


def plan_on(cfg: ModelConfig, device_gib: int, budget: SnapshotBudget | None = None):  # noqa: ANN201
    weights = weight_bytes(cfg, WeightFormat(bits=4, group_size=128))
    total = device_gib * GIB
    free = total - CUDA_CONTEXT - weights
    page = KVSpec(num_layers=len(cfg.full_attention_layers) + cfg.mtp_layers, num_pages=1,
                  n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=KVDtype.INT8, page_size=64)
    margin = safety_margin(total)  # the engine's
    return plan_memory(free, margin, weights, page, LANES, MAX_CONTEXT, StateSpec.for_model(cfg), RING_DEPTH,
                       hidden_bytes=2 * cfg.hidden_size, budget=budget)


def test_the_27b_weights_in_bf16_and_int4(cfg: ModelConfig) -> None:
    # bf16: ~27.3 G parameters, 54.6 GB; int4 g128 projections (0.516 B a weight) + the bf16 embedding and
    # lm_head (248320 x 5120 each, 5.1 GB together) + what stays as stored: 17.9 GB
    assert 50.5 * GIB < weight_bytes(cfg) < 51.5 * GIB
    assert 16.3 * GIB < weight_bytes(cfg, WeightFormat(bits=4, group_size=128)) < 17.0 * GIB


def test_96_gib_holds_the_full_context_for_both_lanes_with_slots_and_snapshots(cfg: ModelConfig) -> None:
    plan = plan_on(cfg, 96)
    print(plan.describe())
    assert plan.max_context_fits
    assert plan.state_slots == LANES * RING_DEPTH
    assert plan.snapshots == 16
    used = plan.kv_pages * plan.page_bytes + plan.state_slots * plan.slot_bytes + plan.snapshots * plan.snapshot_bytes
    assert used + plan.margin + plan.headroom + plan.weights_bytes + CUDA_CONTEXT == 96 * GIB


def test_32_gib_fits_slots_and_snapshots_and_says_how_much_context_is_left(cfg: ModelConfig) -> None:
    plan = plan_on(cfg, 32)
    print(plan.describe())
    assert not plan.max_context_fits
    assert 60_000 < plan.tokens_per_lane < MAX_CONTEXT
    assert plan.state_slots == 8 and plan.snapshots > 0
    assert "does not fit" in plan.describe()


def test_a_device_too_small_for_the_state_slots_is_refused_in_one_line(cfg: ModelConfig) -> None:
    with pytest.raises(MemoryPlanError, match="state slots") as err:
        plan_on(cfg, 20)
    assert "\n" not in str(err.value)


def test_an_explicit_snapshot_budget_overrides_the_default_and_is_checked(cfg: ModelConfig) -> None:
    assert plan_on(cfg, 96, SnapshotBudget.parse("4")).snapshots == 4
    assert plan_on(cfg, 96, SnapshotBudget.parse("3GiB")).snapshots == 3 * GIB // plan_on(cfg, 96).snapshot_bytes
    with pytest.raises(MemoryPlanError, match="--state-snapshot-budget"):
        plan_on(cfg, 32, SnapshotBudget.parse("20GiB"))


@pytest.mark.parametrize("text", ["", "lots", "-3", "4 GiBs"])
def test_a_bad_snapshot_budget_names_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--state-snapshot-budget"):
        SnapshotBudget.parse(text)
