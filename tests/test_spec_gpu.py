"""--spec mtp on the CUDA executor: verify steps replay CUDA graphs keyed by batch and verify width, the MTP
catch-up and draft steps replay graphs keyed by step shape and draft head, bit-identical to running them
op by op, and greedy output equals greedy output without speculation. Uses the agreeable MTP model
(spec_models.py), whose wide logit margins leave no near-ties for bf16 to flip, so equality is exact."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from forward_helpers import SeqStep, step_batch
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.engine.spec import DraftHead
from ninfer_rt.engine.spec_vocab import REFRESH_TOKENS, DraftVocab
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_graphs import GraphedMTPSteps, MTPGraphKey
from ninfer_rt.exec.cuda_tensors import StepShape
from ninfer_rt.exec.cuda_weights import BF16
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.model.executor import StepBatch, WeightRole
from ninfer_rt.model.layers import PreparedModel, forward, prepare_model
from ninfer_rt.model.mtp import EagerMTPSteps, MTPOutput, PreparedMTP, prepare_mtp
from ninfer_rt.model.weights import ModelWeights, load_model_weights
from ninfer_rt.testing.tiny import make_tiny_model
from spec_models import make_agreeable_mtp_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def agreeable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: the smallest head size the attention kernels instantiate.
    return make_agreeable_mtp_model(tmp_path_factory.mktemp("agreeable_mtp_gpu"), layer_scale=100.0, head_dim=64)


def engine(model_dir: Path, **config: object) -> Engine:
    return Engine.load(model_dir, EngineConfig(**{"device": "cuda", "kv_capacity": "64", "token_budget": 64, **config}))  # type: ignore[arg-type]


def greedy(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for out in eng.generate(prompts, GREEDY):
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [tokens[key] for key in sorted(tokens, key=lambda k: int(k.split("-")[-1]))]


PROMPTS = [np.random.default_rng(s).integers(0, 500, n).tolist() for s, n in [(1, 70), (2, 9)]]


@pytest.mark.parametrize("lm_head_draft", [None, 64])
@pytest.mark.parametrize("draft_tokens", [1, 2, 3, 4])
def test_cuda_greedy_with_mtp_drafts_is_greedy_without(agreeable: Path, draft_tokens: int, lm_head_draft: int | None) -> None:
    plain = greedy(engine(agreeable), PROMPTS)
    eng = engine(agreeable, spec="mtp", draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    assert greedy(eng, PROMPTS) == plain
    stats = eng.kv_stats()
    assert stats.in_use == 0 and stats.balanced


def test_cuda_verify_steps_replay_a_graph_per_verify_width(agreeable: Path) -> None:
    eng = engine(agreeable, spec="mtp", draft_tokens=3)
    greedy(eng, PROMPTS[:1])
    assert StepShape((4,), 4) in eng.runner.forward.graphs  # one sequence, 1 + 3 verify rows, all sampled


def test_cuda_catch_up_and_drafts_replay_a_graph_per_shape_and_draft_head(agreeable: Path) -> None:
    eng = engine(agreeable, spec="mtp", draft_tokens=3, lm_head_draft=64)
    greedy(eng, PROMPTS[:1])
    head = "w.mtp.lm_head_draft"
    assert MTPGraphKey(StepShape((4,), 1), "catch-up", head) in eng.runner.mtp_steps.graphs  # 1 + 3 rows, one kept
    assert MTPGraphKey(StepShape((1,), 1), "draft", head) in eng.runner.mtp_steps.graphs


def test_cuda_sampling_with_mtp_drafts_runs_to_the_end_and_returns_every_page(agreeable: Path) -> None:
    eng = engine(agreeable, spec="mtp", draft_tokens=3)
    params = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=0)
    outputs = list(eng.generate(PROMPTS, params))
    assert sum(len(o.token_ids) for o in outputs) == 2 * 32
    stats = eng.kv_stats()
    assert stats.in_use == 0 and stats.balanced


# -- graphed MTP steps against eager ones, below the engine -------------------------------------------

PAGE_SIZE = 64  # the kernels' page size


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Random weights: unlike the agreeable model's MTP, every output depends on the hidden rows handed in.
    return make_tiny_model(tmp_path_factory.mktemp("random_mtp_gpu"), arch="qwen3", mtp=True, head_dim=64)


@dataclass
class MTPRuntime:
    weights: ModelWeights
    executor: CudaExecutor
    model: PreparedModel
    mtp: PreparedMTP
    kv: KVCache

    @classmethod
    def load(cls, model_dir: Path) -> MTPRuntime:
        weights = load_model_weights(model_dir)
        cfg = weights.config
        executor = CudaExecutor(
            StreamSet(open_device(0)), max_tokens=128, max_seqs=2, max_pages_per_seq=2, max_positions=cfg.max_position_embeddings
        )
        model = prepare_model(executor, weights)
        spec = KVSpec(cfg.num_hidden_layers + cfg.mtp_layers, 4, cfg.num_key_value_heads, cfg.head_dim, KVDtype.BF16, PAGE_SIZE)
        return cls(weights, executor, model, prepare_mtp(executor, weights, model), KVCache(executor.streams, spec))


def keeping(batch: StepBatch, offsets: list[int]) -> StepBatch:
    """`batch` with one logit row per sequence, at `offsets[i]` inside sequence i (the accepted row)."""
    return replace(batch, logit_rows=(batch.query_start[:-1] + np.asarray(offsets)).astype(np.int32))


def drafting_outputs(model_dir: Path, graphed: bool, widths: tuple[int, ...], reduced_head: bool) -> tuple[list[np.ndarray], set]:
    """Prefill, then three verify-shaped steps (capture, two replays), each a catch-up and two draft steps:
    every MTP step's logits and argmax ids, and the graph keys used."""
    rt = MTPRuntime.load(model_dir)
    steps = GraphedMTPSteps(rt.executor, rt.model, rt.mtp, rt.kv) if graphed else EagerMTPSteps(rt.executor, rt.model, rt.mtp, rt.kv)
    lm_head = rt.model.lm_head
    if reduced_head:
        lm_head = rt.executor.prepare_weight("mtp.lm_head_draft", [np.asarray(rt.weights.lm_head)[::3]], WeightRole.LINEAR)
    results = []

    def read(scored: MTPOutput) -> None:  # now: a replay's outputs live until the same graph replays again
        results.extend(rt.executor.to_host(t) for t in (scored.logits, scored.ids))

    rng = np.random.default_rng(sum(widths))
    vocab = rt.weights.config.vocab_size
    pages = [[2 * i, 2 * i + 1] for i in range(len(widths))]
    cached = [30 + 5 * i for i in range(len(widths))]
    prompts = [rng.integers(0, vocab, n + 1).tolist() for n in cached]
    out = forward(rt.executor, rt.model, step_batch([SeqStep(p[:-1], 0, pg) for p, pg in zip(prompts, pages)], PAGE_SIZE), rt.kv)
    prefill = step_batch([SeqStep(p[1:], 0, pg) for p, pg in zip(prompts, pages)], PAGE_SIZE)
    steps.catch_up(keeping(prefill, [n - 1 for n in cached]), out.hidden, lm_head)  # wide: eager in both
    for step in range(3):
        rows = [rng.integers(0, vocab, w).tolist() for w in widths]
        verify = step_batch([SeqStep(r, c, pg) for r, c, pg in zip(rows, cached, pages)], PAGE_SIZE)
        hidden = forward(rt.executor, rt.model, verify, rt.kv).hidden
        shifted = step_batch([SeqStep(rng.integers(0, vocab, w).tolist(), c, pg) for w, c, pg in zip(widths, cached, pages)], PAGE_SIZE)
        accepted = [step % w for w in widths]
        read(steps.catch_up(keeping(shifted, accepted), hidden, lm_head))
        for j in range(1, 3):
            drafts = [SeqStep(rng.integers(0, vocab, 1).tolist(), c + a + j, pg) for c, a, pg in zip(cached, accepted, pages)]
            read(steps.draft(step_batch(drafts, PAGE_SIZE), lm_head))
        cached = [c + w for c, w in zip(cached, widths)]
    return results, set(getattr(steps, "graphs", {}))


@pytest.mark.parametrize("reduced_head", [False, True], ids=["full-head", "draft-head"])
@pytest.mark.parametrize("widths", [(4,), (4, 2), (1, 1)], ids=["verify4", "verify4+2", "batch2"])
def test_graph_replayed_catch_up_and_drafts_equal_eager(random_mtp: Path, widths: tuple[int, ...], reduced_head: bool) -> None:
    graphed, keys = drafting_outputs(random_mtp, True, widths, reduced_head)
    eager, _ = drafting_outputs(random_mtp, False, widths, reduced_head)
    for ours, reference in zip(graphed, eager, strict=True):
        np.testing.assert_array_equal(ours, reference)
    head = "w.mtp.lm_head_draft" if reduced_head else "w.lm_head"
    assert keys == {
        MTPGraphKey(StepShape(widths, len(widths)), "catch-up", head),
        MTPGraphKey(StepShape((1,) * len(widths), len(widths)), "draft", head),
    }


def test_a_draft_vocabulary_refresh_rewrites_the_device_head_in_place(agreeable: Path) -> None:
    rt = MTPRuntime.load(agreeable)
    head = DraftHead(rt.executor, rt.model, rt.weights, DraftVocab(4, rt.weights.config.vocab_size))
    buffer, ptr = head.tensor.buffer, head.tensor.buffer.ptr
    head.observe([9, 12, 30, 31] * (REFRESH_TOKENS // 4))
    assert head.tensor.buffer is buffer and buffer.ptr == ptr
    expected = np.asarray(rt.weights.lm_head)[[9, 12, 30, 31]].astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(rt.executor.to_host(head.tensor), expected)
