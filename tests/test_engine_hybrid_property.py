"""The real engine on the tiny Qwen3.5 hybrid, under random programs of client operations: two lanes, a
KV pool small enough that pages are evicted and requests preempted, a snapshot budget of a few records,
periodic snapshots every few tokens, with and without MTP speculation, the ordering verifier on.

A program submits turns of a few conversations that share a system prompt (the next turn: the previous
prompt, the reply as generated and new tokens; an edited turn: the reply changed by the client; a branch:
a prefix of any earlier prompt and other tokens), aborts running requests and steps the engine. Whatever
the interleaving:
- the engine never raises (no OrderingViolation, no restore of a state that was never written or was
  evicted);
- every finished greedy request's tokens are the tokens of its prompt run alone with prefix caching off,
  and an aborted one's are a prefix of them (snapshot resumes, preemption and speculation are exact);
- a turn's cached tokens are fewer than its prompt's;
- between steps the KV pages, the state slots (a ring per running request) and the snapshot records
  (one per live snapshot) are balanced; at idle no page and no slot is held, and every live snapshot
  is covered by a page the prefix cache still holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import run
from ninfer_rt.engine.build import EngineConfig, state_ring_depth
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.request import FinishReason, SamplingParams
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.model.weights import ModelWeights, load_model_weights

PAGE = 8
KV_PAGES = 10  # one request alone always fits (MAX_PROMPT + max_tokens + drafts); two long ones do not
MAX_PROMPT = 64  # a longer conversation is compacted: the system prompt and its recent half are kept
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
BASE = dict(device="cpu", cpu_precision="float64", kv_dtype="f32", page_size=PAGE, token_budget=16, max_context=256)
CONVERSATIONS = 2
SYSTEM = np.random.default_rng(100).integers(0, 500, 12).tolist()


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


class Model:
    """The checkpoint, loaded once, and each prompt's greedy tokens alone."""

    def __init__(self, weights: ModelWeights, tokenizer: Tokenizer) -> None:
        self.weights = weights
        self.tokenizer = tokenizer
        self.solo: dict[tuple[int, ...], list[int]] = {}

    def __repr__(self) -> str:  # a failing example prints its arguments: not the weights
        return "Model(tiny_qwen3_5)"

    def engine(self, **config: object) -> Engine:
        return Engine(self.weights, self.tokenizer, EngineConfig(**{**BASE, **config}))  # type: ignore[arg-type]

    def alone(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.solo:
            (self.solo[key],), _ = run(self.engine(kv_capacity=str(KV_PAGES), prefix_caching=False), [prompt], PARAMS)
        return self.solo[key]


@pytest.fixture(scope="module")
def model(tiny_qwen3_5: Path) -> Model:
    return Model(load_model_weights(tiny_qwen3_5), Tokenizer(tiny_qwen3_5))


# -- operations -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    conversation: int
    kind: str  # 'next', 'edit' (the previous reply changed by the client) or 'branch'
    pick: int  # edit: which reply token changes; branch: which earlier prompt, and where it is cut
    new: int  # new tokens at the end
    seed: int


@dataclass(frozen=True)
class Abort:
    pick: int  # which of the live requests


@dataclass(frozen=True)
class Steps:
    n: int


@dataclass(frozen=True)
class Drain:
    pass


SUBMITS = st.builds(Submit, st.integers(0, CONVERSATIONS - 1), st.sampled_from(["next", "next", "edit", "edit", "branch"]),
                   st.integers(0, 10**6), st.integers(1, 9), st.integers(0, 10**6))
# submits three times as likely as aborts and drains, steps twice: both lanes busy, a queue behind them
OPERATIONS = st.sampled_from(
    [SUBMITS] * 3 + [st.builds(Steps, st.integers(1, 6))] * 2 + [st.builds(Abort, st.integers(0, 3)), st.just(Drain())]
).flatmap(lambda operation: operation)
CONFIGS = st.fixed_dictionaries({
    "state_snapshot_budget": st.sampled_from(["2", "4"]),
    "snapshot_interval": st.sampled_from([16, 24]),
})


Operation = Submit | Abort | Steps | Drain


@dataclass
class Live:
    prompt: list[int]
    conversation: int
    tokens: list[int] = field(default_factory=list)


class Client:
    """Drives one engine with a program and checks every output and every step's accounting."""

    def __init__(self, model: Model, eng: Engine) -> None:
        self.model = model
        self.eng = eng
        self.live: dict[str, Live] = {}
        self.turns: dict[int, tuple[list[int], list[int]]] = {}  # conversation -> its last finished (prompt, reply)
        self.prompts: list[list[int]] = []
        self.depth = state_ring_depth(eng.config)

    def run(self, program: list[Operation]) -> None:
        actions: dict[type, Callable[..., None]] = {Submit: self.submit, Abort: self.abort, Steps: self.steps, Drain: self.drain}
        for op in program:
            actions[type(op)](op)
        self.drain(Drain())
        self.check_idle()

    def submit(self, op: Submit) -> None:
        prompt = self.compose(op)
        if len(prompt) > MAX_PROMPT:  # the client compacts its history
            prompt = SYSTEM + prompt[-MAX_PROMPT // 2 :]
        self.prompts.append(prompt)
        self.live[self.eng.add_request(prompt, PARAMS)] = Live(prompt, op.conversation)

    def compose(self, op: Submit) -> list[int]:
        new = tokens(op.new, op.seed)
        if op.kind == "branch" and self.prompts:
            earlier = self.prompts[op.pick % len(self.prompts)]
            return earlier[: 1 + op.pick % len(earlier)] + new
        if op.conversation not in self.turns:
            return SYSTEM + tokens(24 + 8 * op.conversation, op.conversation) + new
        prompt, reply = self.turns[op.conversation]
        if op.kind == "edit":
            at = op.pick % len(reply)
            reply = reply[:at] + [(reply[at] + 1) % 500] + reply[at + 1 :]
        return prompt + reply + new

    def abort(self, op: Abort) -> None:
        if self.live:
            self.eng.abort(sorted(self.live)[op.pick % len(self.live)])
            self.receive([])  # the abort's final output comes with the next step

    def steps(self, op: Steps) -> None:
        for _ in range(op.n):
            if self.eng.has_work:
                self.receive(self.eng.step())

    def drain(self, _op: Drain) -> None:
        while self.eng.has_work:
            self.receive(self.eng.step())

    def receive(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            live = self.live[output.request_id]
            live.tokens += output.token_ids
            if output.finished:
                del self.live[output.request_id]
                self.finished(live, output)
        self.check_balanced()

    def finished(self, live: Live, output: RequestOutput) -> None:
        assert output.stats is not None and output.stats.cached_tokens < len(live.prompt)
        alone = self.model.alone(live.prompt)
        if output.finish_reason is FinishReason.ABORT:
            assert live.tokens == alone[: len(live.tokens)], live.prompt
            return
        assert output.finish_reason is FinishReason.LENGTH
        assert live.tokens == alone, live.prompt
        self.turns[live.conversation] = (live.prompt, live.tokens)

    def check_balanced(self) -> None:
        kv, slots = self.eng.kv_stats(), self.eng.state_stats()
        assert kv.balanced, kv
        assert slots.balanced and slots.in_use == self.depth * len(self.eng.scheduler.running), slots
        store = self.eng.ledger.states.snapshots
        assert store.records_in_use() == len(store) <= store.capacity, store.stats()

    def check_idle(self) -> None:
        kv, slots = self.eng.kv_stats(), self.eng.state_stats()
        assert kv.in_use == 0 and kv.cached == len(self.eng.kv_manager.prefix), kv
        assert slots.in_use == 0, slots
        pool = self.eng.kv_manager.pool
        assert all(pool.is_cached(page) for page in self.eng.ledger.states.snapshots.covering_pages())


@pytest.mark.parametrize("spec", ["none", "mtp"])  # without MTP the engine overlaps steps (engine.py)
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(config=CONFIGS, program=st.lists(OPERATIONS, min_size=6, max_size=24))
def test_engine_programs_stay_exact_ordered_and_balanced(model: Model, spec: str, config: dict, program: list[Operation]) -> None:
    eng = model.engine(kv_capacity=str(KV_PAGES), verify_ordering=True, spec=spec, draft_tokens=2, **config)
    Client(model, eng).run(program)
