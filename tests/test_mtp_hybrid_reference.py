"""The Qwen3.5 MTP layer on the numpy executor equals a float64 reference written here from its formulas, as
vLLM's qwen3_5_mtp.py defines it (transformers drops mtp.*, so it cannot be the reference):

    z = fc([norm_e(embed(x[p+1])) ; norm_h(h[p])])      embedding first, h after the main model's final norm
    one gated-attention decoder layer (its own KV, position p), mtp.norm, the shared lm_head

with every norm zero-centred (x / rms(x) * (1 + w)). The gated attention: q_proj rows per head
[q_h | gate_h], zero-centred q/k norms, NeoX RoPE on the first partial_rotary_factor of each head, GQA,
scale head_dim^-0.5, output * sigmoid(gate), o_proj. The reference reads the checkpoint's tensors by
their names, and h comes from transformers, so neither our loader nor our main model is under it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from forward_helpers import SeqStep, hf_outputs, make_runtime, random_tokens, relative_error, step_batch
from ninfer_rt.model.mtp import mtp_forward, prepare_mtp

pytest.importorskip("transformers")

TOLERANCE = 1e-7  # float64 math on both sides; the MTP layer's K/V pages hold float32 (~1e-9 here)
PAGES = [3, 0, 5, 1]


def zero_centred_rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + weight)


def partial_neox_rope(x: np.ndarray, positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """x [n, heads, d]: dims i and i + rotary_dim/2 (i < rotary_dim/2) turn by position * theta^(-2i/rotary_dim)."""
    half = rotary_dim // 2
    angles = positions[:, None, None] * theta ** (-2.0 * np.arange(half) / rotary_dim)
    first, second = x[..., :half], x[..., half:rotary_dim]
    turned = [first * np.cos(angles) - second * np.sin(angles), second * np.cos(angles) + first * np.sin(angles)]
    return np.concatenate([*turned, x[..., rotary_dim:]], -1)


def gated_attention(x: np.ndarray, t: dict[str, np.ndarray], cfg: dict) -> np.ndarray:
    n, d, heads, kv_heads, eps = x.shape[0], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    rope = cfg["rope_parameters"]
    rotary_dim, positions = int(d * rope["partial_rotary_factor"]), np.arange(n, dtype=np.float64)
    q_and_gate = (x @ t["self_attn.q_proj.weight"].T).reshape(n, heads, 2 * d)
    q, gate = q_and_gate[..., :d], q_and_gate[..., d:]
    k = (x @ t["self_attn.k_proj.weight"].T).reshape(n, kv_heads, d)
    v = (x @ t["self_attn.v_proj.weight"].T).reshape(n, kv_heads, d)
    q = partial_neox_rope(zero_centred_rms(q, t["self_attn.q_norm.weight"], eps), positions, rotary_dim, rope["rope_theta"])
    k = partial_neox_rope(zero_centred_rms(k, t["self_attn.k_norm.weight"], eps), positions, rotary_dim, rope["rope_theta"])
    k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) * d**-0.5 + np.triu(np.full((n, n), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = np.einsum("hqk,khd->qhd", probs, v) / (1.0 + np.exp(-gate))
    return attended.reshape(n, heads * d) @ t["self_attn.o_proj.weight"].T


def mtp_reference(model_dir: Path, hidden: np.ndarray, next_tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(MTP output after mtp.norm, logits) for rows at positions 0..n-1, in float64."""
    cfg = json.loads((model_dir / "config.json").read_text())
    raw = {name: np.asarray(a, np.float64) for name, a in load_file(str(model_dir / "model.safetensors")).items()}
    layer = {name.removeprefix("mtp.layers.0."): a for name, a in raw.items() if name.startswith("mtp.layers.0.")}
    eps = cfg["rms_norm_eps"]
    embedded = zero_centred_rms(raw["model.embed_tokens.weight"][next_tokens], raw["mtp.pre_fc_norm_embedding.weight"], eps)
    previous = zero_centred_rms(np.asarray(hidden, np.float64), raw["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([embedded, previous], -1) @ raw["mtp.fc.weight"].T
    x = x + gated_attention(zero_centred_rms(x, layer["input_layernorm.weight"], eps), layer, cfg)
    h = zero_centred_rms(x, layer["post_attention_layernorm.weight"], eps)
    gate, up = h @ layer["mlp.gate_proj.weight"].T, h @ layer["mlp.up_proj.weight"].T
    x = x + (gate / (1.0 + np.exp(-gate)) * up) @ layer["mlp.down_proj.weight"].T
    out = zero_centred_rms(x, raw["mtp.norm.weight"], eps)
    return out, out @ raw["lm_head.weight"].T


@pytest.mark.parametrize("step_sizes", [[40], [17, 23], [30] + [1] * 10], ids=["prompt", "chunks", "decode"])
def test_mtp_forward_equals_the_float64_reference(tiny_qwen3_5: Path, step_sizes: list[int]) -> None:
    runtime = make_runtime(tiny_qwen3_5, dtype=np.float64)
    tokens = random_tokens(runtime.weights.config.vocab_size, sum(step_sizes) + 1, seed=3)
    _, main_hidden = hf_outputs(tiny_qwen3_5, tokens[:-1])  # h[p] for p = 0..n-1, after the final norm
    mtp = prepare_mtp(runtime.executor, runtime.weights, runtime.model)
    hidden, logits, cached = [], [], 0
    for size in step_sizes:  # the MTP layer's KV carries across steps
        shifted = step_batch([SeqStep(tokens[cached + 1 : cached + size + 1], cached, PAGES)])
        out = mtp_forward(runtime.executor, runtime.model, mtp, shifted, np.asarray(main_hidden[cached : cached + size], np.float64), runtime.kv)
        hidden.append(runtime.executor.to_host(out.hidden))
        logits.append(runtime.executor.to_host(out.logits))
        cached += size
    expected_hidden, expected_logits = mtp_reference(tiny_qwen3_5, main_hidden, tokens[1:])
    assert relative_error(np.concatenate(hidden), expected_hidden) < TOLERANCE
    assert relative_error(np.concatenate(logits), expected_logits) < TOLERANCE
