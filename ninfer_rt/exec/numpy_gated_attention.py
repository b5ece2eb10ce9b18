"""The parts of the hybrid model's gated attention layer that plain attention lacks, in numpy.

q_proj's output holds, per head, [q_h (D) | gate_h (D)]. RoPE (NeoX rotate-half) turns only the first
rotary_dim = 2 * len(cos) dims of each head; the rest pass through. After attention the output is
multiplied by sigmoid(gate): the architecture fixes sigmoid, whatever the config's gate fields say.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.exec.numpy_hybrid_norms import sigmoid


def split_query_gate(q_proj_out: np.ndarray, num_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, H*2D] -> q [T, H, D] and gate [T, H*D] (the gate flat, as the attention output is)."""
    per_head = q_proj_out.reshape(q_proj_out.shape[0], num_heads, 2 * head_dim)
    q, gate = per_head[..., :head_dim], per_head[..., head_dim:]
    return q, gate.reshape(q_proj_out.shape[0], num_heads * head_dim)


def apply_partial_neox_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [rows, heads, D]; cos/sin [rows, R/2]: dim i < R/2 rotates with dim i + R/2, dims R.. are untouched."""
    half = cos.shape[-1]
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin, rest], axis=-1)


def gate_output(attn: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """attn [T, H*D] * sigmoid(gate [T, H*D])."""
    return attn * sigmoid(gate)
