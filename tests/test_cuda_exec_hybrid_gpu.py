"""The CUDA executor runs the hybrid (Gated DeltaNet + gated attention) forward of model/layers.py and agrees
with the numpy executor on a tiny Qwen3.5 checkpoint that transformers wrote: a prefill, then 16 decode
steps, the linear-attention state carried through its slot between steps; and two sequences of
different lengths in one step (the recurrent and chunked delta rule side by side), prefill through both
chunked forms (NINFER_GDN_CHUNKED=fused|split). Decode and verify
steps replayed from CUDA graphs equal eager steps bit for bit (logits and every state slot), one graph
serving any slots, each replay declaring its own step's slots."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from forward_helpers import SeqStep, random_tokens, relative_error, step_batch
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.cuda_graphs import GraphedForward
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import ForwardOutput, PreparedModel, forward, prepare_model
from ninfer_rt.model.weights import load_model_weights
from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5

pytestmark = pytest.mark.gpu

# The kernels' smallest instantiations: attention head_dim 64 (25% rotary: 16 dims), linear heads of 64 (the
# default tiny checkpoint's 32 and 16 are not instantiated); 4 value heads, so the fused projection's
# [q | k | v | z | b | a] rows (776) are a multiple of 8, as cuBLASLt's prefill GEMM needs.
GPU_TINY_HYBRID = dict(head_dim=64, linear_head_dim=64, linear_value_heads=4)
PAGE_SIZE = 64
PAGES = [3, 1, 0, 2]
PROMPT, DECODE_STEPS = 45, 16
TOLERANCE = 2e-2  # bf16 weights and activations against the float32 reference (as the dense test)
VERIFY = 4  # rows of a verify pass (MTP k = 3): the state after each is kept
SEQS = 2
SLOTS = SEQS * VERIFY  # slot i < SEQS is sequence i's live slot; the rest its verify targets


@pytest.fixture(scope="module")
def gpu_tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("gpu_tiny_qwen3_5"), **GPU_TINY_HYBRID)


@dataclass
class Runtime:
    executor: CudaExecutor | NumpyExecutor
    model: PreparedModel
    kv: KVCache
    states: StateSlotPool

    def step(self, parts: Sequence[SeqStep], step: Callable[[StepBatch], ForwardOutput] | None = None) -> np.ndarray:
        parts = [part if part.state_slot is not None else replace(part, state_slot=0) for part in parts]
        for part in parts:
            if part.cached == 0:
                self.states.zero(part.state_slot, self.executor.compute)
        batch = with_verify_targets(step_batch(parts, PAGE_SIZE), parts)
        out = (step or self.eager)(batch)
        return self.executor.to_host(out.logits)

    def eager(self, batch: StepBatch) -> ForwardOutput:
        return forward(self.executor, self.model, batch, self.kv, self.states)

    def graphed(self) -> GraphedForward:
        return GraphedForward(self.executor, self.model, self.kv, self.states)

    def pool_bytes(self) -> np.ndarray:
        """Every slot of the pool, read back as int32 words (bit-exact comparisons)."""
        words = self.states.buffer.nbytes // 4
        return self.executor.to_host(DeviceTensor(self.states.buffer, 1, words, "i32"))


def with_verify_targets(batch: StepBatch, parts: Sequence[SeqStep]) -> StepBatch:
    """A sequence of n rows keeps the state after each of them, as a verify pass does: the first n - 1 in
    its verify slots, the last in its live slot (in place); -1 pads to the step's widest sequence."""
    width = max(len(part.tokens) for part in parts)
    if width == 1 or width > VERIFY:
        return batch  # plain decode or prefill: the live slot only
    targets = np.full((len(parts), width), -1, np.int32)
    for row, part in enumerate(parts):
        spares = [SEQS + part.state_slot * (VERIFY - 1) + j for j in range(len(part.tokens) - 1)]
        targets[row, width - len(part.tokens) :] = [*spares, part.state_slot]
    return replace(batch, state_targets=targets)


def runtime(model_dir: Path, device: bool) -> Runtime:
    weights = load_model_weights(model_dir)
    cfg = weights.config
    if device:
        streams = StreamSet(open_device(0))
        executor = CudaExecutor(streams, max_tokens=256, max_seqs=4, max_pages_per_seq=4, max_positions=cfg.max_position_embeddings)
        spec = StateSpec.for_model(cfg)  # bf16 windows, f32 states
    else:
        streams = StreamSet()
        executor = NumpyExecutor(streams, dtype=np.float32)
        spec = StateSpec.for_model(cfg, np.float32, np.float32)
    states = StateSlotPool(streams, spec, SLOTS)
    for _ in range(SLOTS):  # slot i is sequence i's
        states.acquire(executor.compute)
    layers = len(cfg.full_attention_layers) + cfg.mtp_layers
    kv_spec = KVSpec(layers, len(PAGES), cfg.num_key_value_heads, cfg.head_dim, KVDtype.parse("bf16"), PAGE_SIZE)
    return Runtime(executor, prepare_model(executor, weights), KVCache(streams, kv_spec), states)


def run_sequence(rt: Runtime, tokens: Sequence[int]) -> np.ndarray:
    logits, cached = [], 0
    for size in [PROMPT] + [1] * DECODE_STEPS:
        logits.append(rt.step([SeqStep(tokens[cached : cached + size], cached, PAGES[:2])]))
        cached += size
    return np.concatenate(logits)


CHUNKED_FORMS = ("fused", "split")


@pytest.mark.parametrize("form", CHUNKED_FORMS)
def test_prefill_and_decode_logits_match_the_numpy_executor(gpu_tiny_qwen3_5: Path, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_GDN_CHUNKED", form)
    vocab = load_model_weights(gpu_tiny_qwen3_5).config.vocab_size
    tokens = random_tokens(vocab, PROMPT + DECODE_STEPS, seed=5)
    ours = run_sequence(runtime(gpu_tiny_qwen3_5, device=True), tokens)
    reference = run_sequence(runtime(gpu_tiny_qwen3_5, device=False), tokens)
    error = relative_error(ours, reference)
    assert error < TOLERANCE, f"CUDA vs numpy logits: relative error {error:.3e}"


@pytest.mark.parametrize("form", CHUNKED_FORMS)
def test_a_step_of_a_prefill_beside_a_decode_gives_each_its_own_logits(
    gpu_tiny_qwen3_5: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NINFER_GDN_CHUNKED", form)
    vocab = load_model_weights(gpu_tiny_qwen3_5).config.vocab_size
    first, second = random_tokens(vocab, 12, seed=1), random_tokens(vocab, 70, seed=2)
    results = []
    for device in (True, False):
        rt = runtime(gpu_tiny_qwen3_5, device)
        rt.step([SeqStep(first[:11], 0, PAGES[:1], state_slot=0)])
        mixed = rt.step([SeqStep(first[11:], 11, PAGES[:1], state_slot=0), SeqStep(second, 0, PAGES[2:4], state_slot=1)])
        results.append(mixed)
    error = relative_error(*results)
    assert error < TOLERANCE, f"CUDA vs numpy logits of a mixed step: relative error {error:.3e}"


def prefilled(device_runtime: Runtime, prompts: Sequence[Sequence[int]]) -> list[SeqStep]:
    """Each prompt prefilled eagerly into sequence i's pages and live slot i; returns their next steps'
    (empty) parts."""
    pages = [PAGES[2 * i : 2 * i + 2] for i in range(len(prompts))]
    device_runtime.step([SeqStep(p, 0, pg, state_slot=i) for i, (p, pg) in enumerate(zip(prompts, pages))])
    return [SeqStep([], len(p), pg, state_slot=i) for i, (p, pg) in enumerate(zip(prompts, pages))]


@dataclass(frozen=True)
class GraphedAndEager:
    graphed_logits: np.ndarray
    graphed_pool: np.ndarray
    graphs: int
    eager_logits: np.ndarray
    eager_pool: np.ndarray


def graphed_and_eager_steps(model_dir: Path, widths: tuple[int, ...], seed: int) -> GraphedAndEager:
    """One sequence per width prefilled, then 3 steps of those widths (a capture and 2 replays) from CUDA
    graphs and eagerly: both runs' logits and state pools."""
    vocab = load_model_weights(model_dir).config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, PROMPT - 5 * i).tolist() for i in range(len(widths))]
    steps = [[rng.integers(0, vocab, w).tolist() for w in widths] for _ in range(3)]  # capture, 2 replays

    def run(graphed: bool) -> tuple[np.ndarray, np.ndarray, int]:
        rt = runtime(model_dir, device=True)
        step = rt.graphed() if graphed else None
        parts, logits = prefilled(rt, prompts), []
        for new in steps:
            parts = [replace(part, tokens=tokens) for part, tokens in zip(parts, new)]
            logits.append(rt.step(parts, step))
            parts = [replace(part, cached=part.cached + len(part.tokens)) for part in parts]
        return np.concatenate(logits), rt.pool_bytes(), len(step.graphs) if graphed else 0

    graphed_logits, graphed_pool, graphs = run(graphed=True)
    eager_logits, eager_pool, _ = run(graphed=False)
    return GraphedAndEager(graphed_logits, graphed_pool, graphs, eager_logits, eager_pool)


@pytest.mark.parametrize("widths", [(1,), (1, 1), (VERIFY,), (VERIFY, 1)], ids=["decode", "batch2", "verify4", "verify4+decode"])
def test_graph_replays_of_decode_and_verify_steps_equal_eager_steps_bit_for_bit(
    gpu_tiny_qwen3_5: Path, widths: tuple[int, ...]
) -> None:
    runs = graphed_and_eager_steps(gpu_tiny_qwen3_5, widths, seed=len(widths) + widths[0])
    assert runs.graphs == 1
    np.testing.assert_array_equal(runs.graphed_logits, runs.eager_logits)
    np.testing.assert_array_equal(runs.graphed_pool, runs.eager_pool)  # live states and every verify target


def test_one_graph_serves_any_slots_and_each_replay_declares_its_own(gpu_tiny_qwen3_5: Path) -> None:
    vocab = load_model_weights(gpu_tiny_qwen3_5).config.vocab_size
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, vocab, PROMPT).tolist(), rng.integers(0, vocab, PROMPT - 7).tolist()]
    turns = [(seq, rng.integers(0, vocab, 1).tolist()) for seq in (0, 1, 1, 0, 1)]  # alone, in turn

    def run(graphed: bool) -> tuple[np.ndarray, Runtime, GraphedForward | None]:
        rt = runtime(gpu_tiny_qwen3_5, device=True)
        step = rt.graphed() if graphed else None
        parts, logits = prefilled(rt, prompts), []
        for seq, tokens in turns:
            logits.append(rt.step([replace(parts[seq], tokens=tokens)], step))
            parts[seq] = replace(parts[seq], cached=parts[seq].cached + 1)
        return np.concatenate(logits), rt, step

    graphed_logits, rt, step = run(graphed=True)
    np.testing.assert_array_equal(graphed_logits, run(graphed=False)[0])
    (graph,) = step.graphs.values()  # captured over slot 0, replayed over slot 1 too
    pool = rt.states.buffer.resource
    captured = graph.accesses.reads | graph.accesses.writes
    assert not any(getattr(r, "key", None) == pool for r in captured)
    reads, writes = rt.executor.step_accesses(rt.states)  # the last replay's: sequence 1, slot 1
    assert rt.states.resource(1) in reads and rt.states.resource(1) in writes
    assert rt.states.resource(0) not in reads + writes
