"""Independent float64 references for the linear-attention tests: the layer's formulas, one token and one
head at a time, written from the architecture's definition (no code shared with ninfer_rt.exec)."""

from __future__ import annotations

import math

import numpy as np

from ninfer_rt.model.executor import LinearAttentionShape
from ninfer_rt.exec.numpy_linear_attn import LinearAttnState, LinearAttnWeights


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def oracle_linear_attention(
    qkv: np.ndarray,
    z: np.ndarray,
    b: np.ndarray,
    a: np.ndarray,
    weights: LinearAttnWeights,
    shape: LinearAttentionShape,
    window: np.ndarray,
    state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence: (out [T, Hv*dv], window after, state after), token by token."""
    kernel = shape.conv_kernel
    hk, hv, dk, dv = shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim
    history = [row.astype(np.float64) for row in window]
    state = state.astype(np.float64).copy()
    outputs = []
    for t in range(qkv.shape[0]):
        history.append(qkv[t].astype(np.float64))
        taps = np.stack(history[-kernel:])  # oldest first; the newest row meets the kernel's last tap
        pre = np.array([sum(taps[j, c] * weights.conv[c, j] for j in range(kernel)) for c in range(qkv.shape[1])])
        x = pre * np.array([_sigmoid(p) for p in pre])
        q_all, k_all = x[: hk * dk].reshape(hk, dk), x[hk * dk : 2 * hk * dk].reshape(hk, dk)
        v_all = x[2 * hk * dk :].reshape(hv, dv)
        row_out = []
        for h in range(hv):
            key_head = h // (hv // hk)
            q = q_all[key_head] / math.sqrt(float(q_all[key_head] @ q_all[key_head]) + 1e-6) / math.sqrt(dk)
            k = k_all[key_head] / math.sqrt(float(k_all[key_head] @ k_all[key_head]) + 1e-6)
            beta = _sigmoid(b[t, h])
            g = -math.exp(weights.a_log[h]) * math.log1p(math.exp(a[t, h] + weights.dt_bias[h]))
            s = math.exp(g) * state[h]
            delta = beta * (v_all[h] - s.T @ k)
            s = s + np.outer(k, delta)
            state[h] = s
            o = s.T @ q
            normed = o / math.sqrt(float(np.mean(o * o)) + shape.norm_eps) * weights.norm
            gate = z[t, h * dv : (h + 1) * dv]
            row_out.append(normed * gate * np.array([_sigmoid(y) for y in gate]))
        outputs.append(np.concatenate(row_out))
    new_window = np.stack(history[len(history) - (kernel - 1) :])
    return np.stack(outputs), new_window, state


def random_layer(
    rng: np.random.Generator, shape: LinearAttentionShape, dtype: type = np.float64
) -> LinearAttnWeights:
    """Weights away from their initial values: A spread over [0.01, 16] as the init draws it."""
    return LinearAttnWeights(
        conv=(rng.standard_normal((shape.conv_channels, shape.conv_kernel)) * 0.5).astype(dtype),
        a_log=np.log(rng.uniform(0.01, 16.0, shape.num_value_heads)).astype(dtype),
        dt_bias=rng.standard_normal(shape.num_value_heads).astype(dtype),
        norm=(1.0 + 0.3 * rng.standard_normal(shape.value_head_dim)).astype(dtype),
    )


def random_inputs(
    rng: np.random.Generator, shape: LinearAttentionShape, rows: int, dtype: type = np.float64
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(qkv, z, b, a) as the input projections would give them."""
    qkv = rng.standard_normal((rows, shape.conv_channels))
    z = rng.standard_normal((rows, shape.value_size))
    b = rng.standard_normal((rows, shape.num_value_heads)) * 2.0
    a = rng.standard_normal((rows, shape.num_value_heads)) * 2.0
    return tuple(x.astype(dtype) for x in (qkv, z, b, a))  # type: ignore[return-value]


def random_state(rng: np.random.Generator, shape: LinearAttentionShape, batch: int) -> LinearAttnState:
    """A state a sequence could have reached: windows of pre-conv values, recurrent states of moderate size."""
    return LinearAttnState(
        rng.standard_normal((batch, shape.conv_kernel - 1, shape.conv_channels)),
        rng.standard_normal((batch, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim)) * 0.3,
    )
