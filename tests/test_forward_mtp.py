"""The MTP module on the executor equals a direct dense numpy implementation of the Qwen3-Next MTP layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forward_helpers import Runtime, SeqStep, main_then_mtp_steps, make_runtime, random_tokens, relative_error, step_batch
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.mtp import PreparedMTP, mtp_forward, prepare_mtp
from ninfer_rt.model.rope import rope_attention_scaling, rope_inv_freq
from ninfer_rt.model.weights import LayerWeights, ModelWeights

TOLERANCE = 1e-5
PAGES = [3, 0, 5]


def f64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return f64(weight) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def rotate(x: np.ndarray, positions: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """HF's rotate_half formulation: x * cos + cat(-x2, x1) * sin, cos/sin over duplicated frequencies."""
    angles = positions[:, None] * np.concatenate([rope_inv_freq(cfg)] * 2)[None, :]
    cos = np.cos(angles)[:, None, :] * rope_attention_scaling(cfg)
    sin = np.sin(angles)[:, None, :] * rope_attention_scaling(cfg)
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def dense_decoder_layer(x: np.ndarray, layer: LayerWeights, cfg: ModelConfig) -> np.ndarray:
    n, eps, d = x.shape[0], cfg.rms_norm_eps, cfg.head_dim
    positions = np.arange(n, dtype=np.float64)
    h = rms(x, layer.input_norm, eps)
    q = (h @ f64(layer.q_proj).T).reshape(n, cfg.num_attention_heads, d)
    k = (h @ f64(layer.k_proj).T).reshape(n, cfg.num_key_value_heads, d)
    v = (h @ f64(layer.v_proj).T).reshape(n, cfg.num_key_value_heads, d)
    q, k = rotate(rms(q, layer.q_norm, eps), positions, cfg), rotate(rms(k, layer.k_norm, eps), positions, cfg)
    k, v = (np.repeat(t, cfg.num_queries_per_kv, axis=1) for t in (k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) * d**-0.5 + np.triu(np.full((n, n), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ f64(layer.o_proj).T
    h = rms(x, layer.post_norm, eps)
    gate, up = h @ f64(layer.gate_proj).T, h @ f64(layer.up_proj).T
    return x + (gate / (1 + np.exp(-gate)) * up) @ f64(layer.down_proj).T


def dense_mtp(weights: ModelWeights, hidden: np.ndarray, next_tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(hidden, logits) of the MTP module for rows at positions 0..n-1, all in float64."""
    cfg, mtp, eps = weights.config, weights.mtp, weights.config.rms_norm_eps
    embedded = rms(f64(weights.embed)[next_tokens], mtp.norm_embedding, eps)
    z = np.concatenate([embedded, rms(f64(hidden), mtp.norm_hidden, eps)], -1) @ f64(mtp.fc).T
    out = rms(dense_decoder_layer(z, mtp.layer, cfg), mtp.norm, eps)
    return out, out @ f64(weights.lm_head).T


def run_main_then_mtp(
    runtime: Runtime, mtp: PreparedMTP, tokens: list[int], step_sizes: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: the main model over its tokens, then the MTP module over the same rows with the tokens
    shifted by one. Returns (main hidden, mtp hidden, mtp logits) of all rows."""
    to_host = runtime.executor.to_host
    steps = list(main_then_mtp_steps(runtime, mtp, tokens, step_sizes, PAGES))
    main_hidden = np.concatenate([to_host(main.hidden) for main, _ in steps])
    mtp_hidden = np.concatenate([to_host(draft.hidden) for _, draft in steps])
    return main_hidden, mtp_hidden, np.concatenate([to_host(draft.logits) for _, draft in steps])


@pytest.fixture
def runtime(tiny_qwen3_mtp: Path) -> Runtime:
    return make_runtime(tiny_qwen3_mtp, dtype=np.float64)


@pytest.mark.parametrize("step_sizes", [[40], [17, 23], [30] + [1] * 10], ids=["prompt", "chunks", "decode"])
def test_mtp_matches_a_dense_numpy_implementation(runtime: Runtime, step_sizes: list[int]) -> None:
    tokens = random_tokens(runtime.weights.config.vocab_size, sum(step_sizes) + 1)
    mtp = prepare_mtp(runtime.executor, runtime.weights, runtime.model)
    main_hidden, hidden, logits = run_main_then_mtp(runtime, mtp, tokens, step_sizes)
    expected_hidden, expected_logits = dense_mtp(runtime.weights, main_hidden, tokens[1:])
    assert relative_error(hidden, expected_hidden) < TOLERANCE
    assert relative_error(logits, expected_logits) < TOLERANCE


def test_mtp_step_writes_only_its_own_kv_layer(runtime: Runtime) -> None:
    tokens = random_tokens(runtime.weights.config.vocab_size, 21)
    mtp = prepare_mtp(runtime.executor, runtime.weights, runtime.model)
    main = runtime.step([SeqStep(tokens[:20], 0, PAGES)])
    main_layers_before = [layer.k.host_bytes().copy() for layer in runtime.kv.layers[: mtp.kv_layer]]
    shifted = step_batch([SeqStep(tokens[1:], 0, PAGES)])
    mtp_forward(runtime.executor, runtime.model, mtp, shifted, main.hidden, runtime.kv)
    for layer, before in zip(runtime.kv.layers, main_layers_before):
        np.testing.assert_array_equal(layer.k.host_bytes(), before)
    assert runtime.kv.layers[mtp.kv_layer].k.host_bytes().any()


def test_preparing_mtp_without_mtp_weights_is_refused(tiny_qwen3: Path) -> None:
    runtime = make_runtime(tiny_qwen3)
    with pytest.raises(ValueError, match="no MTP weights"):
        prepare_mtp(runtime.executor, runtime.weights, runtime.model)
