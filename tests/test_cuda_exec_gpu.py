"""The CUDA executor runs the one forward definition (model/layers.py) and agrees with the numpy executor
and with transformers (bf16) on a tiny checkpoint: prefill, then 64 decode steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from forward_helpers import SeqStep, random_tokens, relative_error, step_batch
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_exec import CudaExecutor, DeferredSwiglu
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.cache import KVCache, KVSpec
from ninfer_rt.model.executor import StepBatch, WeightRole
from ninfer_rt.model.layers import ForwardOutput, PreparedModel, forward, prepare_model
from ninfer_rt.model.tiny import make_tiny_model
from ninfer_rt.model.weights import load_model_weights

pytestmark = pytest.mark.gpu

# head_dim 64: the smallest the attention kernels instantiate; the default tiny model's 32 is not one.
GPU_TINY = dict(hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=512, layers=2)
PAGE_SIZE = 64  # the kernels' page size
PAGES = [3, 1, 0]  # out of order on purpose
PROMPT, DECODE_STEPS = 45, 64
TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def gpu_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpu_tiny"), **GPU_TINY)


@dataclass
class Runtime:
    executor: CudaExecutor | NumpyExecutor
    model: PreparedModel
    kv: KVCache

    def run(self, tokens: Sequence[int], step_sizes: Sequence[int], step: Callable[[StepBatch], ForwardOutput] | None = None) -> np.ndarray:
        """Feeds one sequence in steps of `step_sizes` tokens; the f32 logits of every token."""
        step = step or (lambda batch: forward(self.executor, self.model, batch, self.kv))
        logits, cached = [], 0
        for size in step_sizes:
            batch = step_batch([SeqStep(tokens[cached : cached + size], cached, PAGES)], PAGE_SIZE)
            logits.append(self.executor.to_host(step(batch).logits))
            cached += size
        return np.concatenate(logits)


def runtime(model_dir: Path, device: bool, kv_dtype: str = "bf16", dependent_launch: bool = True) -> Runtime:
    weights = load_model_weights(model_dir)
    cfg = weights.config
    if device:
        executor = CudaExecutor(
            StreamSet(open_device(0), dependent_launch=dependent_launch), max_tokens=256, max_seqs=8, max_pages_per_seq=8,
            max_positions=cfg.max_position_embeddings,
        )
    else:
        executor = NumpyExecutor(StreamSet(), dtype=np.float32)
    spec = KVSpec(cfg.num_hidden_layers, 8, cfg.num_key_value_heads, cfg.head_dim, kv_dtype, PAGE_SIZE)
    return Runtime(executor, prepare_model(executor, weights), KVCache(executor.streams, spec))


def sequence(model_dir: Path) -> list[int]:
    return random_tokens(GPU_TINY["vocab"], PROMPT + DECODE_STEPS, seed=11)


STEPS = [PROMPT] + [1] * DECODE_STEPS


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_prefill_and_decode_logits_match_the_numpy_executor(gpu_tiny: Path, kv_dtype: str) -> None:
    tokens = sequence(gpu_tiny)
    ours = runtime(gpu_tiny, device=True, kv_dtype=kv_dtype).run(tokens, STEPS)
    reference = runtime(gpu_tiny, device=False, kv_dtype=kv_dtype).run(tokens, STEPS)
    assert relative_error(ours[:PROMPT], reference[:PROMPT]) < TOLERANCE
    assert relative_error(ours[PROMPT:], reference[PROMPT:]) < TOLERANCE


def test_chunked_prefill_matches_whole_prefill(gpu_tiny: Path) -> None:
    tokens = sequence(gpu_tiny)[:PROMPT]
    whole = runtime(gpu_tiny, device=True).run(tokens, [PROMPT])
    chunked = runtime(gpu_tiny, device=True).run(tokens, [20, 3, PROMPT - 23])  # a 3-row chunk takes the GEMV
    assert relative_error(chunked, whole) < TOLERANCE


def test_logits_match_transformers_in_bf16(gpu_tiny: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokens = sequence(gpu_tiny)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gpu_tiny), dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        reference = model(torch.tensor([tokens])).logits[0].float().numpy()
    ours = runtime(gpu_tiny, device=True).run(tokens, STEPS)
    assert relative_error(ours[:PROMPT], reference[:PROMPT]) < TOLERANCE
    assert relative_error(ours[PROMPT:], reference[PROMPT:]) < TOLERANCE


def test_greedy_argmax_on_the_device_matches_the_host(gpu_tiny: Path) -> None:
    rt = runtime(gpu_tiny, device=True)
    tokens = sequence(gpu_tiny)[:PROMPT]
    out = forward(rt.executor, rt.model, step_batch([SeqStep(tokens, 0, PAGES)], PAGE_SIZE), rt.kv)
    logits = rt.executor.to_host(out.logits)
    greedy = rt.executor.to_host(rt.executor.argmax(out.logits))
    np.testing.assert_array_equal(greedy[:, 0], logits.argmax(axis=1))


@pytest.mark.parametrize("position", [-1, "max_positions"])
def test_positions_outside_the_rope_table_are_refused_before_publishing(gpu_tiny: Path, position: int | str) -> None:
    rt = runtime(gpu_tiny, device=True)
    batch = step_batch([SeqStep([1], 0, PAGES)], PAGE_SIZE)
    batch.positions = np.array([rt.executor.max_positions if position == "max_positions" else position], np.int32)
    with pytest.raises(ValueError, match="outside the RoPE table"):
        forward(rt.executor, rt.model, batch, rt.kv)


def test_out_of_range_token_ids_are_refused_before_publishing(gpu_tiny: Path) -> None:
    rt = runtime(gpu_tiny, device=True)
    batch = step_batch([SeqStep([GPU_TINY["vocab"]], 0, PAGES)], PAGE_SIZE)
    with pytest.raises(ValueError, match="token id out of range"):
        forward(rt.executor, rt.model, batch, rt.kv)


def test_the_swiglu_fusion_follows_the_role_a_weight_was_prepared_with(gpu_tiny: Path) -> None:
    """A decode-width linear into a GATE_UP weight is deferred into silu_mul (one fused GEMV), whatever the
    weight's name; the same matrix prepared as LINEAR is a plain product. Both give the same SwiGLU."""
    rt = runtime(gpu_tiny, device=True)
    rng = np.random.default_rng(0)
    hidden, inner = GPU_TINY["hidden"], GPU_TINY["intermediate"]
    gate, up = (rng.standard_normal((inner, hidden)).astype(np.float32) * 0.05 for _ in range(2))
    fused = rt.executor.prepare_weight("mlp.in", [gate, up], WeightRole.GATE_UP)
    plain = rt.executor.prepare_weight("layers.0.gate_up", [gate, up], WeightRole.LINEAR)
    rows = rng.standard_normal((2, hidden)).astype(np.float32)
    x = rt.executor.prepare_weight("x", [rows], WeightRole.LINEAR)
    deferred, product = rt.executor.linear(x, fused), rt.executor.linear(x, plain)
    assert isinstance(deferred, DeferredSwiglu) and isinstance(product, DeviceTensor)
    g, u = np.asarray(rows, np.float64) @ gate.T, np.asarray(rows, np.float64) @ up.T
    expected = g / (1.0 + np.exp(-g)) * u
    for out in (rt.executor.silu_mul(deferred), rt.executor.silu_mul(product)):
        assert relative_error(rt.executor.to_host(out), expected) < TOLERANCE
