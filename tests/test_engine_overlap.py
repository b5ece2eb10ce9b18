"""The engine's overlap (engine.py): each step is enqueued before the previous step's samples are read back,
the pending token fed to it on the device. Outputs must equal synchronous stepping token for token, in every
situation that ends, pauses or reorders requests; the ordering verifier is on (root conftest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.engine import Engine, EngineConfig
from ninfer_rt.engine.request import Request, SamplingParams
from ninfer_rt.model.executor import StepBatch
from test_engine_batching import collect, pages_all_back, prompt

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def engine(model_dir: Path, overlap: bool, **config: object) -> Engine:
    return Engine.load(model_dir, EngineConfig(**{"kv_capacity": "64", "token_budget": 64, "overlap": overlap, **config}))  # type: ignore[arg-type]


def outputs_both_ways(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams], **config: object) -> list[dict]:
    """Each request's tokens, text and finish reason, with and without overlap."""
    results = []
    for overlap in (False, True):
        eng = engine(model_dir, overlap, **config)
        ids = [eng.add_request(p, q) for p, q in zip(prompts, params)]
        done = collect(iter_steps(eng))
        assert pages_all_back(eng)
        results.append({rid: (done[rid].token_ids, done[rid].text, done[rid].final.finish_reason) for rid in ids})
    return results


def iter_steps(eng: Engine):
    while eng.has_work:
        yield from eng.step()


def test_greedy_lanes_of_different_lengths_give_the_synchronous_tokens(tiny_qwen3: Path) -> None:
    prompts = [prompt(70, 1), prompt(9, 2), prompt(130, 3)]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), GREEDY]
    synchronous, overlapped = outputs_both_ways(tiny_qwen3, prompts, params, max_concurrency=3)
    assert overlapped == synchronous


def test_seeded_sampling_and_penalties_give_the_synchronous_tokens(tiny_qwen3: Path) -> None:
    """Penalties are applied on the host to the output so far: the token still in flight must be in it."""
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=6, max_tokens=12, ignore_eos=True),
    ]
    synchronous, overlapped = outputs_both_ways(tiny_qwen3, [prompt(20, 4), prompt(33, 5)], params)
    assert overlapped == synchronous


def test_a_stop_ends_the_request_at_the_same_token_though_the_next_step_was_enqueued(tiny_qwen3: Path) -> None:
    free_run = outputs_both_ways(tiny_qwen3, [prompt(15, 7)], [GREEDY])[0]
    tokens = next(iter(free_run.values()))[0]
    stop_at = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(tokens[3],), ignore_eos=True)
    synchronous, overlapped = outputs_both_ways(tiny_qwen3, [prompt(15, 7), prompt(40, 8)], [stop_at, GREEDY])
    assert overlapped == synchronous
    assert next(iter(overlapped.values()))[0] == tokens[: tokens.index(tokens[3]) + 1]


def test_a_pool_too_small_for_every_lane_preempts_and_still_gives_the_synchronous_tokens(tiny_qwen3: Path) -> None:
    prompts = [prompt(60, 9), prompt(60, 10), prompt(60, 11)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3
    synchronous, overlapped = outputs_both_ways(tiny_qwen3, prompts, params, kv_capacity="5", max_concurrency=3)
    assert overlapped == synchronous


def test_a_request_added_while_a_step_is_in_flight_gives_the_synchronous_tokens(tiny_qwen3: Path) -> None:
    results = []
    for overlap in (False, True):
        eng = engine(tiny_qwen3, overlap)
        first = eng.add_request(prompt(12, 12), GREEDY)
        outputs = [out for _ in range(4) for out in eng.step()]
        second = eng.add_request(prompt(30, 13), GREEDY)
        done = collect([*outputs, *iter_steps(eng)])
        results.append((done[first].token_ids, done[second].token_ids))
        assert pages_all_back(eng)
    assert results[1] == results[0]


@pytest.mark.parametrize("steps_before_abort", [1, 2, 5])
def test_abort_while_a_step_is_in_flight_frees_every_page(tiny_qwen3: Path, steps_before_abort: int) -> None:
    eng = engine(tiny_qwen3, True)
    request_id = eng.add_request(prompt(50, 14), GREEDY)
    for _ in range(steps_before_abort):
        eng.step()
    eng.abort(request_id)
    list(iter_steps(eng))
    assert pages_all_back(eng) and not eng.has_work


def test_between_steps_a_decoding_request_holds_its_sample_as_a_pending_token(tiny_qwen3: Path) -> None:
    eng = engine(tiny_qwen3, True)
    eng.add_request(prompt(10, 15), GREEDY)
    eng.step()  # prefill: its sample is on its way back
    (request,) = eng.scheduler.running
    assert request.pending_row == 0 and request.output_ids == []
    assert request.num_tokens == 11 and request.token_slice(10, 11) == [-1]
    outputs = eng.step()  # the next step is enqueued, then the first token arrives
    assert [len(o.token_ids) for o in outputs] == [1] and request.output_ids == outputs[0].token_ids
    assert request.pending_row == 0 and request.num_tokens == 12


def test_the_token_that_ends_a_request_by_length_is_not_followed_by_another_step(tiny_qwen3: Path) -> None:
    eng = engine(tiny_qwen3, True)
    eng.add_request(prompt(10, 16), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()
    eng.step()  # samples the second and last token
    (request,) = eng.scheduler.running
    assert request.pending_row is None and request.num_remaining == 0
    (final,) = eng.step()
    assert final.finished and len(request.output_ids) == 2 and not eng.has_work


def test_without_a_pending_token_the_request_reads_as_before() -> None:
    request = Request("r", [1, 2, 3], GREEDY)
    request.output_ids.append(4)
    assert request.token_slice(2, 4) == [3, 4] and request.num_tokens == 4
    request.pending_row = 2
    assert request.token_slice(2, 5) == [3, 4, -3] and request.num_tokens == 5
    assert request.all_ids == [1, 2, 3, 4]


def test_fed_ids_replace_negative_token_ids_in_the_embedding(tiny_qwen3: Path) -> None:
    eng = engine(tiny_qwen3, False)
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    executor = eng.executor
    executor.feed(np.array([4, 1], np.int32))
    batch = StepBatch(
        token_ids=np.array([2, -2, -1], np.int32), positions=np.array([0, 1, 2], np.int32),
        query_start=np.array([0, 3], np.int32), context_lens=np.array([3], np.int32),
        block_tables=np.array([[0]], np.int32), slot_mapping=np.array([0, 1, 2], np.int32),
        logit_rows=np.array([2], np.int32),
    )
    executor.begin_step(batch, eng.kv)
    assert executor.embed(table).tolist() == [[4, 5], [2, 3], [8, 9]]
