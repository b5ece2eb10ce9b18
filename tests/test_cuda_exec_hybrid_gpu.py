"""The CUDA executor runs the hybrid (Gated DeltaNet + gated attention) forward of model/layers.py and agrees
with the numpy executor on a tiny Qwen3.5 checkpoint that transformers wrote: a prefill, then 16 decode
steps, the linear-attention state carried through its slot between steps; and two sequences of
different lengths in one step (the recurrent and chunked delta rule side by side)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from forward_helpers import SeqStep, random_tokens, relative_error, step_batch
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.layers import PreparedModel, forward, prepare_model
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
SLOTS = 2


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

    def step(self, parts: Sequence[SeqStep]) -> np.ndarray:
        for part in parts:
            if part.cached == 0:
                self.states.zero(part.state_slot, self.executor.compute)
        out = forward(self.executor, self.model, step_batch(parts, PAGE_SIZE), self.kv, self.states)
        return self.executor.to_host(out.logits)


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


def test_prefill_and_decode_logits_match_the_numpy_executor(gpu_tiny_qwen3_5: Path) -> None:
    vocab = load_model_weights(gpu_tiny_qwen3_5).config.vocab_size
    tokens = random_tokens(vocab, PROMPT + DECODE_STEPS, seed=5)
    ours = run_sequence(runtime(gpu_tiny_qwen3_5, device=True), tokens)
    reference = run_sequence(runtime(gpu_tiny_qwen3_5, device=False), tokens)
    error = relative_error(ours, reference)
    assert error < TOLERANCE, f"CUDA vs numpy logits: relative error {error:.3e}"


def test_a_step_of_a_prefill_beside_a_decode_gives_each_its_own_logits(gpu_tiny_qwen3_5: Path) -> None:
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
