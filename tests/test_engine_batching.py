"""The engine on the numpy executor with a tiny model: batching, chunked prefill, sampling, stops, abort,
preemption. The ordering verifier is on (root conftest), so every step's op sequence is checked too."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.request import FinishReason, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: RequestOutput | None = None


def collect(outputs: Iterable[RequestOutput]) -> dict[str, Completion]:
    done: dict[str, Completion] = {}
    for output in outputs:
        completion = done.setdefault(output.request_id, Completion())
        completion.token_ids += output.token_ids
        completion.text += output.text
        if output.finished:
            completion.final = output
    return done


def engine(model_dir: Path, **config: object) -> Engine:
    return Engine.load(model_dir, EngineConfig(**{"kv_capacity": "64", "token_budget": 64, **config}))  # type: ignore[arg-type]


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, length).tolist()


def greedy_tokens(model_dir: Path, prompts: Sequence[list[int]], params: SamplingParams = GREEDY, **config: object) -> list[list[int]]:
    done = collect(engine(model_dir, **config).generate(prompts, params))
    return [done[f"req-{i}"].token_ids for i in range(len(prompts))]


def pages_all_back(eng: Engine) -> bool:
    stats = eng.kv_stats()
    return stats.in_use == 0 and stats.free + stats.cached == stats.total


def test_lanes_batched_together_give_the_solo_greedy_outputs(tiny_qwen3: Path) -> None:
    prompts = [prompt(70, 1), prompt(9, 2)]
    together = greedy_tokens(tiny_qwen3, prompts)
    alone = [greedy_tokens(tiny_qwen3, [p])[0] for p in prompts]
    assert together == alone


def test_the_short_lane_gets_a_token_every_step_while_the_long_lane_prefills(tiny_qwen3: Path) -> None:
    eng = engine(tiny_qwen3, token_budget=32, kv_capacity="128")
    short = eng.add_request(prompt(5, 3), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.step()  # the short lane's prefill
    eng.add_request(prompt(600, 4), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    long_request = eng.scheduler.waiting[0]
    prefill_steps = 0
    while long_request.num_computed < len(long_request.prompt_ids):
        before = long_request.num_computed
        outputs = {o.request_id: o for o in eng.step()}
        assert outputs[short].token_ids, "the short lane missed a step"
        assert long_request.num_computed - before <= 32  # at most one chunk between two short-lane tokens
        prefill_steps += 1
    assert prefill_steps >= 600 // 32


def test_seeded_sampling_repeats_across_engines_and_batch_partners(tiny_qwen3: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    alone = collect(engine(tiny_qwen3).generate([prompt(20, 5)], seeded))["req-0"].token_ids
    eng = engine(tiny_qwen3)
    eng.add_request(prompt(33, 6), SamplingParams(temperature=1.0, seed=99, max_tokens=10))
    with_partner = collect(eng.generate([prompt(20, 5)], seeded))["req-1"].token_ids
    assert with_partner == alone


def test_temperature_zero_equals_argmax_of_the_model(tiny_qwen3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=5)
    [output] = [o for o in engine(tiny_qwen3).generate([prompt(15, 7)], params)]
    assert output.token_ids == [output.logprobs[0].top[0][0]]


def test_a_stop_string_split_across_tokens_ends_the_text_exactly_before_it(tiny_qwen3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = engine(tiny_qwen3)
    the_prompt = eng.tokenizer.encode("def fibonacci(n: int) -> int:\n")
    deltas = [o.text for o in eng.generate([the_prompt], params)]
    k = next(i for i in range(1, len(deltas) - 1) if len(deltas[i]) >= 2 and len(deltas[i + 1]) >= 2)
    stop = deltas[k][-2:] + deltas[k + 1][:2]
    full = "".join(deltas)
    stopped = collect(engine(tiny_qwen3).generate([the_prompt], replace(params, stop=(stop,))))["req-0"]
    assert stopped.text == full[: full.index(stop)]
    assert stopped.final is not None and stopped.final.finish_reason is FinishReason.STOP


def test_a_stop_token_id_ends_the_request_with_the_token_but_not_its_text(tiny_qwen3: Path) -> None:
    free_run = collect(engine(tiny_qwen3).generate([prompt(12, 8)], GREEDY))["req-0"].token_ids
    stop_id = free_run[4]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,))
    stopped = collect(engine(tiny_qwen3).generate([prompt(12, 8)], params))["req-0"]
    assert stopped.token_ids == free_run[: free_run.index(stop_id) + 1]
    assert stopped.final is not None and stopped.final.finish_reason is FinishReason.STOP


def test_max_tokens_ends_the_request_with_length_and_statistics(tiny_qwen3: Path) -> None:
    done = collect(engine(tiny_qwen3).generate([prompt(10, 9)], GREEDY))["req-0"]
    assert len(done.token_ids) == GREEDY.max_tokens
    assert done.final is not None and done.final.finish_reason is FinishReason.LENGTH
    assert done.final.stats is not None and done.final.stats.completion_tokens == GREEDY.max_tokens


@pytest.mark.parametrize("steps_before_abort", [1, 4], ids=["in-prefill", "in-decode"])
def test_abort_frees_every_page(tiny_qwen3: Path, steps_before_abort: int) -> None:
    eng = engine(tiny_qwen3, token_budget=32, prefix_caching=False)
    start = eng.kv_stats()
    request_id = eng.add_request(prompt(100, 10), GREEDY)  # 4 chunks of prefill, then decode
    for _ in range(steps_before_abort):
        eng.step()
    assert eng.kv_stats().in_use > 0
    eng.abort(request_id)
    [final] = eng.step()
    assert final.finish_reason is FinishReason.ABORT
    assert pages_all_back(eng) and eng.kv_stats().total == start.total
    assert not eng.has_work


def test_a_pool_too_small_for_all_lanes_preempts_and_still_gives_the_unconstrained_outputs(tiny_qwen3: Path) -> None:
    prompts = [prompt(100, 20 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    unconstrained = greedy_tokens(tiny_qwen3, prompts, params, max_concurrency=4)
    eng = engine(tiny_qwen3, kv_capacity="5", max_concurrency=4, page_size=64)  # each needs 2 pages, 4 need 8
    done = collect(eng.generate(prompts, params))
    assert [done[f"req-{i}"].token_ids for i in range(4)] == unconstrained
    assert sum(d.final.stats.preemptions for d in done.values() if d.final and d.final.stats) > 0
    assert pages_all_back(eng)


def test_a_prompt_that_can_never_fit_is_refused_with_a_clear_error(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match="tokens of context"):
        engine(tiny_qwen3, kv_capacity="2").add_request(prompt(100, 0), SamplingParams(max_tokens=100))


def test_the_engine_refuses_calls_from_a_second_thread(tiny_qwen3: Path) -> None:
    eng = engine(tiny_qwen3)
    eng.add_request(prompt(5, 0), GREEDY)
    errors: list[BaseException] = []

    def step_elsewhere() -> None:
        try:
            eng.step()
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=step_elsewhere)
    thread.start()
    thread.join()
    assert errors and "EngineLoop" in str(errors[0])
