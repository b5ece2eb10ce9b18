"""After every speculative step the MTP layer's K/V holds, for exactly the computed positions, what a
from-scratch MTP pass over the accepted sequence computes: rejected drafts leave nothing visible."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forward_helpers import PAGE_SIZE, SeqStep, make_runtime, relative_error, step_batch
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.mtp import mtp_forward, prepare_mtp
from spec_models import make_agreeable_mtp_model

TOLERANCE = 1e-4


@pytest.fixture(params=["random", "agreeable"])
def mtp_model(request: pytest.FixtureRequest, tiny_qwen3_mtp: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "random":
        return tiny_qwen3_mtp
    return make_agreeable_mtp_model(tmp_path_factory.mktemp("agreeable"), layer_scale=100.0)


def reference_mtp_keys(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """MTP keys of positions 0..len(tokens)-2: the main model over tokens[:-1], then the MTP over tokens[1:]."""
    runtime = make_runtime(model_dir, kv_dtype="f32", num_pages=16)
    pages = list(range(-(-len(tokens) // PAGE_SIZE)))
    main = runtime.step([SeqStep(tokens[:-1], 0, pages)])
    mtp = prepare_mtp(runtime.executor, runtime.weights, runtime.model)
    mtp_forward(runtime.executor, runtime.model, mtp, step_batch([SeqStep(tokens[1:], 0, pages)]), main.hidden, runtime.kv)
    return runtime.kv.read_tokens(mtp.kv_layer, pages, len(tokens) - 1)[0]


def test_mtp_kv_covers_exactly_the_accepted_positions_after_each_step(mtp_model: Path) -> None:
    eng = Engine.load(
        mtp_model,
        EngineConfig(device="cpu", kv_capacity="32", page_size=PAGE_SIZE, kv_dtype="f32", spec="mtp", draft_tokens=3),
    )
    eng.add_request(np.random.default_rng(0).integers(0, 500, 21).tolist(), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    request = eng.scheduler.waiting[0]
    mtp_layer = eng.runner.mtp.kv_layer
    for _ in range(8):
        eng.step()
        computed = request.num_computed
        keys = eng.kv.read_tokens(mtp_layer, eng.ledger.sequence(request).pages, computed)[0]
        expected = reference_mtp_keys(mtp_model, request.all_ids[: computed + 1])
        assert relative_error(keys, expected) < TOLERANCE
