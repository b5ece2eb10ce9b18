"""A hybrid's steps take the executor's graphed path when it offers one: build hands it the state slot
pool the steps read and write, the runner steps through it (start-up warm-up included), and the tokens
equal op-by-op stepping; the device-side token feed (overlap) gives the synchronous tokens as for a dense
model. The numpy executor graphs nothing, so the offering executor here runs layers.forward over exactly
the pool it was handed: a wrong or missing pool fails the step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_helpers import prompt, run
from ninfer_rt.engine import build
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import ForwardOutput, forward

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class OfferingExecutor(NumpyExecutor):
    """A numpy executor that offers graphed steps: layers.forward over the pool `graphed_forward` got."""

    offered: list[StateSlotPool | None]
    steps = 0

    def graphed_forward(self, model, kv, states=None):  # type: ignore[no-untyped-def]
        self.offered.append(states)

        def step(batch: StepBatch) -> ForwardOutput:
            self.steps += 1
            return forward(self, model, batch, kv, states)

        return step


def engine(model_dir: Path, **config: object) -> Engine:
    defaults = {"device": "cpu", "kv_capacity": "64", "token_budget": 64, "page_size": 16, "max_concurrency": 2}
    return Engine.load(model_dir, EngineConfig(**{**defaults, **config}))  # type: ignore[arg-type]


def test_a_hybrid_steps_through_the_offered_graphed_forward_with_its_state_pool(
    tiny_qwen3_5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [prompt(21, 1), prompt(9, 2)]
    op_by_op, _ = run(engine(tiny_qwen3_5), prompts, GREEDY)

    def offering(config: EngineConfig, streams: object, max_context: int, plan: object) -> OfferingExecutor:
        executor = OfferingExecutor(streams, dtype=np.dtype(config.cpu_precision))
        executor.offered = []
        return executor

    monkeypatch.setattr(build, "make_executor", offering)
    eng = engine(tiny_qwen3_5)
    executor = eng.executor
    assert executor.offered == [eng.ledger.states.pool]
    assert executor.steps > 0 and eng.startup.graphs > 0  # the start-up warm-up stepped through it
    warm_up = executor.steps
    graphed, _ = run(eng, prompts, GREEDY)
    assert executor.steps > warm_up
    assert graphed == op_by_op


def test_overlapped_hybrid_steps_give_the_synchronous_tokens(tiny_qwen3_5: Path) -> None:
    prompts = [prompt(30, 3), prompt(7, 4)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    synchronous, _ = run(engine(tiny_qwen3_5, overlap=False), prompts, params)
    overlapped_engine = engine(tiny_qwen3_5, overlap=True)
    overlapped, _ = run(overlapped_engine, prompts, params)
    assert overlapped == synchronous
    stats = overlapped_engine.state_stats()
    assert stats.in_use == 0 and stats.balanced
