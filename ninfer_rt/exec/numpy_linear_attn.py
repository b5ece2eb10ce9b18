"""The hybrid model's Gated DeltaNet (linear-attention) layer between its projections, in numpy.

in_proj_qkv's rows [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)] go through a causal depthwise conv (kernel K, no
bias) + SiLU; q, k are L2-normalised (q also scaled by dk^-0.5); beta = sigmoid(b), g = -exp(A_log) *
softplus(a + dt_bias); the gated delta rule (numpy_delta_rule) mixes them; each value head's output is
RMSNorm'd with a plain weight and multiplied by silu(z). out_proj follows (an ordinary linear).

A batch is rows of several sequences (query_start [B+1]), each with its own state: the conv window (its
last K-1 pre-conv rows, oldest first, zeros for a fresh sequence) and the recurrent state. The same
functions serve prefill, decode and the k+1 rows of speculative verification; `save_after` returns the
state after chosen row counts of each sequence (snapshots, rollback).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ninfer_rt.exec import numpy_delta_rule
from ninfer_rt.exec.numpy_hybrid_norms import compute_dtype, gated_rms_norm, sigmoid, silu, softplus
from ninfer_rt.model.executor import LinearAttentionShape

L2NORM_EPS = 1e-6  # transformers' l2norm: x * rsqrt(sum(x^2) + eps)


@dataclass(frozen=True)
class LinearAttnWeights:
    conv: np.ndarray  # [conv_channels, K]: conv1d.weight without its middle axis
    a_log: np.ndarray  # [Hv]
    dt_bias: np.ndarray  # [Hv]
    norm: np.ndarray  # [dv], the gated RMSNorm's plain weight


@dataclass(frozen=True)
class LinearAttnState:
    """States of a batch of sequences: conv windows [B, K-1, C] and recurrent states [B, Hv, dk, dv]."""

    conv_windows: np.ndarray
    recurrent: np.ndarray

    @classmethod
    def fresh(cls, shape: LinearAttentionShape, batch: int, dtype: type = np.float32) -> LinearAttnState:
        return cls(
            np.zeros((batch, shape.conv_kernel - 1, shape.conv_channels), dtype=dtype),
            np.zeros((batch, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim), dtype=dtype),
        )


@dataclass(frozen=True)
class ConvResult:
    """The conv's output and its history: each sequence's window, then its rows, in pre-conv values."""

    out: np.ndarray  # [T, C], after SiLU
    history: np.ndarray  # [T + B*(K-1), C]
    history_start: np.ndarray  # [B] first history row of each sequence (its window's oldest row)
    lengths: np.ndarray  # [B]
    width: int  # K-1

    def windows_after(self, seq: int, counts: Sequence[int]) -> np.ndarray:
        """[len(counts), K-1, C]: the window after the first n rows of sequence `seq`, for each n in counts."""
        if any(not 0 <= n <= self.lengths[seq] for n in counts):
            raise ValueError(f"row counts {list(counts)} outside 0..{int(self.lengths[seq])}")
        offsets = self.history_start[seq] + np.asarray(counts, dtype=np.int64)[:, None] + np.arange(self.width)
        return self.history[offsets]

    @property
    def windows(self) -> np.ndarray:
        """[B, K-1, C]: every sequence's window after all its rows."""
        offsets = (self.history_start + self.lengths)[:, None] + np.arange(self.width)
        return self.history[offsets]


def causal_conv_silu(x: np.ndarray, weight: np.ndarray, query_start: np.ndarray, windows: np.ndarray) -> ConvResult:
    """Depthwise causal conv over rows + SiLU: out[t] = silu(sum_j weight[:, j] * x[t - (K-1) + j]), the rows
    before a sequence's first taken from its window [B, K-1, C]."""
    dtype = compute_dtype(x)
    lengths = np.diff(query_start).astype(np.int64)
    batch, width = len(lengths), weight.shape[1] - 1
    seq_of_row = np.repeat(np.arange(batch), lengths)
    history_start = np.asarray(query_start[:-1], dtype=np.int64) + np.arange(batch) * width
    history = np.empty((x.shape[0] + batch * width, x.shape[1]), dtype=dtype)
    history[(history_start[:, None] + np.arange(width)).reshape(-1)] = windows.reshape(-1, x.shape[1])
    row_at = np.arange(x.shape[0]) + (seq_of_row + 1) * width  # history row of each input row
    history[row_at] = x
    taps = weight.astype(dtype, copy=False)
    # every history row past the first `width` gets a conv value; the rows that are inputs are then picked
    span = history.shape[0] - width
    conv = sum(taps[:, j] * history[j : j + span] for j in range(width + 1))[row_at - width]
    return ConvResult(silu(conv), history, history_start, lengths, width)


def gating(a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(g, beta) [T, Hv]: the log-decay -exp(A_log) * softplus(a + dt_bias) and the write strength sigmoid(b)."""
    dtype = compute_dtype(a)
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    g = -np.exp(a_log.astype(dtype)) * softplus(a + dt_bias.astype(dtype))
    return g, sigmoid(b)


def l2_normalize(x: np.ndarray, eps: float = L2NORM_EPS) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def normalize_qk(q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q, k [T, Hk, dk] L2-normalised per head; q also scaled by dk^-0.5."""
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)


@dataclass(frozen=True)
class LinearAttnResult:
    out: np.ndarray  # [T, Hv*dv], the input of out_proj
    state: LinearAttnState  # after all rows
    saved: tuple[LinearAttnState, ...]  # per sequence, the states after save_after[b]'s row counts


def linear_attention_mix(
    qkv: np.ndarray,
    z: np.ndarray,
    b: np.ndarray,
    a: np.ndarray,
    weights: LinearAttnWeights,
    shape: LinearAttentionShape,
    query_start: np.ndarray,
    state: LinearAttnState,
    save_after: Sequence[Sequence[int]] | None = None,
) -> LinearAttnResult:
    """The layer from its input projections' outputs (qkv [T, C], z [T, Hv*dv], b, a [T, Hv]) to out_proj's input."""
    rows = qkv.shape[0]
    conv = causal_conv_silu(qkv, weights.conv, query_start, state.conv_windows)
    q, k, v = np.split(conv.out, [shape.key_size, 2 * shape.key_size], axis=-1)
    key_heads = (rows, shape.num_key_heads, shape.key_head_dim)
    q, k = normalize_qk(q.reshape(key_heads), k.reshape(key_heads))
    v = v.reshape(rows, shape.num_value_heads, shape.value_head_dim)
    g, beta = gating(a, b, weights.a_log, weights.dt_bias)
    inputs = numpy_delta_rule.DeltaRuleInputs(q, k, v, g, beta, query_start, state.recurrent)
    mixed = numpy_delta_rule.gated_delta_rule(inputs, save_after)
    gate = z.reshape(rows, shape.num_value_heads, shape.value_head_dim)
    out = gated_rms_norm(mixed.out, gate, weights.norm, shape.norm_eps).reshape(rows, shape.value_size)
    saved = tuple(
        LinearAttnState(conv.windows_after(seq, counts), recurrent)
        for seq, (counts, recurrent) in enumerate(zip(save_after or [()] * len(conv.lengths), mixed.saved_states))
    )
    return LinearAttnResult(out, LinearAttnState(conv.windows, mixed.final_states), saved)
