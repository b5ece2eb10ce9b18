"""The engine on the CUDA executor, end to end: the same scheduler, KV pages, prefix cache and sampler as
on the CPU, with decode steps replayed from CUDA graphs. The verifier is on (root conftest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.engine import Engine, EngineConfig
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_qwen3_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: the smallest head size the attention kernels instantiate.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_d64"), head_dim=64)


def engine(model_dir: Path, device: str, **config: object) -> Engine:
    return Engine.load(model_dir, EngineConfig(**{"device": device, "kv_capacity": "64", "token_budget": 64, **config}))  # type: ignore[arg-type]


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, length).tolist()


def greedy(eng: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for out in eng.generate(prompts, params):
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [tokens[key] for key in sorted(tokens, key=lambda k: int(k.split("-")[-1]))]


def leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_cuda_engine_greedy_tokens_follow_the_cpu_engine(tiny_qwen3_d64: Path) -> None:
    # bf16 weights on the GPU vs float32 math on the CPU: near-ties may flip late tokens, not early ones.
    prompts = [prompt(70, 1), prompt(9, 2), prompt(130, 3)]
    on_gpu = greedy(engine(tiny_qwen3_d64, "cuda"), prompts)
    on_cpu = greedy(engine(tiny_qwen3_d64, "cpu"), prompts)
    agreement = [leading_agreement(g, c) for g, c in zip(on_gpu, on_cpu)]
    print("leading tokens in agreement:", agreement)
    assert all(len(g) == GREEDY.max_tokens for g in on_gpu)
    assert sum(agreement) >= 0.75 * GREEDY.max_tokens * len(prompts)


def test_cuda_engine_is_deterministic_across_runs_and_batch_partners(tiny_qwen3_d64: Path) -> None:
    eng = engine(tiny_qwen3_d64, "cuda")
    alone = greedy(eng, [prompt(70, 1)])[0]
    together = greedy(eng, [prompt(70, 1), prompt(33, 4)])[0]
    assert alone == together


def test_cuda_engine_prefix_hit_and_preemption_return_every_page(tiny_qwen3_d64: Path) -> None:
    eng = engine(tiny_qwen3_d64, "cuda", kv_capacity="6", max_concurrency=3)
    system = prompt(128 + 41, 7)
    outputs = greedy(eng, [system + prompt(20, 8), system + prompt(25, 9), prompt(90, 10)])
    assert all(len(o) == GREEDY.max_tokens for o in outputs)
    stats = eng.kv_stats()
    assert stats.in_use == 0 and stats.free + stats.cached == stats.total


def test_start_up_captures_the_decode_graphs_and_leaves_every_page_free(tiny_qwen3_d64: Path) -> None:
    eng = engine(tiny_qwen3_d64, "cuda", max_concurrency=2)
    captured = {shape.query_lens for shape in eng.runner.forward.graphs}
    assert {(1,), (1, 1)} <= captured
    stats = eng.kv_stats()
    assert stats.in_use == 0 and stats.free + stats.cached == stats.total
    assert eng.startup.graphs > 0 and "decode graphs" in eng.startup.describe()
    before = len(eng.runner.forward.graphs)
    greedy(eng, [prompt(30, 1), prompt(20, 2)])
    assert len(eng.runner.forward.graphs) == before  # nothing left to capture in real requests


def test_overlap_gives_the_tokens_of_synchronous_stepping_on_the_device(tiny_qwen3_d64: Path) -> None:
    """Greedy and seeded device sampling: the token fed to the next step on the device is the one read back."""
    prompts = [prompt(70, 1), prompt(9, 2)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    for params in (GREEDY, seeded):
        overlapped = greedy(engine(tiny_qwen3_d64, "cuda", overlap=True), prompts, params)
        synchronous = greedy(engine(tiny_qwen3_d64, "cuda", overlap=False), prompts, params)
        assert overlapped == synchronous


def test_fed_ids_replace_negative_token_ids_in_the_embedding_kernel(tiny_qwen3_d64: Path) -> None:
    eng = engine(tiny_qwen3_d64, "cuda", overlap=False)
    executor, embed = eng.executor, eng.runner.model.embed
    batch = StepBatch(
        token_ids=np.array([2, -2, -1], np.int32), positions=np.array([0, 1, 2], np.int32),
        query_start=np.array([0, 3], np.int32), context_lens=np.array([3], np.int32),
        block_tables=np.array([[0]], np.int32), slot_mapping=np.array([0, 1, 2], np.int32),
        logit_rows=np.array([2], np.int32),
    )
    executor.feed(np.array([4, 1], np.int32))
    executor.begin_step(batch, eng.kv)
    fed = executor.to_host(executor.embed(embed))
    batch.token_ids = np.array([2, 1, 4], np.int32)
    executor.begin_step(batch, eng.kv)
    assert np.array_equal(fed, executor.to_host(executor.embed(embed)))
