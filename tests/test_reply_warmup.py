"""A hybrid's next turn resumes at the end of its previous reply even when the sampled reply was not its text's
own tokenization: the engine prefills prompt + re-tokenized reply while idle, so the turn that sends the
reply back as text finds a snapshot there and computes only its new tokens, with the logits of a
from-scratch prefill. Without the warm-up that turn resumes at the previous end of input and recomputes the
whole reply. The next turn, arriving while the warm-up runs, waits for it and resumes at its end; any other
request aborts a running warm-up, and nothing is left held."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.reply_warmup import WarmupStats, retokenized_reply
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.tokenizer import Tokenizer

PROMPT = "def main(argv):\n    values = [int(a) for a in argv]\n    return sorted(values)\n" * 6
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=5)


def engine(model_dir: Path, **config: object) -> Engine:
    defaults = dict(device="cpu", cpu_precision="float64", kv_dtype="f32", kv_capacity="256", max_context=4096)
    return Engine.load(model_dir, EngineConfig(**{**defaults, **config}))  # type: ignore[arg-type]


def run(eng: Engine, ids: list[int], params: SamplingParams, as_text: bool = True) -> tuple[list[int], list[float], int]:
    """The request's tokens, their top-5 logprobs flattened and the prompt tokens the engine skipped; the
    engine is stepped until it is idle (a queued warm-up runs too). `as_text`: the reply comes back as text."""
    request = eng.add_request(ids, params, warm_reply=as_text)
    tokens, logprobs, cached = [], [], -1
    while eng.has_work:
        for out in eng.step():
            assert out.request_id == request, "a warm-up's outputs are nobody's"
            tokens += out.token_ids
            logprobs += [lp for entry in out.logprobs for _, lp in entry.top]
            cached = out.stats.cached_tokens if out.stats is not None else cached
    return tokens, logprobs, cached


def second_turn(model_dir: Path, warmup: bool) -> tuple[int, int, list[int], list[float], Engine]:
    """The turn that re-sends a sampled reply that is not its text's tokenization: the prompt tokens it
    skipped, the length of prompt + reply as re-sent, its whole prompt, its logprobs, and the engine."""
    tokenizer = Tokenizer(model_dir)
    eng = engine(model_dir, reply_warmup=warmup)
    prompt = tokenizer.encode(PROMPT)
    reply, _, _ = run(eng, prompt, SAMPLED)
    retokenized = retokenized_reply(tokenizer, reply, eng.eos_ids)
    assert retokenized is not None, "the premise: this sampled reply is not its text's tokenization"
    resent = prompt + tokenizer.encode(tokenizer.decode(reply))
    assert resent == prompt + retokenized
    ids = resent + tokenizer.encode("\nnow fix the test")
    _, logprobs, cached = run(eng, ids, GREEDY)
    return cached, len(resent), ids, logprobs, eng


def test_the_next_turn_resumes_at_the_end_of_a_retokenized_reply_and_stays_exact(tiny_qwen3_5: Path) -> None:
    cached, reply_end, ids, logprobs, eng = second_turn(tiny_qwen3_5, warmup=True)
    assert cached == reply_end
    stats = eng.warmup_stats()
    assert stats is not None and stats.completed == stats.started >= 1 and stats.aborted == stats.queued == 0
    cold = engine(tiny_qwen3_5, prefix_caching=False)
    assert cold.warmup_stats() is None  # no snapshots, nothing to warm
    _, cold_logprobs, cold_cached = run(cold, ids, GREEDY)
    assert cold_cached == 0
    np.testing.assert_allclose(logprobs, cold_logprobs, rtol=1e-9, atol=1e-12)


def test_without_the_warmup_the_turn_recomputes_the_whole_reply(tiny_qwen3_5: Path) -> None:
    cached, reply_end, _, _, _ = second_turn(tiny_qwen3_5, warmup=False)
    assert cached == len(Tokenizer(tiny_qwen3_5).encode(PROMPT)) < reply_end


@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_real_request_aborts_a_running_warmup_and_nothing_stays_held(tiny_qwen3_5: Path, steps_before: int) -> None:
    eng = engine(tiny_qwen3_5, token_budget=64)  # the warm-up's prefill takes several steps
    prompt = eng.tokenizer.encode(PROMPT)
    first = eng.add_request(prompt, SAMPLED, warm_reply=True)
    while not any(out.finished for out in eng.step() if out.request_id == first):
        pass
    assert eng.warmup_stats() is not None and eng.warmup_stats().queued == 1  # type: ignore[union-attr]
    for _ in range(steps_before + 1):
        assert eng.step() == []  # the warm-up starts (and runs a chunk): nobody's outputs
    _, _, cached = run(eng, prompt + eng.tokenizer.encode(" and more"), GREEDY)
    stats = eng.warmup_stats()
    assert stats is not None and (stats.started, stats.aborted) == (1, 1)
    assert cached >= len(prompt) - 64
    slots = eng.state_stats()
    assert eng.kv_stats().in_use == 0 and slots is not None and slots.in_use == 0 and slots.balanced


def test_a_reply_that_comes_back_as_token_ids_is_not_warmed(tiny_qwen3_5: Path) -> None:
    eng = engine(tiny_qwen3_5)
    run(eng, eng.tokenizer.encode(PROMPT), SAMPLED, as_text=False)
    assert eng.warmup_stats() == WarmupStats(queued=0, running=False, started=0, completed=0, aborted=0)


def test_the_next_turn_arriving_during_the_warmup_waits_for_it_and_resumes_at_its_end(tiny_qwen3_5: Path) -> None:
    eng = engine(tiny_qwen3_5, token_budget=64)  # the warm-up's prefill takes several steps
    prompt = eng.tokenizer.encode(PROMPT)
    first = eng.add_request(prompt, SAMPLED, warm_reply=True)
    reply: list[int] = []
    while not any(out.finished for out in eng.step() if out.request_id == first and not reply.extend(out.token_ids)):
        pass
    resent = prompt + eng.tokenizer.encode(eng.tokenizer.decode(reply))
    assert eng.step() == []  # the warm-up starts
    stats = eng.warmup_stats()
    assert stats is not None and stats.running
    _, _, cached = run(eng, resent + eng.tokenizer.encode("\nnow fix the test"), GREEDY)
    assert cached == len(resent)
    stats = eng.warmup_stats()
    assert stats is not None and stats.aborted == 0 and stats.completed == stats.started
