"""Test-side builders for forward tests: StepBatches over hand-picked pages, a numpy runtime on a logical
StreamSet, Hugging Face reference outputs, and the error metric the golden tests share."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.exec.numpy_rank_stores import rank_major_kv_spec, rank_major_state_spec
from ninfer_rt.exec.numpy_tensor_parallel import TensorParallelExecutor
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import ForwardOutput, PreparedModel, forward, prepare_model
from ninfer_rt.model.mtp import PreparedMTP, mtp_forward
from ninfer_rt.model.tensor_parallel import plan_for, shard_weights
from ninfer_rt.model.weights import ModelWeights, load_model_weights

# Small pages so that short test prompts cross several page boundaries.
PAGE_SIZE = 16
STATE_SLOTS = 4


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a step: `tokens` appended after `cached` tokens already in its pages (and,
    for a hybrid model, its linear-attention state in `state_slot`)."""

    tokens: Sequence[int]
    cached: int
    pages: Sequence[int]
    state_slot: int | None = None  # a hybrid model's: its runtime's slot 0 when not given


def step_batch(parts: Sequence[SeqStep], page_size: int = PAGE_SIZE) -> StepBatch:
    """A StepBatch for `parts` in order, asking for the logits of every row."""
    seq_positions = [np.arange(p.cached, p.cached + len(p.tokens)) for p in parts]
    positions = np.concatenate(seq_positions)
    page_of_row = np.concatenate([np.asarray(p.pages)[pos // page_size] for p, pos in zip(parts, seq_positions)])
    block_tables = np.full((len(parts), max(len(p.pages) for p in parts)), -1, dtype=np.int32)
    for row, part in enumerate(parts):
        block_tables[row, : len(part.pages)] = part.pages
    return StepBatch(
        token_ids=np.concatenate([np.asarray(p.tokens) for p in parts]).astype(np.int32),
        positions=positions.astype(np.int32),
        query_start=np.cumsum([0, *(len(p.tokens) for p in parts)]).astype(np.int32),
        context_lens=np.array([p.cached + len(p.tokens) for p in parts], dtype=np.int32),
        block_tables=block_tables,
        slot_mapping=(page_of_row * page_size + positions % page_size).astype(np.int32),
        logit_rows=np.arange(len(positions), dtype=np.int32),
        **state_inputs(parts),
    )


def state_inputs(parts: Sequence[SeqStep]) -> dict[str, np.ndarray]:
    """StepBatch.state_slots / state_targets: each sequence's slot, updated in place; none for a dense model."""
    if all(p.state_slot is None for p in parts):
        return {}
    slots = np.array([p.state_slot for p in parts], np.int32)
    return {"state_slots": slots, "state_targets": slots[:, None].copy()}


@dataclass
class Runtime:
    executor: NumpyExecutor | TensorParallelExecutor
    weights: ModelWeights
    model: PreparedModel
    kv: KVCache
    states: StateSlotPool | None = None

    def step(self, parts: Sequence[SeqStep]) -> ForwardOutput:
        if self.states is not None:
            parts = [part if part.state_slot is not None else replace(part, state_slot=0) for part in parts]
            for part in parts:
                if part.cached == 0:  # a fresh sequence starts from the empty prefix's state
                    self.states.zero(part.state_slot, self.executor.compute)
        return forward(self.executor, self.model, step_batch(parts, self.kv.spec.page_size), self.kv, self.states)

    def run_sequence(self, tokens: Sequence[int], step_sizes: Sequence[int], pages: Sequence[int]) -> np.ndarray:
        """Feeds `tokens` of one sequence in steps of `step_sizes` tokens; the logits of every token."""
        assert sum(step_sizes) == len(tokens)
        logits, cached = [], 0
        for size in step_sizes:
            out = self.step([SeqStep(tokens[cached : cached + size], cached, pages)])
            logits.append(self.executor.to_host(out.logits))
            cached += size
        return np.concatenate(logits)


def make_runtime(model_dir: Path, kv_dtype: str = "f32", num_pages: int = 16, dtype: type = np.float32) -> Runtime:
    return runtime_for(load_model_weights(model_dir), kv_dtype, num_pages, dtype)


def runtime_for(
    weights: ModelWeights, kv_dtype: str = "f32", num_pages: int = 16, dtype: type = np.float32, ranks: int = 1
) -> Runtime:
    """A numpy runtime; with ranks > 1, tensor parallel over that many simulated ranks (its `weights` are
    then the sharded ones it runs)."""
    cfg = weights.config
    streams = StreamSet()
    spec = KVSpec(
        num_layers=len(cfg.full_attention_layers) + cfg.mtp_layers,
        num_pages=num_pages,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype=KVDtype.parse(kv_dtype),
        page_size=PAGE_SIZE,
    )
    state_spec = StateSpec.for_model(cfg, np.dtype(dtype), np.dtype(dtype)) if cfg.is_hybrid else None
    if ranks == 1:
        executor, prepared = NumpyExecutor(streams, dtype=dtype), weights
    else:
        plan = plan_for(cfg, ranks)
        executor, prepared = TensorParallelExecutor(streams, plan, dtype), shard_weights(weights, plan)
        spec = rank_major_kv_spec(spec, plan)
        state_spec = state_spec and rank_major_state_spec(state_spec, plan)
    states = None
    if state_spec is not None:
        states = StateSlotPool(streams, state_spec, STATE_SLOTS)
        for _ in range(STATE_SLOTS):  # slot i is sequence i's (SeqStep.state_slot)
            states.acquire(executor.compute)
    return Runtime(executor, prepared, prepare_model(executor, prepared), KVCache(streams, spec), states)


def random_tokens(vocab_size: int, count: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, count).tolist()


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """The worse of the norm-relative error and the max-abs error over the reference's max magnitude."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    diff = actual - expected
    return float(max(np.linalg.norm(diff) / np.linalg.norm(expected), np.abs(diff).max() / np.abs(expected).max()))


def _hf_model(model_dir: Path):  # noqa: ANN202 -- torch types stay out of annotations (test-only dependency)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    return torch, model.eval()


def hf_outputs(model_dir: Path, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' (logits, final-normed hidden states) of one sequence, float32 weights and math."""
    torch, model = _hf_model(model_dir)
    with torch.no_grad():
        hidden = model.model(torch.tensor([list(tokens)])).last_hidden_state
        logits = model.lm_head(hidden)
    return logits[0].numpy(), hidden[0].numpy()


def main_then_mtp_steps(
    runtime: Runtime, mtp: PreparedMTP, tokens: list[int], step_sizes: Sequence[int], pages: list[int]
) -> Iterator[tuple[ForwardOutput, ForwardOutput]]:
    """Per step of `step_sizes` tokens of one sequence in `pages`: the main model's output over its tokens,
    then the MTP module's over the same rows with the tokens shifted by one."""
    cached = 0
    for size in step_sizes:
        main = runtime.step([SeqStep(tokens[cached : cached + size], cached, pages)])
        shifted = step_batch([SeqStep(tokens[cached + 1 : cached + size + 1], cached, pages)])
        yield main, mtp_forward(runtime.executor, runtime.model, mtp, shifted, main.hidden, runtime.kv)
        cached += size
