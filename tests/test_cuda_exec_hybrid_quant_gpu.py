"""The CUDA executor on a quantized tiny Qwen3.5 hybrid (`ninfer-rt quantize`: every projection int4/int8 g128
but in_proj_a/b, kept bf16): each Gated DeltaNet input projection is one split-format weight, one GEMV launch
at decode widths (gemv_quant.cu's dense tail) and two GEMMs into one output's column ranges above (either
NINFER_QUANT_GEMM form); a prefill and 16 decode steps give the numpy executor's logits, and decode and verify
steps replayed from CUDA graphs equal eager ones bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forward_helpers import random_tokens, relative_error
from ninfer_rt.exec.cuda_weights import SplitFormatWeight
from ninfer_rt.model.mixers import PreparedLinearAttention
from ninfer_rt.model.weights import load_model_weights
from ninfer_rt.quantize_checkpoint.writer import quantize_checkpoint
from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5
from test_cuda_exec_hybrid_gpu import (
    DECODE_STEPS,
    GPU_TINY_HYBRID,
    PROMPT,
    TOLERANCE,
    VERIFY,
    graphed_and_eager_steps,
    run_sequence,
    runtime,
)

pytestmark = pytest.mark.gpu

# hidden 128: a whole int4 column (128 inputs) per row of every projection whose input is the hidden state
GPU_TINY_QUANT_HYBRID = GPU_TINY_HYBRID | dict(hidden=128)
QUANT_GEMM_FORMS = ("dequant", "fused")


@pytest.fixture(scope="module", params=[4, 8], ids=["int4", "int8"])
def quantized_hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    bf16 = make_tiny_qwen3_5(tmp_path_factory.mktemp("gpu_tiny_qwen3_5_bf16"), **GPU_TINY_QUANT_HYBRID)
    return quantize_checkpoint(bf16, tmp_path_factory.mktemp("gpu_tiny_qwen3_5_quant") / "model", bits=request.param, group_size=128)


@pytest.mark.parametrize("form", QUANT_GEMM_FORMS)
def test_prefill_and_decode_logits_match_the_numpy_executor(quantized_hybrid: Path, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_QUANT_GEMM", form)
    vocab = load_model_weights(quantized_hybrid).config.vocab_size
    tokens = random_tokens(vocab, PROMPT + DECODE_STEPS, seed=7)
    device = runtime(quantized_hybrid, device=True)
    in_projs = [layer.mixer.in_proj for layer in device.model.layers if isinstance(layer.mixer, PreparedLinearAttention)]
    assert in_projs and all(isinstance(w, SplitFormatWeight) and w.dense.rows == 2 * 4 for w in in_projs)
    ours = run_sequence(device, tokens)
    reference = run_sequence(runtime(quantized_hybrid, device=False), tokens)
    for part, rows in (("prefill", slice(0, PROMPT)), ("decode", slice(PROMPT, None))):
        error = relative_error(ours[rows], reference[rows])
        assert error < TOLERANCE, f"{part}: CUDA vs numpy logits, relative error {error:.3e}"


@pytest.mark.parametrize("widths", [(1,), (VERIFY, 1)], ids=["decode", "verify4+decode"])
def test_graph_replays_equal_eager_steps_bit_for_bit(quantized_hybrid: Path, widths: tuple[int, ...]) -> None:
    runs = graphed_and_eager_steps(quantized_hybrid, widths, seed=len(widths))
    np.testing.assert_array_equal(runs.graphed_logits, runs.eager_logits)
    np.testing.assert_array_equal(runs.graphed_pool, runs.eager_pool)
