"""The engine on the Qwen3.5 hybrid (numpy executor): `ninfer-rt generate` gives transformers' greedy text
in both checkpoint layouts; chunked prefill carries the state through the live slot; concurrent,
preempted and aborted requests keep their solo outputs and leave the state slot pool balanced; a hybrid's
prefix is recomputed (no state is known past position 0 until snapshots) and reported as not cached."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine_helpers import GREEDY, prompt, run
from ninfer_rt.cli import main
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.tokenizer import Tokenizer

pytest.importorskip("transformers")

PAGE_SIZE = 16


def engine(model_dir: Path, **config: object) -> Engine:
    defaults = {"device": "cpu", "kv_capacity": "64", "token_budget": 64, "page_size": PAGE_SIZE}
    return Engine.load(model_dir, EngineConfig(**{**defaults, **config}))  # type: ignore[arg-type]


def slots_all_back(eng: Engine) -> bool:
    stats = eng.state_stats()
    return stats is not None and stats.in_use == 0 and stats.balanced


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, eos_ids: Sequence[int] | None) -> list[int]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=list(eos_ids) if eos_ids else None, pad_token_id=0,
        )
    generated = out[0, len(prompt_ids) :].tolist()
    stop = next((i for i, t in enumerate(generated) if eos_ids and t in eos_ids), len(generated))
    return generated[: stop + 1]


@pytest.fixture(params=["tiny_qwen3_5", "tiny_qwen3_5_vl"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_generate_cli_prints_transformers_greedy_text(model_dir: Path) -> None:
    # The CLI keeps K/V in bf16 (transformers computes in f32): this prompt's 24 greedy tokens hold no
    # near-tie that the rounding flips; the next test compares f32 K/V over chunked prefill.
    text = "def fibonacci(n): return the nth number"
    args = ["generate", "--device", "cpu", "--model", str(model_dir), "--prompt", text, "--max-tokens", "24",
            "--temperature", "0", "--kv-capacity", "16", "--max-context", "1024"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    tokenizer = Tokenizer(model_dir)
    eng = engine(model_dir)
    expected = hf_greedy(model_dir, tokenizer.encode(text), 24, sorted(eng.eos_ids))
    assert result.stdout.rstrip("\n") == tokenizer.decode(expected, skip_special_tokens=True)


def test_chunked_prefill_and_decode_give_transformers_greedy_tokens(tiny_qwen3_5: Path) -> None:
    prompt_ids = prompt(70, 1)
    (tokens,), _ = run(engine(tiny_qwen3_5, token_budget=16, kv_dtype="f32"), [prompt_ids])  # chunks of 16 through the live slot
    assert tokens == hf_greedy(tiny_qwen3_5, prompt_ids, 24, None)


def test_two_concurrent_requests_each_give_their_solo_output(tiny_qwen3_5: Path) -> None:
    prompts = [prompt(37, 2), prompt(9, 3)]
    solo = [run(engine(tiny_qwen3_5), [p])[0][0] for p in prompts]
    eng = engine(tiny_qwen3_5, max_concurrency=2, token_budget=16)
    together, _ = run(eng, prompts)
    assert together == solo
    assert slots_all_back(eng)


def test_preempted_requests_recompute_their_state_and_give_their_solo_output(tiny_qwen3_5: Path) -> None:
    prompts = [prompt(30, 5), prompt(30, 6), prompt(20, 7)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    solo = [run(engine(tiny_qwen3_5), [p], params)[0][0] for p in prompts]
    eng = engine(tiny_qwen3_5, kv_capacity="9", max_concurrency=3)
    outputs, stats = run(eng, prompts, params)
    assert sum(s.preemptions for s in stats) > 0
    assert outputs == solo
    assert slots_all_back(eng)


def test_an_aborted_request_gives_its_slot_back_and_the_other_lane_is_unchanged(tiny_qwen3_5: Path) -> None:
    (solo,), _ = run(engine(tiny_qwen3_5), [prompt(20, 9)])
    eng = engine(tiny_qwen3_5, max_concurrency=2)
    kept = eng.add_request(prompt(20, 9), GREEDY)
    aborted = eng.add_request(prompt(25, 8), GREEDY)
    tokens: list[int] = []
    for step in range(30):
        if step == 4:
            eng.abort(aborted)
            assert eng.state_stats().in_use == eng.ledger.states.ring_depth
        tokens += [t for o in eng.step() if o.request_id == kept for t in o.token_ids]
    assert not eng.has_work
    assert tokens == solo
    assert slots_all_back(eng)


def test_a_second_turn_resumes_from_the_end_of_generation_snapshot(tiny_qwen3_5: Path) -> None:
    first = prompt(40, 3)
    eng = engine(tiny_qwen3_5)
    (reply,), _ = run(eng, [first])
    second = first + reply + prompt(5, 4)
    (warm,), (stats,) = run(eng, [second])
    (cold,), _ = run(engine(tiny_qwen3_5), [second])
    assert warm == cold
    # the first request computed its prompt and all but its last sampled token: that state was saved
    assert stats.cached_tokens == len(first) + len(reply) - 1
    assert slots_all_back(eng)


def test_snapshots_over_a_recomputed_prefix_go_with_the_pages_the_cache_keeps(tiny_qwen3_5: Path) -> None:
    # The first run's snapshots are dropped and its pages stay cached: the second run recomputes the prompt
    # into pages the cache does not index (it holds those tokens already) and saves its states over them.
    first = prompt(40, 3)
    eng = engine(tiny_qwen3_5)
    run(eng, [first])
    store = eng.ledger.states.snapshots
    store.evict(len(store))
    (_,), (stats,) = run(eng, [first])
    assert stats.cached_tokens == 0 and len(store) > 0
    pool = eng.kv_manager.pool
    assert all(pool.is_cached(page) for page in store.covering_pages())
    pool.evict(pool.total)
    assert len(store) == 0  # no snapshot outlives the K/V a resume from it needs


def test_without_prefix_caching_a_hybrid_recomputes_everything(tiny_qwen3_5: Path) -> None:
    first = prompt(40, 3)
    eng = engine(tiny_qwen3_5, prefix_caching=False)
    (reply,), _ = run(eng, [first])
    (_,), (stats,) = run(eng, [first + reply + prompt(5, 4)])
    assert stats.cached_tokens == 0
    assert eng.ledger.states.snapshots is None


def test_a_dense_model_has_no_state_slots(tiny_qwen3: Path) -> None:
    assert engine(tiny_qwen3).state_stats() is None
