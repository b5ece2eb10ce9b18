"""EngineLoop: the engine on its own thread, fed from other threads and from asyncio."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.loop import EngineLoop
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.request import FinishReason, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300]]


def engine(model_dir: Path) -> Engine:
    return Engine.load(model_dir, EngineConfig(kv_capacity="32", token_budget=64))


def direct_tokens(model_dir: Path) -> list[list[int]]:
    outputs = list(engine(model_dir).generate(PROMPTS, PARAMS))
    return [[t for o in outputs if o.request_id == f"req-{i}" for t in o.token_ids] for i in range(len(PROMPTS))]


async def tokens_of(loop: EngineLoop, prompt: list[int]) -> list[int]:
    return [t async for output in loop.stream(prompt, PARAMS) for t in output.token_ids]


def test_concurrent_async_streams_give_the_direct_engine_outputs(tiny_qwen3: Path) -> None:
    loop = EngineLoop(engine(tiny_qwen3)).start()

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(*(tokens_of(loop, p) for p in PROMPTS)))

    try:
        assert asyncio.run(both()) == direct_tokens(tiny_qwen3)
    finally:
        loop.stop()


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_pages(tiny_qwen3: Path) -> None:
    eng = engine(tiny_qwen3)
    loop = EngineLoop(eng).start()

    async def first_output_only() -> None:
        async for _ in loop.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)):
            break

    asyncio.run(first_output_only())
    loop.stop()
    assert eng.kv_stats().in_use == 0
    assert not eng.scheduler.has_work


def test_invalid_requests_fail_in_the_submitting_thread(tiny_qwen3: Path) -> None:
    loop = EngineLoop(engine(tiny_qwen3)).start()
    try:
        with pytest.raises(ValueError, match="tokens of context"):
            loop.submit(list(range(1, 300)) * 10, PARAMS, lambda _: None)
    finally:
        loop.stop()


def test_a_plain_thread_can_submit_and_collect_through_a_callback(tiny_qwen3: Path) -> None:
    loop = EngineLoop(engine(tiny_qwen3)).start()
    received: list[RequestOutput] = []
    done = threading.Event()

    def sink(item: RequestOutput | BaseException) -> None:
        assert isinstance(item, RequestOutput)
        received.append(item)
        if item.finished:
            done.set()

    loop.submit(PROMPTS[1], PARAMS, sink)
    assert done.wait(timeout=60)
    loop.stop()
    assert [t for o in received for t in o.token_ids] == direct_tokens(tiny_qwen3)[1]
    assert received[-1].finish_reason is FinishReason.LENGTH


def test_a_request_queued_when_the_engine_fails_gets_the_error(tiny_qwen3: Path) -> None:
    eng = engine(tiny_qwen3)
    in_step, fail = threading.Event(), threading.Event()

    def failing_step() -> list[RequestOutput]:
        in_step.set()
        fail.wait(timeout=60)
        raise RuntimeError("sticky")

    eng.step = failing_step  # type: ignore[method-assign]
    loop = EngineLoop(eng).start()
    received: list[RequestOutput | BaseException] = []
    loop.submit(PROMPTS[0], PARAMS, received.append)
    assert in_step.wait(timeout=60)
    loop.submit(PROMPTS[1], PARAMS, received.append)  # queued behind the failing step
    fail.set()
    loop.stop()
    assert len(received) == 2 and all(isinstance(item, RuntimeError) for item in received)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(PROMPTS[1], PARAMS, received.append)
