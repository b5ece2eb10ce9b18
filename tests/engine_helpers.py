"""Test-side helpers for engine tests: seeded prompts, and running requests to completion step by step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestStats
from ninfer_rt.engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, length).tolist()


def run(eng: Engine, prompts: Sequence[list[int]], params: SamplingParams = GREEDY) -> tuple[list[list[int]], list[RequestStats]]:
    """Each prompt's generated tokens and final statistics, all requests added at once."""
    tokens: dict[str, list[int]] = {}
    stats: dict[str, RequestStats] = {}
    ids = [eng.add_request(p, params) for p in prompts]
    while eng.has_work:
        for output in eng.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.stats is not None:
                stats[output.request_id] = output.stats
    return [tokens[i] for i in ids], [stats[i] for i in ids]
