"""The hybrid model's numpy math against transformers' own torch functions (qwen3_5), in float64 where
transformers lets it run so: its functions upcast "to float32" by name, and `float64_reference` makes that
name mean float64 for the duration of a test, so both sides are compared at float64 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.model.executor import LinearAttentionShape
from ninfer_rt.exec.numpy_delta_rule import DeltaRuleInputs, chunked_gated_delta_rule, recurrent_gated_delta_rule
from ninfer_rt.exec.numpy_gated_attention import apply_partial_neox_rope, gate_output, split_query_gate
from ninfer_rt.exec.numpy_hybrid_norms import gated_rms_norm, zero_centred_rms_norm
from ninfer_rt.exec.numpy_linear_attn import (
    LinearAttnState,
    LinearAttnWeights,
    causal_conv_silu,
    gating,
    linear_attention_mix,
    normalize_qk,
)

torch = pytest.importorskip("torch")
modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


class _TorchWithWideFloat32:
    """torch, with `float32` naming float64."""

    def __getattr__(self, name: str) -> object:
        return torch.float64 if name == "float32" else getattr(torch, name)


@pytest.fixture
def float64_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling, "torch", _TorchWithWideFloat32())


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def t(x: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(x))


@pytest.mark.parametrize("length", [5, 70, 130])
def test_delta_rule_equals_transformers_chunked_and_recurrent(float64_reference: None, length: int) -> None:
    rng = np.random.default_rng(length)
    batch, hk, hv, dk, dv = 2, 2, 6, 16, 8
    q = rng.standard_normal((batch, length, hk, dk))
    k = rng.standard_normal((batch, length, hk, dk))
    v = rng.standard_normal((batch, length, hv, dv))
    g = -np.exp(rng.uniform(-3, 1.5, (batch, length, hv)))
    beta = rng.uniform(0, 1, (batch, length, hv))
    initial = rng.standard_normal((batch, hv, dk, dv)) * 0.3
    args = dict(g=t(g), beta=t(beta), initial_state=t(initial), output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_chunk = modeling.torch_chunk_gated_delta_rule(t(q), t(k), t(v), **args)
    hf_recurrent = modeling.torch_recurrent_gated_delta_rule(t(q), t(k), t(v), **args)
    assert hf_chunk[0].dtype == torch.float64

    flat = [x.reshape(batch * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
    flat[0], flat[1] = normalize_qk(flat[0], flat[1])
    starts = np.array([0, length, 2 * length])
    inputs = DeltaRuleInputs(*flat, starts, initial)
    for form, theirs in ((chunked_gated_delta_rule, hf_chunk), (recurrent_gated_delta_rule, hf_recurrent)):
        ours = form(inputs)
        assert rel_err(ours.out.reshape(batch, length, hv, dv), theirs[0].numpy()) < 1e-12
        assert rel_err(ours.final_states, theirs[1].numpy()) < 1e-12


def test_conv_with_a_window_equals_transformers_conv_update() -> None:
    rng = np.random.default_rng(0)
    channels, kernel, rows = 12, 4, 6
    weight = rng.standard_normal((channels, kernel))
    window = rng.standard_normal((1, kernel - 1, channels))
    x = rng.standard_normal((rows, channels))
    conv_state = t(window.transpose(0, 2, 1).copy())  # transformers keeps [B, C, K-1] and updates it in place
    theirs = modeling.causal_conv1d_update(t(x.T[None].copy()), conv_state, t(weight), None, "silu")
    ours = causal_conv_silu(x, weight, np.array([0, rows]), window)
    assert rel_err(ours.out, theirs[0].numpy().T) < 1e-14
    np.testing.assert_array_equal(ours.windows[0], conv_state[0].numpy().T)


def test_fresh_conv_equals_transformers_conv_fn() -> None:
    rng = np.random.default_rng(1)
    weight, x = rng.standard_normal((12, 4)), rng.standard_normal((9, 12))
    theirs = modeling.causal_conv1d_fn(t(x.T[None].copy()), t(weight), None, activation="silu")
    ours = causal_conv_silu(x, weight, np.array([0, 9]), np.zeros((1, 3, 12)))
    assert rel_err(ours.out, theirs[0].numpy().T) < 1e-14


def test_gated_norm_equals_transformers(float64_reference: None) -> None:
    rng = np.random.default_rng(2)
    x, z, weight = rng.standard_normal((7, 3, 16)), rng.standard_normal((7, 3, 16)) * 3, rng.standard_normal(16)
    norm = modeling.Qwen3_5RMSNormGated(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(t(weight))
        theirs = norm(t(x), t(z)).numpy()
    assert rel_err(gated_rms_norm(x, z, weight, 1e-6), theirs) < 1e-14


def test_zero_centred_norm_equals_transformers_in_float32() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 32)).astype(np.float32)
    weight = (rng.standard_normal(32) * 0.1).astype(np.float32)
    norm = modeling.Qwen3_5RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(t(weight))
        theirs = norm(t(x)).numpy()
    ours = zero_centred_rms_norm(x, weight, 1e-6)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-6)


def test_gating_equals_the_layers_formula() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((9, 6)) * 8, rng.standard_normal((9, 6)) * 8
    a_log, dt_bias = np.log(rng.uniform(0.01, 16, 6)), rng.standard_normal(6)
    g, beta = gating(a, b, a_log, dt_bias)
    theirs_g = -t(a_log).exp() * torch.nn.functional.softplus(t(a) + t(dt_bias))
    assert rel_err(g, theirs_g.numpy()) < 1e-14
    assert rel_err(beta, t(b).sigmoid().numpy()) < 1e-14


def test_partial_rope_equals_transformers() -> None:
    rng = np.random.default_rng(5)
    rows, heads, head_dim, rotary = 6, 3, 32, 8
    q, k = rng.standard_normal((rows, heads, head_dim)), rng.standard_normal((rows, 1, head_dim))
    angles = np.arange(rows)[:, None] * (1e4 ** -(np.arange(0, rotary, 2) / rotary))[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    to_hf = lambda x: t(x.transpose(1, 0, 2)[None].copy())  # noqa: E731  [1, heads, rows, D]
    full = lambda x: t(np.concatenate([x, x], axis=-1)[None])  # noqa: E731
    hf_q, hf_k = modeling.apply_rotary_pos_emb(to_hf(q), to_hf(k), full(cos), full(sin))
    ours_q = apply_partial_neox_rope(q, cos, sin)
    assert rel_err(ours_q, hf_q[0].numpy().transpose(1, 0, 2)) < 1e-14
    assert rel_err(apply_partial_neox_rope(k, cos, sin), hf_k[0].numpy().transpose(1, 0, 2)) < 1e-14
    np.testing.assert_array_equal(ours_q[..., rotary:], q[..., rotary:])


def test_query_gate_split_and_output_gate_follow_the_attention_layer() -> None:
    rng = np.random.default_rng(6)
    rows, heads, head_dim = 4, 3, 8
    projected = rng.standard_normal((rows, heads * 2 * head_dim))
    hf_q, hf_gate = torch.chunk(t(projected).view(rows, -1, head_dim * 2), 2, dim=-1)
    q, gate = split_query_gate(projected, heads, head_dim)
    np.testing.assert_array_equal(q, hf_q.numpy())
    np.testing.assert_array_equal(gate, hf_gate.reshape(rows, -1).numpy())
    attn = rng.standard_normal((rows, heads * head_dim))
    assert rel_err(gate_output(attn, gate), (t(attn) * torch.sigmoid(t(gate))).numpy()) < 1e-15


def test_layer_equals_transformers_gated_deltanet_module() -> None:
    """The whole layer, float32 (the module upcasts with .float()), 70-row prefill: qkv split, z, conv layout."""
    config = modeling.Qwen3_5TextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    module = modeling.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for param in (module.dt_bias, module.norm.weight):
            param.add_(torch.randn_like(param) * 0.3)
        x = torch.randn(1, 70, 64)
        theirs = module(x).numpy()[0]
    shape = LinearAttentionShape(2, 6, 16, 8, 4, 1e-6)
    weights = LinearAttnWeights(
        conv=module.conv1d.weight.detach().numpy()[:, 0, :],
        a_log=module.A_log.detach().numpy(),
        dt_bias=module.dt_bias.detach().numpy(),
        norm=module.norm.weight.detach().numpy(),
    )
    hidden = x.numpy()[0]
    projections = (module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a)
    qkv, z, b, a = (hidden @ p.weight.detach().numpy().T for p in projections)
    mixed = linear_attention_mix(qkv, z, b, a, weights, shape, np.array([0, 70]), LinearAttnState.fresh(shape, 1))
    ours = mixed.out @ module.out_proj.weight.detach().numpy().T
    assert rel_err(ours, theirs) < 1e-4
