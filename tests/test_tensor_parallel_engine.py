"""The engine over simulated tensor-parallel ranks is the engine: one scheduler, one prefix cache and one
state cache whose page and slot ids every rank shares. Greedy replies, speculative decoding with the MTP
module and a second turn resumed from the prefix cache come out as they do unsharded, with the ordering
verifier on."""

from __future__ import annotations

from pathlib import Path

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
FIRST_TURN = "def fibonacci(n):\n    "
SECOND_TURN = FIRST_TURN + "return n\n\nclass Tree:\n"


def two_turns(model: Path, ranks: int) -> list[str]:
    config = EngineConfig(device="cpu", kv_capacity="32", max_context=512, page_size=16, spec="mtp",
                          verify_ordering=True, cpu_precision="float64", tensor_parallel=ranks)
    engine = Engine.load(model, config)
    return ["".join(out.text for out in engine.generate([prompt], GREEDY)) for prompt in (FIRST_TURN, SECOND_TURN)]


def test_hybrid_engine_on_two_ranks_replies_as_on_one(tiny_qwen3_5: Path) -> None:
    assert two_turns(tiny_qwen3_5, 2) == two_turns(tiny_qwen3_5, 1)


def test_dense_engine_on_four_ranks_replies_as_on_one(tiny_qwen3_mtp: Path) -> None:
    assert two_turns(tiny_qwen3_mtp, 4) == two_turns(tiny_qwen3_mtp, 1)
