"""Prefix caching through the engine (issue 5): multi-turn reuse, shared system prompts, copy-on-write
tails, KV exhaustion, int8 KV. Page size 64 as in production; the verifier is on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.request import SamplingParams

PAGE = 64


def engine(model_dir: Path, **config: object) -> Engine:
    return Engine.load(model_dir, EngineConfig(**{"kv_capacity": "64", "token_budget": 256, **config}))  # type: ignore[arg-type]


def tokens(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, length).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_one(eng: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], RequestOutput]:
    outputs = list(eng.generate([prompt], params))
    return [t for o in outputs for t in o.token_ids], outputs[-1]


def test_a_60_turn_conversation_reuses_every_previous_turn_and_matches_cold_runs(tiny_qwen3: Path) -> None:
    cached, cold = engine(tiny_qwen3), engine(tiny_qwen3, prefix_caching=False)
    params = greedy(3)
    prompt = tokens(40, 0)
    previous_length = 0
    for turn in range(60):
        reply, final = run_one(cached, prompt, params)
        assert final.stats is not None
        if turn > 0:
            assert final.stats.cached_tokens >= previous_length // PAGE * PAGE
        assert reply == run_one(cold, prompt, params)[0], f"turn {turn}"
        previous_length = len(prompt)
        prompt = prompt + reply + tokens(3, turn + 1)


def test_two_lanes_with_one_system_prompt_share_its_pages(tiny_qwen3: Path) -> None:
    system = tokens(2 * PAGE, 1)
    eng = engine(tiny_qwen3)
    first = eng.add_request(system + tokens(10, 2), greedy(20))
    eng.step()  # the first lane's prefill indexes the system prompt's two full pages
    second = eng.add_request(system + tokens(7, 3), greedy(5))
    eng.step()
    lane_a, lane_b = (eng.ledger.sequences[r] for r in (first, second))
    assert lane_a.pages[:2] == lane_b.pages[:2]
    assert [eng.kv_manager.pool.refcount(p) for p in lane_a.pages[:2]] == [2, 2]

    eng.abort(first)
    eng.step()
    assert all(eng.kv_manager.pool.refcount(p) == 1 for p in lane_b.pages)  # nothing the second lane uses was freed


def test_the_second_lane_of_a_shared_system_prompt_gives_its_cold_output(tiny_qwen3: Path) -> None:
    system = tokens(2 * PAGE, 1)
    prompts = [system + tokens(10, 2), system + tokens(7, 3)]
    eng = engine(tiny_qwen3)
    eng.add_request(prompts[0], greedy(20))
    eng.step()
    outputs = list(eng.generate([prompts[1]], greedy(8)))
    assert outputs[-1].stats is not None and outputs[-1].stats.cached_tokens == 2 * PAGE
    assert [t for o in outputs for t in o.token_ids] == run_one(engine(tiny_qwen3, prefix_caching=False), prompts[1], greedy(8))[0]


def test_prefixes_41_past_a_page_boundary_take_the_copy_on_write_tail_and_match_cold_runs(tiny_qwen3: Path) -> None:
    for full_pages in (0, 1, 2):
        stored = full_pages * PAGE + 41  # tokens the first turn leaves in the cache: prompt + replies but the last
        first_prompt = tokens(stored - 4, full_pages)
        eng = engine(tiny_qwen3)
        reply, _ = run_one(eng, first_prompt, greedy(5))
        follow_up = first_prompt + reply + tokens(20, 100 + full_pages)
        cached_reply, final = run_one(eng, follow_up, greedy(6))
        assert final.stats is not None and final.stats.cached_tokens == stored
        assert cached_reply == run_one(engine(tiny_qwen3, prefix_caching=False), follow_up, greedy(6))[0]


def test_kv_exhaustion_completes_every_request_and_returns_the_pages(tiny_qwen3: Path) -> None:
    prompts = [tokens(120, 40 + i) for i in range(5)]  # 2 pages at admission, 3 once decoding passes 128
    params = greedy(40)
    roomy = engine(tiny_qwen3, max_concurrency=5)
    expected = [run_one(roomy, p, params)[0] for p in prompts]
    tight = engine(tiny_qwen3, kv_capacity="7", max_concurrency=5)  # 3 admitted, then they outgrow the pool
    start = tight.kv_stats()
    done: dict[str, list[int]] = {}
    preemptions = 0
    for output in tight.generate(prompts, params):
        done.setdefault(output.request_id, []).extend(output.token_ids)
        preemptions += output.stats.preemptions if output.stats else 0
    assert [done[f"req-{i}"] for i in range(5)] == expected
    assert preemptions > 0
    end = tight.kv_stats()
    assert end.in_use == 0 and end.free + end.cached == start.total == start.free


def test_int8_kv_agrees_with_bf16_kv_on_the_first_16_greedy_tokens_of_most_prompts(tiny_qwen3: Path) -> None:
    bf16, int8 = engine(tiny_qwen3, kv_dtype="bf16", prefix_caching=False), engine(tiny_qwen3, kv_dtype="int8", prefix_caching=False)
    prompts = [tokens(30 + 7 * i, 200 + i) for i in range(20)]
    agree = sum(run_one(bf16, p, greedy(16))[0] == run_one(int8, p, greedy(16))[0] for p in prompts)
    print(f"int8 KV vs bf16 KV: {agree}/{len(prompts)} prompts agree on the first 16 greedy tokens")
    assert agree >= 0.8 * len(prompts)
